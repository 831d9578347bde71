"""The one-call C decoder layer (`model/fused_decode.py`) against the same layer op by op.

Each decode step of a quantised tiny model runs every layer both ways on the same input: the
C layer first (it writes the step's K/V), then the op-by-op path (which writes the same K/V
again). They share every kernel but silu, so their outputs agree to float32 rounding; the
bound is relative to the layer's output, 1e-5 (observed ~1e-7).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.attention.fp8 import KVScales
from pagedkv.model import decoder
from pagedkv.model.fused_decode import run_fused
from pagedkv.weights.load import load
from pagedkv.worker.kv_cache import KVCache
from tests.model.tiny_models import random_prompt


def both_ways(monkeypatch) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """Patch every layer to run fused then op by op; returns the (fused, plain) outputs."""
    outputs = []

    def forward(self, hidden, cos, sin, batch, kv_cache):
        weights = self.fused_weights()
        fused = None
        if weights is not None:
            fused = run_fused(self, weights, hidden, cos, sin, batch, kv_cache)
        mid = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, batch, kv_cache)
        plain = mid + self.mlp(self.post_attention_layernorm(mid))
        outputs.append((fused, plain))
        return plain

    monkeypatch.setattr(decoder.DecoderLayer, "forward", forward)
    return outputs


def decode_steps(model, num_seqs: int, steps: int, **cache_options) -> None:
    """A prompt per sequence, then `steps` batched decode steps of all of them (into a cache
    made with `cache_options`: an fp8 dtype and scales)."""
    block_size = 4
    cache = KVCache.for_model(
        model, block_size=block_size, num_blocks=16 * num_seqs, **cache_options
    )
    tables = [list(range(16 * s, 16 * (s + 1))) for s in range(num_seqs)]
    prompts = [random_prompt(5 + 3 * s, seed=s) for s in range(num_seqs)]
    model(
        ForwardBatch.build(
            [SequenceInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)], 4
        ),
        cache,
    )
    for step in range(steps):
        batch = [
            SequenceInput([3 + step + s], len(p) + step, t)
            for s, (p, t) in enumerate(zip(prompts, tables, strict=True))
        ]
        model(ForwardBatch.build(batch, block_size), cache)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_fused_layer_equals_the_op_by_op_layer(zoo, monkeypatch, name, scheme, num_seqs):
    """llama, qwen2 (q/k/v biases, tied head) and mistral (a sliding window)."""
    model = load(zoo.folder(name), quantization=scheme).model
    for module in model.modules():  # zoo biases are zero: make them count
        if isinstance(module, torch.nn.Module) and getattr(module, "bias", None) is not None:
            module.bias.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    outputs = both_ways(monkeypatch)
    decode_steps(model, num_seqs, steps=6)
    decodes = [(f, p) for f, p in outputs if p.shape[0] == num_seqs and f is not None]
    assert len(decodes) == 6 * model.config.num_layers  # every decode layer took the C path
    for fused, plain in decodes:
        scale = plain.abs().max().item()
        assert (fused - plain).abs().max().item() <= 1e-5 * scale


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fused_layer_over_fp8_caches_equals_the_op_by_op_layer(zoo, monkeypatch, dtype):
    """The C layer rounds K/V into fp8 bytes and reads them back with each layer's scales,
    as the op-by-op path's kernels do; the same bound as over float32 caches."""
    model = load(zoo.folder("llama"), quantization="int4").model
    num_layers = model.config.num_layers
    scales = [KVScales(0.5 + layer, 0.25 * (layer + 1)) for layer in range(num_layers)]
    outputs = both_ways(monkeypatch)
    decode_steps(model, 3, steps=6, dtype=dtype, scales=scales)
    decodes = [(f, p) for f, p in outputs if p.shape[0] == 3 and f is not None]
    assert len(decodes) == 6 * num_layers
    for fused, plain in decodes:
        assert (fused - plain).abs().max().item() <= 1e-5 * plain.abs().max().item()


def test_prompts_and_dense_or_normed_layers_run_op_by_op(zoo, monkeypatch):
    """A prompt step (several tokens), a float model and Qwen3's q/k norms never take it."""
    outputs = both_ways(monkeypatch)
    quantised = load(zoo.folder("llama"), quantization="int8").model
    decode_steps(quantised, 1, steps=1)
    prompt_layers = [f for f, p in outputs if p.shape[0] > 1]
    assert prompt_layers and all(f is None for f in prompt_layers)
    assert all(f is not None for f, p in outputs if p.shape[0] == 1)
    for name, scheme in (("llama", "none"), ("qwen3", "int8")):
        layers = load(zoo.folder(name), quantization=scheme).model.layers
        assert all(layer.fused_weights() is None for layer in layers)
