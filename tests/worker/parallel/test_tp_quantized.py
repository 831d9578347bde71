"""Quantised weights are sharded still quantised: each rank keeps its slice of a GGUF file's
blocks (quantization "auto") or of the int8/int4 weights it quantises, and multiplies them with
the kernels one process uses.

Oracles: a shard dequantised equals the same slice of the whole weight dequantised, bit for bit
(every value keeps its integer, scale and min), for random weights of every width and group
size, cut as each projection kind cuts them; and two ranks (gloo, two processes) give the greedy
tokens of one process with the same quantization. Their logprobs differ more than float
rounding: the ranks' partial sums are added in another order, and where that moves a hidden
value across a rounding boundary of the next layer's int8 activations, one integer changes by
1 (a few hundredths of a logprob after a few layers; float weights differ in the 6th digit).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine import LLM, SamplingParams
from pagedkv.model.layers.embedding import Embedding
from pagedkv.model.layers.linear import Linear, _local_product
from pagedkv.parallel.group import TPGroup, sharding
from pagedkv.parallel.split import NotDivisible
from pagedkv.quant.formats import QuantizedTensor
from pagedkv.quant.matmul import dequantize
from pagedkv.quant.quantize import quantize_int4, quantize_int8
from pagedkv.weights.load import load
from tests.model.tiny_models import _COMMON, TinyModel, build_model_folder, random_prompt
from tests.weights.gguf.writer import write_model_gguf

SETTINGS = dict(num_gpu_blocks=32, swap_space_gb=0.01, max_model_len=256, threads=1)
PROMPTS = [random_prompt(length, seed=length) for length in (4, 19, 40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)


def random_quantized(rows: int, cols: int, bits: int, seed: int) -> QuantizedTensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator)
    return quantize_int4(weight) if bits == 4 else quantize_int8(weight)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([4, 8]),
    num_groups=st.integers(1, 20),
    rows=st.integers(1, 40),
    data=st.data(),
)
def test_a_shard_holds_exactly_its_slice_of_the_weight(bits, num_groups, rows, data):
    whole = random_quantized(rows, 32 * num_groups, bits, seed=rows * 100 + num_groups)
    if bits == 8 and data.draw(st.booleans()):  # Q6_K's groups of 16
        whole = QuantizedTensor.from_ggml(
            whole.ggml_values(),
            whole.scales.repeat_interleave(2, dim=1),
            whole.mins.repeat_interleave(2, dim=1),
            bits=8,
            group_size=16,
        )
    groups = whole.shape[1] // whole.group_size
    first_row = data.draw(st.integers(0, rows - 1))
    num_rows = data.draw(st.integers(1, rows - first_row))
    first_group = data.draw(st.integers(0, groups - 1))
    num_groups_kept = data.draw(st.integers(1, groups - first_group))
    cols = slice(first_group * whole.group_size, (first_group + num_groups_kept) * whole.group_size)
    shard = whole.shard(first_row, num_rows, cols.start, cols.stop - cols.start)
    expected = whole.dequantize()[first_row : first_row + num_rows, cols]
    assert torch.equal(shard.dequantize(), expected)
    extra = data.draw(st.integers(0, 3))
    padded = shard.padded(num_rows + extra).dequantize()
    assert torch.equal(padded[:num_rows], expected)
    assert not padded[num_rows:].any()


@pytest.mark.parametrize("bits", [4, 8])
def test_an_empty_share_of_rows_pads_to_zero_rows(bits):
    """A padded vocabulary can leave a rank no rows of its own (5 rows on 4 ranks): its share
    is all padding, whatever the row's width."""
    whole = random_quantized(5, 512, bits, seed=2)
    share = whole.shard(5, 0, 0, 512).padded(2)
    assert share.shape == (2, 512) and not share.dequantize().any()


def test_a_shard_must_cut_whole_groups():
    whole = random_quantized(4, 64, 4, seed=1)
    with pytest.raises(ValueError, match="groups of 32"):
        whole.shard(0, 4, 16, 32)


def sharded(build, rank: int):
    with sharding(TPGroup(rank, 2)):
        return build()


