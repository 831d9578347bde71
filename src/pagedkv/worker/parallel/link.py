"""The process group and store one tensor-parallel group shares, from any rank's side.

Rank 0 hosts a `TCPStore`; every rank reaches it (a spawned worker is told its port, a
`torchrun` worker reads `MASTER_ADDR`/`MASTER_PORT`) and the process group is started over it:
gloo on CPU, NCCL on CUDA. Rank 0 writes the collective timeout into the store first, so every
rank's collectives give up after the same time instead of waiting for ever on a dead peer.

The store also carries what rank 0 needs to name a failed rank: each worker bumps a heartbeat
counter from a thread (one that stops counting is dead or stopped), and writes its error before
it exits on one.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_TIMEOUT_KEY = "pagedkv/timeout_s"
_DEVICE_KEY = "pagedkv/device_type"
_ARRIVED_KEY = "pagedkv/arrived/{rank}"  # set by a worker that reached the store
ARRIVAL_POLL_S = 0.05
HEARTBEAT_S = 0.5  # how often a worker's heartbeat counter moves
STORE_WAIT_S = 600.0  # how long a worker waits for rank 0's store and timeout to appear


@dataclass(frozen=True)
class TorchrunEnv:
    """A rank's place as `torchrun` (or a user, by hand) describes it in the environment."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    local_rank: int
    agent_store: bool  # torchrun's agent hosts the store at MASTER_PORT: every rank is a client

    @classmethod
    def from_environ(cls) -> TorchrunEnv | None:
        """The environment's description, or None when `WORLD_SIZE` is not set; a variable
        missing or out of its range is a ValueError naming it and its value, since both the
        worker and rank 0's engine print it as their one-line start-up error."""
        if "WORLD_SIZE" not in os.environ:
            return None
        missing = [
            name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK") if name not in os.environ
        ]
        if missing:
            raise ValueError(f"WORLD_SIZE is set but {', '.join(missing)} is not")
        world_size = _environ_int("WORLD_SIZE", 1, math.inf, "a positive integer")
        last = world_size - 1
        return cls(
            master_addr=os.environ["MASTER_ADDR"],
            master_port=_environ_int("MASTER_PORT", 1, 65535, "a port number (1 .. 65535)"),
            rank=_environ_int("RANK", 0, last, f"a rank 0 .. {last} of WORLD_SIZE={world_size}"),
            world_size=world_size,
            local_rank=_environ_int("LOCAL_RANK", 0, math.inf, "a GPU index (an integer >= 0)"),
            agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )


def _environ_int(name: str, low: int, high: float, what: str) -> int:
    """The integer in environment variable `name` (LOCAL_RANK defaults to 0), if within
    `low` .. `high`; else a ValueError saying it is not `what`."""
    text = os.environ.get(name, "0")
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ValueError(f"{name}={text!r} in the environment is not {what}")
    return value


def heartbeat_key(rank: int) -> str:
    return f"pagedkv/heartbeat/{rank}"


def error_key(rank: int) -> str:
    return f"pagedkv/error/{rank}"


