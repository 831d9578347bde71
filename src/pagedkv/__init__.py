"""pagedkv: a small, readable LLM inference engine built around paged KV-cache memory.

`from pagedkv import LLM, SamplingParams` is the vLLM-shaped entry point. The names are
imported on first use, so `pagedkv plan` and the memory code never pay for importing torch.
"""

from __future__ import annotations

import os
from typing import Any

# How long an idle OpenMP thread (libgomp's, which torch and the C kernels share) spins before
# it sleeps, unless the environment already says. libgomp's own wait is milliseconds of a core:
# while another process needs the cores (a second engine, a torch job, a test suite), the
# spinning threads take its turns and it theirs. Two engines on one 2-core machine made 24 tok/s
# each with it and 157 with this; alone, about the same speed (`bench/omp_contention.py`).
# libgomp reads it when it loads, so it counts only where pagedkv is imported before torch.
SPIN_COUNT = "10000"
os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)

_ENGINE_NAMES = (
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "LoRARequest",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "Engine",
    "LLMEngine",
    "EngineArgs",
    "RequestOutput",
    "CompletionOutput",
    "TextPrompt",
    "TokensPrompt",
)
__all__ = list(_ENGINE_NAMES)


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        import pagedkv.engine

        return getattr(pagedkv.engine, name)
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
