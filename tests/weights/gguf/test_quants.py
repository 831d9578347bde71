"""Dequantisation: every supported GGUF type against the reference loops, and clear refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from pagedkv.model.errors import UnsupportedTensorType
from pagedkv.weights.gguf.file import GGUFFile
from pagedkv.weights.gguf.tensors import SUPPORTED_TYPES, dequantize, unpermute_rows
from tests.weights.gguf.quant_reference import LAYOUTS, dequantize_reference, random_blocks
from tests.weights.gguf.writer import permute_rows, write_gguf

ROWS = 3


@pytest.mark.parametrize("qtype", list(LAYOUTS), ids=lambda t: t.name)
def test_block_types_match_the_reference(tmp_path, qtype):
    values_per_block, _, _ = LAYOUTS[qtype]
    blocks_per_row = 2 if values_per_block == 256 else 4
    blocks = random_blocks(qtype, ROWS * blocks_per_row, seed=int(qtype))
    raw = blocks.reshape(ROWS, -1)
    path = write_gguf(tmp_path / "q.gguf", "llama", {}, {"w": (raw, qtype)})
    file = GGUFFile(path)
    got = dequantize(file, file.tensors["w"])
    expected = dequantize_reference(qtype, blocks).reshape(ROWS, -1)
    assert got.dtype == torch.float32
    assert got.shape == (ROWS, blocks_per_row * values_per_block)
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16], ids=lambda t: t.name)
def test_float_types_are_read_exactly(tmp_path, qtype):
    values = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    if qtype == QType.F32:
        tensor, expected = values, values
    elif qtype == QType.F16:
        tensor, expected = (values.astype(np.float16), QType.F16), values.astype(np.float16)
    else:
        # bfloat16 is the upper half of a float32: truncate by hand, read back by shifting.
        upper = (values.view(np.uint32) >> 16).astype(np.uint16)
        tensor = (upper.view(np.uint8).reshape(4, 16), QType.BF16)
        expected = (upper.astype(np.uint32) << 16).view(np.float32)
    path = write_gguf(tmp_path / "f.gguf", "llama", {}, {"w": tensor})
    file = GGUFFile(path)
    np.testing.assert_array_equal(dequantize(file, file.tensors["w"]).numpy(), expected)


def test_rows_can_be_gathered_while_dequantising(tmp_path):
    blocks = random_blocks(QType.Q8_0, 8, seed=3).reshape(8, -1)
    path = write_gguf(tmp_path / "q.gguf", "llama", {}, {"w": (blocks, QType.Q8_0)})
    file = GGUFFile(path)
    order = np.array([3, 0, 7, 1, 6, 2, 5, 4])
    whole = dequantize(file, file.tensors["w"])
    assert torch.equal(dequantize(file, file.tensors["w"], order), whole[order])


def test_unsupported_type_names_tensor_and_type(tmp_path):
    raw = np.zeros((2, 84), dtype=np.uint8)  # one Q2_K block per row
    path = write_gguf(tmp_path / "q.gguf", "llama", {}, {"blk.0.attn_q.weight": (raw, QType.Q2_K)})
    file = GGUFFile(path)
    with pytest.raises(UnsupportedTensorType, match=r"'blk.0.attn_q.weight' has type Q2_K"):
        dequantize(file, file.tensors["blk.0.attn_q.weight"])
    assert QType.Q2_K not in SUPPORTED_TYPES


@pytest.mark.parametrize("num_heads", [1, 3, 4])
def test_unpermute_inverts_the_converters_permutation(num_heads):
    weight = np.arange(num_heads * 8 * 5, dtype=np.float32).reshape(num_heads * 8, 5)
    permuted = torch.from_numpy(permute_rows(weight, num_heads))
    assert not torch.equal(permuted, torch.from_numpy(weight))
    assert torch.equal(unpermute_rows(permuted, num_heads), torch.from_numpy(weight))
    bias = torch.arange(num_heads * 8.0)
    assert torch.equal(
        unpermute_rows(torch.from_numpy(permute_rows(bias.numpy(), num_heads)), num_heads), bias
    )
