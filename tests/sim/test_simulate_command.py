"""`pagedkv simulate`: JSON for scripts, tables for people, PNGs, and clear errors."""

import json
import subprocess
import sys

import pytest
from matplotlib.image import imread

from pagedkv.cli import main
from pagedkv.sim import plots

SMALL = ["--num-requests", "30", "--batch-sizes", "10,20", "--pool-gb", "5"]


def test_json_reports_every_scheme_and_the_sweep(capsys):
    assert main(["simulate", "--workload", "tutorial", *SMALL, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "gpt-tutorial"
    assert out["num_blocks"] == 5 * 10**9 // (16 * 512 * 1024) == 596
    assert [scheme["scheme"] for scheme in out["schemes"]] == [
        "slab-max",
        "slab-exact",
        "paged",
        "paged-shared",
    ]
    assert all(scheme["finished"] == 30 for scheme in out["schemes"])
    assert [(p["batch_size"], p["scheme"]) for p in out["batch_sweep"]] == [
        (10, "slab-max"),
        (10, "paged"),
        (20, "slab-max"),
        (20, "paged"),
    ]
    assert out["sharing"] is None


def test_system_prompt_adds_the_sharing_report(capsys):
    argv = ["simulate", *SMALL, "--system-prompt", "200", "--json"]
    assert main(argv) == 0
    sharing = json.loads(capsys.readouterr().out)["sharing"]
    assert (sharing["unshared_blocks"], sharing["forked_blocks"]) == (130, 13)
    assert sharing["forked_bytes_saved"] == 936 * 2**20


def test_tables_name_schemes_and_sweep(capsys):
    assert main(["simulate", "--workload", "alpaca", "--model", "qwen2.5-0.5b", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "Schemes: same requests, same pool" in out
    assert "utilisation, peak" in out
    assert "Utilisation vs batch size" in out


def test_trace_input_is_simulated(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"prompt_len": 300, "output_len": 40, "prefix_id": "a", "prefix_len": 256}\n' * 12
    )
    argv = ["simulate", "--trace", str(trace), "--model", "llama-3-8b", "--json"]
    assert main([*argv, "--batch-sizes", "5,12", "--pool-gb", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    shared = out["schemes"][3]["stats"]
    assert shared["prefix_hit_tokens"] == 11 * 256  # every request after the first


def test_plots_are_written_at_their_pixel_sizes(tmp_path, capsys):
    assert main(["simulate", *SMALL, "--system-prompt", "40", "--plot", str(tmp_path)]) == 0
    expected = {
        "utilisation_vs_batch_size.png": plots.UTILISATION_SIZE,
        "concurrency_over_time.png": plots.CONCURRENCY_SIZE,
        "memory_map.png": plots.MEMORY_MAP_SIZE,
    }
    for name, (width, height) in expected.items():
        path = tmp_path / name
        assert path.stat().st_size > 10_000, name
        assert imread(path).shape[:2] == (height, width), name
    out = capsys.readouterr().out
    assert all(f"wrote {tmp_path / name}" in out for name in expected)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "docs", "--model", "llama-3-8b"], "needs a 32,768-token context"),
        (["--model", "nope"], "neither a preset"),
        (["--pool-gb", "0.001"], "holds no block"),
        (["--trace", "/nonexistent.jsonl"], "cannot read trace"),
        (["--system-prompt", "-3"], "--system-prompt must be >= 0"),
        (["--max-model-len", "100"], "--max-model-len is for --trace"),
        (["--pool-gb", "1", "--num-requests", "3", "--batch-sizes", "3"], "needs 2,048 token"),
    ],
)
def test_bad_input_is_a_one_line_error(capsys, argv, message):
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv simulate: error:")
    assert message in err


def test_simulation_never_imports_torch_and_plots_only_on_request():
    code = (
        "import sys, pagedkv.commands.simulate; "
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr
