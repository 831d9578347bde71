"""Random workloads: arrivals, aborts, n > 1, tiny pools. Nothing is lost, nothing leaks.

Each scenario is a seeded random schedule of requests arriving between steps and aborts of
requests in flight, over a pool small enough to preempt. After every step the memory
invariants hold; at the end every request ended exactly once, every sample that was not
aborted produced exactly max_tokens tokens (ignore_eos), and every block is free.
"""

from __future__ import annotations

import random

import pytest

from pagedkv.engine import RequestTooLarge, SamplingParams
from tests.engine.conftest import make_engine
from tests.model.tiny_models import random_prompt


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_loses_nothing_and_frees_everything(engine_zoo, seed):
    rng = random.Random(seed)
    block_size = rng.choice([4, 16])
    engine = make_engine(
        engine_zoo,
        rng.choice(["llama", "mistral", "qwen2"]),
        num_gpu_blocks=rng.choice([160, 320, 640]) // block_size,  # 160 to 640 tokens
        block_size=block_size,
        preemption_mode=rng.choice(["swap", "recompute"]),
        enable_prefix_caching=rng.random() < 0.5,
        max_num_batched_tokens=rng.choice([32, 256]),
        max_num_seqs=rng.choice([4, 32]),
    )
    shared_prefix = random_prompt(20, seed=100 + seed)
    requested: dict[str, SamplingParams] = {}
    tokens: dict[tuple[str, int], int] = {}
    finished: dict[str, list] = {}
    aborted: set[str] = set()
    rejected = 0
    for _ in range(400):  # a bound: the workload ends long before
        if len(requested) + rejected < 10 and rng.random() < 0.4:
            request_id = f"r{len(requested) + rejected}"
            prompt = random_prompt(rng.randint(1, 40), seed=rng.randrange(10**6))
            if rng.random() < 0.5:
                prompt = shared_prefix + prompt
            params = SamplingParams(
                n=rng.choice([1, 1, 2, 3]),
                temperature=rng.choice([0.0, 1.0]),
                max_tokens=rng.randint(1, 30),
                ignore_eos=True,
                seed=rng.choice([None, 5]),
            )
            try:
                engine.add_request(request_id, prompt, params)
            except RequestTooLarge:  # more than the whole pool: refused up front, never queued
                rejected += 1
                continue
            requested[request_id] = params
        in_flight = [r for r in requested if r not in finished and r not in aborted]
        if in_flight and rng.random() < 0.03:
            victim = rng.choice(in_flight)
            engine.abort(victim)
            aborted.add(victim)
            engine.manager.check_invariants()
        for delta in engine.step():
            for out in delta.outputs:
                key = (delta.request_id, out.index)
                tokens[key] = tokens.get(key, 0) + len(out.token_ids)
            if delta.finished:
                assert delta.request_id not in finished, "a request finished twice"
                finished[delta.request_id] = [o.finish_reason for o in delta.outputs]
        engine.manager.check_invariants()
        if not engine.has_unfinished() and len(requested) + rejected >= 10:
            break
    assert len(requested) >= 5
    assert set(finished) == set(requested)
    for request_id, params in requested.items():
        if request_id in aborted:
            continue
        for index in range(params.n):
            assert tokens[(request_id, index)] == params.max_tokens
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks
    assert engine.manager.num_free_cpu_blocks == engine.manager.num_cpu_blocks
