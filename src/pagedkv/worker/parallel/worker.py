"""A worker rank's life: join the group, load its shard, then run every step rank 0 sends.

Spawned by rank 0 on one machine (`ranks.py`) or started by `pagedkv worker` on another
(`torchrun`'s environment), a worker keeps no scheduler: it receives the `LoadSpec`, the pool
request, then one message at a time (a `SchedulerOutput` to execute, the LoRA adapters it
loads before it, a `Keepalive` to answer, `Stop`) and ends on `Stop`, on any error (after
leaving it in the store for rank 0 to report; a `ValueError`, which rank 0 meets too, such as
heads the ranks cannot split, in one line), or when rank 0's store disappears (the heartbeat
thread exits the process).
"""

from __future__ import annotations

import sys
import time

from pagedkv.model.errors import ModelError
from pagedkv.parallel.group import TPGroup
from pagedkv.worker.kv_budget import kv_pool
from pagedkv.worker.parallel.link import Link
from pagedkv.worker.parallel.messages import Keepalive, LoRAWeights, Stop
from pagedkv.worker.parallel.rank_setup import agreed_budget, load_shard
from pagedkv.worker.runner import ModelRunner
from pagedkv.worker.thread_governor import thread_governor


def run_worker(
    rank: int, size: int, host: str, port: int, local_rank: int, host_store: bool = True
) -> None:
    """Serve as rank `rank` of `size` until rank 0 says stop (or fails); rank 0's store is
    at `host:port` (hosted by torchrun's agent when not `host_store`) and says the device
    type; `local_rank` picks this machine's GPU."""
    link = Link(
        host=host, port=port, rank=rank, size=size, local_rank=local_rank, host_store=host_store
    )
    link.arrive()
    link.start_group()
    link.start_heartbeat()
    try:
        _serve(link)
    except (ValueError, ModelError) as error:  # a configuration or a model file every rank
        # refuses alike (rank 0 reports it too): one line, no trace
        link.report_error(f"{type(error).__name__}: {error}")
        print(f"pagedkv worker (rank {rank}): error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except BaseException as error:
        link.report_error(f"{type(error).__name__}: {error}")
        raise
    finally:
        link.close()


def _serve(link: Link) -> None:
    spec = link.receive()
    if isinstance(spec, Stop):
        return
    threads = thread_governor(link.device, spec.threads, link.size)
    loaded = load_shard(spec, TPGroup(link.rank, link.size), link.device)
    request = link.receive()
    while isinstance(request, Keepalive):  # rank 0 still loading (a speculative draft model)
        link.pulse()
        request = link.receive()
    if isinstance(request, Stop):  # rank 0 failed to load, or was shut down meanwhile
        return
    budget = agreed_budget(link, request, loaded.model)
    cache = kv_pool(loaded.model, budget)
    runner = ModelRunner(loaded.model, cache)
    while True:
        message = link.receive()
        if isinstance(message, Stop):
            return
        if isinstance(message, Keepalive):
            link.pulse()
        elif isinstance(message, LoRAWeights):  # for the step that follows
            runner.lora_registry = message.adapters
        else:
            started = time.perf_counter()
            threads.apply()
            runner.execute(message)
            runner.lora_registry = {}  # written into their blocks: the host copies are done
            threads.observe(time.perf_counter() - started)
