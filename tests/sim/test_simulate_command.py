"""`pagedkv simulate`: JSON for scripts, tables for people, PNGs, and clear errors."""

import json
import re
import subprocess
import sys

import pytest
from matplotlib.image import imread

from pagedkv.cli import main
from pagedkv.sim import plots

SMALL = ["--num-requests", "12", "--batch-sizes", "6,12", "--pool-gb", "5"]


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
    assert all(scheme["finished"] == 12 for scheme in out["schemes"])
    assert [(p["batch_size"], p["scheme"]) for p in out["batch_sweep"]] == [
        (6, "slab-max"),
        (6, "paged"),
        (12, "slab-max"),
        (12, "paged"),
    ]
    assert out["sharing"] is None
    assert out["batch_sizes_left_out"] == []


def test_kv_cache_dtype_sizes_the_blocks_as_plan_does(capsys):
    """vLLM's --kv-cache-dtype, as plan takes it: fp8 halves the tutorial model's fp16
    block (16 tokens x 512 KiB), so the pool holds twice the blocks."""
    argv = ["simulate", "--workload", "tutorial", *SMALL, "--json"]
    assert main([*argv, "--kv-cache-dtype", "fp8"]) == 0
    assert json.loads(capsys.readouterr().out)["num_blocks"] == 5 * 10**9 // (16 * 256 * 1024)
    assert main([*argv, "--kv-cache-dtype", "auto"]) == 0
    assert json.loads(capsys.readouterr().out)["num_blocks"] == 596


def test_device_sizes_the_blocks_as_the_engine_stores_them_there(capsys):
    """The tutorial model's fp16 block (16 tokens x 512 KiB) is float32 on a CPU, twice the
    bytes, half the blocks; on a GPU it stays 2 bytes a value; --kv-cache-dtype still wins."""
    argv = ["simulate", "--workload", "tutorial", *SMALL, "--json"]
    blocks = {}
    for flags in (
        ["--device", "cpu"],
        ["--device", "cuda"],
        ["--device", "cpu", "--kv-dtype", "fp8"],
    ):
        assert main([*argv, *flags]) == 0
        blocks[" ".join(flags)] = json.loads(capsys.readouterr().out)["num_blocks"]
    assert blocks["--device cpu"] == 5 * 10**9 // (16 * 1024 * 1024)
    assert blocks["--device cuda"] == 596
    assert blocks["--device cpu --kv-dtype fp8"] == 5 * 10**9 // (16 * 256 * 1024)


