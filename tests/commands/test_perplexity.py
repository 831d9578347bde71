"""`pagedkv perplexity` against the same arithmetic done on transformers' logits.

The oracle follows llama.cpp's `llama-perplexity` by hand: windows of n_ctx tokens, the first
replaced by BOS, logits of each whole window from transformers (no cache), and the negative
log-likelihood of tokens n_ctx/2 + 1 .. n_ctx - 1. pagedkv computes the same windows in pieces
through its paged cache, asking logits only of the scored positions.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import fields

import pytest
import torch

from pagedkv.cli import main
from pagedkv.commands.perplexity import ENGINE_FIELDS, add_arguments, perplexity
from pagedkv.engine.args import EngineArgs
from pagedkv.tokenizer import Tokenizer
from pagedkv.weights.load import load

TEXT = (
    "Paged attention stores keys and values in fixed-size blocks. A block table maps each "
    "sequence's positions to blocks, so memory is allocated as tokens arrive and shared "
    "between requests with a common prefix. "
) * 6


def oracle(zoo, name: str, tokens: list[int], n_ctx: int, bos: int) -> tuple[float, int]:
    nll, scored = 0.0, 0
    for index in range(len(tokens) // n_ctx):
        window = tokens[index * n_ctx : (index + 1) * n_ctx]
        window[0] = bos
        log_probs = torch.log_softmax(zoo.hf_logits(name, window).double(), dim=-1)
        for position in range(n_ctx // 2, n_ctx - 1):
            nll -= log_probs[position, window[position + 1]].item()
            scored += 1
    return math.exp(nll / scored), scored


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize(("n_ctx", "piece"), [(32, 2048), (40, 7), (33, 16)])
def test_matches_transformers_by_hand(zoo, name: str, n_ctx: int, piece: int) -> None:
    """Pieces smaller than a window (7 tokens) and odd windows (33) score the same tokens."""
    loaded = load(zoo.folder(name))
    tokenizer: Tokenizer = loaded.tokenizer
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    expected, expected_scored = oracle(zoo, name, tokens, n_ctx, tokenizer.bos_token_id)
    result = perplexity(
        loaded.model, tokenizer, TEXT, n_ctx=n_ctx, block_size=4, max_num_batched_tokens=piece
    )
    assert result.scored == expected_scored
    assert result.windows == len(tokens) // n_ctx
    assert result.perplexity == pytest.approx(expected, rel=1e-4)  # float32 vs float64 sums


def test_command_prints_the_figure(zoo, tmp_path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    folder = zoo.folder("llama")
    args = ["perplexity", str(text), "--model", str(folder), "--n-ctx", "32", "--threads", "1"]
    assert main([*args, "--block-size", "4", "--max-num-batched-tokens", "7"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    figure = float(re.search(r"perplexity ([\d.]+) over (\d+) tokens", line)[1])
    tokenizer = load(folder).tokenizer
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    assert figure == pytest.approx(oracle(zoo, "llama", tokens, 32, 1)[0], rel=1e-3)


def test_text_shorter_than_a_window_is_an_error(zoo, tmp_path, capsys) -> None:
    text = tmp_path / "short.txt"
    text.write_text("Paged attention.")
    code = main(["perplexity", str(text), "--model", str(zoo.folder("llama")), "--n-ctx", "64"])
    assert code == 2
    assert "fewer than one window of n_ctx 64" in capsys.readouterr().err


def test_a_file_that_is_no_utf8_text_is_named(zoo, tmp_path, capsys) -> None:
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"ok \x80\x81")
    for path, reason in ((binary, "not UTF-8 text"), (tmp_path / "none.txt", "cannot read it")):
        code = main(["perplexity", str(path), "--model", str(zoo.folder("llama"))])
        assert code == 2
        assert f"pagedkv perplexity: error: {path}: {reason}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--n-ctx", "--max-windows"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_window_counts_below_one_are_refused_when_parsed(tmp_path, capsys, flag, value) -> None:
    text = tmp_path / "text.txt"
    text.write_text("Paged attention.")
    with pytest.raises(SystemExit) as exit:
        main(["perplexity", str(text), flag, value])
    assert exit.value.code == 2
    assert f"argument {flag}: must be a positive integer, got {value}" in capsys.readouterr().err


def test_a_window_the_model_cannot_hold_is_refused_naming_n_ctx(zoo, tmp_path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    with pytest.raises(SystemExit):
        main(["perplexity", str(text), "--n-ctx", "3"])
    assert "argument --n-ctx: must be at least 4, got 3" in capsys.readouterr().err
    context = json.loads((zoo.folder("llama") / "config.json").read_text())
    context = context["max_position_embeddings"]
    args = ["perplexity", str(text), "--model", str(zoo.folder("llama"))]
    assert main([*args, "--n-ctx", str(context + 1)]) == 2
    expected = f"--n-ctx {context + 1} is beyond the model's context of {context} tokens"
    assert expected in capsys.readouterr().err


def test_command_scores_through_an_fp8_cache(zoo, tmp_path, capsys) -> None:
    """`--kv-cache-dtype fp8` scores through fp8 blocks: the function's fp8 figure, not
    auto's (the two differ on a tiny model: its logits move with its rounded K/V)."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    folder = zoo.folder("llama")
    args = ["perplexity", str(text), "--model", str(folder), "--n-ctx", "32"]
    assert main([*args, "--kv-cache-dtype", "fp8"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "kv_cache_dtype fp8" in line
    figure = float(re.search(r"perplexity ([\d.]+) over", line)[1])
    loaded = load(folder)
    scores = {
        kv: perplexity(loaded.model, loaded.tokenizer, TEXT, n_ctx=32, kv_cache_dtype=kv)
        for kv in ("auto", "fp8")
    }
    assert figure == pytest.approx(scores["fp8"].perplexity, rel=1e-4)
    assert scores["fp8"].perplexity != pytest.approx(scores["auto"].perplexity, rel=1e-4)


def off_default_argvs() -> list[list[str]]:
    """For each engine flag perplexity does not use (every `EngineArgs` field outside
    `ENGINE_FIELDS`, so a field added later is covered), the flag set to a value other than
    its default, the flag first as typed."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    unused = {field.name for field in fields(EngineArgs)} - ENGINE_FIELDS
    argvs = []
    for action in parser._actions:
        if action.dest not in unused:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x: the other one
            argvs.append([action.option_strings[1 if action.default else 0]])
        elif action.choices:
            other = next(choice for choice in action.choices if choice != action.default)
            argvs.append([action.option_strings[0], other])
        else:  # an int, float or string flag, none of which defaults to 3
            argvs.append([action.option_strings[0], "3"])
    assert len(argvs) == len(unused)
    return argvs


@pytest.mark.parametrize("argv", off_default_argvs(), ids=lambda argv: argv[0])
def test_an_engine_flag_it_does_not_use_is_refused_by_name(tmp_path, capsys, argv) -> None:
    """Refused before the model loads: the model named does not exist."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    code = main(["perplexity", str(text), "--model", str(tmp_path / "absent"), *argv])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedkv perplexity: error: {argv[0]} does not apply to perplexity (")
    assert err.count("\n") == 1


def test_several_unused_flags_are_named_in_one_line(tmp_path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    argv = ["--seed", "7", "--tensor-parallel-size", "2", "--no-enable-prefix-caching"]
    assert main(["perplexity", str(text), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "pagedkv perplexity: error: --no-enable-prefix-caching, --seed, --tensor-parallel-size "
        "do not apply to perplexity ("
    )
    assert err.count("\n") == 1


def test_unused_flags_typed_at_their_defaults_pass(tmp_path, capsys) -> None:
    """They change nothing, so the start-up goes on to the next error: the absent model."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    argv = ["--seed", "0", "--tensor-parallel-size", "1", "--enable-prefix-caching"]
    argv += ["--no-enable-lora", "--swap-space-gb", "1", "--model", str(tmp_path / "absent")]
    assert main(["perplexity", str(text), *argv]) == 2
    err = capsys.readouterr().err
    assert "does not apply" not in err
    assert "absent' is not a model folder" in err


def test_help_lists_only_the_engine_flags_it_uses(capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["perplexity", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    for field in fields(EngineArgs):
        flag = "--" + field.name.replace("_", "-")
        listed = re.search(rf"{flag}(?![\w-])", out) is not None
        assert listed == (field.name in ENGINE_FIELDS), flag
    assert "do not apply to perplexity and are refused" in " ".join(out.split())
