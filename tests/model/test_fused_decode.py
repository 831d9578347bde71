"""Runs of decoder layers in one C call (`model/fused_decode.py`) against the same layers op by
op.

Each layer, on the C path alone (a run of one), is compared with the op-by-op layer on the same
input at every step of a quantised tiny model (prompts, decodes, and chunks of a few tokens per
sequence, as a speculative step verifies drafts): they call the very same kernels (matmuls,
norms, rope, attention, silu * up), so their outputs must be equal bit for bit. A run of several
layers in one call must then equal its layers called one at a time, bit for bit, K/V included.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.attention.context import get_forward_context
from pagedkv.attention.fp8 import KVScales
from pagedkv.model import decoder
from pagedkv.model.fused_decode import LayerRun
from pagedkv.model.layers.linear import DENSE
from pagedkv.model.registry import ARCHITECTURES
from pagedkv.weights.load import load
from pagedkv.worker.kv_cache import KVCache
from tests.model.tiny_models import random_prompt


def each_layer_both_ways(monkeypatch, model) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """Run the model op by op, each layer also run alone through the C path on the same
    input first (it writes the step's K/V, which the op-by-op layer writes again); returns
    the (C, op-by-op) outputs of every layer of every step."""
    outputs = []
    weights = {}
    path = model.layer_path
    for run in path.runs:
        for index in range(run.start, run.stop):
            weights[index] = None if run.weights is None else run.weights[index - run.start]
    plain_forward = decoder.DecoderLayer.forward

    def forward(self, hidden):
        index = self.self_attn.attn.index
        fused = None
        context = get_forward_context()
        if weights[index] is not None and path.takes_step(hidden, context):
            alone = LayerRun(index, index + 1, [weights[index]])
            fused = path.run_fused(alone, hidden, context)
        plain = plain_forward(self, hidden)
        outputs.append((fused, plain))
        return plain

    monkeypatch.setattr(decoder.DecoderLayer, "forward", forward)
    path.runs = [LayerRun(0, len(model.layers), None)]
    return outputs


def steps(num_seqs: int, num_steps: int) -> list[list[SequenceInput]]:
    """A prompt per sequence, then `num_steps` batched decode steps of all of them, then a step
    where sequence s computes a chunk of s + 1 tokens (a speculative step's token and drafts)."""
    tables = [list(range(16 * s, 16 * (s + 1))) for s in range(num_seqs)]
    prompts = [random_prompt(5 + 3 * s, seed=s) for s in range(num_seqs)]
    batches = [[SequenceInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)]]
    for step in range(num_steps):
        batches.append(
            [
                SequenceInput([3 + step + s], len(p) + step, t)
                for s, (p, t) in enumerate(zip(prompts, tables, strict=True))
            ]
        )
    batches.append(
        [
            SequenceInput([7 + s + i for i in range(s + 1)], len(p) + num_steps, t, s + 1)
            for s, (p, t) in enumerate(zip(prompts, tables, strict=True))
        ]
    )
    return batches


def cache_for(model, num_seqs: int, **cache_options) -> KVCache:
    """A zeroed cache (the pool starts uninitialised) with `cache_options`: fp8 dtype, scales."""
    cache = KVCache.for_model(model, block_size=4, num_blocks=16 * num_seqs, **cache_options)
    cache.cache.zero_()
    return cache


def assert_each_layer_matches(monkeypatch, model, num_seqs: int, **cache_options) -> None:
    outputs = each_layer_both_ways(monkeypatch, model)
    cache = cache_for(model, num_seqs, **cache_options)
    batches = steps(num_seqs, 6)
    for batch in batches:
        model(ForwardBatch.build(batch, 4), cache)
    # Every layer of every step took the C path: prompts, decodes and chunks of several tokens.
    assert len(outputs) == len(batches) * model.config.num_layers
    for fused, plain in outputs:
        assert fused is not None
        assert torch.equal(fused, plain), f"max difference {(fused - plain).abs().max():.3g}"


def assert_runs_equal_their_layers_alone(model, num_seqs: int, **cache_options) -> None:
    """The model's runs against runs of one layer each: logits and caches bit for bit."""
    path = model.layer_path
    runs = path.runs
    alone = [
        LayerRun(i, i + 1, None if r.weights is None else [r.weights[i - r.start]])
        for r in runs
        for i in range(r.start, r.stop)
    ]
    caches = [cache_for(model, num_seqs, **cache_options) for _ in range(2)]
    for batch in steps(num_seqs, 6):
        path.runs = runs
        together = model(ForwardBatch.build(batch, 4), caches[0])
        path.runs = alone
        one_by_one = model(ForwardBatch.build(batch, 4), caches[1])
        assert torch.equal(together, one_by_one)
    path.runs = runs
    assert torch.equal(caches[0].cache, caches[1].cache)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_the_c_path_equals_the_op_by_op_layers(zoo, monkeypatch, name, scheme, num_seqs):
    """llama, qwen2 (q/k/v biases, tied head) and mistral (a sliding window)."""
    model = load(zoo.folder(name), quantization=scheme).model
    for module in model.modules():  # zoo biases are zero: make them count
        if isinstance(module, torch.nn.Module) and getattr(module, "bias", None) is not None:
            module.bias.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    assert [(r.start, r.stop) for r in model.layer_path.runs] == [(0, model.config.num_layers)]
    assert_runs_equal_their_layers_alone(model, num_seqs)
    assert_each_layer_matches(monkeypatch, model, num_seqs)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_c_path_over_fp8_caches_equals_the_op_by_op_layers(zoo, monkeypatch, dtype):
    """The C code rounds K/V into fp8 bytes and reads them back with each layer's scales,
    as the op-by-op path's kernels do; the same bounds as over float32 caches."""
    model = load(zoo.folder("llama"), quantization="int4").model
    num_layers = model.config.num_layers
    scales = [KVScales(0.5 + layer, 0.25 * (layer + 1)) for layer in range(num_layers)]
    assert_runs_equal_their_layers_alone(model, 3, dtype=dtype, scales=scales)
    assert_each_layer_matches(monkeypatch, model, 3, dtype=dtype, scales=scales)


def test_a_layer_the_c_code_cannot_take_splits_the_runs(zoo, monkeypatch):
    """Layer 0's o projection made dense (its weights dequantised): that layer runs op by op,
    the layers after it as one C run, and every step takes that run."""
    model = load(zoo.folder("llama"), quantization="int8").model
    o_proj = model.layers[0].self_attn.o_proj
    o_proj.weight = torch.nn.Parameter(o_proj.qweight.dequantize(), requires_grad=False)
    o_proj.qweight, o_proj.method = None, DENSE
    model.__dict__.pop("layer_path", None)
    num_layers = model.config.num_layers
    path = model.layer_path
    runs = [(r.start, r.stop, r.weights is not None) for r in path.runs]
    assert runs == [(0, 1, False), (1, num_layers, True)]
    taken = []
    real_fused, real_layers = path.run_fused, path.run_layers

    def fused(run, *args):
        taken.append((run.start, run.stop, True))
        return real_fused(run, *args)

    def op_by_op(run, *args):
        if run.weights is not None:
            taken.append((run.start, run.stop, False))
        return real_layers(run, *args)

    monkeypatch.setattr(path, "run_fused", fused)
    monkeypatch.setattr(path, "run_layers", op_by_op)
    cache = cache_for(model, 2)
    for batch in steps(2, 3):
        model(ForwardBatch.build(batch, 4), cache)
    assert taken == [(1, num_layers, True)] * len(steps(2, 3))


def test_dense_or_normed_models_have_no_c_runs(zoo):
    """A float model never takes the C path, nor does Qwen3 (its q/k norms are not what the C
    code computes, and its registry entry says so: `fused_decode` False)."""
    assert not ARCHITECTURES["Qwen3ForCausalLM"].fused_decode
    for name, scheme in (("llama", "none"), ("qwen3", "int8")):
        model = load(zoo.folder(name), quantization=scheme).model
        assert [(r.start, r.stop, r.weights) for r in model.layer_path.runs] == [
            (0, model.config.num_layers, None)
        ]
