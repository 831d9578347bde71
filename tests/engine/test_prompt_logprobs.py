"""`SamplingParams(prompt_logprobs=k)`: every prompt token's logprob, rank and top k, as vLLM.

The oracle is transformers' log-softmax of its own logits over the whole prompt, computed
without a cache. The engine must give the same figures whatever it does to get them: chunked
prefill under a tiny token budget, a batch beside requests that ask nothing, a prompt whose
prefix another request left in the prefix cache (a scoring request reads nothing from it: it
needs every position's logits), recompute preemption (a recomputed chunk scores nothing twice)
and n > 1 samples (the prompt is scored once).
"""

from __future__ import annotations

import pytest

from pagedkv.engine import SamplingParams
from pagedkv.engine.errors import TooManyLogprobs
from tests.engine.conftest import make_engine, make_llm, run_to_completion
from tests.model.tiny_models import random_prompt

K = 3
PROMPT = random_prompt(75, seed=5)


TOLERANCE = 1e-4


def expected(zoo, prompt: list[int]) -> list[tuple[float, range, list[int]]]:
    """(logprob, possible ranks, top-K ids) of prompt tokens 1..n-1 from transformers; a rank
    may differ where another token's logprob is within float noise of the chosen one's."""
    logprobs = zoo.hf_logits("llama", prompt).log_softmax(dim=-1)
    result = []
    for position in range(1, len(prompt)):
        row = logprobs[position - 1]
        chosen = row[prompt[position]]
        ranks = range(
            int((row > chosen + TOLERANCE).sum()) + 1, int((row > chosen - TOLERANCE).sum()) + 2
        )
        result.append((chosen.item(), ranks, row.topk(K).indices.tolist()))
    return result


def check(prompt_logprobs, prompt, reference) -> None:
    assert len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for position, (logprob, ranks, top_ids) in enumerate(reference, start=1):
        entry = prompt_logprobs[position]
        chosen = entry[prompt[position]]
        assert chosen.logprob == pytest.approx(logprob, abs=TOLERANCE), position
        assert chosen.rank in ranks, position
        by_rank = sorted(entry.items(), key=lambda item: item[1].rank)
        assert [token_id for token_id, e in by_rank if e.rank <= K] == top_ids, position


def test_prompt_logprobs_match_transformers_under_chunking_caching_and_batching(engine_zoo):
    llm = make_llm(engine_zoo, max_num_batched_tokens=16)
    # Another request computes the prompt's first blocks first: they sit in the prefix cache.
    llm.generate([PROMPT[:48] + [7, 8, 9]], SamplingParams(max_tokens=2))
    others = [random_prompt(30, seed=1), random_prompt(52, seed=2)]
    outputs = llm.generate(
        [others[0], PROMPT, others[1]],
        [
            SamplingParams(max_tokens=4),
            SamplingParams(max_tokens=4, prompt_logprobs=K, temperature=0.0),
            SamplingParams(max_tokens=4, logprobs=2),
        ],
    )
    check(outputs[1].prompt_logprobs, PROMPT, expected(engine_zoo, PROMPT))
    assert outputs[1].num_cached_tokens == 0  # scored, so nothing was read from the cache
    assert outputs[0].prompt_logprobs is None and outputs[2].prompt_logprobs is None
    # The request beside it generates what it generates alone.
    alone = make_llm(engine_zoo).generate([PROMPT], SamplingParams(max_tokens=4, temperature=0))
    assert outputs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_recompute_preemption_scores_each_prompt_token_once(engine_zoo):
    engine = make_engine(
        engine_zoo, num_gpu_blocks=12, preemption_mode="recompute", max_num_batched_tokens=32
    )
    prompts = [random_prompt(70, seed=seed) for seed in (11, 12, 13)]
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, SamplingParams(max_tokens=40, prompt_logprobs=K))
    reported: dict[str, list] = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            if delta.prompt_logprobs is not None:
                assert delta.request_id not in reported  # in exactly one delta
                reported[delta.request_id] = delta.prompt_logprobs
    assert engine.stats.num_recompute_preemptions > 0
    for index, prompt in enumerate(prompts):
        check(reported[str(index)], prompt, expected(engine_zoo, prompt))


def test_n_samples_share_one_scored_prompt(engine_zoo):
    llm = make_llm(engine_zoo)
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=3, prompt_logprobs=0)
    output = llm.generate([PROMPT], params)[0]
    assert len(output.outputs) == 3
    reference = expected(engine_zoo, PROMPT)
    for position, (logprob, ranks, _) in enumerate(reference, start=1):
        entry = output.prompt_logprobs[position]
        assert list(entry) == [PROMPT[position]]  # k = 0: the prompt token alone
        assert entry[PROMPT[position]].logprob == pytest.approx(logprob, abs=TOLERANCE)
        assert entry[PROMPT[position]].rank in ranks


def test_more_prompt_logprobs_than_max_logprobs_is_refused(engine_zoo):
    engine = make_engine(engine_zoo, max_logprobs=5)
    with pytest.raises(
        TooManyLogprobs, match="prompt_logprobs is 6, but the engine allows at most 5"
    ):
        engine.add_request("a", PROMPT, SamplingParams(prompt_logprobs=6))
    assert not engine.has_unfinished()
    # -1 (vLLM's every token) names what was asked and the setting that allows it.
    vocab = engine.config.vocab_size
    with pytest.raises(
        TooManyLogprobs,
        match=rf"logprobs=-1 \(every token: {vocab}\), .* at most 5 \(max_logprobs; "
        "max_logprobs=-1 when",
    ):
        engine.add_request("b", PROMPT, SamplingParams(logprobs=-1))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-2)
