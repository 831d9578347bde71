"""vLLM's step profiler: `LLM(..., profiler_config={"profiler": "torch", "torch_profiler_dir":
DIR})`, then `llm.start_profile()` ... `llm.stop_profile()` (or the server's `/start_profile`
and `/stop_profile`) writes a torch.profiler trace of the steps between, for Perfetto or
chrome://tracing.

Why: an engineer asking where a step's time goes wants a timeline, not a total. pagedkv's
work is mostly C kernels called outside torch's operators, so the profiler alone would see
little; while it records, each step is a span `step` holding the engine's stages:
`schedule`, `execute` (forward pass, sampling, drafts), `update` and `outputs`
(detokenising). When it is not recording, a stage costs an empty `with`.

As vLLM's: a start while profiling and a stop while not are ignored; `delay_iterations` steps
pass after the start before recording begins, and recording ends by itself after
`max_iterations` steps (0: at the stop); the stop writes the trace as
`{prefix or "pagedkv"}_{host}_{pid}.{time in ns}.pt.trace.json` (gzipped by default) and the
operators' table by self CPU time (the top 50) to `profiler_out_0.txt`, and prints the table.
Only this process's steps are traced: tensor-parallel ranks' workers are not.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

import torch

from pagedkv.engine.profiler_config import ProfilerConfig

_NOTHING = contextlib.nullcontext()


class ProfilingDisabled(RuntimeError):
    """start_profile or stop_profile without a profiler configured."""

    def __init__(self) -> None:
        super().__init__(
            "profiling is not enabled: start the engine with profiler_config="
            '{"profiler": "torch", "torch_profiler_dir": DIR} (--profiler-config JSON)'
        )


class StepProfiler:
    """The engine's profiler: started and stopped by the user, stepped by the engine."""

    def __init__(self, config: ProfilerConfig, device: str) -> None:
        self.config = config
        self._activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.device(device).type == "cuda":
            self._activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile: torch.profiler.profile | None = None
        self._prefix = "pagedkv"
        self._active = False  # between start and stop
        self._steps = 0  # steps since the start
        self.recording = False
        self.traces: list[Path] = []  # written so far, oldest first

    @property
    def enabled(self) -> bool:
        return self.config.profiler is not None

    def start(self, prefix: str | None = None) -> None:
        """Begin (after delay_iterations steps) recording the steps; ignored while active."""
        if not self.enabled:
            raise ProfilingDisabled()
        if self._active:
            return
        self._active, self._steps = True, 0
        self._prefix = prefix or "pagedkv"
        if self.config.delay_iterations == 0:
            self._record()

    def stop(self) -> None:
        """Stop recording and write the trace; ignored when not active."""
        if not self.enabled:
            raise ProfilingDisabled()
        if not self._active:
            return
        self._active = False
        if self.recording:
            self._finish()

    def step_started(self) -> None:
        """Count a step of the engine: begin recording after the delay, end after the most."""
        if not self._active:
            return
        self._steps += 1  # this step's number since the start
        delay, most = self.config.delay_iterations, self.config.max_iterations
        if not self.recording and delay and self._steps == delay + 1:
            self._record()
        elif self.recording and most and self._steps - delay > most:
            self._finish()

    def span(self, name: str) -> contextlib.AbstractContextManager[object]:
        """`name` marked in the trace while recording; else a context that does nothing."""
        return torch.profiler.record_function(name) if self.recording else _NOTHING

    def _record(self) -> None:
        config = self.config
        self._profile = torch.profiler.profile(
            activities=self._activities,
            record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory,
            with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
        )
        self._profile.start()
        self.recording = True

    def _finish(self) -> None:
        profile, self._profile = self._profile, None
        self.recording = False
        assert profile is not None
        profile.stop()
        directory = Path(self.config.torch_profiler_dir)
        directory.mkdir(parents=True, exist_ok=True)
        suffix = ".pt.trace.json.gz" if self.config.torch_profiler_use_gzip else ".pt.trace.json"
        name = f"{self._prefix}_{socket.gethostname()}_{os.getpid()}.{time.time_ns()}{suffix}"
        profile.export_chrome_trace(str(directory / name))
        self.traces.append(directory / name)
        table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
        (directory / "profiler_out_0.txt").write_text(table + "\n", encoding="utf-8")
        print(table)