@pytest.mark.parametrize("bits", [4, 8])
def test_each_projection_kind_keeps_its_ranks_slice_quantised(bits):
    """q/k/v split by heads (column), o by input columns (row), a padded LM head by
    vocabulary rows, and the embedding table: every rank's dequantised weight is the whole
    one's slice, and the row-parallel products of the ranks add up to the whole product."""
    hidden, vocab = 128, 45  # 4 query heads of 32, 2 KV heads; 45 rows: the last rank pads
    q, k, v = (random_quantized(n, hidden, bits, seed) for seed, n in enumerate((128, 64, 64)))
    o = random_quantized(hidden, 128, bits, seed=3)
    head = random_quantized(vocab, hidden, bits, seed=4)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5))
    partial_sums = []
    for rank in range(2):
        qkv = sharded(
            lambda: Linear(hidden, (128, 64, 64), bias=False, parts=("q", "k", "v"),
                           parallel="column", part_units=(4, 2, 2)),
            rank,
        )  # fmt: skip
        out = sharded(lambda: Linear(128, (hidden,), bias=False, parallel="row"), rank)
        lm_head = sharded(
            lambda: Linear(hidden, (vocab,), bias=False, parallel="column", gather_output=True),
            rank,
        )
        table = sharded(lambda: Embedding(vocab, hidden), rank)
        for layer, tensors in ((qkv, (q, k, v)), (out, (o,)), (lm_head, (head,))):
            layer.quantize("auto")
            for part, tensor in enumerate(tensors):
                layer.load("weight", part, tensor)
        table.quantize("auto")
        table.load(head)
        halves = [slice(rank * n // 2, (rank + 1) * n // 2) for n in (128, 64, 64)]
        expected = torch.cat([w.dequantize()[h] for w, h in zip((q, k, v), halves, strict=True)])
        assert torch.equal(dequantize(qkv.qweight), expected)
        columns = slice(rank * 64, (rank + 1) * 64)
        assert torch.equal(dequantize(out.qweight), o.dequantize()[:, columns])
        rows = slice(rank * 23, min(vocab, (rank + 1) * 23))
        for weight in (dequantize(lm_head.qweight), dequantize(table.qweight)):
            assert weight.shape == (23, hidden)
            assert torch.equal(weight[: rows.stop - rows.start], head.dequantize()[rows])
            assert not weight[rows.stop - rows.start :].any()
        partial_sums.append(_local_product(out, x[:, columns], None))  # before the all-reduce
    whole = Linear(128, (hidden,), bias=False)
    whole.quantize("auto")
    whole.load("weight", 0, o)
    torch.testing.assert_close(partial_sums[0] + partial_sums[1], whole(x), rtol=1e-5, atol=1e-5)


def run(llm: LLM):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    logprobs = [
        [entry[token].logprob for entry, token in zip(out.outputs[0].logprobs, ids, strict=True)]
        for out, ids in zip(outputs, tokens, strict=True)
    ]
    return tokens, logprobs


@pytest.mark.parametrize(
    ("family", "qtype"), [("qwen2", QType.Q8_0), ("llama", QType.Q4_1)], ids=["q8_0", "q4_1"]
)
def test_a_gguf_file_runs_quantised_on_two_ranks_as_on_one(tiny_gguf, family, qtype):
    """qwen2: tied head, q/k/v biases; llama: an LM head of its own."""
    path = str(tiny_gguf(family, qtype=qtype))
    single = LLM(path, **SETTINGS)
    parallel = LLM(path, tensor_parallel_size=2, **SETTINGS)
    try:
        want_tokens, want_logprobs = run(single)
        got_tokens, got_logprobs = run(parallel)
        rank_0 = parallel.engine.runner.model
    finally:
        parallel.engine.shutdown()
    assert got_tokens == want_tokens
    gaps = [
        abs(g - w)
        for got, want in zip(got_logprobs, want_logprobs, strict=True)
        for g, w in zip(got, want, strict=True)
    ]
    assert max(gaps) < 0.1  # a flipped activation integer at most
    assert sorted(gaps)[len(gaps) * 9 // 10] < 1e-5  # the rest: the sums' order alone
    layers = [m for m in rank_0.modules() if isinstance(m, Linear)]
    assert layers and all(layer.qweight is not None for layer in layers)
    assert all(layer.parallel is not None for layer in layers)


def test_int8_quantises_each_ranks_shard(tp_folders):
    folder = str(tp_folders["llama"])
    single = LLM(folder, quantization="int8", **SETTINGS)
    parallel = LLM(folder, quantization="int8", tensor_parallel_size=2, **SETTINGS)
    try:
        want, _ = run(single)
        got, _ = run(parallel)
    finally:
        parallel.engine.shutdown()
    assert got == want


@pytest.mark.parametrize("scheme", ["auto", "int8", "int4"])
def test_a_rank_share_that_cuts_groups_is_refused_naming_the_fix(scheme):
    """96 inputs on 2 ranks: 48 each, not whole groups of 32. One process multiplies that
    projection quantised; a rank could only do it in float, another product, so the split is
    refused (as vLLM refuses it), before any weight is kept."""
    whole = random_quantized(16, 96, 4, seed=6)
    layer = sharded(lambda: Linear(96, (16,), bias=False, parallel="row"), 1)
    message = r"96 inputs give each of tensor_parallel_size \(2\) ranks 48, not whole groups"
    with pytest.raises(NotDivisible, match=message):
        layer.quantize(scheme)
        layer.load("weight", 0, whole if scheme == "auto" else whole.dequantize())


def test_a_gguf_file_whose_rank_shares_cut_groups_is_refused_on_load(tmp_path):
    """An MLP of 96 on 2 ranks: each down_proj would take 48 inputs."""
    spec = TinyModel("LlamaForCausalLM", dict(_COMMON, intermediate_size=96))
    folder = build_model_folder("llama_mlp_96", tmp_path / "folder", spec=spec)
    path = write_model_gguf(tmp_path / "mlp96.gguf", folder, qtype=QType.Q8_0)
    with sharding(TPGroup(rank=1, size=2)), pytest.raises(NotDivisible, match="ranks 48"):
        load(path, progress=lambda line: None)
    with sharding(TPGroup(rank=1, size=2)):  # float, as one process would run it too
        model = load(path, quantization="none", progress=lambda line: None).model
    assert all(m.qweight is None for m in model.modules() if isinstance(m, Linear))