def test_utilisation_is_reported_at_completion_and_at_its_peak_over_time(capsys):
    assert main(["simulate", *SMALL, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for record in [*out["schemes"], *out["batch_sweep"]]:
        assert "peak_utilisation" not in record  # it was never a peak: renamed
        assert 0 < record["utilisation_at_completion"] <= record["peak_utilisation_over_time"]
    # The tutorial's measure: a 2,048-token slab per ~500-token request.
    slab = out["schemes"][0]
    assert 0.2 < slab["utilisation_at_completion"] < 0.3


def test_system_prompt_adds_the_sharing_report(capsys):
    argv = ["simulate", *SMALL, "--system-prompt", "200", "--json"]
    assert main(argv) == 0
    sharing = json.loads(capsys.readouterr().out)["sharing"]
    assert (sharing["unshared_blocks"], sharing["forked_blocks"]) == (130, 13)
    assert sharing["forked_bytes_saved"] == 936 * 2**20
    assert sharing["prefix_cached_blocks"] == 12 + 10


def test_sharing_table_says_which_figure_is_parallel_sampling(capsys):
    assert main(["simulate", *SMALL, "--system-prompt", "200"]) == 0
    out = capsys.readouterr().out
    # 13 blocks is one request sampling n=10; ten separate requests hold 12 shared + 10 own.
    assert re.search(r"│ fork: 1 request, n=10, prefilled +│ +13 │", out)
    assert re.search(r"│ prefix caching: 10 requests at once +│ +22 │", out)


def test_tables_name_schemes_and_sweep(capsys):
    assert main(["simulate", "--workload", "alpaca", "--model", "qwen2.5-0.5b", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "Schemes: same requests, same pool" in out
    assert "utilisation, at completion" in out
    assert "utilisation, peak over time" in out
    assert "Utilisation vs batch size" in out
    assert "each request at its largest" in out


def test_trace_input_is_simulated(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"prompt_len": 300, "output_len": 40, "prefix_id": "a", "prefix_len": 256}\n' * 12
    )
    argv = ["simulate", "--trace", str(trace), "--model", "llama-3-8b", "--json"]
    assert main([*argv, "--batch-sizes", "5,12", "--pool-gb", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    shared = out["schemes"][3]["stats"]
    # All 12 are admitted in the first step (its 2,048-token budget holds 300 + 11 x 44): the
    # first computes its 16 prefix blocks, the other 11 share them as soon as they are
    # scheduled, in the same step.
    assert shared["prefix_hit_tokens"] == 11 * 256


def test_a_trace_shorter_than_the_batch_sizes_sweeps_the_sizes_it_fills(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_len": 100, "output_len": 50}\n' * 20)
    argv = ["simulate", "--trace", str(trace), "--model", "llama-3-8b"]
    assert main([*argv, "--json"]) == 0  # default batch sizes 10..200
    out = json.loads(capsys.readouterr().out)
    assert {point["batch_size"] for point in out["batch_sweep"]} == {10}
    assert out["batch_sizes_left_out"] == [25, 50, 100, 200]
    assert main(argv) == 0
    assert "batch sizes 25, 50, 100, 200 left out: the trace has only 20 requests" in (
        capsys.readouterr().out
    )


def test_a_trace_shorter_than_every_batch_size_is_swept_whole(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_len": 100, "output_len": 50}\n' * 3)
    argv = ["simulate", "--trace", str(trace), "--model", "llama-3-8b"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {point["batch_size"] for point in out["batch_sweep"]} == {3}
    assert main(argv) == 0
    assert "swept at 3 instead, the whole trace" in capsys.readouterr().out


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
        (["--pool-gb", "100000"], "the simulator builds at most 2,000,000"),
        (["--rate", "1e-300"], "raise the rate"),
        (["--max-model-len", "100"], "--max-model-len is for --trace"),
        (["--pool-gb", "1", "--num-requests", "3", "--batch-sizes", "3"], "needs 2,048 token"),
    ],
)
def test_bad_input_is_a_one_line_error(capsys, argv, message):
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv simulate: error:")
    assert message in err


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_a_plot_folder_that_cannot_be_written_is_a_one_line_error(tmp_path, capsys, where):
    blocker = tmp_path / "taken"
    blocker.write_text("not a folder")
    folder = blocker if where == "file" else blocker / "plots"
    assert main(["simulate", *SMALL, "--plot", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedkv simulate: error: --plot {folder}")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("option", "value"),
    [
        (option, value)
        for option in ("--pool-gb", "--rate")
        for value in ("inf", "-inf", "nan", "-1", "0")
    ]
    + [
        (option, value)
        for option in ("--block-size", "--num-requests", "--n", "--max-num-seqs", "--batch-sizes")
        for value in ("inf", "nan", "-1", "0")
    ]
    + [(option, value) for option in ("--seed", "--system-prompt") for value in ("inf", "-1")]
    + [("--shared-fraction", value) for value in ("inf", "nan", "-0.5", "1.5")]
    + [("--max-model-len", value) for value in ("inf", "0")]
    + [("--pool-gb", "1e300")],
)
def test_numbers_out_of_range_are_refused_when_parsed(capsys, option, value):
    argv = ["simulate", f"{option}={value}"]
    if option == "--max-model-len":
        argv += ["--trace", "unused.jsonl"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"error: argument {option}: " in capsys.readouterr().err


def test_simulation_never_imports_torch_and_plots_only_on_request():
    code = (
        "import sys, pagedkv.commands.simulate; "
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr


def test_a_trace_max_model_len_beyond_the_models_context_is_refused(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_len": 30, "output_len": 4}\n' * 3)
    argv = ["simulate", "--trace", str(trace), "--model", "llama-3-8b", "--pool-gb", "2"]
    assert main([*argv, "--max-model-len", "8192", "--batch-sizes", "3", "--json"]) == 0
    capsys.readouterr()
    assert main([*argv, "--max-model-len", "8193"]) == 2
    assert capsys.readouterr().err == (
        "pagedkv simulate: error: max_model_len 8193 is beyond the model's context length "
        "8192 (max_position_embeddings)\n"
    )


def test_a_gguf_model_simulates_as_the_folder_it_was_written_from(zoo, tiny_gguf, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"prompt_len": 40, "output_len": 8, "prefix_id": "a", "prefix_len": 32}\n' * 6
    )
    argv = ["simulate", "--trace", str(trace), "--pool-gb", "0.001", "--batch-sizes", "3", "--json"]
    runs = []
    for model in (zoo.folder("llama"), tiny_gguf("llama")):
        assert main([*argv, "--kv-dtype", "fp16", "--model", str(model)]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["schemes"] == runs[1]["schemes"]
    assert runs[0]["batch_sweep"] == runs[1]["batch_sweep"]
    assert runs[0]["num_blocks"] == runs[1]["num_blocks"] > 0


def test_a_pool_of_exactly_n_blocks_holds_n_blocks(capsys):
    """GB are 10^9 bytes, so n blocks in GB is rarely a float that times 10^9 gives back
    n x bytes per block exactly: 240 tutorial blocks (8 MiB each) came out 239 when truncated
    (a slab of the tutorial's context takes 128)."""
    per_block = 16 * 512 * 1024
    for blocks in (240, 487, 596):
        pool_gb = repr(blocks * per_block / 10**9)
        argv = ["simulate", "--workload", "tutorial", "--num-requests", "3", "--pool-gb", pool_gb]
        assert main([*argv, "--batch-sizes", "3", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["num_blocks"] == blocks


def test_tensor_parallel_pools_are_one_ranks_share_of_every_block(capsys):
    """Llama 3 70B has 8 KV heads of 128 values over 80 layers: 2 x 80 x 8 x 128 x 2 bytes =
    327,680 B/token in bf16. Over 4 ranks each holds 2 heads (81,920 B/token), so a rank's
    2 GB holds 4x the blocks; over 16, the 8 heads are replicated, one a rank (40,960)."""
    argv = ["simulate", "--model", "llama-3-70b", "--pool-gb", "2", "--num-requests", "6"]
    argv += ["--batch-sizes", "6", "--json"]
    for ranks, bytes_per_token in ((1, 327_680), (4, 81_920), (16, 40_960)):
        assert main([*argv, "--tensor-parallel-size", str(ranks)]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["tensor_parallel_size"] == ranks
        assert out["spec"]["bytes_per_token"] == bytes_per_token
        assert out["num_blocks"] == 2 * 10**9 // (16 * bytes_per_token)
    assert main([*argv, "--tensor-parallel-size", "3"]) == 2
    assert "not divisible by tensor_parallel_size (3)" in capsys.readouterr().err
    assert main(argv[:-1] + ["--tensor-parallel-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "81,920 B/token per rank" in out and "tensor parallel over 4 ranks" in out
