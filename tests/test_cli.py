"""The `pagedkv` command line's own parsing: errors in a command's words, whole flags only,
and `serve MODEL` as vLLM's `vllm serve MODEL`."""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def config_args(command: str, config: str, argv: list[str], tmp_path: Path):
    """`pagedkv COMMAND --config FILE ARGV` parsed as `main` parses it, FILE holding `config`."""
    import argparse

    from pagedkv.cli import _command_module, vllm_spellings, with_config

    path = tmp_path / "config.yaml"
    path.write_text(config)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    _command_module(command).add_arguments(parser)
    parser.add_argument("--config")
    expanded = with_config(vllm_spellings([command, "--config", str(path), *argv]), parser)
    return vars(parser.parse_args(expanded[1:]))


def test_a_config_file_reads_as_its_options_on_the_command_line(tmp_path: Path) -> None:
    """vLLM's --config: each key is the option of that name, underscores or dashes; true a
    flag, false its --no- form, a list its values, a mapping its JSON. The oracle is the same
    options typed out."""
    config = """
model: /models/x
max_num_seqs: 8
gpu-memory-utilization: 0.5
enable_prefix_caching: false
enable-auto-tool-choice: true
served_model_name: [a, b]
speculative_config: {method: ngram, num_speculative_tokens: 3}
"""
    typed = [
        "--model", "/models/x", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5",
        "--no-enable-prefix-caching", "--enable-auto-tool-choice", "--served-model-name", "a",
        "b", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
    ]  # fmt: skip
    read = config_args("serve", config, [], tmp_path)
    assert read == {**vars(serve_args(typed)), "config": None}
    # the command line wins, wherever it stands; a positional model still wins over --model
    read = config_args("serve", config, ["/other", "--max_num_seqs=4"], tmp_path)
    assert (read["max_num_seqs"], read["model_tag"], read["model"]) == (4, "/other", "/models/x")
    # a repeatable option takes a list as repeats; values may start with a dash
    read = config_args("generate", "stop: [x, '-y']\nprompt: '-q'\n", [], tmp_path)
    assert (read["stop"], read["prompt"]) == (["x", "-y"], "-q")
    # a one-value option takes a list as its JSON (vLLM's JSON flags), never spilling into the
    # positional model; null and an empty list leave the option out
    config = "allowed_origins: ['https://ui.example']\nhost: [a, b]\napi_key: null\n"
    read = config_args("serve", config + "served_model_name: []\n", [], tmp_path)
    typed = vars(serve_args(["--allowed-origins", '["https://ui.example"]']))
    assert read["allowed_origins"] == typed["allowed_origins"]
    assert (read["host"], read["model_tag"]) == ('["a", "b"]', None)
    assert (read["api_key"], read["served_model_name"]) == (typed["api_key"], None)
    # the file's options come before a typed "--", which ends the options
    read = config_args("perplexity", "max_windows: 2\n", ["--", "-file.txt"], tmp_path)
    assert (read["max_windows"], str(read["file"])) == (2, "-file.txt")


