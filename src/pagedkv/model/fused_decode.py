"""A whole decoder layer of a decode step in one C call (`kernels/decode_layer.c`).

At batch 1 a layer of a small model is ~20 PyTorch ops and 8 module calls whose dispatch
costs more than their arithmetic; the C layer runs the same kernels (quantised matmuls, rope,
K/V write, paged decode attention, RMSNorm) with no Python between them. It applies when the
layer is the plain Llama shape with every projection quantised in groups of 32 and the step
is all decodes of at most `DOT_ROWS` sequences over float32 or fp8 CPU caches (the C write
rounds into fp8 bytes exactly as torch does, and attention reads them through a byte table);
otherwise the layer runs op by op, which is also what the tests compare it with. A
tensor-parallel layer never takes it: its projections are dense shards (quantised weights are
not sharded) and the C layer has no all-reduce between attention and the MLP.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from pagedkv.attention.backend import CPUAttention, PagedKVCache
from pagedkv.attention.batch import ForwardBatch
from pagedkv.kernels import native
from pagedkv.model.layers.linear import QUANTIZED, Linear
from pagedkv.quant.matmul import DOT_ROWS


def layer_weights(projections: tuple[Linear, ...]) -> ctypes.Array | None:
    """The four projections (qkv, o, gate_up, down) as the C layer takes them, or None when
    one of them cannot go through it (dense, or not in groups of 32)."""
    args = []
    for linear in projections:
        qweight = linear.qweight
        if linear.method is not QUANTIZED or qweight is None or not qweight.kernel_ready:
            return None
        if qweight.group_size != 32:
            return None
        bias = linear.bias
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            return None
        values, scales, mins, has_mins = qweight.pointers
        rows, cols = qweight.shape
        args.append(
            native.QuantizedWeightArgs(
                values,
                scales,
                mins,
                has_mins,
                qweight.bits,
                32,
                rows,
                cols,
                None if bias is None else bias.data_ptr(),
            )
        )
    return (native.QuantizedWeightArgs * 4)(*args)


def run_fused(
    layer,
    weights: ctypes.Array,
    hidden: Tensor,
    cos: Tensor,
    sin: Tensor,
    batch: ForwardBatch,
    kv_cache: PagedKVCache,
) -> Tensor | None:
    """The layer's output for this step through the C layer, or None when the step does not
    fit it (then the caller runs the layer op by op)."""
    kernels = native.kernels()
    attention = layer.self_attn
    if (
        kernels is None
        or not isinstance(attention.backend, CPUAttention)
        or hidden.shape[0] > DOT_ROWS
        or max(batch.host_query_lens) != 1
        or hidden.dtype != torch.float32
        or not hidden.is_contiguous()
        or not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == torch.float32)
    ):
        return None
    k_cache, v_cache = kv_cache.layer(attention.index)
    if not CPUAttention.takes(k_cache, v_cache, hidden):
        return None
    tables, rows, context_lens = CPUAttention.decode_tables(batch)
    fp8 = CPUAttention.fp8_args(k_cache, kv_cache.layer_scales(attention.index))
    out = hidden.clone()
    status = kernels.decode_layer(
        out.data_ptr(),
        out.shape[0],
        out.shape[1],
        layer.input_layernorm.weight.data_ptr(),
        layer.post_attention_layernorm.weight.data_ptr(),
        layer.input_layernorm.eps,
        weights,
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        batch.slot_mapping.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        rows.data_ptr(),
        context_lens.data_ptr(),
        k_cache.shape[1],
        attention.scale,
        attention.sliding_window or 0,
        None if fp8 is None else ctypes.byref(fp8),
    )
    if status != 0:
        raise MemoryError(f"decode layer over {hidden.shape[0]} sequences: no scratch memory")
    return out
