"""vLLM's `profiler_config`, read and checked (see `step_profiler.py` for what it does); no
torch, so EngineArgs stays as cheap to import as it was."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from pagedkv.engine.vllm_keywords import json_object

# vLLM ProfilerConfig keys pagedkv has no use for: the default taken, and why no other.
_NOT_SUPPORTED: dict[str, tuple[object, str]] = {
    "capture_torch_profiler": (False, "pagedkv captures no CUDA graphs"),
    "warmup_iterations": (
        0,
        "the trace holds every step between start and stop (or delay_iterations and "
        "max_iterations)",
    ),
    "wait_iterations": (0, "use delay_iterations"),
    "active_iterations": (5, "use max_iterations"),
}
# vLLM keys that change nothing here: pagedkv has one process per engine (no front end apart)
# and marks each step's stages by name (no per-step annotations of request counts).
_NO_EFFECT = ("ignore_frontend", "detailed_trace_annotation")


_SWITCHES = (
    "torch_profiler_with_stack",
    "torch_profiler_with_flops",
    "torch_profiler_use_gzip",
    "torch_profiler_record_shapes",
    "torch_profiler_with_memory",
    "torch_profiler_dump_cuda_time_total",
)


@dataclass(frozen=True)
class ProfilerConfig:
    """vLLM's profiler settings that pagedkv reads (see the module docstring)."""

    profiler: str | None = None
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    torch_profiler_dump_cuda_time_total: bool = True
    delay_iterations: int = 0
    max_iterations: int = 0

    @classmethod
    def parse(cls, value: ProfilerConfig | Mapping[str, Any] | str | None) -> ProfilerConfig:
        """`profiler_config` as given (a dict, JSON text or None), checked as vLLM checks it;
        the directory made absolute."""
        if isinstance(value, ProfilerConfig):
            return value
        given = dict(json_object("profiler_config", value) or {})
        known = {f.name for f in fields(cls)}
        for key in list(given):
            if key in _NOT_SUPPORTED:
                default, why = _NOT_SUPPORTED[key]
                if given.pop(key) != default:
                    raise ValueError(f"profiler_config {key} is not supported: {why}")
            elif key in _NO_EFFECT:
                given.pop(key)
            elif key not in known:
                raise ValueError(
                    f"profiler_config has no key {key!r} (keys: {', '.join(sorted(known))})"
                )
        config = cls(**given)
        config._check()
        if config.torch_profiler_dir:
            directory = os.path.abspath(os.path.expanduser(config.torch_profiler_dir))
            config = replace(config, torch_profiler_dir=directory)
        return config

    def _check(self) -> None:
        if self.profiler not in (None, "torch"):
            raise ValueError(
                f"profiler_config profiler must be 'torch' or None, got {self.profiler!r} "
                "(vLLM's 'cuda' marks a range for Nsight Systems; pagedkv traces with torch)"
            )
        for name in _SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"profiler_config {name} must be true or false")
        for name in ("delay_iterations", "max_iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"profiler_config {name} must be an integer >= 0, got {value!r}")
        if self.torch_profiler_dir and self.profiler != "torch":
            raise ValueError("profiler_config torch_profiler_dir needs profiler 'torch'")
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise ValueError("profiler_config profiler 'torch' needs torch_profiler_dir")