@pytest.mark.parametrize(
    ("config", "argv", "message"),
    [
        ("max_num_sequences: 8\n", [], "'max_num_sequences' is not an option of this command"),
        ("- 8\n", [], "must be a mapping of option names to values"),
        ("a: [\n", [], "not valid YAML"),
        ("enable-auto-tool-choice: 'yes'\n", [], "is a flag: give true or false"),
        ("port: 1\n", ["--config", "again.yaml"], "--config is given more than once"),
        ("port: 1\nhost: a\nport: 2\n", [], "'port' given more than once"),
        ("max-num-seqs: 1\nmax_num_seqs: 2\n", [], "'max_num_seqs' given more than once"),
        (
            "enable_prefix_caching: true\nno_enable_prefix_caching: true\n",
            [],
            "'enable_prefix_caching' and 'no_enable_prefix_caching' set one option",
        ),
    ],
)
def test_a_bad_config_file_is_named(tmp_path: Path, capsys, config, argv, message) -> None:
    with pytest.raises(SystemExit) as exit:
        config_args("serve", config, argv, tmp_path)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_config_and_reads_no_file(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--config", str(tmp_path / "none.yaml"), "--help"])
    assert exit.value.code == 0 and "--config FILE" in capsys.readouterr().out


def test_main_reads_a_config_file_and_names_a_missing_one(tmp_path: Path, capsys) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("num_gpu_blocks: 0\nprompt: hi\n")
    assert main(["generate", "--config", str(path)]) == 2
    assert "--num-gpu-blocks must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        main(["generate", f"--config={tmp_path / 'none.yaml'}"])
    assert exit.value.code == 2
    assert "none.yaml: No such file or directory" in capsys.readouterr().err


def test_a_config_files_list_of_lengths_is_the_lengths_typed(tmp_path: Path, capsys) -> None:
    """`lengths: [1000, 2k]` in a --config file plans what `--lengths 1000,2k` plans."""
    path = tmp_path / "plan.yaml"
    path.write_text("model: llama-3-8b\npool_gb: 10\nlengths: [1000, 2k]\njson: true\n")
    assert main(["plan", "--config", str(path)]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main([*PLAN, "--lengths", "1000,2k", "--json"]) == 0
    assert from_file == json.loads(capsys.readouterr().out)
    assert [row["request_tokens"] for row in from_file["rows"]] == [1000, 2048]
    with pytest.raises(SystemExit):
        main([*PLAN, "--lengths", "[]"])
    assert "not a list of token counts: '[]'" in capsys.readouterr().err


def test_python_dash_m_pagedkv_runs_the_command() -> None:
    """`python -m pagedkv` is the `pagedkv` script, for a venv whose bin is not on PATH."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "pagedkv", "generate", "--help"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: pagedkv generate")


def test_vllms_script_parser_reads_a_command_line_as_the_commands_do(tmp_path: Path) -> None:
    """vLLM's examples parse engine flags with `FlexibleArgumentParser` (from `vllm.utils`, or
    `vllm.utils.argparse_utils` in newer ones) and `EngineArgs.add_cli_args`: vLLM's spellings
    (`--max_model_len`, `-tp`) and a `--config` YAML (typed flags win) give the EngineArgs
    written out by hand, and a prefix of an option is not taken for it."""
    from pagedkv.engine import EngineArgs
    from pagedkv.utils import FlexibleArgumentParser
    from pagedkv.utils.argparse_utils import FlexibleArgumentParser as newer_path

    assert newer_path is FlexibleArgumentParser
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    config = tmp_path / "engine.yaml"
    config.write_text("max_num_seqs: 7\nenable_prefix_caching: false\nblock_size: 32\n")
    typed = ["--max_model_len", "64", "-tp", "1", "--config", str(config), "--max-num-seqs", "9"]
    parsed = EngineArgs.from_cli_args(parser.parse_args(typed))
    by_hand = EngineArgs(
        max_model_len=64,
        tensor_parallel_size=1,
        max_num_seqs=9,
        enable_prefix_caching=False,
        block_size=32,
    )
    assert parsed == by_hand
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-model", "64"])


KEYS = st.from_regex(r"\A[a-z_][a-z0-9_]{0,6}\Z")
TEXTS = st.from_regex(r"\A[a-z][a-z ._/-]{0,8}\Z").filter(
    lambda t: t not in ("true", "false", "null")
)
LEAVES = (
    st.integers(-(10**6), 10**6) | st.booleans() | TEXTS | st.floats(-1e6, 1e6, allow_nan=False)
)
OBJECTS = st.recursive(
    st.dictionaries(KEYS, LEAVES, min_size=1, max_size=3),
    lambda children: st.dictionaries(KEYS, children | LEAVES, min_size=1, max_size=3),
    max_leaves=8,
)


def flattened(value: dict, prefix: str) -> list[str]:
    """vLLM's dotted form of `value` as its docs write it: `--OPT.a.b V` per leaf, a list as
    its items appended one by one with `+`."""
    args = []
    for key, item in value.items():
        name = f"{prefix}.{key}"
        if isinstance(item, dict):
            args += flattened(item, name)
        elif isinstance(item, list):
            args += [part for element in item for part in (f"{name}+", str(element))]
        else:
            args += [name, json.dumps(item) if not isinstance(item, str) else item]
    return args


@settings(max_examples=200, deadline=None)
@given(value=OBJECTS, lists=st.lists(TEXTS.filter(lambda t: "," not in t), max_size=3))
def test_vllms_dotted_json_options_are_the_json_they_spell(value, lists) -> None:
    """vLLM's docs: `--json-arg.key1 value1 --json-arg.key2.key3 value2` is `--json-arg
    '{"key1": "value1", "key2": {"key3": "value2"}}'`, and `--json-arg.key4+ v` appends to a
    list; other options and their values pass through in order."""
    from pagedkv.cli import dotted_json

    if lists:
        value = {**value, "listed": lists}
    argv = ["generate", "--temperature", "-0.5", *flattened(value, "--hf-overrides"), "--n", "2"]
    parsed = dotted_json(argv, pytest.fail)
    others = [arg for arg in parsed if not arg.startswith("--hf-overrides=")]
    assert others == ["generate", "--temperature", "-0.5", "--n", "2"]
    objects = [arg.partition("=")[2] for arg in parsed if arg.startswith("--hf-overrides=")]
    assert all(json.loads(text) == value for text in objects)
    assert parsed[-1].startswith("--hf-overrides=")  # last: it wins over JSON typed earlier


@settings(max_examples=100, deadline=None)
@given(
    assignments=st.lists(
        st.tuples(st.sampled_from(("method", "k", "draft.path", "draft.size")), st.integers()),
        max_size=8,
    )
)
def test_a_dotted_key_given_twice_keeps_its_last_value_and_is_named(assignments) -> None:
    """vLLM's rule: a repeated key is overwritten, and each repeat is named in one warning."""
    from pagedkv.cli import dotted_json

    argv = [part for key, value in assignments for part in (f"--spec.{key}", str(value))]
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        parsed = dotted_json(["serve", *argv], pytest.fail)
    expected: dict = {}
    for key, value in assignments:
        *outer, leaf = key.split(".")
        (expected.setdefault(outer[0], {}) if outer else expected)[leaf] = value
    assert [json.loads(arg.partition("=")[2]) for arg in parsed[-1:] if assignments] == (
        [expected] if assignments else []
    )
    keys = [key for key, _ in assignments]
    repeats = list(
        dict.fromkeys(f"--spec.{key}" for at, key in enumerate(keys) if key in keys[:at])
    )
    assert stderr.getvalue() == (
        f"warning: found duplicate keys {', '.join(repeats)}\n" if repeats else ""
    )


def test_dotted_options_reach_the_engine_args_as_their_json_would() -> None:
    """Through vLLM's script parser: vLLM's underscores before the dot only, nested keys, a
    count with a suffix, and a dotted option replacing a JSON one typed before it."""
    from pagedkv.engine import EngineArgs
    from pagedkv.utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    typed = [
        *("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 9}'),
        *("--speculative_config.method", "ngram", "--speculative-config.num_speculative_tokens=3"),
        *("--hf-overrides.rope_scaling.factor", "2.0", "--hf_overrides.max_position_embeddings"),
        *("2k", "--hf-overrides.rope_scaling.rope_type=linear"),
    ]
    by_hand = EngineArgs(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        hf_overrides={
            "rope_scaling": {"factor": 2.0, "rope_type": "linear"},
            "max_position_embeddings": 2000,
        },
    )
    assert EngineArgs.from_cli_args(parser.parse_args(typed)) == by_hand
    with pytest.raises(SystemExit):
        parser.parse_args(["--hf-overrides.rope_scaling"])  # no value


def test_dotted_options_keep_the_command_line_around_them_and_read_config_keys(tmp_path) -> None:
    """A positional typed after a dotted option stays positional (an option of several values
    before it does not swallow it); tokens after a typed "--" are left as they are; a dotted
    key in a `--config` file is a dotted flag under the typed ones; values such as `1_000` and
    `+5` are counts, as vLLM's int() reads them; a key may be any name."""
    from pagedkv.utils import FlexibleArgumentParser

    def parser() -> FlexibleArgumentParser:
        parser = FlexibleArgumentParser()
        parser.add_argument("model")
        parser.add_argument("--allowed-hosts", nargs="+")
        parser.add_argument("--speculative-config", type=json.loads)
        parser.add_argument("--hf-overrides", type=json.loads)
        return parser

    typed = ["--allowed-hosts", "localhost", "--speculative-config.method", "ngram", "org/m.v1"]
    typed += ["--speculative-config", '{"model": "other"}', "--hf-overrides.1", "1_000"]
    typed += ["--hf-overrides.b=+5", "--", "--hf-overrides.c", "x"]
    args, after = parser().parse_known_args(typed)
    assert (args.model, args.allowed_hosts) == ("org/m.v1", ["localhost"])
    assert args.speculative_config == {"method": "ngram"}  # replaces the JSON typed after it
    assert args.hf_overrides == {"1": 1000, "b": 5}
    assert after == ["--", "--hf-overrides.c", "x"]
    config = tmp_path / "c.yaml"
    config.write_text(
        "speculative_config.method: ngram\nspeculative_config.num_speculative_tokens: 9\n"
        "hf_overrides.rope_scaling: {factor: 2.0}\n"
    )
    typed = ["m", "--config", str(config), "--speculative-config.num_speculative_tokens", "3"]
    args = parser().parse_args(typed)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert args.hf_overrides == {"rope_scaling": {"factor": 2.0}}
    config.write_text("no_such_option.key: 1\n")
    with pytest.raises(SystemExit):
        parser().parse_args(["m", "--config", str(config)])
