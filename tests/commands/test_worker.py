"""`pagedkv worker` under torchrun's environment, two processes on loopback: rank 0 runs
`pagedkv generate --tensor-parallel-size 2`, the worker is rank 1; the completion is
transformers' greedy one, and the worker exits 0 when the engine is done."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import transformers

from pagedkv.cli import main
from tests.server.conftest import free_port

PROMPT = "Paged attention stores keys and values"
MAX_TOKENS = 12


def test_generate_on_rank_0_with_a_worker_as_rank_1(zoo):
    tokenizer = transformers.AutoTokenizer.from_pretrained(zoo.folder("llama"))
    prompt_ids = tuple(tokenizer(PROMPT)["input_ids"])
    want = tokenizer.decode(
        zoo.hf_greedy("llama", prompt_ids, MAX_TOKENS), skip_special_tokens=True
    )
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    command = [sys.executable, "-m", "pagedkv.cli"]
    worker = subprocess.Popen(
        [*command, "worker"], env=dict(env, RANK="1", LOCAL_RANK="0"), stderr=subprocess.PIPE
    )
    try:
        argv = ["generate", "--model", str(zoo.folder("llama")), "--prompt", PROMPT]
        argv += ["--max-tokens", str(MAX_TOKENS), "--num-gpu-blocks", "32", "--threads", "1"]
        argv += ["--swap-space-gb", "0", "--tensor-parallel-size", "2"]
        rank_0 = subprocess.run(
            [*command, *argv], env=dict(env, RANK="0"), capture_output=True, text=True, timeout=120
        )
        assert rank_0.returncode == 0, rank_0.stderr
        assert rank_0.stdout == want + "\n"
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()


def test_worker_outside_a_group_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["worker"]) == 2
    assert "WORLD_SIZE is not set" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(["worker"]) == 2
    assert "rank 0 runs the engine" in capsys.readouterr().err


# One variable malformed at a time, over a good environment; each error names it and its value.
BAD_ENVIRONMENTS = [
    ("MASTER_PORT", "abc"),
    ("MASTER_PORT", "70000"),
    ("MASTER_PORT", "0"),
    ("WORLD_SIZE", "two"),
    ("WORLD_SIZE", "0"),
    ("RANK", "x"),
    ("RANK", "2"),
    ("RANK", "-1"),
    ("LOCAL_RANK", "gpu0"),
    ("LOCAL_RANK", "-1"),
]


def set_environment(monkeypatch, rank: str, name: str, value: str) -> None:
    environment = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2"}
    environment.update(RANK=rank, LOCAL_RANK="0")
    environment[name] = value
    for key, text in environment.items():
        monkeypatch.setenv(key, text)


def refuse_to_start(*args, **kwargs):
    raise AssertionError("the malformed environment got as far as the group's store")


@pytest.mark.parametrize(("name", "value"), BAD_ENVIRONMENTS)
def test_worker_names_a_malformed_variable(monkeypatch, capsys, name, value):
    set_environment(monkeypatch, "1", name, value)
    monkeypatch.setattr("pagedkv.worker.parallel.worker.run_worker", refuse_to_start)
    assert main(["worker"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedkv worker: error: {name}='{value}' in the environment is not ")
    assert err.count("\n") == 1


@pytest.mark.parametrize(("name", "value"), BAD_ENVIRONMENTS)
def test_rank_0_engine_names_a_malformed_variable(monkeypatch, capsys, name, value):
    """The engine reads the environment before it loads anything: no model is needed."""
    set_environment(monkeypatch, "0", name, value)
    monkeypatch.setattr("pagedkv.worker.parallel.ranks.Link", refuse_to_start)
    argv = ["generate", "--model", "absent", "--prompt", PROMPT, "--tensor-parallel-size", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedkv generate: error: {name}='{value}' in the environment is not ")
    assert err.count("\n") == 1
