"""Quantised models end to end: what loads quantised, what it computes, what it costs.

The oracle for a quantised model is the float model (quantization "none", same checkpoint)
with every projection and the embedding table replaced by the quantised model's own weights,
dequantised: the two then differ only in how the products are computed. Prompts and decode
steps alike run on the int8 dot-product kernel, which quantises activations to int8 per group
(one path for every row count, so a token's logits never depend on its step). Every product is
checked on its real activations against the rigorous per-product bound derived in
tests/quant/test_qmatmul.py. End to end the errors pass through attention and the MLPs, which
no simple bound follows, so the logits are held to measured figures with about 2x margin
(stated at each assertion); and since a prompt's rows take the decode path's arithmetic, each
prompt position's logits equal, bit for bit, those of the same tokens fed one decode at a time.
Weight quantisation error is measured too, against the float model itself.
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.engine.args import EngineArgs
from pagedkv.model import footprint, fused_decode
from pagedkv.model.decoder import DecoderModel
from pagedkv.model.fused_decode import LayerRun
from pagedkv.model.layers import embedding as embedding_module
from pagedkv.model.layers import linear as linear_module
from pagedkv.model.layers.embedding import Embedding
from pagedkv.model.layers.linear import DENSE, QUANTIZED, Linear
from pagedkv.quant.formats import QuantizedTensor
from pagedkv.quant.matmul import kernel_layout
from pagedkv.quant.quantize import quantize_int4
from pagedkv.quant.schemes import QUANTIZATIONS, resolve_quantization
from pagedkv.weights.hf_folder import load_model
from pagedkv.weights.load import load
from pagedkv.worker.kv_cache import KVCache
from pagedkv.worker.threads import physical_cores
from tests.model.tiny_models import random_prompt
from tests.quant.test_qmatmul import assert_within, dot_path_bound, reference
from tests.weights.gguf.writer import folder_weights, permute_rows, write_model_gguf

ARCHITECTURES = ["llama", "qwen2"]  # untied head + plain Linear; tied head + q/k/v biases
PROMPT = random_prompt(40, seed=7)  # one prefill
CONTINUATION = random_prompt(48, seed=8)  # 48 teacher-forced decode steps
LAYOUT = {"int8": (8, 32), "int4": (4, 32), QType.Q8_0: (8, 32), QType.Q4_0: (4, 32)}
# Decode-vs-oracle logit errors measured over llama, qwen2, qwen3 and mistral with five
# prompts each, as fractions of the logits' standard deviation, and the share of decode steps
# whose argmax agrees: int8 rms <= 0.027, max <= 0.17, argmax >= 81%; int4 rms <= 0.148,
# argmax >= 75%. int4's integer parts `scale * q` span the group's whole range, so activation
# rounding weighs more there, and its largest errors are heavy-tailed (one rounding that
# lands the other way early on moves a few logits by up to ~1.1 std): no max is held for it.
# Bounds: about twice the rms and max, and agreement a few steps below the measured.
DECODE_BOUNDS = {8: (0.06, 0.35, 0.7), 4: (0.3, None, 0.6)}  # bits -> rms, max, argmax


def forward_logits(model: DecoderModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at every prompt position (one prefill) and at each of the fixed continuation's
    decode steps (tokens fed regardless of the model's choice, so both models see the same)."""
    block_size, num_blocks = 16, 6
    cache = KVCache.for_model(model, block_size=block_size, num_blocks=num_blocks)
    table = list(range(num_blocks))
    prompt = SequenceInput(PROMPT, 0, table, num_logits=len(PROMPT))
    prefill = model(ForwardBatch.build([prompt], block_size), cache)
    steps = []
    for offset, token in enumerate(CONTINUATION):
        step = SequenceInput([token], len(PROMPT) + offset, table)
        steps.append(model(ForwardBatch.build([step], block_size), cache))
    return prefill, torch.cat(steps)


