"""The LoRA products of a mixed batch: lora.c equals its torch twin bit for bit, each row's
result equals the float64 product of its own adapter, and no row depends on the others."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.kernels import native
from pagedkv.model import lora
from pagedkv.model.lora import AdapterWeights, LoRAPart, ProjectionLoRA, add_lora, lora_step

PARTS, SIZES = ("q_proj", "k_proj", "v_proj"), (48, 16, 16)
IN = 40


def adapter(seed: int, parts=PARTS, rank: int = 8) -> AdapterWeights:
    """Random A and B of `parts` of layer 3's q/k/v projection; A stacked, B transposed."""
    gen = torch.Generator().manual_seed(seed)
    a_parts, adapted, offset = [], [], 0
    for index, (part, size) in enumerate(zip(PARTS, SIZES, strict=True)):
        if part in parts:
            a_parts.append(torch.randn(rank, IN, generator=gen))
            b_t = torch.randn(rank, size, generator=gen)
            adapted.append(LoRAPart(index, offset, b_t, 0.5 + seed + index))
            offset += rank
    projection = ProjectionLoRA(torch.cat(a_parts), adapted)
    return AdapterWeights({(3, PARTS): projection}, num_layers=4)


def batch(lora_ids: list[int], lengths: list[int]) -> ForwardBatch:
    sequences = [
        SequenceInput([1] * n, 0, list(range(4 * i, 4 * i + 4)), 1, lora_id)
        for i, (n, lora_id) in enumerate(zip(lengths, lora_ids, strict=True))
    ]
    return ForwardBatch.build(sequences, 16)


def products(adapters, lora_ids, lengths, x, out, monkeypatch=None) -> torch.Tensor:
    with lora_step(adapters, batch(lora_ids, lengths)):
        return add_lora(3, PARTS, SIZES, x, out.clone())


@pytest.fixture
def setting():
    adapters = {1: adapter(1), 2: adapter(2, parts=("q_proj", "v_proj"), rank=4), 3: adapter(3)}
    lora_ids, lengths = [1, 0, 2, 1, 3, 0], [3, 2, 1, 40, 2, 1]  # adapter 1: 43 rows, the rest few
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(sum(lengths), IN, generator=gen)
    out = torch.randn(sum(lengths), sum(SIZES), generator=gen)
    return adapters, lora_ids, lengths, x, out


def test_kernel_equals_torch_twin_and_float64(setting, monkeypatch):
    if native.kernels() is None:
        pytest.skip(f"C kernels unavailable: {native.unavailable_reason()}")
    adapters, lora_ids, lengths, x, out = setting
    ours = products(adapters, lora_ids, lengths, x, out)
    monkeypatch.setattr(lora, "_kernel_reads", lambda x, out: False)  # the torch twin
    twin = products(adapters, lora_ids, lengths, x, out)
    assert torch.equal(ours, twin)
    row = 0
    for lora_id, length in zip(lora_ids, lengths, strict=True):
        for _ in range(length):
            expected = out[row].double().clone()
            offsets = [0, SIZES[0], SIZES[0] + SIZES[1]]
            if lora_id:
                projection = adapters[lora_id].projections[(3, PARTS)]
                for part in projection.parts:
                    a = projection.a[part.rank_offset : part.rank_offset + part.rank].double()
                    delta = (x[row].double() @ a.T) @ part.b_t.double() * part.scaling
                    at = offsets[part.index]
                    expected[at : at + SIZES[part.index]] += delta
            assert torch.allclose(ours[row].double(), expected, rtol=1e-5, atol=1e-5)
            row += 1


def test_a_rows_products_do_not_depend_on_its_neighbours(setting):
    adapters, lora_ids, lengths, x, out = setting
    together = products(adapters, lora_ids, lengths, x, out)
    row = 0
    for lora_id, length in zip(lora_ids, lengths, strict=True):
        rows = slice(row, row + length)
        alone = products(adapters, [lora_id], [length], x[rows].contiguous(), out[rows])
        assert torch.equal(alone, together[rows])
        row += length
