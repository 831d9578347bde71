"""`reset_prefix_cache`, vLLM's: after it no prompt is served from KV computed before it.

The oracle is the prompt's own length: a prompt seen before is served from the prefix cache
(`num_cached_tokens` its whole blocks but the last token's), and after a reset it is computed
whole, on the device and through the host tier alike, with the same greedy tokens and logprobs
(batch invariance: where KV came from changes no float). While a request holds blocks the
reset is refused and changes nothing.
"""

from __future__ import annotations

import pytest

from pagedkv import LLMEngine
from pagedkv.engine import EngineArgs, SamplingParams
from tests.engine.conftest import make_llm
from tests.model.tiny_models import random_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True)
PROMPT = random_prompt(53, seed=7)
BLOCK_SIZE = 16


def cached_and_answer(llm) -> tuple[int, list]:
    [output] = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    sample = output.outputs[0]
    return output.num_cached_tokens, [list(sample.token_ids), sample.logprobs]


@pytest.mark.parametrize("served_from", ["device", "host tier"])
def test_a_reset_makes_a_seen_prompt_compute_again(engine_zoo, served_from) -> None:
    # Through the tier: a pool of 6 blocks, which a filler prompt of 90 tokens takes whole.
    tier = served_from == "host tier"
    overrides = {"num_gpu_blocks": 6, "kv_offloading_size": 0.01} if tier else {}
    llm = make_llm(engine_zoo, enable_prefix_caching=True, block_size=BLOCK_SIZE, **overrides)
    cold, answer = cached_and_answer(llm)
    if tier:
        llm.generate([{"prompt_token_ids": random_prompt(90, seed=8)}], GREEDY, use_tqdm=False)
    warm, again = cached_and_answer(llm)
    assert (cold, warm) == (0, (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE)
    assert llm.engine.manager.offload_stats.hits == (warm // BLOCK_SIZE if tier else 0)
    assert llm.reset_prefix_cache(reset_running_requests=True)  # vLLM's keyword: none run
    assert cached_and_answer(llm) == (0, answer) and again == answer
    assert llm.engine.manager.num_free_blocks == llm.engine.manager.num_gpu_blocks


def test_a_reset_is_refused_while_a_request_holds_blocks(engine_zoo) -> None:
    args = EngineArgs(
        model=str(engine_zoo.folder("llama")), num_gpu_blocks=64, enable_prefix_caching=True
    )
    engine = LLMEngine.from_engine_args(args)
    engine.add_request("seen", PROMPT, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("running", PROMPT, GREEDY)
    engine.step()
    assert not engine.reset_prefix_cache()  # "running" holds the cached blocks
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("after", PROMPT, GREEDY)
    [first] = engine.step()
    assert first.num_cached_tokens == (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