def exact_weight(weight: QuantizedTensor) -> torch.Tensor:
    """`scale * q + min` in float64: the weight the quantised model stands for, unrounded."""
    rows, cols = weight.shape
    q = weight.integers().double().view(rows, -1, weight.group_size)
    return (q * weight.scales.double()[..., None] + weight.mins.double()[..., None]).view(
        rows, cols
    )


class RecordedProducts:
    """Every `quantized_linear` call a model makes (projections and a tied head), recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[torch.Tensor, QuantizedTensor, torch.Tensor | None, torch.Tensor]]
        self.calls = []
        real = linear_module.quantized_linear

        def recording(x, weight, bias):
            out = real(x, weight, bias)
            self.calls.append((x.detach().clone(), weight, bias, out.detach().clone()))
            return out

        monkeypatch.setattr(linear_module, "quantized_linear", recording)
        monkeypatch.setattr(embedding_module, "quantized_linear", recording)

    def check(self) -> tuple[int, int]:
        """Each product within its bound on its own activations; returns how many products
        had one row (decode steps) and how many had more (the prompt)."""
        counts = [0, 0]
        for x, weight, bias, out in self.calls:
            flat = x.reshape(-1, x.shape[-1]).float()
            bound = dot_path_bound(flat, weight, exact_weight(weight), bias)
            what = f"product {tuple(flat.shape)} @ {weight.shape}"
            expected = reference(flat, exact_weight(weight), bias)
            assert_within(out.reshape(flat.shape[0], -1), expected, bound, what)
            counts[0 if flat.shape[0] == 1 else 1] += 1
        return counts[0], counts[1]


def randomise_biases(model: DecoderModel, seed: int) -> int:
    """Give every projection bias random values; returns how many there are. The tiny
    checkpoints' biases are all zero (transformers initialises them so), which would let a
    dropped or misplaced bias go unseen."""
    gen = torch.Generator().manual_seed(seed)
    biases = [m.bias for m in model.modules() if isinstance(m, Linear) and m.bias is not None]
    with torch.no_grad():
        for bias in biases:
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.5)
    return len(biases)


def oracle_for(quantised: DecoderModel, float_model: DecoderModel) -> DecoderModel:
    """`float_model` with every projection and the embedding table set to `quantised`'s
    weights, dequantised by `QuantizedTensor.dequantize` (torch, not the C kernel), and its
    projection biases set to `quantised`'s."""
    pairs = zip(quantised.named_modules(), float_model.named_modules(), strict=True)
    replaced = 0
    with torch.no_grad():
        for (name, ours), (other_name, theirs) in pairs:
            assert name == other_name
            if isinstance(ours, (Linear, Embedding)):
                assert theirs.weight.shape == ours.qweight.shape
                theirs.weight.copy_(ours.qweight.dequantize())
                replaced += 1
            if isinstance(ours, Linear) and ours.bias is not None:
                theirs.bias.copy_(ours.bias)
    assert replaced > 0
    return float_model


def assert_quantised(model: DecoderModel, layout: tuple[int, int]) -> None:
    """Every projection and the embedding table kept quantised in `layout`, no float copy."""
    modules = [m for m in model.modules() if isinstance(m, (Linear, Embedding))]
    assert any(isinstance(m, Embedding) for m in modules)
    for module in modules:
        assert module.weight is None and module.qweight is not None
        assert (module.qweight.bits, module.qweight.group_size) == layout
        if isinstance(module, Linear):
            assert module.method is QUANTIZED
            assert module.qweight.shape == (module.out_features, module.in_features)


def logit_error(actual: torch.Tensor, expected: torch.Tensor, scale: float) -> tuple[float, float]:
    """(rms, max) of the difference, as fractions of `scale`."""
    diff = (actual - expected).double()
    return float(diff.pow(2).mean().sqrt()) / scale, float(diff.abs().max()) / scale


def teacher_forced(model: DecoderModel) -> torch.Tensor:
    """The prompt's logits at every position, its tokens fed one decode step at a time."""
    block_size, num_blocks = 16, 6
    cache = KVCache.for_model(model, block_size=block_size, num_blocks=num_blocks)
    table = list(range(num_blocks))
    steps = [
        model(ForwardBatch.build([SequenceInput([token], position, table)], block_size), cache)
        for position, token in enumerate(PROMPT)
    ]
    return torch.cat(steps)


