"""Rank 0's side of the engine's ranks: one process, or a tensor-parallel group it leads.

The engine asks its ranks to load the model, size the KV pool and make the runner, and never
branches on the group's size: `SingleRank` does each directly; `TensorParallelRanks` starts the
workers (spawned here, or already started by `torchrun` as `pagedkv worker`), broadcasts what
they must do the same way, and wraps the runner so that each step's `SchedulerOutput` is
broadcast before rank 0 executes it.

Failure: every collective times out (`COLLECTIVE_TIMEOUT_S`), a dead peer fails it at once
(and a spawned worker whose process has exited fails the next step before it is sent), and a
failed step names the rank (the error a worker left in the store, its exit code, or its
stopped heartbeat) in a `WorkerFailed`, after which every step raises it again. While the engine
is idle a thread sends a `Keepalive` every quarter timeout and pulses the group, so an idle
worker never times out and a worker that died while idle is still noticed (`failure`).
`shutdown` stops every worker and reaps its process; it also runs when the engine is
garbage-collected, and at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedkv.model.decoder import DecoderModel
from pagedkv.parallel.group import SINGLE, TPGroup
from pagedkv.weights.load import LoadedModel
from pagedkv.worker.kv_budget import KVCacheConfig, kv_budget
from pagedkv.worker.kv_cache import KVCache
from pagedkv.worker.kv_request import PoolRequest
from pagedkv.worker.parallel.errors import WorkerFailed
from pagedkv.worker.parallel.link import HEARTBEAT_S, Link, TorchrunEnv
from pagedkv.worker.parallel.messages import Keepalive, LoadSpec, LoRAWeights, Stop
from pagedkv.worker.parallel.rank_setup import agreed_budget, load_shard
from pagedkv.worker.parallel.worker import run_worker
from pagedkv.worker.runner import ModelRunner, StepLogits
from pagedkv.worker.step import SchedulerOutput

COLLECTIVE_TIMEOUT_S = 120.0  # a hung rank is named after this long; a dead one at once
SHUTDOWN_WAIT_S = 10.0  # how long a worker gets to exit after `Stop` before it is killed


def start_ranks(size: int, spec: LoadSpec, *, preloaded: bool = False) -> SingleRank:
    """The engine's ranks: this process alone, or it and `size - 1` workers."""
    if size == 1:
        return SingleRank(spec)
    if preloaded:
        raise ValueError(
            "tensor parallelism loads each rank's shard itself: do not pass a loaded model"
        )
    return TensorParallelRanks.start(size, spec)


class SingleRank:
    """One process: load, size and run directly."""

    group: TPGroup = SINGLE

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.failure: WorkerFailed | None = None  # why the ranks cannot run a step, if so

    def load(self) -> LoadedModel:
        """This rank's model (the whole model here)."""
        return load_shard(self.spec, self.group, torch.device(self.spec.device))

    def kv_budget(
        self, request: PoolRequest, model: DecoderModel, draft: DecoderModel | None = None
    ) -> KVCacheConfig:
        """The pool sizes every rank uses (blocks that also hold a speculative `draft`
        model's K/V when one is given)."""
        return kv_budget(request, model, draft)

    def runner(self, model: DecoderModel, kv_cache: KVCache) -> ModelRunner:
        """The runner the engine steps."""
        return ModelRunner(model, kv_cache)

    def shutdown(self) -> None:
        """End every worker (none here)."""


