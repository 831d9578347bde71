"""How many CPU threads the model runs on by default: this machine's physical cores.

Hyper-threads share a core's vector units, and the matmuls here keep those busy, so a second
thread per core adds contention rather than speed; llama.cpp defaults the same way. Only the
cores this process may run on (its affinity mask, e.g. a container's CPU set) count.
"""

from __future__ import annotations

import os
from pathlib import Path


def physical_cores() -> int:
    """Distinct physical cores among the CPUs this process may use (at least 1)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            return max(1, len(cpus))  # no topology: count logical CPUs
        cores.add((package, core))
    return max(1, len(cores) or os.cpu_count() or 1)
