"""Tensor parallelism hides itself: two ranks (gloo, two processes) give the greedy output of
one, for every family, through preemption (swap and recompute), chunked prefill, prefix
caching and n > 1 forks, and schedule exactly the same steps.

One TP=2 `LLM` per family runs every case, because each group spawns a process that imports
torch. The oracle is the same engine at TP=1 with the same settings (which the engine tests
compare with transformers).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine import LLM, SamplingParams
from pagedkv.kvmath.parallel import per_rank_spec
from pagedkv.worker.kv_cache import kv_spec
from tests.model.tiny_models import random_prompt
from tests.worker.parallel.conftest import FAMILIES

# A pool of 10 blocks for requests that grow to 6: they are preempted again and again;
# a token budget of 32 chunks every longer prompt.
SETTINGS = dict(
    num_gpu_blocks=10,
    swap_space_gb=0.01,
    max_model_len=1024,
    max_num_batched_tokens=32,
    max_num_seqs=8,
    threads=1,
    # Every rank must load with it: a worker that dropped it would compute other logits.
    hf_overrides={"rms_norm_eps": 0.01},
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
FORKED = SamplingParams(n=2, temperature=0.0, max_tokens=24)
SHARED = random_prompt(40, seed=99)
PROMPTS = [random_prompt(length, seed=length) for length in (3, 9, 17, 30, 45, 60)]
CACHED = [SHARED + random_prompt(length, seed=length + 1) for length in (1, 12, 20)]


@pytest.fixture(scope="module", params=FAMILIES)
def engines(request, tp_folders):
    """`(TP=1, TP=2)` LLMs over one family; even families preempt by swap, odd by recompute."""
    name = request.param
    mode = "swap" if FAMILIES.index(name) % 2 == 0 else "recompute"
    folder = str(tp_folders[name])
    single = LLM(folder, preemption_mode=mode, **SETTINGS)
    parallel = LLM(folder, preemption_mode=mode, tensor_parallel_size=2, **SETTINGS)
    yield single, parallel, mode
    parallel.engine.shutdown()


def token_ids(llm: LLM, prompts, params) -> list[list[list[int]]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[list(sample.token_ids) for sample in output.outputs] for output in outputs]


def test_greedy_output_and_schedule_match_one_rank(engines):
    single, parallel, mode = engines
    params = [GREEDY, GREEDY, GREEDY, FORKED, GREEDY, GREEDY]  # two samples of 30 + 24 fit
    for llm in (single, parallel):
        llm.results = token_ids(llm, PROMPTS, params)  # type: ignore[attr-defined]
        llm.results += token_ids(llm, CACHED[:1], GREEDY)  # fills the prefix cache
        llm.results += token_ids(llm, CACHED[1:], GREEDY)  # hits it
    assert parallel.results == single.results  # type: ignore[attr-defined]
    assert len(parallel.results[3]) == 2  # type: ignore[attr-defined]
    one, two = single.engine.stats, parallel.engine.stats
    preemptions = "num_swap_preemptions" if mode == "swap" else "num_recompute_preemptions"
    assert getattr(two, preemptions) == getattr(one, preemptions) > 0
    assert two.prefix_hit_tokens == one.prefix_hit_tokens >= 2 * 32


def test_each_rank_holds_its_share_of_every_block(engines):
    single, parallel, _ = engines
    config = single.engine.config
    heads_per_rank = max(config.num_kv_heads // 2, 1)  # one replicated head below two
    assert parallel.engine.manager.num_gpu_blocks == single.engine.manager.num_gpu_blocks
    assert (
        parallel.engine.kv_bytes_per_block * config.num_kv_heads
        == single.engine.kv_bytes_per_block * heads_per_rank
    )
    assert parallel.engine.runner.kv_cache.cache.shape[4] == heads_per_rank
    # The planner's per-rank arithmetic (`pagedkv plan --tensor-parallel-size 2`) agrees.
    planned = per_rank_spec(kv_spec(config, torch.float32), 2)
    assert planned.bytes_per_block(16) == parallel.engine.kv_bytes_per_block


def test_two_ranks_give_a_request_one_answer_however_batched(engines):
    """Under tensor parallelism too, a request's tokens and logprob floats alone equal those
    it gets among a crowd that preempts and chunks it, its prompt then served from the prefix
    cache: the all-reduce sums the ranks' partial products in rank order, whatever the step."""
    _, parallel, _ = engines
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    target = SHARED + random_prompt(7, seed=5)

    def answer(outputs) -> tuple[list[int], list]:
        sample = outputs[-1].outputs[0]
        return list(sample.token_ids), sample.logprobs

    alone = answer(parallel.generate([target], params, use_tqdm=False))
    crowd = parallel.generate(
        [*PROMPTS, target], [GREEDY] * len(PROMPTS) + [params], use_tqdm=False
    )
    assert answer(crowd) == alone


def test_speculative_drafts_verify_across_ranks(tp_folders):
    """Prompt-lookup drafts travel with the step to every rank: two ranks speculating give the
    greedy output of one rank without speculation, under preemption and chunking."""
    folder = str(tp_folders[FAMILIES[0]])
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    prompts = [p * 2 for p in PROMPTS[:4]]  # repeated text: some drafts are kept
    expected = token_ids(LLM(folder, **SETTINGS), prompts, GREEDY)
    parallel = LLM(folder, tensor_parallel_size=2, speculative_config=spec, **SETTINGS)
    try:
        assert token_ids(parallel, prompts, GREEDY) == expected
        assert parallel.engine.scheduler.drafts.stats.num_draft_tokens > 0
    finally:
        parallel.engine.shutdown()


def test_a_draft_model_runs_on_rank_0_and_changes_no_token(tp_folders):
    """Speculative decoding with a draft model under TP=2: the model drafts for itself (every
    greedy draft kept), whole on rank 0, in a pool that preempts; the tokens are TP=1's without
    speculation."""
    folder = str(tp_folders["llama"])
    draft = {"model": folder, "num_speculative_tokens": 3}
    # The draft loads as its folder says: the model must too, for its drafts to be its own.
    settings = {key: value for key, value in SETTINGS.items() if key != "hf_overrides"}
    single = LLM(folder, preemption_mode="swap", **settings)
    parallel = LLM(
        folder, preemption_mode="swap", tensor_parallel_size=2, speculative_config=draft, **settings
    )
    try:
        got = token_ids(parallel, PROMPTS, GREEDY)
        stats = parallel.engine.stats.spec_decoding
        swapped = parallel.engine.scheduler.num_swap_preemptions
    finally:
        parallel.engine.shutdown()
    assert got == token_ids(single, PROMPTS, GREEDY)
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert swapped > 0  # the draft's K/V went to the CPU and back with the model's
