"""The runner keeps block tables and receives only their changes: it never runs a stale one.

A wrapper around the runner checks, after every executed step, that the table it used for each
chunk is the memory manager's table of that sequence, and that it keeps no table of a sequence
the manager no longer holds on the GPU beyond the next executed step. The workload preempts
(swap and recompute), forks (n = 2) and hits the prefix cache; outputs still equal
transformers' greedy tokens, and the entries sent are a small share of the tables used.
"""

from __future__ import annotations

import pytest

from pagedkv.engine import SamplingParams
from tests.engine.conftest import make_engine, run_to_completion
from tests.model.tiny_models import random_prompt


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_runner_tables_follow_the_manager_through_preemption_and_forks(engine_zoo, preemption_mode):
    engine = make_engine(
        engine_zoo,
        "llama",
        num_gpu_blocks=24,
        block_size=4,
        preemption_mode=preemption_mode,
        max_num_batched_tokens=64,
    )
    runner, manager = engine.runner, engine.manager
    real_execute = runner.execute
    sent = used = 0

    def checked_execute(output):
        nonlocal sent, used
        logits = real_execute(output)
        for chunk in output.chunks:
            table = runner.block_tables[chunk.seq_id]
            assert table == manager.block_table(chunk.seq_id), chunk.seq_id
            used += len(table)
            sent += 0 if chunk.table_update is None else len(chunk.table_update[1])
        for seq_id in runner.block_tables:
            resident = seq_id in manager and not manager.is_swapped_out(seq_id)
            assert resident or seq_id in engine.scheduler._dropped, seq_id
        return logits

    runner.execute = checked_execute
    shared = random_prompt(12, seed=7)
    prompts = [shared + random_prompt(n, seed=n) for n in (5, 9, 14, 20, 27, 33)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        params = SamplingParams(n=2, max_tokens=12, ignore_eos=True) if index % 3 == 0 else greedy
        engine.add_request(f"r{index}", prompt, params)
    outputs: dict[str, list[int]] = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            outputs[delta.request_id] = outputs.get(delta.request_id, []) + list(
                delta.outputs[0].token_ids
            )

    preemptions = engine.stats.num_swap_preemptions + engine.stats.num_recompute_preemptions
    assert preemptions > 0
    for index, prompt in enumerate(prompts):
        if index % 3:
            expected = engine_zoo.hf_greedy("llama", tuple(prompt), 12)
            assert outputs[f"r{index}"] == expected, index
    assert sent < used / 4  # decodes send nothing; a new block sends one entry
