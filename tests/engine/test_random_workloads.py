"""Random workloads: arrivals, aborts, n > 1, tiny pools. Nothing is lost, nothing leaks.

Each scenario is a seeded random schedule of requests arriving between steps and aborts of
requests in flight, over a pool small enough to preempt. After every step the memory
invariants hold; at the end every request ended exactly once, every sample that was not
aborted produced exactly max_tokens tokens (ignore_eos), and every block is free. The seeds
together must reach what the scenarios are for: preemption by swap and by recompute, and
aborts of running, waiting and swapped-out requests.
"""

from __future__ import annotations

import random
from collections import Counter

from pagedkv.engine import RequestTooLarge, SamplingParams
from tests.engine.conftest import make_engine
from tests.model.tiny_models import random_prompt

SEEDS = range(24)


def test_random_workloads_lose_nothing_free_everything_and_reach_every_case(engine_zoo):
    reached: Counter[str] = Counter()
    for seed in SEEDS:
        try:
            reached += run_workload(engine_zoo, seed)
        except AssertionError as error:
            raise AssertionError(f"workload seed {seed}: {error}") from error
    cases = ("swap", "recompute", "abort running", "abort waiting", "abort swapped")
    assert all(reached[case] for case in cases), reached


def run_workload(engine_zoo, seed: int) -> Counter[str]:
    """One seeded scenario, checked; the preemptions and aborts it reached."""
    reached: Counter[str] = Counter()
    rng = random.Random(seed)
    block_size = rng.choice([4, 16])
    engine = make_engine(
        engine_zoo,
        rng.choice(["llama", "mistral", "qwen2"]),
        num_gpu_blocks=rng.choice([96, 160, 320]) // block_size,  # 96 to 320 tokens
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
        # A request is swapped out for a few steps at most: aborts find it there more often.
        swapped = [request.request_id for request in engine.scheduler.swapped]
        if in_flight and rng.random() < (0.3 if swapped else 0.03):
            victim = rng.choice(swapped or in_flight)
            for state in ("running", "waiting", "swapped"):
                queue = getattr(engine.scheduler, state)
                reached[f"abort {state}"] += any(r.request_id == victim for r in queue)
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
    stats = engine.stats
    reached["swap"] += stats.num_swap_preemptions
    reached["recompute"] += stats.num_recompute_preemptions
    return reached