def assert_close_logits(actual, expected, bits: int, scale: float, what: str) -> None:
    """Logits within DECODE_BOUNDS (see there for the measurements behind them)."""
    rms, worst = logit_error(actual, expected, scale)
    rms_bound, max_bound, agree_bound = DECODE_BOUNDS[bits]
    assert rms <= rms_bound, f"{what}: rms error {rms:.3f} std"
    assert max_bound is None or worst <= max_bound, f"{what}: max error {worst:.3f} std"
    agree = float((actual.argmax(-1) == expected.argmax(-1)).double().mean())
    assert agree >= agree_bound, f"{what}: argmax agrees at {agree:.0%} of decode steps"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_quantised_model_computes_what_its_weights_say(zoo, monkeypatch, name, scheme):
    """`load(..., quantization=scheme)` quantises every projection and the embedding, and
    its logits are its dequantised weights' logits up to activation quantisation: exact to
    float32 rounding on the prompt, every decode product within its derived bound, and the
    decode logits within the measured bounds (module docstring)."""
    # Op by op, so every product is seen (the one-call decode layer is checked against this
    # runs in test_fused_decode.py).
    monkeypatch.setattr(
        fused_decode, "layer_runs", lambda layers, allowed: [LayerRun(0, len(layers), None)]
    )
    float_model = load(zoo.folder(name), quantization="none").model
    model = load(zoo.folder(name), quantization=scheme).model
    assert_quantised(model, LAYOUT[scheme])
    if scheme == "int8":
        assert all(not m.qweight.has_mins for m in model.modules() if isinstance(m, Linear))
    # qwen2: one fused q/k/v bias in each of 2 layers; llama has none
    assert randomise_biases(model, seed=11) == (2 if name == "qwen2" else 0)
    oracle_prefill, oracle_decode = forward_logits(oracle_for(model, float_model))

    products = RecordedProducts(monkeypatch)
    prefill, decode = forward_logits(model)
    single, many = products.check()
    assert single > 0 and many > 0  # decode steps and the prompt, every product within bound

    scale = float(oracle_prefill.std())
    bits = LAYOUT[scheme][0]
    assert_close_logits(prefill, oracle_prefill, bits, scale, f"{name} {scheme} prompt")
    assert_close_logits(decode, oracle_decode, bits, scale, f"{name} {scheme} decode")
    assert torch.equal(prefill, teacher_forced(model)), "prompt rows differ from decode steps"


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_weight_quantisation_error_is_measured(zoo, name):
    """Against the float model itself, prompt and decode logits together: int8 stays close
    (rms <= 0.11 std, max <= 0.8 std, same argmax at >= 70% of positions; measured <= 0.055,
    <= 0.42 and >= 82% over four architectures and five prompts), and int4, whose steps are
    ~15x coarser than int8's, is clearly worse (measured rms 0.32-0.63, at least 6x int8's)
    yet still related to the float logits (unrelated logits would be ~1.4 std apart)."""
    reference_logits = torch.cat(forward_logits(load(zoo.folder(name)).model))
    scale = float(reference_logits.std())
    errors = {}
    for scheme in ("int8", "int4"):
        logits = torch.cat(forward_logits(load(zoo.folder(name), quantization=scheme).model))
        errors[scheme] = logit_error(logits, reference_logits, scale)
        if scheme == "int8":
            rms, worst = errors[scheme]
            assert rms <= 0.11 and worst <= 0.8, f"int8 vs float: rms {rms:.3f}, max {worst:.3f}"
            agree = float((logits.argmax(-1) == reference_logits.argmax(-1)).double().mean())
            assert agree >= 0.7, f"int8 vs float: argmax agrees at {agree:.0%}"
    assert errors["int4"][0] > 4 * errors["int8"][0], errors
    assert errors["int4"][0] < 0.9, errors


def expected_resident_bytes(folder, bits_of, group_bytes: int = 4) -> tuple[int, int]:
    """(resident, float32) bytes from the checkpoint's shapes: a quantised `[rows, cols]`
    matrix holds rows*cols*bits/8 value bytes plus a scale and a min per group of 32
    (`group_bytes * rows * cols / 32` bytes: 4 for a GGUF file's float16 pair, 8 for float32);
    every other tensor stays float32 at 4 bytes per value."""
    resident = total = 0
    for hf_name, tensor in folder_weights(folder).items():
        values = tensor.size
        total += 4 * values
        bits = bits_of(hf_name) if tensor.ndim == 2 else None
        resident += 4 * values if bits is None else values * bits // 8 + group_bytes * values // 32
    return resident, total


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0], ids=["Q8_0", "Q4_0"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_gguf_auto_keeps_the_files_blocks(zoo, tiny_gguf, monkeypatch, name, qtype):
    """A Q8_0 / Q4_0 file under "auto" keeps its layout (8-bit/32, or 4-bit/32 with Q4_0's
    `-8 d` as mins), holds exactly the values gguf's own dequantiser gives (the "none" load,
    bit for bit: `d * q` and `-8 d` are exact in float32), weighs what the arithmetic of
    `expected_resident_bytes` says, and computes the "none" model's logits up to activation
    quantisation."""
    path = tiny_gguf(name, qtype=qtype)
    model = load(path, quantization="auto").model
    float_model = load(path, quantization="none").model
    assert_quantised(model, LAYOUT[qtype])
    pairs = zip(model.named_modules(), float_model.named_modules(), strict=True)
    for (module_name, ours), (_, theirs) in pairs:
        if isinstance(ours, (Linear, Embedding)):
            assert torch.equal(ours.qweight.dequantize(), theirs.weight), module_name
            assert ours.qweight.has_mins == (qtype == QType.Q4_0), module_name

    resident, total = expected_resident_bytes(zoo.folder(name), lambda _: LAYOUT[qtype][0])
    if model.config.tie_word_embeddings:  # the folder may carry a head the file leaves out
        head = folder_weights(zoo.folder(name)).get("lm_head.weight")
        if head is not None:
            resident -= head.size * LAYOUT[qtype][0] // 8 + 4 * head.size // 32
            total -= 4 * head.size
    counted = footprint.weight_footprint(model)
    assert (counted.resident_bytes, counted.float32_bytes) == (resident, total)
    assert counted.ratio == pytest.approx(resident / total, rel=1e-12)
    # per layout, one entry per tensor the model holds (fused q/k/v biases are one parameter)
    floats = sum(1 for _ in model.parameters())
    quantised = sum(1 for m in model.modules() if isinstance(m, (Linear, Embedding)))
    layout = f"{LAYOUT[qtype][0]}-bit/32"
    assert counted.layouts == {layout: quantised, "float32": floats}

    oracle_prefill, oracle_decode = forward_logits(float_model)
    products = RecordedProducts(monkeypatch)
    prefill, decode = forward_logits(model)
    assert all(count > 0 for count in products.check())
    scale = float(oracle_prefill.std())
    bits = LAYOUT[qtype][0]
    assert_close_logits(prefill, oracle_prefill, bits, scale, f"{name} {qtype.name} prompt")
    assert_close_logits(decode, oracle_decode, bits, scale, f"{name} {qtype.name} decode")


def test_gguf_mixed_types_in_one_projection(zoo, tmp_path):
    """A Q4_0 file whose layer-0 k projection is Q8_0 (as Q4_K_M files mix types): that
    layer's fused q/k/v becomes one 8-bit/32 tensor holding every part's exact values, the
    others stay 4-bit/32, and the footprint counts the widened layer at 8 bits."""
    folder = zoo.folder("llama")
    weights = folder_weights(folder)
    k_name = "model.layers.0.self_attn.k_proj.weight"
    heads = json.loads((folder / "config.json").read_text())["num_key_value_heads"]
    k_blocks = gguf.quants.quantize(permute_rows(weights[k_name], heads), QType.Q8_0)
    path = write_model_gguf(
        tmp_path / "mixed.gguf",
        folder,
        qtype=QType.Q4_0,
        extra_tensors={"blk.0.attn_k.weight": (np.ascontiguousarray(k_blocks), QType.Q8_0)},
    )
    model = load(path, quantization="auto").model
    float_model = load(path, quantization="none").model
    layer0_qkv = model.layers[0].self_attn.qkv_proj
    assert (layer0_qkv.qweight.bits, layer0_qkv.qweight.group_size) == (8, 32)
    assert (model.layers[1].self_attn.qkv_proj.qweight.bits, model.embed_tokens.qweight.bits) == (
        4,
        4,
    )
    assert torch.equal(
        layer0_qkv.qweight.dequantize(), float_model.layers[0].self_attn.qkv_proj.weight
    )
    widened = {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"}
    resident, total = expected_resident_bytes(folder, lambda n: 8 if n in widened else 4)
    counted = footprint.weight_footprint(model)
    assert (counted.resident_bytes, counted.float32_bytes) == (resident, total)
    assert counted.layouts["8-bit/32"] == 1


def test_requantising_a_gguf_file(tiny_gguf):
    """ "int8" on a Q4_0 file dequantises the file's blocks and quantises them again: every
    projection becomes symmetric 8-bit/32 (no mins), within half an int8 step of the file's
    values (1 / 254 of each group's largest magnitude, plus float32 rounding)."""
    path = tiny_gguf("llama", qtype=QType.Q4_0)
    model = load(path, quantization="int8").model
    float_model = load(path, quantization="none").model
    assert_quantised(model, (8, 32))
    pairs = zip(model.modules(), float_model.modules(), strict=True)
    for ours, theirs in pairs:
        if isinstance(ours, Linear):
            assert not ours.qweight.has_mins
            step = ours.qweight.scales.repeat_interleave(32, dim=1)
            error = (ours.qweight.dequantize() - theirs.weight).abs()
            assert bool((error <= step / 2 + 4e-7 * theirs.weight.abs()).all())


def test_unknown_quantization_is_refused():
    """EngineArgs names every accepted choice when given one that does not exist."""
    with pytest.raises(ValueError, match="quantization") as error:
        EngineArgs(quantization="int3")
    for choice in (*QUANTIZATIONS, "int3"):
        assert repr(choice) in str(error.value)
    with pytest.raises(ValueError, match="quantization"):
        resolve_quantization("int3", "cpu")


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("meta")])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_int_schemes_are_cpu_only(device, scheme):
    """int8/int4 off the CPU is a ValueError saying CPU only; "auto" there means "none"."""
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization(scheme, device)
    assert resolve_quantization("auto", device) == "none"
    assert resolve_quantization("none", device) == "none"


