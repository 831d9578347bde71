"""`kv_offloading_size`: the prefix cache's host tier, through the engine.

Multi-turn chats through a KV pool too small to keep every conversation's history: with the
tier, blocks the pool evicts are copied to host RAM and back on the next turn's hit. Outputs
must be identical with the tier on and off (greedy), fewer prompt tokens computed with it,
and nothing left behind, under preemption and aborts too.
"""

from __future__ import annotations

import pytest

from pagedkv.engine import LLM, EngineArgs, SamplingParams
from tests.engine.conftest import make_engine, run_to_completion
from tests.model.tiny_models import random_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
NUM_CHATS, NUM_TURNS = 6, 4


def chat_turns(vocab_limit: int = 1000) -> list[list[list[int]]]:
    """turns[t][c]: conversation c's prompt at turn t, each the last one plus a new message."""
    histories = [random_prompt(40, seed=100 + c) for c in range(NUM_CHATS)]
    turns = []
    for turn in range(NUM_TURNS):
        turns.append([list(history) for history in histories])
        for chat, history in enumerate(histories):
            history.extend(random_prompt(30, seed=1000 * turn + chat))
    return [[[t % vocab_limit for t in prompt] for prompt in turn] for turn in turns]


def run_chats(engine, turns) -> tuple[list[list[int]], int]:
    """Every turn's greedy tokens, and the prompt tokens the engine computed."""
    outputs = []
    for turn, prompts in enumerate(turns):
        for chat, prompt in enumerate(prompts):
            engine.add_request(f"{turn}-{chat}", prompt, GREEDY)
        tokens: dict[str, list[int]] = {}
        for deltas in run_to_completion(engine):
            for delta in deltas:
                tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
        outputs.extend(tokens[f"{turn}-{chat}"] for chat in range(len(prompts)))
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks
    stats = engine.stats
    return outputs, stats.prefix_queried_tokens - stats.prefix_hit_tokens


@pytest.mark.parametrize(
    ("name", "dtype"), [("llama", "float32"), ("qwen2", "float32"), ("llama", "bfloat16")]
)
@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_outputs_are_identical_with_the_tier_on_and_off(engine_zoo, name, dtype, preemption_mode):
    turns = chat_turns()
    # 20 blocks of 16 tokens: two or three conversations' histories, of six.
    settings = dict(dtype=dtype, num_gpu_blocks=20, preemption_mode=preemption_mode)
    off = make_engine(engine_zoo, name, **settings)
    on = make_engine(engine_zoo, name, kv_offloading_size=0.01, **settings)
    (outputs_off, computed_off), (outputs_on, computed_on) = (
        run_chats(off, turns),
        run_chats(on, turns),
    )
    assert outputs_on == outputs_off
    assert on.stats.offload_hits_total > 0
    assert computed_on < computed_off
    assert off.stats.num_offload_blocks == 0 and on.stats.num_offload_blocks > 0


def test_aborted_requests_leave_the_tier_and_the_pools_whole(engine_zoo):
    engine = make_engine(engine_zoo, num_gpu_blocks=12, kv_offloading_size=0.01)
    turns = chat_turns()
    run_chats(engine, turns[:2])
    for chat, prompt in enumerate(turns[2]):
        engine.add_request(str(chat), prompt, SamplingParams(max_tokens=30))
    for step in range(6):  # a few steps in, abort every other request
        engine.step()
        if step == 3:
            for chat in range(0, NUM_CHATS, 2):
                engine.abort(str(chat))
        engine.manager.check_invariants()
    list(run_to_completion(engine))
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks
    assert engine.manager.num_free_cpu_blocks == engine.manager.num_cpu_blocks
    assert engine.stats.offload_blocks > 0  # the tier keeps its cache across all of it


@pytest.mark.slow
def test_the_builtin_model_answers_the_same_with_the_tier(tmp_path):
    turns = [
        [[t % 49152 for t in prompt] for prompt in turn[:3]]
        for turn in chat_turns(vocab_limit=49152)[:3]
    ]
    results = []
    for size in (0.0, 0.05):
        llm = LLM(num_gpu_blocks=14, kv_offloading_size=size)
        results.append(run_chats(llm.engine, turns))
    assert results[1][0] == results[0][0]
    assert results[1][1] < results[0][1]


def test_a_tier_without_the_prefix_cache_is_refused_by_name():
    """The tier holds evicted prefix-cache blocks: with the cache off it would only take host
    RAM (sized and counted against the host's limit) and never be read."""
    with pytest.raises(ValueError, match="kv_offloading_size .* needs enable_prefix_caching"):
        EngineArgs(model="unused", kv_offloading_size=1.0, enable_prefix_caching=False)
    assert EngineArgs(model="unused", enable_prefix_caching=False).kv_offloading_size == 0
