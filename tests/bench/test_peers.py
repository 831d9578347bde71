"""`bench/peers.py`: runs end to end on a tiny GGUF file, reports every figure, counts tokens.

A smoke test: no timing thresholds (the machine is shared). llama.cpp is not installed here,
so the full run covers pagedkv and transformers; llama.cpp's worker is checked for how it
packs llama-server's batches (pure Python), and the benchmark for skipping a peer that cannot
run, with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from tests.bench import load_script

peers = load_script("peers")
worker = load_script("llama_cpp_worker")

NUM_PROMPTS, MAX_TOKENS = 3, 4
TITLE_LLAMA = peers.TITLES["llama.cpp"]


def test_peers_runs_pagedkv_and_transformers_with_exact_token_counts(
    tiny_gguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figures_path = tmp_path / "peers.json"
    gguf = tiny_gguf("llama")
    exit_code = peers.main(
        [
            "--model",
            str(gguf),
            "--systems",
            "pagedkv,transformers",
            "--num-prompts",
            str(NUM_PROMPTS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--rounds",
            "2",
            "--threads",
            "1",
            "--json",
            str(figures_path),
        ]
    )
    printed = capsys.readouterr().out
    assert exit_code == 0, printed
    for figure in (
        "round 1",
        "round 2",
        "batch tok/s (min-max)",
        "batch-1 decode (min-max)",
        "pagedkv/transformers: batch",
        "load average (1 min) before",
        "prefill tok/s (min-max)",
        "read bandwidth",
        "pagedkv: batch-1 decode at",
        "pagedkv LLM() ready in",
        "threads 1, quantization auto",
        "torch ",
        "transformers ",
    ):
        assert figure in printed, figure
    assert TITLE_LLAMA not in printed and "pagedkv/llama.cpp" not in printed
    report = json.loads(figures_path.read_text())
    assert report["threads"] == 1 and report["rounds"] == 2 and report["max_tokens"] == MAX_TOKENS
    assert report["batch"]["num_prompts"] == NUM_PROMPTS
    assert set(report["systems"]) == {"pagedkv", "transformers"}
    assert set(report["ratios"]) == {"pagedkv/transformers"}
    assert {"load_average_before", "load_average_after", "versions"} <= set(report)
    assert report["pagedkv_start_seconds"] > 0
    limit = report["read_bandwidth_bytes_per_s"] / report["weight_bytes_per_token"]
    assert report["bandwidth_limit_tokens_per_s"] == pytest.approx(limit)
    for system, figures in report["systems"].items():
        assert figures["batch_generated_tokens"] == [NUM_PROMPTS * MAX_TOKENS] * 2, system
        assert figures["batch1_generated_tokens"] == [MAX_TOKENS] * 2, system
        for key in ("batch_tokens_per_s", "batch1_decode_tokens_per_s", "prefill_tokens_per_s"):
            spread = figures[key]
            assert len(spread["per_round"]) == 2, (system, key)
            assert 0 < spread["min"] <= spread["median"] <= spread["max"], (system, key)


@pytest.mark.parametrize("tied", [False, True])
def test_a_decoded_token_reads_every_weight_but_the_embedding_rows_it_skips(tiny_gguf, tied):
    """Every tensor's bytes, as gguf's own reader counts them; of an untied embedding table
    only one row (the output layer reads a tied one whole)."""
    path = tiny_gguf("llama", drop_tensors=("lm_head.weight",) if tied else ())
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    if not tied:
        table = tensors["token_embd.weight"]
        total -= int(table.n_bytes) - int(table.n_bytes) // int(table.shape[1])
    assert ("output.weight" in tensors) is not tied
    assert peers.weight_bytes_per_token(path) == total


def test_a_peer_that_cannot_run_is_skipped_with_the_reason(
    tiny_gguf, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No interpreter: the install hint. A build that dies of SIGILL: named as such."""
    gguf = str(tiny_gguf("llama"))
    common = ["--model", gguf, "--systems", "llama.cpp", "--num-prompts", "1", "--rounds", "1"]
    assert peers.main([*common, "--llama-python", str(tmp_path / "missing")]) == 0
    printed = capsys.readouterr().out
    assert "skipped llama.cpp" in printed and "pip install llama-cpp-python" in printed
    dies = tmp_path / "python"
    dies.write_text("#!/bin/sh\nkill -s ILL $$\n")
    dies.chmod(0o755)
    figures_path = tmp_path / "skipped.json"
    assert peers.main([*common, "--llama-python", str(dies), "--json", str(figures_path)]) == 0
    assert "Illegal instruction" in capsys.readouterr().out
    report = json.loads(figures_path.read_text())
    assert report["systems"] == {} and "Illegal instruction" in report["skipped"]["llama.cpp"]


class _Batch:
    """The fields of a llama_batch the worker writes, as Python lists."""

    def __init__(self, size: int) -> None:
        self.token, self.pos, self.n_seq_id, self.logits = ([0] * size for _ in range(4))
        self.seq_id = [[0] for _ in range(size)]
        self.n_tokens = 0

    def entries(self) -> list[tuple[int, int, int, int]]:
        n = self.n_tokens
        return list(
            zip(
                self.token[:n],
                self.pos[:n],
                [s[0] for s in self.seq_id[:n]],
                self.logits[:n],
                strict=True,
            )
        )


def test_llama_cpp_worker_packs_batches_like_llama_server(monkeypatch) -> None:
    """Decodes of live sequences first, then prompt tokens up to n_batch (a prompt may be
    split across batches); logits for a prompt's last token and for every decode."""
    monkeypatch.setattr(worker, "N_BATCH", 5)
    batch = _Batch(5)
    first, second = worker.Sequence(0, [10, 11, 12]), worker.Sequence(1, [20, 21, 22, 23])
    rows = worker.fill_batch(batch, [first, second], max_tokens=3)
    assert batch.entries() == [
        (10, 0, 0, 0),
        (11, 1, 0, 0),
        (12, 2, 0, 1),
        (20, 0, 1, 0),
        (21, 1, 1, 0),
    ]
    assert rows == [first]
    first.generated.append(100)  # sampled from that row
    rows = worker.fill_batch(batch, [first, second], max_tokens=3)
    assert batch.entries() == [(100, 3, 0, 1), (22, 2, 1, 0), (23, 3, 1, 1)]
    assert rows == [first, second]
    first.generated.append(101)
    second.generated.append(200)
    rows = worker.fill_batch(batch, [first, second], max_tokens=3)
    assert batch.entries() == [(101, 4, 0, 1), (200, 4, 1, 1)]
    first.generated.append(102)  # first is done: three tokens
    second.generated.append(201)
    rows = worker.fill_batch(batch, [first, second], max_tokens=3)
    assert batch.entries() == [(201, 5, 1, 1)] and rows == [second]


def test_peers_help_works(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        peers.main(["--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    for flag in ("--rounds", "--threads", "--systems", "--llama-python", "--json", "--seed"):
        assert flag in printed, flag