def test_quantization_on_the_cpu_is_kept():
    for quantization in QUANTIZATIONS:
        assert resolve_quantization(quantization, "cpu") == quantization


def test_loading_int8_for_a_gpu_fails_before_touching_it(zoo):
    """The refusal comes from the loaders' first step, so it needs no GPU to be raised."""
    with pytest.raises(ValueError, match="CPU only"):
        load_model(zoo.folder("llama"), device="cuda", quantization="int8")
    with pytest.raises(ValueError, match="CPU only"):
        load(zoo.folder("llama"), device="cuda", quantization="int4")


def test_physical_cores_counts_usable_cores(monkeypatch):
    """Between 1 and the CPUs this process may use; one usable CPU is one core."""
    cores = physical_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        assert cores <= len(os.sched_getaffinity(0))
        first = min(os.sched_getaffinity(0))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {first})
        assert physical_cores() == 1


def test_linear_with_columns_not_in_groups_of_32_stays_dense():
    """in_features 48 cannot be cut into groups of 32: under "int8" the layer keeps the
    float weight it was given, bit for bit, and multiplies densely."""
    layer = Linear(48, (16,), bias=False)
    layer.quantize("int8")
    weight = torch.randn(16, 48, generator=torch.Generator().manual_seed(0))
    layer.load("weight", 0, weight)
    assert layer.method is DENSE and layer.qweight is None
    assert torch.equal(layer.weight, weight)
    x = torch.randn(3, 48)
    expected = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    table = Embedding(10, 48)
    table.quantize("int8")
    rows = torch.randn(10, 48)
    table.load(rows)
    assert table.qweight is None and torch.equal(table.weight, rows)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_tied_table_in_the_kernels_layout_gives_the_same_rows_and_logits(scheme):
    """A table that is also the LM head is kept in `kernel_layout`'s layout (panels on
    AVX-512 VNNI builds); its lookups and logits have the bits of the same table kept as
    quantised, looked up and multiplied in kernel order."""
    generator = torch.Generator().manual_seed(5)
    rows = torch.randn(64, 96, generator=generator)
    tied, plain = Embedding(64, 96, reads_logits=True), Embedding(64, 96)
    for table in (tied, plain):
        table.quantize(scheme)
        table.load(rows)
    assert plain.qweight.layout == "kernel"
    assert tied.qweight.layout == kernel_layout(plain.qweight).layout
    tokens = torch.tensor([[63, 0, 17], [16, 15, 63]])
    assert torch.equal(tied(tokens), plain(tokens))
    hidden = torch.randn(7, 96, generator=generator)
    assert torch.equal(tied.logits(hidden), plain.logits(hidden))


