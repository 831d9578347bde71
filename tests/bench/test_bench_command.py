"""`pagedkv bench`: runs end to end on a tiny model, prints every figure, counts every token.

A smoke test: no timing thresholds (the machine is shared), only that the three systems run
the same workload, that each reports exactly the tokens the workload asked for, and that the
tables carry every figure the benchmark promises.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from pathlib import Path

import pytest

from pagedkv.bench.systems import run_pagedkv
from pagedkv.bench.workloads import WORKLOADS, WorkloadSpec, make_workload
from pagedkv.cli import main
from pagedkv.engine import Engine, EngineArgs
from tests.model.tiny_models import build_model_folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_folder("llama", tmp_path_factory.mktemp("bench_model") / "llama")


def test_workloads_are_the_issues_and_seeded() -> None:
    uniform = make_workload("uniform", WORKLOADS["uniform"], vocab_size=1000, seed=0)
    mixed = make_workload("mixed", WORKLOADS["mixed"], vocab_size=1000, seed=0)
    assert len(uniform.prompts) == 32 and set(uniform.output_lens) == {128}
    assert len(mixed.prompts) == 48
    assert all(16 <= n <= 512 for n in mixed.output_lens) and len(set(mixed.output_lens)) > 10
    for workload in (uniform, mixed):
        assert all(32 <= len(p) <= 256 for p in workload.prompts)
        assert all(3 <= t < 1000 for p in workload.prompts for t in p)
    assert make_workload("mixed", WORKLOADS["mixed"], 1000, 0) == mixed
    assert make_workload("mixed", WORKLOADS["mixed"], 1000, 1) != mixed


@pytest.mark.parametrize("idle_every_other_step", [False, True])
def test_pagedkv_figures_come_from_the_runners_clocks_with_its_model_untouched(
    tiny_folder: Path, idle_every_other_step: bool
) -> None:
    """Every generated token is one sequence in one forward (no preemption, no chunking).

    A step with nothing to run skips the runner and leaves its `last_num_seqs` as it was:
    such a step must count no sequences.
    """
    engine = Engine(EngineArgs(model=str(tiny_folder), num_gpu_blocks=12, max_model_len=64))
    model = engine.runner.model
    if idle_every_other_step:
        real_step, idle = engine.step, itertools.cycle([False, True])
        engine.step = lambda: [] if next(idle) else real_step()
    workload = make_workload("mixed", WorkloadSpec(5, (4, 20), (2, 9)), vocab_size=320, seed=0)
    result = run_pagedkv(engine, workload, round_index=0)
    figures = result.details["engine"]
    assert engine.runner.model is model
    assert result.useful_tokens == result.generated_tokens == workload.requested_tokens
    assert figures.swap_preemptions == figures.recompute_preemptions == 0
    assert round(figures.mean_running * figures.steps) == workload.requested_tokens
    assert figures.peak_running == 5  # 53 prompt tokens: every prompt in the first forward
    assert 0 < figures.model_forward_seconds <= figures.engine_forward_seconds
    assert figures.engine_forward_seconds <= figures.step_seconds


def test_bench_runs_prints_every_figure_and_counts_requested_tokens(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figures_path = tmp_path / "bench.json"
    exit_code = main(
        [
            "bench",
            "--model",
            str(tiny_folder),
            "--workload",
            "mixed",
            "--rounds",
            "1",
            "--num-prompts",
            "5",
            "--prompt-len",
            "4",
            "20",
            "--output-len",
            "2",
            "9",
            "--kv-tokens",
            "192",
            "--max-model-len",
            "64",
            "--threads",
            "1",
            "--json",
            str(figures_path),
        ]
    )
    printed = capsys.readouterr().out
    assert exit_code == 0, printed
    for figure in (
        "pagedkv",
        "transformers generate (static)",
        "transformers continuous batching",
        "tok/s",
        "pagedkv/this",
        "per round",
        "peak concurrency",
        "KV utilisation",
        "preemptions swap",
        "outside the model forward",
        "goals",
    ):
        assert figure in printed, figure
    figures = json.loads(figures_path.read_text())
    assert set(figures["workloads"]) == {"mixed"}
    for name, workload in figures["workloads"].items():
        requested = workload["requested_tokens"]
        expected = make_workload(
            name,
            WorkloadSpec(num_prompts=5, prompt_len=(4, 20), output_len=(2, 9)),
            vocab_size=320,
            seed=0,
        ).requested_tokens
        assert requested == expected
        assert set(workload["systems"]) == {"pagedkv", "hf-generate", "hf-cb"}
        for system, per_system in workload["systems"].items():
            assert per_system["useful_tokens"] == [requested], system
            assert per_system["tokens_per_s"] > 0, system
        # Static batches pad every request to its batch's longest output.
        assert workload["systems"]["hf-generate"]["generated_tokens"][0] >= requested
        assert workload["systems"]["pagedkv"]["generated_tokens"] == [requested]
        assert workload["engine"]["peak_running"] >= 1
        assert 0.0 <= workload["engine"]["outside_forward_share"] <= 1.0


def test_a_builtin_model_runs_its_own_file_in_pagedkv_and_its_float_folder_in_transformers(
    monkeypatch, tmp_path, tiny_folder
) -> None:
    """pagedkv gets the built-in name (under --quantization auto: its GGUF blocks), transformers
    the converted float folder; a folder goes to both as it is, and so does a repo id's folder
    in the Hugging Face cache (labelled by the repo id); a REPO:QUANT_TYPE file runs in pagedkv
    alone, as a .gguf path does."""
    from pagedkv.bench import main as bench_main
    from pagedkv.weights import load as load_module
    from tests.hub_cache import cache_repo, commit_of

    converted = tiny_folder.parent / "converted"
    monkeypatch.setattr(load_module, "converted_folder", lambda name: converted)
    systems = ["pagedkv", "hf-cb"]

    def models(model: str) -> tuple:
        args = argparse.Namespace(model=model, seed=0, revision=None, download_dir=None)
        return bench_main._models(args, systems)

    builtin = "smollm2-135m-instruct"
    assert models(builtin) == (builtin, converted, builtin, converted)
    assert models(str(tiny_folder)) == (str(tiny_folder), tiny_folder, "llama", tiny_folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cache_repo(tmp_path / "hub", "org/m", {commit_of("a"): tiny_folder}, {"main": commit_of("a")})
    snapshot = tmp_path / "hub" / "models--org--m" / "snapshots" / commit_of("a")
    assert models("org/m") == ("org/m", snapshot, "org/m", snapshot)
    gguf_repo, commit = tmp_path / "gguf-repo", commit_of("g")
    gguf_repo.mkdir()
    (gguf_repo / "Tiny-Q8_0.gguf").write_bytes(b"GGUF")
    cache_repo(tmp_path / "hub", "org/m-GGUF", {commit: gguf_repo}, {"main": commit})
    with pytest.raises(ValueError, match=r"transformers \(hf-cb\) loads a folder, not a \.gguf"):
        models("org/m-GGUF:Q8_0")
    systems.remove("hf-cb")
    file = tmp_path / "hub" / "models--org--m-GGUF" / "snapshots" / commit / "Tiny-Q8_0.gguf"
    assert models("org/m-GGUF:Q8_0") == ("org/m-GGUF:Q8_0", None, "org/m-GGUF:Q8_0", file)


def test_speculative_figures_are_the_engines_counts_of_the_run(tiny_folder: Path) -> None:
    """With speculation on, the run's draft figures are the engine's counters over that run,
    and every requested token is still produced exactly once."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = Engine(
        EngineArgs(
            model=str(tiny_folder), num_gpu_blocks=64, max_model_len=64, speculative_config=spec
        )
    )
    workload = make_workload("mixed", WorkloadSpec(5, (4, 20), (8, 24)), vocab_size=320, seed=0)
    run_pagedkv(engine, workload, round_index=0)  # counters before the measured run are not its
    before = engine.stats.spec_decoding
    result = run_pagedkv(engine, workload, round_index=1)
    figures, after = result.details["engine"], engine.stats.spec_decoding
    assert result.useful_tokens == result.generated_tokens == workload.requested_tokens
    spec = figures.spec
    assert spec.num_drafts == after.num_drafts - before.num_drafts > 0
    assert spec.num_draft_tokens == after.num_draft_tokens - before.num_draft_tokens
    assert spec.num_accepted_tokens == after.num_accepted_tokens - before.num_accepted_tokens
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens


