"""The layer path: how a step runs a model's decoder layers, op by op or in one C call per run.

At batch 1 a layer of a small model is ~20 PyTorch ops and 8 module calls whose dispatch
costs more than their arithmetic, so the CPU attention backend offers a one-call decode
(`CPUAttention.decode_layers`, `kernels/decode_layer.c`): the very kernels the op-by-op path
calls (quantised matmuls, rope, K/V write, paged attention, RMSNorm, silu * up) with no Python
between them, over every layer of a run of consecutive layers at once, so its floats are the
op-by-op path's, bit for bit. `LayerPath` is chosen once per model, after loading: it cuts the
layers into runs, a layer joining a C run when the backend is the CPU one, its family's registry
entry allows it (`fused_decode`: the plain Llama layer, which is what the C code computes) and
every projection is quantised in groups of 32. Per step the backend says once whether the step
fits (float32 hidden rows over float32 or fp8 CPU caches, whatever mix of decodes, speculative
chunks and prompt chunks: `CPUAttention.takes_decode_step`); other layers and steps run op by
op, which is also what the tests compare the C path with. A
tensor-parallel layer never takes it: its row-parallel projections are not `QUANTIZED` (their
products are all-reduced) and the C code has no all-reduce between attention and the MLP.

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

from pagedkv.attention.backend import AttentionBackend, CPUAttention
from pagedkv.attention.context import ForwardContext, PagedKVCache, get_forward_context
from pagedkv.kernels import native
from pagedkv.model.layers.linear import QUANTIZED, Linear
from pagedkv.model.lora import fused_lora


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

    def c_layers(
        self, layers: Sequence[nn.Module], backend: CPUAttention, kv_cache: PagedKVCache
    ) -> ctypes.Array:
        """This run's layers as `DecodeLayerArgs`, over `kv_cache`'s tensors."""
        if self._cache is not None and self._cache[0]() is kv_cache:
            return self._cache[1]
        args = []
        for index, weights in zip(range(self.start, self.stop), self.weights, strict=True):
            layer = layers[index]
            k_address, v_address, fp8 = backend.layer_caches(kv_cache, index)
            args.append(
                native.DecodeLayerArgs(
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    layer.input_layernorm.eps,
                    weights,
                    k_address,
                    v_address,
                    layer.self_attn.attn.sliding_window or 0,
                    None if fp8 is None else ctypes.pointer(fp8),
                )
            )
        array = (native.DecodeLayerArgs * len(args))(*args)
        self._cache = (weakref.ref(kv_cache), array)
        return array


class LayerPath:
    """A model's decoder layers in runs, each run through the CPU backend's one-call decode
    when a step fits it, else op by op (`layer(hidden)`, reading the step from the forward
    context). Made once per model, after its weights are loaded and quantised."""

    def __init__(
        self, layers: Sequence[nn.Module], backend: AttentionBackend, allowed: bool
    ) -> None:
        self.layers = layers
        # Only the C kernels' backend decodes layers in one call; with any other, every run
        # is op by op.
        self.cpu = backend if isinstance(backend, CPUAttention) else None
        self.runs = layer_runs(layers, allowed and self.cpu is not None)

    def __call__(self, hidden: Tensor) -> Tensor:
        """The hidden states after every layer, for the step of the current forward context."""
        context = get_forward_context()
        fused = self.takes_step(hidden, context)
        for run in self.runs:
            if fused and run.weights is not None:
                hidden = self.run_fused(run, hidden, context)
            else:
                hidden = self.run_layers(run, hidden)
        return hidden

    def takes_step(self, hidden: Tensor, context: ForwardContext) -> bool:
        """Whether this step's C runs go through the one-call decode (decided once a step)."""
        return self.cpu is not None and self.cpu.takes_decode_step(hidden, context)

    def run_fused(self, run: LayerRun, hidden: Tensor, context: ForwardContext) -> Tensor:
        """The hidden states after a C run's layers, in one call."""
        attn = self.layers[run.start].self_attn.attn
        return self.cpu.decode_layers(
            hidden,
            run.c_layers(self.layers, self.cpu, context.kv_cache),
            (attn.num_heads, attn.num_kv_heads, attn.head_dim),
            attn.scale,
            context,
            fused_lora(run.start, run.stop),
        )

    def run_layers(self, run: LayerRun, hidden: Tensor) -> Tensor:
        """The hidden states after the run's layers, op by op."""
        for index in range(run.start, run.stop):
            hidden = self.layers[index](hidden)
        return hidden


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
    values, scales, mins, half, has_mins = qweight.pointers
    rows, cols = qweight.shape
    return native.QuantizedWeightArgs(
        values,
        scales,
        mins,
        half,
        has_mins,
        qweight.bits,
        32,
        rows,
        cols,
        None if bias is None else bias.data_ptr(),
        int(qweight.layout == "panels"),
    )