class TensorParallelRanks(SingleRank):
    """Rank 0 of a tensor-parallel group, and the worker processes it spawned (if any)."""

    def __init__(self, spec: LoadSpec, link: Link, processes: list[Any]) -> None:
        super().__init__(spec)
        self.group = TPGroup(0, link.size)
        self.link = link
        self._processes = processes  # spawned workers, rank 1 first; none under torchrun
        self._lock = threading.Lock()  # one collective sequence at a time: steps, keepalives
        self._last_message = time.monotonic()
        self._closed = threading.Event()
        _open_groups.add(self)

    @classmethod
    def start(cls, size: int, spec: LoadSpec) -> TensorParallelRanks:
        """Spawn `size - 1` workers on this machine, or (under torchrun's environment) join
        the workers started elsewhere; then send them what to load."""
        _end_previous_group()
        env = TorchrunEnv.from_environ()
        processes: list[Any] = []
        if env is None:
            link = Link(
                host="127.0.0.1",
                port=0,
                rank=0,
                size=size,
                device_type=spec.device,
                local_rank=0,
                timeout_s=COLLECTIVE_TIMEOUT_S,
            )
            context = mp.get_context("spawn")
            for rank in range(1, size):
                process = context.Process(
                    target=run_worker,
                    args=(rank, size, link.host, link.port, rank),
                    name=f"pagedkv-tp-rank{rank}",
                    daemon=True,
                )
                process.start()
                processes.append(process)
        else:
            if env.rank != 0 or env.world_size != size:
                raise ValueError(
                    f"the engine runs as rank 0 of tensor_parallel_size ({size}) ranks, but the "
                    f"environment says RANK={env.rank}, WORLD_SIZE={env.world_size}: run "
                    "`pagedkv worker` on the other ranks"
                )
            link = Link(
                host=env.master_addr,
                port=env.master_port,
                rank=0,
                size=size,
                device_type=spec.device,
                local_rank=env.local_rank,
                timeout_s=COLLECTIVE_TIMEOUT_S,
                host_store=not env.agent_store,
            )
        ranks = cls(spec, link, processes)
        try:
            if processes:
                link.await_arrivals(ranks._check_processes)
            link.start_group()
            link.send(spec)
        except Exception as error:
            failure = ranks._failed(error)
            ranks.shutdown()
            raise failure from error
        return ranks

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers spawned here, rank 1 first (none under torchrun)."""
        return [process.pid for process in self._processes]

    def load(self) -> LoadedModel:
        try:
            loaded = load_shard(self.spec, self.group, self.link.device)
        except BaseException:
            self.shutdown()
            raise
        # From here on the workers wait on rank 0 (its draft model loading, its steps): the
        # thread holds the ranks only weakly, so an engine dropped without `shutdown` is
        # collected and its workers ended (`__del__`).
        threading.Thread(
            target=_keep_alive,
            args=(weakref.ref(self), self._closed, min(self.link.timeout_s / 16, 1.0)),
            name="pagedkv-tp-keepalive",
            daemon=True,
        ).start()
        return loaded

    def kv_budget(
        self, request: PoolRequest, model: DecoderModel, draft: DecoderModel | None = None
    ) -> KVCacheConfig:
        try:
            with self._lock:
                self.link.send(request)
                return agreed_budget(self.link, request, model, draft)
        except ValueError:  # a pool too small: every rank finds it alike
            self.shutdown()
            raise
        except Exception as error:
            failure = self._failed(error)
            self.shutdown()
            raise failure from error

    def runner(self, model: DecoderModel, kv_cache: KVCache) -> ModelRunner:
        return BroadcastingRunner(model, kv_cache, self)

    def step(
        self,
        output: SchedulerOutput,
        execute: Callable[[SchedulerOutput], StepLogits],
        adapters: LoRAWeights | None = None,
    ) -> StepLogits:
        """Broadcast the adapters `output` loads (if any) and `output`, then run it here too; a
        failure of any rank is a `WorkerFailed`."""
        with self._lock:
            if self.failure is not None:
                raise self.failure
            if self._closed.is_set():
                raise WorkerFailed(None, "the tensor-parallel group was shut down")
            try:
                self._check_processes()  # a spawned worker seen dead fails before any send
                if adapters is not None:
                    self.link.send(adapters)
                self.link.send(output)
                self._last_message = time.monotonic()
                return execute(output)
            except Exception as error:
                raise self._failed(error) from error
            except BaseException as interrupt:  # Ctrl-C: the workers may be mid-step for ever
                self._failed(WorkerFailed(0, f"{type(interrupt).__name__} in the middle of a step"))
                raise

    def shutdown(self) -> None:
        """Tell every worker to stop, wait for their processes (killing one that does not
        exit), and leave the process group. Safe to call twice."""
        if self._closed.is_set():
            return
        self._closed.set()
        _open_groups.discard(self)
        with self._lock:
            if self.failure is None:
                with contextlib.suppress(Exception):  # a dead worker needs no stop message
                    self.link.send(Stop())
            for process in self._processes:
                process.join(SHUTDOWN_WAIT_S if self.failure is None else 0.5)
                if process.is_alive():
                    process.kill()
                    process.join()
            self.link.close()

    def __del__(self) -> None:
        self.shutdown()

    def keep_alive(self) -> None:
        """While idle, keep the workers' receive from timing out (a keepalive every quarter
        timeout), and notice a worker that died meanwhile: a spawned one's exit at once, any
        other's at the next pulse."""
        with self._lock:
            if self.failure is not None or self._closed.is_set():
                return
            try:
                self._check_processes()
                if time.monotonic() - self._last_message >= self.link.timeout_s / 4:
                    self.link.send(Keepalive())
                    self.link.pulse()
                    self._last_message = time.monotonic()
            except Exception as error:  # noqa: BLE001 - kept as `failure`, raised next step
                self._failed(error)

    def _check_processes(self, wait_s: float = 0.0) -> None:
        """Raise a `WorkerFailed` for the first spawned worker whose process has exited."""
        for rank, process in enumerate(self._processes, start=1):
            process.join(wait_s)
            if process.exitcode is not None:
                raise WorkerFailed(
                    rank, f"its process (pid {process.pid}) exited with code {process.exitcode}"
                )

    def _failed(self, error: Exception) -> WorkerFailed:
        """Name the rank behind a failed collective, and remember it: the group is broken."""
        failure = error if isinstance(error, WorkerFailed) else self._diagnose(error)
        if self.failure is None:
            self.failure = failure
        return failure

    def _diagnose(self, error: Exception) -> WorkerFailed:
        try:
            reported = self.link.reported_errors()
        except Exception:  # noqa: BLE001 - the store itself may be gone
            reported = {}
        if reported:
            rank = min(reported)
            return WorkerFailed(rank, reported[rank])
        try:
            self._check_processes(wait_s=0.1)
        except WorkerFailed as failure:
            return failure
        try:
            silent = self.link.silent_ranks()
        except Exception:  # noqa: BLE001
            silent = []
        if silent:
            return WorkerFailed(
                silent[0],
                f"it stopped responding (no heartbeat for {3 * HEARTBEAT_S:g} s; the "
                f"collective gave up after {self.link.timeout_s:g} s)",
            )
        if isinstance(error, dist.DistError):
            return WorkerFailed(None, f"a collective failed ({type(error).__name__}: {error})")
        # Rank 0's own error mid-step: the workers may be waiting inside the step for ever.
        return WorkerFailed(0, f"{type(error).__name__}: {error}")


