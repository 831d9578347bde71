"""vLLM's step profiler: `profiler_config`, `start_profile` / `stop_profile`, the server's routes.

Oracles: the steps a test runs by hand (`LLMEngine.step` called k times between start and stop
gives k `step` spans in the trace, each holding the engine's four stages once, in order), the
rule vLLM states for delay_iterations and max_iterations, the trace read back with json, and
the outputs of the same requests without a profiler, which profiling must not change.
"""

from __future__ import annotations

import gzip
import json
import threading
import uuid
from pathlib import Path

import pytest

from pagedkv import LLM, LLMEngine
from pagedkv.engine import EngineArgs, SamplingParams
from pagedkv.engine.profiler_config import ProfilerConfig
from tests.model.tiny_models import random_prompt

STAGES = ["schedule", "execute", "update", "outputs"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)


def spans(trace: Path) -> list[dict]:
    """The trace's complete events named by the engine, in time order."""
    opened = gzip.open if trace.suffix == ".gz" else open
    with opened(trace, "rt", encoding="utf-8") as file:
        events = json.load(file)["traceEvents"]
    named = [e for e in events if e.get("ph") == "X" and e.get("name") in ("step", *STAGES)]
    return sorted(named, key=lambda e: (e["ts"], -e["dur"]))


def stages_by_step(trace: Path) -> list[list[str]]:
    """For each `step` span, the stage spans inside it, in order."""
    steps: list[list[str]] = []
    events = spans(trace)
    for step in (e for e in events if e["name"] == "step"):
        end = step["ts"] + step["dur"]
        inside = [e for e in events if e["name"] != "step" and step["ts"] <= e["ts"] <= end]
        steps.append([e["name"] for e in inside])
    return steps


def engine_with(folder: Path, directory: Path, **config) -> LLMEngine:
    profiler = {"profiler": "torch", "torch_profiler_dir": str(directory), **config}
    args = EngineArgs(model=str(folder), num_gpu_blocks=64, profiler_config=profiler)
    return LLMEngine.from_engine_args(args)


def run_steps(engine: LLMEngine, count: int) -> None:
    """A request long enough that none of `count` steps is idle, then `count` steps."""
    params = SamplingParams(temperature=0.0, max_tokens=count + 1, ignore_eos=True)
    engine.add_request(uuid.uuid4().hex, {"prompt_token_ids": random_prompt(9, seed=1)}, params)
    for _ in range(count):
        engine.step()


def test_the_trace_holds_each_step_between_start_and_stop(engine_zoo, tmp_path, capsys) -> None:
    engine = engine_with(engine_zoo.folder("llama"), tmp_path / "traces")
    engine.step()  # before the start: not traced
    engine.start_profile()
    engine.start_profile()  # while profiling: ignored, as vLLM's
    run_steps(engine, 4)
    engine.stop_profile()
    engine.stop_profile()  # while not: ignored
    [trace] = engine.profiler.traces
    assert trace.parent == tmp_path / "traces" and trace.name.endswith(".pt.trace.json.gz")
    assert trace.name.startswith("pagedkv_")
    assert stages_by_step(trace) == [STAGES] * 4
    table = (tmp_path / "traces" / "profiler_out_0.txt").read_text()
    assert "execute" in table and table.strip() in capsys.readouterr().out
    engine.start_profile("decode")  # a second profile, its own file, named by the prefix
    run_steps(engine, 2)
    engine.shutdown()  # ends the recording and writes it
    assert engine.profiler.traces[1].name.startswith("decode_")
    assert stages_by_step(engine.profiler.traces[1]) == [STAGES] * 2


@pytest.mark.parametrize(
    ("delay", "most", "recorded"), [(2, 3, 3), (0, 2, 2), (3, 0, 6), (1, 0, 8), (6, 5, 3)]
)
def test_delay_and_max_iterations_pick_the_steps_vllm_says(
    engine_zoo, tmp_path, delay, most, recorded
) -> None:
    """Of 8 steps after the start, vLLM's worker records from step `delay` (its count of
    steps reaches the delay as that step starts: 1 and 0 alike) and at most `most` (0: all)."""
    directory = tmp_path / "t"
    engine = engine_with(
        engine_zoo.folder("llama"),
        directory,
        delay_iterations=delay,
        max_iterations=most,
        torch_profiler_use_gzip=False,
        torch_profiler_with_stack=False,  # Python's stack: the slow part of a trace
    )
    engine.start_profile()
    run_steps(engine, 8)
    engine.stop_profile()
    [trace] = engine.profiler.traces
    assert trace.name.endswith(".pt.trace.json")
    assert len(stages_by_step(trace)) == recorded


