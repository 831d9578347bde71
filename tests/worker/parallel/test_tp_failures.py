"""A tensor-parallel group never hangs silently and never leaves a process behind.

A worker that dies fails the next step at once, one that hangs fails it after the collective
timeout, and either way the error names the rank; every later step fails the same way.
An idle group outlives its timeout (keepalives). Shutdown, an engine that fails to start and
a rank 0 that is killed all end every worker.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine import engine as engine_module
from pagedkv.engine.errors import StepFailed
from pagedkv.model.errors import MalformedModelFile
from pagedkv.parallel.group import TPGroup, sharding
from pagedkv.parallel.split import NotDivisible
from pagedkv.weights.load import load
from pagedkv.worker.kv_budget import KVCacheTooSmallForModel
from pagedkv.worker.parallel import ranks
from pagedkv.worker.parallel.errors import WorkerFailed

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROMPT = [5, 6, 7, 8]


def start(folder: Path, **overrides) -> LLM:
    settings = dict(
        tensor_parallel_size=2, num_gpu_blocks=32, swap_space_gb=0.01, max_model_len=256, threads=1
    )
    return LLM(str(folder), **{**settings, **overrides})


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_until_gone(pid: int, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setattr(ranks, "COLLECTIVE_TIMEOUT_S", 3.0)


@pytest.fixture
def folder(tp_folders) -> Path:
    return tp_folders["llama"]


def test_shutdown_ends_every_worker_and_later_steps_fail(folder):
    llm = start(folder)
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    (pid,) = llm.engine.ranks.worker_pids
    llm.engine.shutdown()
    assert not alive(pid) and multiprocessing.active_children() == []
    with pytest.raises(StepFailed, match="shut down"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False)
    llm.engine.shutdown()  # twice is harmless


def test_a_killed_worker_fails_the_step_naming_its_rank(folder):
    llm = start(folder)
    (pid,) = llm.engine.ranks.worker_pids
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(StepFailed) as failed:
        llm.generate(PROMPT, GREEDY, use_tqdm=False)
    cause = failed.value.__cause__
    assert isinstance(cause, WorkerFailed) and cause.rank == 1
    assert "tensor-parallel rank 1 failed" in str(cause) and "code -9" in str(cause)
    with pytest.raises(StepFailed, match="rank 1"):  # the group stays broken
        llm.generate(PROMPT, GREEDY, use_tqdm=False)
    llm.engine.shutdown()
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_a_hung_worker_is_named_after_the_timeout(folder, short_timeout):
    llm = start(folder)
    (pid,) = llm.engine.ranks.worker_pids
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(StepFailed) as failed:
            llm.generate(PROMPT, GREEDY, use_tqdm=False)
        cause = failed.value.__cause__
        assert isinstance(cause, WorkerFailed) and cause.rank == 1
        assert "stopped responding" in str(cause)
    finally:
        llm.engine.shutdown()  # kills the stopped process
    assert not alive(pid)


@pytest.mark.slow
def test_an_idle_group_outlives_its_collective_timeout(folder, short_timeout):
    llm = start(folder)
    want = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    time.sleep(2 * ranks.COLLECTIVE_TIMEOUT_S)  # workers wait; keepalives keep them waiting
    assert llm.engine.ranks.failure is None
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    llm.engine.shutdown()


def test_a_worker_death_while_idle_is_noticed_without_a_step(folder, short_timeout):
    llm = start(folder)
    (pid,) = llm.engine.ranks.worker_pids
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10 * ranks.COLLECTIVE_TIMEOUT_S
    while llm.engine.ranks.failure is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert llm.engine.ranks.failure is not None and llm.engine.ranks.failure.rank == 1
    llm.engine.shutdown()


def test_a_worker_that_dies_before_joining_is_named_before_the_join(
    folder, short_timeout, monkeypatch
):
    """A spawned worker killed while it starts (a crash on import, the OOM killer) is named
    as soon as its process has exited: rank 0 never enters the group's join, which would only
    give up after the collective timeout."""
    from multiprocessing.context import SpawnProcess

    from pagedkv.worker.parallel.link import Link

    started = SpawnProcess.start

    def start_then_kill(process):
        started(process)
        os.kill(process.pid, signal.SIGKILL)

    joins = []
    join = Link.start_group
    monkeypatch.setattr(SpawnProcess, "start", start_then_kill)
    monkeypatch.setattr(Link, "start_group", lambda link: joins.append(link) or join(link))
    with pytest.raises(WorkerFailed, match="rank 1 failed: its process .* code -9"):
        start(folder)
    assert joins == []
    assert multiprocessing.active_children() == []


def test_a_store_port_in_use_is_one_clear_error(folder, monkeypatch):
    """Rank 0 under torchrun's environment with MASTER_PORT already taken: an OSError naming
    the address and the variables (a 20-line DistNetworkError before), nothing left behind."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        environment = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
        for name, value in {**environment, "RANK": "0", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(OSError, match=f"store at 127.0.0.1:{port} .*MASTER_PORT.*in use"):
            start(folder)
    assert multiprocessing.active_children() == []


def test_bad_sizes_are_refused_with_the_numbers(folder):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(str(folder), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="each rank takes its LOCAL_RANK's GPU"):
        LLM(str(folder), tensor_parallel_size=2, device="cuda:1")
    # 4 query heads cannot be split across 3 ranks (vLLM requires the same divisibility).
    with pytest.raises(ValueError, match=r"4 heads .*not divisible by tensor_parallel_size \(3\)"):
        start(folder, tensor_parallel_size=3)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("rank", [0, 7])
def test_more_ranks_than_query_heads_are_refused_as_they_load(folder, rank):
    """4 query heads on 8 ranks: KV heads fewer than the ranks are replicated, but query
    heads never are (each rank's o_proj takes whole heads), so every rank refuses to load,
    naming the heads, rather than start and fail its first step on half a head."""
    refused = pytest.raises(NotDivisible, match=r"4 heads of q_proj are not divisible by ")
    with sharding(TPGroup(rank=rank, size=8)), refused:
        load(str(folder), progress=lambda line: None)
    with sharding(TPGroup(rank=rank % 4, size=4)):  # 1 query head each, KV heads replicated
        attention = load(str(folder), progress=lambda line: None).model.layers[0].self_attn
    assert (attention.attn.num_heads, attention.attn.num_kv_heads) == (1, 1)


def test_a_broken_model_file_is_one_line_from_each_worker(folder, tmp_path, capfd):
    """Every rank fails to read a truncated checkpoint alike: rank 0 raises the model error,
    each worker says it in one line (a traceback per worker repeated it), none is left."""
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(MalformedModelFile, match="model.safetensors"):
        start(broken)
    err = capfd.readouterr().err
    assert "pagedkv worker (rank 1): error: " in err and "Traceback" not in err
    assert multiprocessing.active_children() == []


def test_workers_exit_when_rank_0_is_killed(folder):
    script = textwrap.dedent(
        f"""
        import os, signal
        from pagedkv.engine import LLM
        if __name__ == "__main__":
            llm = LLM({str(folder)!r}, tensor_parallel_size=2, num_gpu_blocks=32, threads=1,
                      swap_space_gb=0.01, max_model_len=256)
            print(*llm.engine.ranks.worker_pids, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    (pid,) = map(int, result.stdout.split())
    assert wait_until_gone(pid)


def test_a_new_group_ends_the_one_an_earlier_engine_left_open(folder):
    first = start(folder)
    (first_pid,) = first.engine.ranks.worker_pids
    second = start(folder)  # torch.distributed allows one group per process
    assert not alive(first_pid)
    assert second.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(StepFailed, match="shut down"):
        first.generate(PROMPT, GREEDY, use_tqdm=False)
    second.engine.shutdown()


def test_an_engine_dropped_without_shutdown_ends_its_workers(folder):
    llm = start(folder)
    (pid,) = llm.engine.ranks.worker_pids
    del llm
    gc.collect()
    assert wait_until_gone(pid)


def test_workers_outlive_a_draft_model_loading_longer_than_the_timeout(
    folder, short_timeout, monkeypatch
):
    """Rank 0 loads a speculative draft model after its shard while the workers wait for the
    pool's size: keepalives keep them waiting past the collective timeout."""
    real = engine_module.load_draft_model

    def slow(*args, **kwargs):
        time.sleep(2 * ranks.COLLECTIVE_TIMEOUT_S)  # a draft pulled or read slowly
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_draft_model", slow)
    llm = start(folder, speculative_config={"model": str(folder), "num_speculative_tokens": 2})
    try:
        assert len(llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) > 0
    finally:
        llm.engine.shutdown()


def test_a_pool_only_rank_0_cannot_hold_stops_every_rank_at_once(folder, short_timeout, capfd):
    """Rank 0's blocks also hold the draft model's K/V: a budget the workers' blocks fit but
    rank 0's do not ends the start on every rank with a reason (the workers named it only
    after the collective timeout, with a traceback)."""
    draft = {"model": str(folder), "num_speculative_tokens": 2}
    with pytest.raises(KVCacheTooSmallForModel, match="of it the draft model's"):
        start(folder, num_gpu_blocks=None, kv_cache_memory=8000, speculative_config=draft)
    err = capfd.readouterr().err
    assert "pagedkv worker (rank 1): error: another rank cannot hold the KV pool" in err
    assert "Traceback" not in err
    assert multiprocessing.active_children() == []


def test_a_start_refused_after_the_load_ends_the_workers_at_once(folder):
    """A setting refused once the shards are loaded (a context beyond the model's) ends the
    workers before the error reaches the caller, who may keep it (a notebook, a retry loop):
    they used to live until the half-built engine was collected."""
    with pytest.raises(ValueError, match="max_model_len") as refused:
        start(folder, max_model_len=1 << 20)
    assert refused.value is not None  # still referenced, with its traceback's frames
    assert multiprocessing.active_children() == []


def test_starting_groups_leaves_the_callers_exception_hook_as_it_was(folder):
    """torch wraps `sys.excepthook` to prefix "[rank0]: " on every group it starts; rank 0 is
    the caller's process, whose hook stays its own however many engines it starts."""
    hook = sys.excepthook
    for _ in range(2):
        start(folder).engine.shutdown()
    assert sys.excepthook is hook
