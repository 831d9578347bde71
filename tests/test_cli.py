"""The `pagedkv` command line's own parsing: errors in a command's words, whole flags only,
and `serve MODEL` as vLLM's `vllm serve MODEL`."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from pagedkv.cli import main

PLAN = ["plan", "--model", "llama-3-8b", "--pool-gb", "10"]


def test_an_unknown_flag_is_named_by_its_commands_usage(capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main([*PLAN, "--bogus", "1"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pagedkv plan ")
    assert "pagedkv plan: error: unrecognized arguments: --bogus 1" in err


def test_version_is_the_installed_packages(capsys) -> None:
    """`pagedkv --version`, as `vllm --version`: the version pyproject.toml gives."""
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    [declared] = re.findall(r'^version = "([^"]+)"$', pyproject, re.MULTILINE)
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"pagedkv {declared}\n"


def test_a_flags_prefix_is_not_taken_for_the_flag(capsys) -> None:
    """`--pool 10` would have meant `--pool-gb 10`: with ~40 flags a prefix can silently
    mean another flag, so only whole flags are read."""
    assert main(PLAN) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        main(["plan", "--model", "llama-3-8b", "--pool", "10"])
    assert exit.value.code == 2
    assert "pagedkv plan: error:" in capsys.readouterr().err


def test_serve_takes_the_model_as_its_first_word(tmp_path: Path, capsys) -> None:
    missing = str(tmp_path / "nowhere")
    assert main(["serve", missing]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv serve: ") and missing in err and "is not a model folder" in err


def test_serve_on_a_port_in_use_fails_before_loading_the_model(tmp_path: Path, capsys) -> None:
    """The port is bound first, as vLLM binds it: the error is the port's, though the model
    named does not exist either (loading it first would have said so)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        missing = str(tmp_path / "nowhere")
        assert main(["serve", missing, "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pagedkv serve: error: cannot listen on 127.0.0.1 port {port}: ")
    assert "in use" in err and missing not in err


def serve_args(argv: list[str]):
    """`pagedkv serve ARGV` parsed as the command line reads it (vLLM's spellings made ours)."""
    import argparse

    from pagedkv.cli import vllm_spellings
    from pagedkv.commands import serve

    parser = argparse.ArgumentParser(allow_abbrev=False)
    serve.add_arguments(parser)
    return parser.parse_args(vllm_spellings(argv))


def test_vllms_spellings_of_flags_are_read_as_vllm_reads_them() -> None:
    """vLLM's parser takes underscores in flag names, -tp and -q, and token counts such as
    32k (decimal) or 32K (binary); a value is never rewritten."""
    args = serve_args(
        [
            "--gpu_memory_utilization=0.5",
            "--max_num_batched_tokens",
            "4k",
            "-tp",
            "2",
            "-pp",
            "1",
            "-dp=1",
            "-q=int8",
            "--max-model-len",
            "32K",
            "--served-model-name",
            "my_model",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--disable-log-requests",
            "--uvicorn-log-level",
            "warning",
        ]
    )
    assert (args.gpu_memory_utilization, args.max_num_batched_tokens) == (0.5, 4000)
    assert (args.tensor_parallel_size, args.quantization) == (2, "int8")
    assert (args.pipeline_parallel_size, args.data_parallel_size) == (1, 1)
    assert args.max_model_len == 32 * 1024 and args.served_model_name == ["my_model"]
    assert args.uvicorn_log_level == "warning"
    assert serve_args(["--max-model-len", "25.6k"]).max_model_len == 25600
    for bad in ("1.5K", "lots"):
        with pytest.raises(SystemExit):
            serve_args(["--max-model-len", bad])
    with pytest.raises(SystemExit):
        serve_args(["--tool-call-parser", "llama3_json"])  # only Hermes calls are read


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench", "demo"])
def test_an_engine_value_refused_is_named_by_the_flag_typed(command, capsys) -> None:
    """The engine's checks name its fields; a command says the flag the user typed."""
    needs = {"generate": ["--prompt", "hi"], "serve": ["--port", "0"]}.get(command, [])
    assert main([command, *needs, "--num-gpu-blocks", "0", "--max-num-seqs", "2"]) == 2
    err = capsys.readouterr().err
    assert "--num-gpu-blocks must be a positive integer, got 0" in err
    assert "num_gpu_blocks" not in err