def test_profiling_changes_no_output(engine_zoo, tmp_path) -> None:
    folder = engine_zoo.folder("qwen2")
    prompts = [random_prompt(7 + 4 * i, seed=i) for i in range(3)]
    plain = LLM(str(folder), num_gpu_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path)}
    config["torch_profiler_with_stack"] = False  # the slow part of a trace; no effect on outputs
    profiled = LLM(str(folder), num_gpu_blocks=64, profiler_config=json.dumps(config))
    profiled.start_profile()
    outputs = profiled.generate(prompts, GREEDY, use_tqdm=False)
    profiled.stop_profile()
    assert [[(s.token_ids, s.logprobs) for s in o.outputs] for o in outputs] == [
        [(s.token_ids, s.logprobs) for s in o.outputs] for o in plain
    ]
    assert len(profiled.engine.profiler.traces) == 1


def test_without_a_profiler_start_and_stop_say_how_to_enable_it(engine_zoo) -> None:
    llm = LLM(str(engine_zoo.folder("llama")), num_gpu_blocks=32)
    for call in (llm.start_profile, llm.stop_profile):
        with pytest.raises(RuntimeError, match=r"profiling is not enabled: .*profiler_config="):
            call()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"profiler": "torch"}, "profiler 'torch' needs torch_profiler_dir"),
        ({"torch_profiler_dir": "/tmp/x"}, "torch_profiler_dir needs profiler 'torch'"),
        ({"profiler": "cuda", "torch_profiler_dir": "/t"}, "must be 'torch' or None"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "depth": 1}, "has no key 'depth'"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "delay_iterations": -1}, ">= 0"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "max_iterations": 1.5}, ">= 0"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "warmup_iterations": 2}, "warmup"),
        (
            {"profiler": "torch", "torch_profiler_dir": "/t", "torch_profiler_use_gzip": 1},
            "true or",
        ),
        ("[1]", "must be a JSON object"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(config, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(profiler_config=config)


def test_the_directory_is_made_absolute_and_vllms_no_effect_keys_are_taken(monkeypatch) -> None:
    monkeypatch.chdir("/tmp")
    config = ProfilerConfig.parse(
        {
            "profiler": "torch",
            "torch_profiler_dir": "traces",
            "ignore_frontend": True,
            "warmup_iterations": 0,
            "active_iterations": 5,
        }
    )
    assert config.torch_profiler_dir == "/tmp/traces"
    assert ProfilerConfig.parse(None) == ProfilerConfig()


def test_idle_steps_are_not_counted_and_a_failed_write_fails_no_request(
    engine_zoo, tmp_path, capsys
) -> None:
    """As vLLM's worker, only steps that run requests count toward the delay; a trace that
    cannot be written when max_iterations ends it is reported, and the requests go on."""
    directory = tmp_path / "t"
    engine = engine_with(
        engine_zoo.folder("llama"),
        directory,
        delay_iterations=2,
        max_iterations=1,
        torch_profiler_with_stack=False,
    )
    engine.start_profile()
    for _ in range(5):
        engine.step()  # idle: nothing to run
    assert not engine.profiler.recording
    directory.rmdir()
    directory.write_text("not a folder")  # the trace's folder is gone when the profile ends
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": random_prompt(9, seed=1)}, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert len(outputs[0].outputs[0].token_ids) == 6
    assert "the profile ended without a trace" in capsys.readouterr().err
    assert engine.profiler.traces == [] and not engine.profiler.recording
    with pytest.raises(ValueError, match="profile_prefix must be a file name's start"):
        engine.start_profile("a/b")


def test_a_stop_from_another_thread_is_refused_and_the_profile_goes_on(
    engine_zoo, tmp_path
) -> None:
    """torch's profiler must be stopped on the thread that started it (stopped on another, it
    crashed the process): such a stop is refused before anything changes, and the stop on the
    engine's thread then writes the whole trace."""
    engine = engine_with(engine_zoo.folder("llama"), tmp_path, torch_profiler_with_stack=False)
    engine.start_profile()
    run_steps(engine, 2)
    failures = []

    def stop_elsewhere() -> None:
        try:
            engine.stop_profile()
        except RuntimeError as error:
            failures.append(str(error))

    thread = threading.Thread(target=stop_elsewhere)
    thread.start()
    thread.join()
    assert failures == ["a profile must be stopped on the thread that runs the steps"]
    assert engine.profiler.recording
    run_steps(engine, 1)
    engine.stop_profile()
    [trace] = engine.profiler.traces
    assert stages_by_step(trace) == [STAGES] * 3