SPEC_LINE = re.compile(
    r"pagedkv speculative decoding: (\d+) verifications of (\d+) drafted tokens; "
    r"acceptance rate ([\d.]+)%, mean accepted length ([\d.]+)"
)


def test_the_speculative_line_and_json_count_every_round(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model drafting for itself keeps every greedy draft, and each round of one workload
    drafts alike: two rounds' figures, printed and in the JSON, are one round's twice, with
    the acceptance rate and mean accepted length. With nothing drafted (n-gram drafts of
    random prompts, lookups of 4 tokens), the line still says speculation was on."""
    model = str(tiny_folder)
    flags = ["--model", model, "--workload", "uniform", "--num-prompts", "3", "--threads", "1"]
    flags += ["--prompt-len", "8", "24", "--output-len", "12", "12", "--systems", "pagedkv"]
    spec = json.dumps({"model": model, "num_speculative_tokens": 3})
    figures = {}
    for rounds in (1, 2):
        path = tmp_path / f"rounds{rounds}.json"
        argv = ["bench", *flags, "--rounds", str(rounds), "--speculative-config", spec]
        assert main([*argv, "--json", str(path)]) == 0
        [line] = SPEC_LINE.findall(capsys.readouterr().out)
        [workload] = json.loads(path.read_text())["workloads"].values()
        figures[rounds] = workload["engine"]["speculative_decoding"]
        drafts, draft_tokens, rate, mean = line
        assert (int(drafts), int(draft_tokens)) == (
            figures[rounds]["num_drafts"],
            figures[rounds]["num_draft_tokens"],
        )
        assert rate == "100.0" and figures[rounds]["acceptance_rate"] == 1.0
        assert float(mean) == pytest.approx(1 + int(draft_tokens) / int(drafts), abs=0.005)
    once, twice = figures[1], figures[2]
    assert once["num_drafts"] > 0
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert twice[name] == 2 * once[name], name
    assert twice["accepted_per_position"] == [2 * n for n in once["accepted_per_position"]]
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4})
    assert main(["bench", *flags, "--rounds", "1", "--speculative-config", ngram]) == 0
    assert "pagedkv speculative decoding: no drafts verified" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--kv-cache-memory", "10000000"], "--kv-cache-memory"),
        (["--max-model-len", "100000"], "--max-model-len 100000"),
        (["--prompt-len", "2000", "2000"], "prompt has 2000 tokens"),
        (["--json", "/no/such/dir/figures.json"], "/no/such/dir/figures.json"),
        (["--systems", "bogus"], "bogus"),
    ],
    ids=["kv-cache-memory", "max-model-len", "prompt-too-long", "json-dir", "systems"],
)
def test_bad_input_is_one_line_naming_it_before_or_instead_of_a_run(
    tiny_folder: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    base = ["bench", "--model", str(tiny_folder), "--systems", "pagedkv", "--rounds", "1"]
    base += ["--workload", "uniform", "--num-prompts", "2", "--output-len", "4", "4"]
    base += ["--threads", "1"]
    assert main(base + flags) == 2
    captured = capsys.readouterr()
    line = captured.err.strip().splitlines()[-1]  # after the engine's start-up lines, if any
    assert line.startswith("pagedkv bench: error: ") and named in line
    assert "tok/s" not in captured.out  # nothing was measured


def test_two_kv_budgets_are_refused(tiny_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--kv-tokens and --num-gpu-blocks each set every system's budget: given both, one would
    be dropped without a word."""
    flags = ["--kv-tokens", "100", "--num-gpu-blocks", "3", "--systems", "pagedkv"]
    assert main(["bench", "--model", str(tiny_folder), *flags]) == 2
    assert "not both" in capsys.readouterr().err


def test_a_gguf_file_benches_in_pagedkv_alone(
    tiny_gguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A .gguf runs in pagedkv, its workloads drawn from the file's own vocabulary; asked of
    transformers too, which loads folders, it is one line naming the way out."""
    gguf_file = tiny_gguf("llama")
    figures_path = tmp_path / "bench.json"
    flags = ["--model", str(gguf_file), "--workload", "uniform", "--rounds", "1"]
    flags += ["--num-prompts", "3", "--output-len", "4", "4", "--threads", "1"]
    assert main(["bench", *flags, "--systems", "pagedkv", "--json", str(figures_path)]) == 0
    [workload] = json.loads(figures_path.read_text())["workloads"].values()
    spec = WorkloadSpec(3, WORKLOADS["uniform"].prompt_len, (4, 4))
    assert workload["requested_tokens"] == make_workload("uniform", spec, 320, 0).requested_tokens
    assert workload["systems"]["pagedkv"]["useful_tokens"] == [workload["requested_tokens"]]
    capsys.readouterr()
    assert main(["bench", *flags, "--systems", "pagedkv,hf-cb"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        line.startswith("pagedkv bench: error: ")
        and "hf-cb" in line
        and "--systems pagedkv" in line
    )
