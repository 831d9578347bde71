"""Runs of decoder layers of a decode step in one C call (`kernels/decode_layer.c`).

At batch 1 a layer of a small model is ~20 PyTorch ops and 8 module calls whose dispatch
costs more than their arithmetic; the C code runs the very kernels the op-by-op path calls
(quantised matmuls, rope, K/V write, paged attention, RMSNorm, silu * up) with no Python
between them, over every layer of a run of consecutive layers at once, so its floats are the
op-by-op path's, bit for bit. A layer joins a run when its family's registry entry allows it
(`fused_decode`: the plain Llama layer, which is what the C code computes) and every
projection is quantised in groups of 32; a step takes the C path when it is all decodes over
float32 or fp8 CPU caches (the C write rounds into fp8 bytes exactly as torch does, and
attention reads them through a byte table). Other layers and steps run op by op, which is also
what the tests compare the C path with. A tensor-parallel layer
never takes it: its projections are dense shards (quantised weights are not sharded) and the
C code has no all-reduce between attention and the MLP.

One call per run rather than per layer matters beyond dispatch: measured on SmolLM2-135M at
batch 1 (2 threads), a layer called from Python took 176 us where the same layer called again
at once took 92 us, since the Python between layers leaves its weights out of the cores'
caches; a run of 30 layers in one call costs about what the back-to-back calls do.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from pagedkv.attention.backend import CPUAttention, PagedKVCache
from pagedkv.attention.batch import ForwardBatch
from pagedkv.kernels import native
from pagedkv.model.layers.linear import QUANTIZED, Linear


@dataclass
class LayerRun:
    """Layers `[start, stop)` of a model, which run the same way: through the C code when
    `weights` (each layer's four projections as the C code takes them) is given, else op by
    op. The C arguments of a run depend on the KV cache too, so they are built for the cache
    a step uses and kept while that cache lives."""

    start: int
    stop: int
    weights: list[ctypes.Array] | None
    _cache: tuple[weakref.ref, ctypes.Array] | None = field(default=None, repr=False)

    def c_layers(self, layers: Sequence[nn.Module], kv_cache: PagedKVCache) -> ctypes.Array:
        """This run's layers as `DecodeLayerArgs`, over `kv_cache`'s tensors."""
        if self._cache is not None and self._cache[0]() is kv_cache:
            return self._cache[1]
        args = []
        for index, weights in zip(range(self.start, self.stop), self.weights, strict=True):
            layer = layers[index]
            k_cache, v_cache = kv_cache.layer(index)
            fp8 = CPUAttention.fp8_args(k_cache, kv_cache.layer_scales(index))
            args.append(
                native.DecodeLayerArgs(
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    layer.input_layernorm.eps,
                    weights,
                    k_cache.data_ptr(),
                    v_cache.data_ptr(),
                    layer.self_attn.sliding_window or 0,
                    None if fp8 is None else ctypes.pointer(fp8),
                )
            )
        array = (native.DecodeLayerArgs * len(args))(*args)
        self._cache = (weakref.ref(kv_cache), array)
        return array


def layer_runs(layers: Sequence[nn.Module], allowed: bool) -> list[LayerRun]:
    """The model's layers cut into runs of consecutive layers the C code takes, or not;
    `allowed` is the family's registry entry's `fused_decode` (all op by op when False)."""
    runs: list[LayerRun] = []
    for index, layer in enumerate(layers):
        weights = _layer_weights(layer) if allowed else None
        if runs and (runs[-1].weights is None) == (weights is None):
            runs[-1].stop = index + 1
            if weights is not None:
                runs[-1].weights.append(weights)
        else:
            runs.append(LayerRun(index, index + 1, None if weights is None else [weights]))
    return runs


def _layer_weights(layer: nn.Module) -> ctypes.Array | None:
    """The four projections (qkv, o, gate_up, down) as the C code takes them, or None when
    the layer's weights cannot go through it (norms not in float32 on the CPU, a dense
    projection, or groups other than 32)."""
    attention = layer.self_attn
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if not all(w.dtype == torch.float32 and w.device.type == "cpu" for w in norms):
        return None
    projections = (
        attention.qkv_proj,
        attention.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    )
    args = []
    for linear in projections:
        args.append(_projection(linear))
        if args[-1] is None:
            return None
    return (native.QuantizedWeightArgs * 4)(*args)


def _projection(linear: Linear) -> native.QuantizedWeightArgs | None:
    """One projection's arrays as the C code reads them; None if it cannot."""
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
    return native.QuantizedWeightArgs(
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


def run_fused(
    run: LayerRun,
    layers: Sequence[nn.Module],
    hidden: Tensor,
    cos: Tensor,
    sin: Tensor,
    batch: ForwardBatch,
    kv_cache: PagedKVCache,
) -> Tensor | None:
    """The hidden states after the run's layers, through the C code; None when the step does
    not fit it (then the caller runs them op by op)."""
    kernels = native.kernels()
    attention = layers[run.start].self_attn
    if (
        kernels is None
        or run.weights is None
        or not isinstance(attention.backend, CPUAttention)
        or max(batch.host_query_lens) != 1
        or hidden.dtype != torch.float32
        or not hidden.is_contiguous()
        or not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == torch.float32)
    ):
        return None
    k_cache, v_cache = kv_cache.layer(run.start)
    if hidden.device.type != "cpu" or not CPUAttention.writes(k_cache, v_cache):
        return None
    tables, query_starts, context_lens = CPUAttention.step_tables(batch)
    out = hidden.clone()
    status = kernels.decode_layers(
        out.data_ptr(),
        out.shape[0],
        out.shape[1],
        run.stop - run.start,
        run.c_layers(layers, kv_cache),
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        batch.slot_mapping.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        query_starts.data_ptr(),
        context_lens.data_ptr(),
        k_cache.shape[1],
        attention.scale,
    )
    if status != 0:
        raise MemoryError(f"decode layers over {hidden.shape[0]} sequences: no scratch memory")
    return out