# The group this process leads, if any: torch.distributed allows one per process.
_open_groups: weakref.WeakSet[TensorParallelRanks] = weakref.WeakSet()


def _keep_alive(
    ref: weakref.ref[TensorParallelRanks], closed: threading.Event, poll_s: float
) -> None:
    """The keepalive thread: `keep_alive` every `poll_s` until the ranks close or are gone."""
    while not closed.wait(poll_s):
        ranks = ref()
        if ranks is None:
            return
        ranks.keep_alive()
        del ranks


@atexit.register
def _shutdown_open_groups() -> None:
    """At exit, end every worker this process still leads."""
    for ranks in list(_open_groups):
        ranks.shutdown()


def _end_previous_group() -> None:
    """Shut down a group an earlier engine of this process left open (it was never shut down,
    or its start failed half-way), so a new engine can lead one; the old engine's steps then
    fail with a `WorkerFailed`."""
    for ranks in list(_open_groups):
        print(
            "pagedkv: shutting down the tensor-parallel workers of an earlier engine (one group "
            "per process; call Engine.shutdown() when done with an engine)",
            file=sys.stderr,
        )
        ranks.shutdown()


class BroadcastingRunner(ModelRunner):
    """Rank 0's runner: each step is broadcast to the workers before it runs here."""

    def __init__(self, model: DecoderModel, kv_cache: KVCache, ranks: TensorParallelRanks) -> None:
        super().__init__(model, kv_cache)
        self._ranks = ranks

    def execute(self, output: SchedulerOutput) -> StepLogits:
        loaded = {a.lora_id: self.lora_registry[a.lora_id] for a in output.adapters.loaded}
        return self._ranks.step(output, super().execute, LoRAWeights(loaded) if loaded else None)
