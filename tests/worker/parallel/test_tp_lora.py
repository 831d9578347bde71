"""LoRA under tensor parallelism: each rank holds its share of an adapter, as of the base
weights, and the answers are one process's.

The oracle is transformers + peft with the adapter merged into the weights (as in
tests/engine/test_lora.py): every greedy token a TP=2 engine chooses must be the merged model's
argmax, or within `TIE` of it, teacher-forced over the engine's own tokens, so no near tie of a
random model can flip the test. A batch mixes adapters of every target set with base requests,
on a family whose KV heads split (llama: 2 for 2 ranks) and one whose single KV head is
replicated (llama3), and for a quantised model the tokens are TP=1's.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv.engine import LLM, LoRARequest, SamplingParams
from pagedkv.kvmath.lora import plan_lora
from pagedkv.kvmath.parallel import per_rank_spec
from pagedkv.kvmath.spec import KVSpec
from pagedkv.model.lora import RankSlice
from pagedkv.weights.lora import LoRAModule
from tests.engine.test_lora import ADAPTERS, TIE, make_adapter
from tests.model.tiny_models import random_prompt

peft = pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SETTINGS = dict(
    num_gpu_blocks=96, swap_space_gb=0.01, max_model_len=256, threads=1, enable_lora=True
)
PROMPTS = [random_prompt(length, seed=length) for length in (5, 11, 23, 8, 17)]


def merged_model(zoo, name: str, adapter):
    """transformers' model of tiny model `name` with `adapter` (None: none) merged in."""
    model = zoo.hf(name).__class__.from_pretrained(zoo.folder(name), dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def assert_merged_argmax(model, prompt: list[int], output: list[int]) -> None:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    for step, token in enumerate(output):
        row = logits[len(prompt) - 1 + step]
        assert row.max() - row[token] <= TIE, (
            f"token {step}: the engine chose {token}, transformers+peft {int(row.argmax())}"
        )


@pytest.fixture(scope="module")
def lora_folders(zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_lora")
    return {
        (name, kind): make_adapter(zoo, name, kind, root / f"{name}-{kind}")
        for name in ("llama", "llama3")
        for kind in ADAPTERS
    }


def requests_of(name: str, folders) -> list[LoRARequest | None]:
    """One request per prompt: each adapter kind, then the base model."""
    kinds = list(ADAPTERS)
    return [
        LoRARequest(kind, index + 1, str(folders[(name, kind)])) for index, kind in enumerate(kinds)
    ] + [None]


@pytest.mark.parametrize("name", ["llama", "llama3"])
def test_a_mixed_batch_at_two_ranks_matches_peft_merged(zoo, lora_folders, name):
    llm = LLM(str(zoo.folder(name)), tensor_parallel_size=2, **SETTINGS)
    try:
        loras = requests_of(name, lora_folders)
        outputs = llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)
        # Again, one at a time: the adapters are loaded once and written on every rank.
        again = [
            llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)[0]
            for prompt, lora in zip(PROMPTS, loras, strict=True)
        ]
        _, blocks = llm.engine.loras.resolve(loras[0])
    finally:
        llm.engine.shutdown()
    for prompt, lora, output, alone in zip(PROMPTS, loras, outputs, again, strict=True):
        tokens = list(output.outputs[0].token_ids)
        assert list(alone.outputs[0].token_ids) == tokens
        adapter = None if lora is None else lora_folders[(name, lora.lora_name)]
        assert_merged_argmax(merged_model(zoo, name, adapter), prompt, tokens)
    # Every adapter changes the answer (so a rank that dropped its share would be seen).
    base = list(outputs[-1].outputs[0].token_ids)
    assert all(list(output.outputs[0].token_ids) != base for output in outputs[:-1])
    # The pool blocks an adapter of every projection takes are the planner's, per rank.
    config = json.loads((zoo.folder(name) / "config.json").read_text())
    spec = per_rank_spec(KVSpec.from_hf_config(config, "fp32"), 2)
    rank, _, _, _ = ADAPTERS["all"]
    planned = plan_lora(config, spec, rank, 1, 16, tensor_parallel_size=2)
    assert blocks == planned.blocks_per_adapter


def test_a_quantised_model_gives_one_process_tokens(zoo, lora_folders):
    name = "llama"
    loras = requests_of(name, lora_folders)
    results = []
    for size in (1, 2):
        llm = LLM(str(zoo.folder(name)), quantization="int8", tensor_parallel_size=size, **SETTINGS)
        try:
            outputs = llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        results.append([list(output.outputs[0].token_ids) for output in outputs])
    assert results[1] == results[0]


def test_the_shares_of_a_module_make_the_whole_product() -> None:
    """Column-parallel shares (B's rows, padded) are the whole delta's columns; row-parallel
    shares (A's columns) add up to it over the ranks."""
    torch.manual_seed(0)
    module = LoRAModule(torch.randn(4, 12), torch.randn(10, 4), 0.5)
    x = torch.randn(3, 12)
    whole = (x @ module.a.T) @ module.b.T * module.scaling
    columns = [module.shard(RankSlice((5 * r, 5, 6), (0, 12))) for r in range(2)]
    for r, share in enumerate(columns):
        delta = (x @ share.a.T) @ share.b.T * share.scaling
        torch.testing.assert_close(delta[:, :5], whole[:, 5 * r : 5 * r + 5])
        assert not delta[:, 5:].any()  # the padding rows
    rows = [module.shard(RankSlice((0, 10, 10), (6 * r, 6))) for r in range(2)]
    total = sum((x[:, 6 * r : 6 * r + 6] @ s.a.T) @ s.b.T * s.scaling for r, s in enumerate(rows))
    torch.testing.assert_close(total, whole)
    assert module.shard(RankSlice((0, 10, 10), (0, 12))) is module
