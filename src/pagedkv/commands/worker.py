"""`pagedkv worker`: serve as one tensor-parallel rank of an engine running on another machine.

The rank is described by torchrun's environment (`MASTER_ADDR`, `MASTER_PORT`, `RANK`,
`WORLD_SIZE`, `LOCAL_RANK`); rank 0 runs the engine (`pagedkv serve|generate|bench
--tensor-parallel-size N` under the same environment) and sends everything else: the model,
the dtype, the device, the pool. The worker exits when the engine shuts down or fails.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the rank comes from the environment, the rest from rank 0."""
    parser.epilog = (
        "Environment: MASTER_ADDR and MASTER_PORT (rank 0's address and a free port), RANK "
        "(1 .. WORLD_SIZE-1), WORLD_SIZE (= --tensor-parallel-size of rank 0), LOCAL_RANK "
        "(this machine's GPU, default 0); torchrun sets them all."
    )


def run(args: argparse.Namespace) -> int:
    """Join the group and run every step rank 0 sends; exit 2 on a bad environment (a variable
    missing or malformed, named in one line)."""
    from pagedkv.worker.parallel.link import TorchrunEnv
    from pagedkv.worker.parallel.worker import run_worker

    try:
        env = TorchrunEnv.from_environ()
        if env is None:
            raise ValueError("WORLD_SIZE is not set: run under torchrun or set the environment")
        if env.rank == 0:  # from_environ has checked RANK < WORLD_SIZE
            raise ValueError(
                f"RANK={env.rank}: a worker is rank 1 .. {env.world_size - 1} of WORLD_SIZE="
                f"{env.world_size} (rank 0 runs the engine)"
            )
    except ValueError as error:
        print(f"pagedkv worker: error: {error}", file=sys.stderr)
        return 2
    print(f"pagedkv worker: rank {env.rank} of {env.world_size}", file=sys.stderr)
    run_worker(
        env.rank,
        env.world_size,
        env.master_addr,
        env.master_port,
        env.local_rank,
        host_store=not env.agent_store,
    )
    return 0