def test_fused_projection_under_auto_mixes_file_blocks_and_floats():
    """ "auto" with a quantised part beside a float one (rare in files): the quantised part
    keeps its exact values, the float part is quantised to int8 (within half its step), and
    the layer is one 8-bit tensor; with every part float, "auto" stays dense."""
    gen = torch.Generator().manual_seed(3)
    block_part = quantize_int4(torch.randn(16, 64, generator=gen))
    float_part = torch.randn(8, 64, generator=gen)
    layer = Linear(64, (16, 8), bias=False, parts=("a", "b"))
    layer.quantize("auto")
    layer.load("weight", 0, block_part)
    assert layer.qweight is None  # nothing is packed before the last part arrives
    layer.load("weight", 1, float_part)
    assert layer.method is QUANTIZED
    assert (layer.qweight.bits, layer.qweight.group_size) == (8, 32)
    dense = layer.qweight.dequantize()
    assert torch.equal(dense[:16], block_part.dequantize())
    step = layer.qweight.scales[16:].repeat_interleave(32, dim=1)
    assert bool(((dense[16:] - float_part).abs() <= step / 2 + 4e-7 * float_part.abs()).all())

    floats = Linear(64, (16, 8), bias=False, parts=("a", "b"))
    floats.quantize("auto")
    floats.load("weight", 0, float_part.repeat(2, 1))
    floats.load("weight", 1, float_part)
    assert floats.method is DENSE and floats.qweight is None
    assert torch.equal(floats.weight, torch.cat((float_part.repeat(2, 1), float_part)))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_projections_that_cannot_be_quantised_are_named_at_load(tmp_path, caplog, scheme):
    """Groups of 32 inputs must tile a row: an MLP of 100 leaves each down_proj float, and
    the load says so (it used to only count them in the start-up line)."""
    import logging

    import transformers

    from pagedkv.weights.load import load
    from tests.model.tiny_models import write_tokenizer_files

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=100,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    write_tokenizer_files(tmp_path)
    with caplog.at_level(logging.WARNING, logger="pagedkv.weights.assemble"):
        model = load(tmp_path, quantization=scheme, progress=lambda line: None).model
    kept = [m for m in model.modules() if isinstance(m, Linear) and m.method is DENSE]
    assert [m.in_features for m in kept] == [100, 100]  # each layer's down_proj
    assert f"quantization {scheme}: 2 projections stay float" in caplog.text
    assert "[100] are not multiples of 32" in caplog.text
