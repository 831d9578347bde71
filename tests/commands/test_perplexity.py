"""`pagedkv perplexity` against the same arithmetic done on transformers' logits.

The oracle follows llama.cpp's `llama-perplexity` by hand: windows of n_ctx tokens, the first
replaced by BOS, logits of each whole window from transformers (no cache), and the negative
log-likelihood of tokens n_ctx/2 + 1 .. n_ctx - 1. pagedkv computes the same windows in pieces
through its paged cache, asking logits only of the scored positions.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from pagedkv.cli import main
from pagedkv.commands.perplexity import perplexity
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
    assert main(["perplexity", str(text), "--model", str(folder), "--n-ctx", "32"]) == 0
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


@pytest.mark.parametrize("flag", ["--n-ctx", "--max-windows"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_window_counts_below_one_are_refused_when_parsed(tmp_path, capsys, flag, value) -> None:
    text = tmp_path / "text.txt"
    text.write_text("Paged attention.")
    with pytest.raises(SystemExit) as exit:
        main(["perplexity", str(text), flag, value])
    assert exit.value.code == 2
    assert f"argument {flag}: must be a positive integer, got {value}" in capsys.readouterr().err


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
