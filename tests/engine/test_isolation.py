"""One request's parameters never fail, nor change, another request of the same step.

Every step samples all its rows with shared tensor ops, so an extreme value of one request
(a top_k above the vocabulary, more logprobs than there are tokens, penalties and
temperatures at the edge of float32, the largest seeds) must stay inside that request's row.
The oracle is the normal request run alone: run beside the extreme one it must give the same
tokens and logprobs, and both must finish.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine import SamplingParams
from pagedkv.engine.penalties import TokenCounts
from pagedkv.engine.sampler import Sampler, SamplingRow
from tests.engine.conftest import make_engine, run_to_completion
from tests.model.tiny_models import VOCAB_SIZE, random_prompt

SAMPLER_VOCAB = 12  # fewer tokens than the most logprobs a request may ask for (20)
MAX_TOKENS = 12
NORMAL = [
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
    SamplingParams(
        temperature=0.8, top_k=5, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True
    ),
]
EXTREME = {
    "top_k-above-vocab": dict(top_k=10**9),
    "top_k-at-vocab": dict(top_k=VOCAB_SIZE),
    "logprobs-max": dict(logprobs=20),
    "min_p-one": dict(min_p=1.0),
    "tiny-top_p": dict(top_p=1e-300),
    "huge-temperature": dict(temperature=1e300, min_tokens=4),
    "tiny-temperature": dict(temperature=1e-5 + 1e-12),
    "huge-repetition": dict(repetition_penalty=1e300),
    "tiny-repetition": dict(repetition_penalty=1e-300),
    "penalties-at-bounds": dict(presence_penalty=2.0, frequency_penalty=-2.0),
    "largest-seed": dict(seed=2**64 - 1, n=3),
    "smallest-seed": dict(seed=-(2**63)),
    "stop-ids-at-vocab-edge": dict(stop_token_ids=[0, VOCAB_SIZE - 1], min_tokens=6),
}


def sampler_row(params: SamplingParams, seed: int | None = None) -> SamplingRow:
    """A row as the engine builds it: a sampled one with its sample's stream."""
    generator = None if params.greedy else torch.Generator().manual_seed(seed or 0)
    counts = TokenCounts.for_prompt([1, 2, 3], SAMPLER_VOCAB, "cpu")
    counts.add(4)
    counts.add(4)
    return SamplingRow(params, 2, [0, SAMPLER_VOCAB - 1], generator, counts, (4, 4))


@pytest.mark.parametrize("normal", NORMAL, ids=["greedy", "seeded"])
@pytest.mark.parametrize("extreme", list(EXTREME.values()), ids=list(EXTREME))
def test_the_sampler_keeps_an_extreme_row_to_itself(normal, extreme):
    logits = torch.randn(2, SAMPLER_VOCAB, generator=torch.Generator().manual_seed(3))
    alone = Sampler()(logits[:1], [sampler_row(normal, seed=5)])
    extreme_row = sampler_row(SamplingParams(**extreme), seed=extreme.get("seed"))
    together = Sampler()(logits, [sampler_row(normal, seed=5), extreme_row])
    assert together.token_ids[0] == alone.token_ids[0]
    assert together.logprobs[0] == alone.logprobs[0]
    assert 0 <= together.token_ids[1] < SAMPLER_VOCAB
    if extreme.get("logprobs"):
        assert len(together.logprobs[1][2]) == SAMPLER_VOCAB  # every token, no more


@pytest.fixture(scope="module")
def engine(engine_zoo):
    return make_engine(engine_zoo, "llama", seed=11)


def tokens_of(engine, request_id: str, prompt: list[int], params: SamplingParams) -> list:
    """Token ids and logprobs of a request run alone."""
    engine.add_request(request_id, prompt, params)
    tokens, logprobs = [], []
    for deltas in run_to_completion(engine):
        for delta in deltas:
            tokens += delta.outputs[0].token_ids if delta.outputs else []
            logprobs += (delta.outputs[0].logprobs or []) if delta.outputs else []
    return [tokens, logprobs]


@pytest.mark.parametrize("normal", NORMAL, ids=["greedy", "seeded"])
@pytest.mark.parametrize("extreme", list(EXTREME.values()), ids=list(EXTREME))
def test_an_extreme_request_neither_fails_nor_changes_its_neighbour(engine, normal, extreme):
    prompt = random_prompt(20, seed=4)
    alone = tokens_of(engine, "alone", prompt, normal)
    engine.add_request("normal", prompt, normal)
    engine.add_request("extreme", random_prompt(9, seed=5), SamplingParams(max_tokens=8, **extreme))
    together: dict[str, list] = {"normal": [[], []], "extreme": [[], []]}
    finish_reasons: dict[str, set[str]] = {"normal": set(), "extreme": set()}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            for output in delta.outputs:
                if output.index == 0:
                    together[delta.request_id][0] += output.token_ids
                    together[delta.request_id][1] += output.logprobs or []
                if output.finish_reason is not None:
                    finish_reasons[delta.request_id].add(output.finish_reason)
    # Batch invariance: the neighbour's tokens and logprobs are the ones it has alone, exactly.
    assert together["normal"] == alone
    assert finish_reasons["normal"] == {"length"}
    assert finish_reasons["extreme"] <= {"length", "stop"} and finish_reasons["extreme"]
    assert all(0 <= token < VOCAB_SIZE for token in together["extreme"][0])
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks
