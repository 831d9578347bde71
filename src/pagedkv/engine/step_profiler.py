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
`max_iterations` steps (0: at the stop), counting steps that run requests; the stop writes the
trace as `{prefix or "pagedkv"}_{host}_{pid}.{time in ns}.pt.trace.json` (gzipped by default)
and the operators' table (by self CPU time, the top 50; on CUDA by CUDA time when
`torch_profiler_dump_cuda_time_total`) to `profiler_out_0.txt`, and prints the table.
Only this process's steps are traced: tensor-parallel ranks' workers are not.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
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
    """The engine's profiler: started and stopped by the user, stepped by the engine, all on
    the thread that runs the engine's steps (torch's profiler must be stopped on the thread
    that started it: stopped on another, it crashed the process)."""

    def __init__(self, config: ProfilerConfig, device: str) -> None:
        self.config = config
        self._activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.device(device).type == "cuda":
            self._activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile: torch.profiler.profile | None = None
        self._thread = 0  # the thread that started the recording
        self._prefix = "pagedkv"
        self._active = False  # between start and stop
        self._steps = 0  # steps since the start
        self._recorded = 0  # steps recorded since the start
        self.traces: list[Path] = []  # written so far, oldest first

    @property
    def enabled(self) -> bool:
        """Whether a profiler is configured (start and stop refuse otherwise)."""
        return self.config.profiler is not None

    @property
    def recording(self) -> bool:
        """Whether the steps are being recorded now."""
        return self._profile is not None

    def start(self, prefix: str | None = None) -> None:
        """Begin (after delay_iterations steps) recording the steps; ignored while active. The
        trace's folder is made now, so a folder that cannot be written fails here, not later
        inside a step."""
        if not self.enabled:
            raise ProfilingDisabled()
        if prefix is not None and (not prefix or os.sep in prefix or prefix in (".", "..")):
            raise ValueError(f"profile_prefix must be a file name's start, got {prefix!r}")
        if self._active:
            return
        Path(self.config.torch_profiler_dir).mkdir(parents=True, exist_ok=True)
        if self.config.delay_iterations == 0:
            self._record()
        self._active, self._steps, self._recorded = True, 0, 0
        self._prefix = prefix or "pagedkv"

    def stop(self) -> None:
        """Stop recording and write the trace; ignored when not active."""
        if not self.enabled:
            raise ProfilingDisabled()
        if not self._active:
            return
        if self.recording and threading.get_ident() != self._thread:  # before any change
            raise RuntimeError("a profile must be stopped on the thread that runs the steps")
        self._active = False
        if self.recording:
            self._finish()

    def step_started(self) -> None:
        """Count a step that runs requests, as vLLM's worker counts them: recording begins at
        step `delay_iterations` after the start (1 and 0 alike, as there) and ends before the
        step past `max_iterations` recorded. A failure here is reported and ends the profile:
        it must not fail the step's requests."""
        if not self._active:
            return
        self._steps += 1
        delay, most = self.config.delay_iterations, self.config.max_iterations
        try:
            if not self.recording and self._steps == delay:
                self._record()
            if self.recording:
                self._recorded += 1
                if most and self._recorded > most:
                    self._finish()
        except Exception as error:  # noqa: BLE001 - reported; the engine's step goes on
            profile, self._profile, self._active = self._profile, None, False
            if profile is not None:  # still recording: torch's profiler is turned off
                with contextlib.suppress(Exception):
                    profile.stop()
            print(f"pagedkv: the profile ended without a trace: {error}", file=sys.stderr)

    def span(self, name: str) -> contextlib.AbstractContextManager[object]:
        """`name` marked in the trace while recording; else a context that does nothing."""
        return torch.profiler.record_function(name) if self.recording else _NOTHING

    def _record(self) -> None:
        config = self.config
        profile = torch.profiler.profile(
            activities=self._activities,
            record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory,
            with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
        )
        profile.start()
        self._profile, self._thread = profile, threading.get_ident()

    def _finish(self) -> None:
        profile, self._profile = self._profile, None
        assert profile is not None
        profile.stop()
        directory = Path(self.config.torch_profiler_dir)
        suffix = ".pt.trace.json.gz" if self.config.torch_profiler_use_gzip else ".pt.trace.json"
        name = f"{self._prefix}_{socket.gethostname()}_{os.getpid()}.{time.time_ns()}{suffix}"
        profile.export_chrome_trace(str(directory / name))
        self.traces.append(directory / name)
        cuda = torch.profiler.ProfilerActivity.CUDA in self._activities
        if cuda and self.config.torch_profiler_dump_cuda_time_total:
            table = profile.key_averages().table(sort_by="self_cuda_time_total")
        else:
            table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
        (directory / "profiler_out_0.txt").write_text(table + "\n", encoding="utf-8")
        print(table)
