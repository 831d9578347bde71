"""GGUF tensors -> Hugging Face-named float tensors, dequantised one at a time.

Three things separate a GGUF tensor from the checkpoint tensor it came from, and all three are
undone here: llama.cpp's names (`blk.3.attn_q.weight`), its quantised storage (blocks of ints
with per-block scales), and, for architectures whose registry entry says so (`llama`), a
permutation of the rows of the q and k projections into the rotary layout llama.cpp computes
with (interleaved pairs rather than halves). Yielding one tensor at a time keeps peak memory
near the model's size.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from torch import Tensor

from pagedkv.model.config import ModelConfig
from pagedkv.model.errors import MalformedModelFile, UnsupportedTensorType
from pagedkv.model.registry import gguf_architecture
from pagedkv.quant.formats import QuantizedTensor
from pagedkv.quant.gguf_blocks import BLOCK_TYPES, from_gguf_blocks
from pagedkv.weights.gguf.file import GGUFFile
from pagedkv.weights.gguf.reader import GGUFTensor

SUPPORTED_TYPES = (
    QType.F32,
    QType.F16,
    QType.BF16,
    QType.Q8_0,
    QType.Q4_0,
    QType.Q4_1,
    QType.Q5_0,
    QType.Q5_1,
    QType.Q4_K,
    QType.Q5_K,
    QType.Q6_K,
)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)
_CHUNK_VALUES = 1 << 20  # values dequantised per call
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors llama.cpp stores that the checkpoint derives from its config (checked there).
_DERIVED = {"rope_freqs.weight"}
# llama.cpp permutes these rows (weights and, when present, biases) where the registry says so.
_PERMUTED = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")


def gguf_tensors(
    file: GGUFFile, config: ModelConfig, *, keep_quantized: bool = False
) -> Iterator[tuple[str, Tensor | QuantizedTensor]]:
    """Yield `(hf_name, tensor)` for every weight of the file, in file order.

    Tensors are float32, except that with `keep_quantized` a block-quantised matrix comes as
    a `QuantizedTensor` holding exactly the file's values (`quant/gguf_blocks.py`).
    """
    unpermute = gguf_architecture(file.architecture, file.path).gguf_permutes_qk
    layer_names = layer_tensor_names(file)
    for name, tensor in file.tensors.items():
        if name in _DERIVED:
            continue
        hf_name = hf_tensor_name(file, name, layer_names)
        row_order = None
        if unpermute and hf_name.endswith(_PERMUTED):
            num_heads = config.num_heads if ".q_proj." in hf_name else config.num_kv_heads
            row_order = unpermute_rows(torch.arange(int(tensor.shape[-1])), num_heads).numpy()
        if keep_quantized and tensor.tensor_type in BLOCK_TYPES and len(tensor.shape) == 2:
            yield hf_name, quantized(file, tensor, row_order)
        else:
            yield hf_name, dequantize(file, tensor, row_order)


def layer_tensor_names(file: GGUFFile) -> dict[str, str]:
    """llama.cpp's per-layer tensor names (`attn_q`) -> checkpoint modules: the Llama set plus
    what the file's registry entry adds."""
    architecture = gguf_architecture(file.architecture, file.path)
    return {**_LAYER_NAMES, **architecture.gguf_layer_tensors}


def gguf_tensor_name(hf_name: str, layer_names: dict[str, str]) -> str:
    """The GGUF name of checkpoint tensor `hf_name` (`hf_tensor_name` backwards), so an error
    about a GGUF file names the tensor as the file would hold it."""
    for name, hf in _GLOBAL_NAMES.items():
        if hf == hf_name:
            return name
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    if match is not None:
        for name, module in layer_names.items():
            if module == match[2]:
                return f"blk.{match[1]}.{name}.{match[3]}"
    return hf_name


def hf_tensor_name(file: GGUFFile, name: str, layer_names: dict[str, str]) -> str:
    """The Hugging Face name of GGUF tensor `name`, or an error naming it.

    `layer_names` maps llama.cpp's per-layer names (`attn_q`) to checkpoint modules: the
    Llama set plus what the file's registry entry adds.
    """
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match[2] not in layer_names:
        raise MalformedModelFile(file.path, f"unexpected tensor {name!r}")
    return f"model.layers.{match[1]}.{layer_names[match[2]]}.{match[3]}"


def dequantize(file: GGUFFile, tensor: GGUFTensor, row_order: np.ndarray | None = None) -> Tensor:
    """One tensor as float32 in PyTorch's `[out, in]` order (GGUF lists dims innermost first).

    `row_order[i]` names the stored row that becomes row `i`: rows are gathered while they are
    dequantised, so un-permuting q and k costs no second copy of the tensor.
    """
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(
            file.path, tensor.name, tensor.tensor_type.name, [t.name for t in SUPPORTED_TYPES]
        )
    shape = tuple(int(n) for n in reversed(tensor.shape))
    # A row is what `row_order` permutes: a matrix row, or one value of an unquantised vector
    # (a q or k bias); block-quantised data can only be split between whole blocks.
    vector = len(shape) == 1 and tensor.tensor_type in _FLOAT_TYPES
    num_rows = shape[0] if vector else math.prod(shape[:-1])
    raw = tensor.data.reshape(num_rows, -1)
    values = np.empty(shape, dtype=np.float32)
    rows = values.reshape(num_rows, -1)
    # gguf's dequantiser makes several float32 temporaries the size of its input; feeding it
    # row chunks bounds them, so loading peaks near the size of the weights themselves.
    step = max(1, _CHUNK_VALUES // max(1, rows.shape[1]))
    try:
        for start in range(0, raw.shape[0], step):
            stored = (
                raw[start : start + step]
                if row_order is None
                else raw[row_order[start : start + step]]
            )
            chunk = gguf.quants.dequantize(stored, tensor.tensor_type)
            rows[start : start + step] = chunk.reshape(-1, rows.shape[1])
    except ValueError as error:
        raise MalformedModelFile(
            file.path, f"tensor {tensor.name!r} ({tensor.tensor_type.name}) is corrupt: {error}"
        ) from error
    return torch.from_numpy(values)


def quantized(
    file: GGUFFile, tensor: GGUFTensor, row_order: np.ndarray | None = None
) -> QuantizedTensor:
    """One block-quantised matrix re-packed into a QuantizedTensor, rows in `row_order`."""
    cols = int(tensor.shape[0])
    raw = tensor.data.reshape(int(tensor.shape[1]), -1)
    try:
        return from_gguf_blocks(
            raw if row_order is None else raw[row_order], tensor.tensor_type, cols
        )
    except ValueError as error:
        raise MalformedModelFile(
            file.path, f"tensor {tensor.name!r} ({tensor.tensor_type.name}) is corrupt: {error}"
        ) from error


def unpermute_rows(weight: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's rotary permutation of a q or k projection's rows (or bias).

    The converter maps each head's rows `reshape(2, head_dim // 2)` -> transposed, turning the
    "first half / second half" rotary pairs of Hugging Face into adjacent pairs; this is the
    inverse: view each head as `(head_dim // 2, 2)` and swap the two axes back.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )
