"""pagedkv: a small, readable LLM inference engine built around paged KV-cache memory.

`from pagedkv import LLM, SamplingParams` is the vLLM-shaped entry point. The names are
imported on first use, so `pagedkv plan` and the memory code never pay for importing torch.
"""

from __future__ import annotations

from typing import Any

_ENGINE_NAMES = (
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "LoRARequest",
    "StructuredOutputsParams",
    "Engine",
    "EngineArgs",
    "RequestOutput",
)
__all__ = list(_ENGINE_NAMES)


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        import pagedkv.engine

        return getattr(pagedkv.engine, name)
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