class Link:
    """This rank's end of the group: broadcasts from rank 0, pulses, agreements, the store."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        size: int,
        local_rank: int,
        device_type: str | None = None,
        timeout_s: float | None = None,
        host_store: bool = True,
    ) -> None:
        """Reach the group's store; rank 0 gives `device_type` and `timeout_s`, which the
        others read from the store, and hosts the store (`port` 0 picks a free one) unless
        `host_store` is False (torchrun's agent already hosts one). `start_group` then joins
        the process group, which waits for every rank."""
        self.rank = rank
        self.size = size
        self.host = host
        wait = timedelta(seconds=timeout_s if timeout_s is not None else STORE_WAIT_S)
        try:
            self.store = dist.TCPStore(
                host,
                port,
                size,
                is_master=rank == 0 and host_store,
                timeout=wait,
                wait_for_workers=False,
            )
        except dist.DistNetworkError as error:  # a port in use, a host it cannot reach
            where = "host" if rank == 0 and host_store else "reach"
            raise OSError(
                f"tensor-parallel rank {rank} cannot {where} the group's store at {host}:{port} "
                f"(MASTER_ADDR, MASTER_PORT under torchrun): {error}"
            ) from None
        self.port = self.store.port
        if rank == 0:
            self.store.set(_DEVICE_KEY, str(device_type))
            self.store.set(_TIMEOUT_KEY, str(timeout_s))
        device_type = self.store.get(_DEVICE_KEY).decode()
        self.timeout_s = float(self.store.get(_TIMEOUT_KEY).decode())
        self.device = torch.device("cpu")
        if device_type == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        self._backend = "nccl" if device_type == "cuda" else "gloo"

    def arrive(self) -> None:
        """A worker: say it reached the store, before it joins the group."""
        self.store.set(_ARRIVED_KEY.format(rank=self.rank), "1")

    def await_arrivals(self, check: Callable[[], None]) -> None:
        """Rank 0: wait for every worker to reach the store, calling `check` meanwhile (it
        raises for a spawned worker that died: one that crashed while importing, or was
        killed for memory, is named at once rather than after the group's join times out).
        Gives up silently after the collective timeout: the join then fails and says why."""
        keys = [_ARRIVED_KEY.format(rank=rank) for rank in range(1, self.size)]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys) and time.monotonic() < deadline:
            check()
            time.sleep(ARRIVAL_POLL_S)

    def start_group(self) -> None:
        """Join the process group (every rank must call it; it waits for them all)."""
        if dist.is_initialized():
            raise RuntimeError(
                "this process already belongs to a torch.distributed group: one "
                "tensor-parallel engine per process"
            )
        hook = sys.excepthook
        dist.init_process_group(
            self._backend,
            store=dist.PrefixStore("pg", self.store),
            rank=self.rank,
            world_size=self.size,
            timeout=timedelta(seconds=self.timeout_s),
        )
        if self.rank == 0:  # the caller's process: torch prefixed its tracebacks with
            sys.excepthook = hook  # "[rank0]: ", once more for every engine it starts

    def send(self, message: Any) -> None:
        """Rank 0: broadcast one picklable message to every worker."""
        dist.broadcast_object_list([message], src=0)

    def receive(self) -> Any:
        """A worker: the next message rank 0 broadcast (waits at most the timeout)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def pulse(self) -> None:
        """Every rank: a one-element all-reduce, returning only when every rank took part."""
        dist.all_reduce(torch.zeros(1, device=self.device))

    def agree_min(self, values: list[int]) -> list[int]:
        """Every rank: the element-wise minimum of every rank's `values`."""
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return tensor.tolist()

    def close(self) -> None:
        """Leave the process group (so this process may start another later)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- failure detection -----------------------------------------------------------------

    def start_heartbeat(self) -> None:
        """A worker: bump this rank's counter every `HEARTBEAT_S` from a daemon thread, on a
        store connection of its own. If rank 0's store is gone, so is the engine: exit at once
        rather than linger (the main thread may be blocked in a collective)."""
        client = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False)
        key = heartbeat_key(self.rank)

        def beat() -> None:
            while True:
                try:
                    client.add(key, 1)
                except Exception:  # noqa: BLE001 - any store failure means rank 0 is gone
                    os._exit(3)
                time.sleep(HEARTBEAT_S)

        threading.Thread(target=beat, name="pagedkv-heartbeat", daemon=True).start()

    def report_error(self, message: str) -> None:
        """A worker about to exit on an error: leave the reason for rank 0 to report."""
        self.store.set(error_key(self.rank), message)

    def reported_errors(self) -> dict[int, str]:
        """Rank 0: the errors workers left, by rank."""
        return {
            rank: self.store.get(error_key(rank)).decode()
            for rank in range(1, self.size)
            if self.store.check([error_key(rank)])
        }

    def silent_ranks(self) -> list[int]:
        """Rank 0: the workers whose heartbeat did not move over three heartbeat periods."""
        before = self._heartbeats()
        time.sleep(3 * HEARTBEAT_S)
        after = self._heartbeats()
        return [rank for rank in before if after[rank] == before[rank]]

    def _heartbeats(self) -> dict[int, int]:
        return {rank: self.store.add(heartbeat_key(rank), 0) for rank in range(1, self.size)}
