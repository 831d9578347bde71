"""llama.cpp's side of `bench/peers.py`, run by the interpreter that has llama-cpp-python.

llama-cpp-python is never a dependency of pagedkv: `peers.py` starts this file with another
virtual environment's python and talks to it over pipes. Each stdin line is one JSON job;
each gets one JSON line back on stdout (llama.cpp's own logs go to stderr):

    {"model": "/path/file.gguf", "threads": 2, "prompts": [[ids], ...], "max_tokens": 128}
    -> {"generated_tokens": 4096, "seconds": 12.3, "first_token_seconds": [...], ...}

A job with `"mode": "prompt_lookup"` runs the prompts one at a time through llama-cpp-python's
own `Llama.generate`, greedy, with its prompt-lookup decoding (`LlamaPromptLookupDecoding`,
`max_ngram_size` and `num_pred_tokens` from the job; `num_pred_tokens` 0: none), each until a
`stop_ids` token or `max_tokens`, and returns per prompt its tokens and the seconds from its
first token to its last (`bench/spec_bench.py`).

The model is loaded once per path and kept; every job gets a fresh context, so no job finds
an earlier one's KV. The decode loop is llama-server's: one context whose n_seq_max is the
number of sequences, each prompt in its own seq_id, and per step ONE llama_batch holding
every live sequence's next token, then prompt tokens up to n_batch; greedy argmax over the
logits of each output row. Only the standard library, numpy and llama_cpp are imported here.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    import llama_cpp as lc
except ImportError:  # importable without it, so the tests can check the batch packing
    lc = None

N_BATCH = 2048  # llama-server's default logical batch
N_UBATCH = 512  # and physical batch
CTX_SLACK = 256  # tokens of n_ctx beyond what the sequences need


@dataclass
class Sequence:
    """One request: its prompt, how far the prompt is in, and what it has generated."""

    seq_id: int
    prompt: list[int]
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None

    @property
    def position(self) -> int:
        """Position of the next token fed to the model."""
        return self.prefilled + max(0, len(self.generated) - 1)


class Worker:
    """Loaded models by path; runs jobs."""

    def __init__(self) -> None:
        lc.llama_backend_init()
        self.models: dict[str, Any] = {}

    def model(self, path: str) -> Any:
        """The model at `path`, loaded on first use, CPU only."""
        if path not in self.models:
            params = lc.llama_model_default_params()
            params.n_gpu_layers = 0
            model = lc.llama_model_load_from_file(path.encode(), params)
            if not model:
                raise RuntimeError(f"llama.cpp could not load {path}")
            self.models[path] = model
        return self.models[path]

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        """One generate job: every prompt to max_tokens new tokens, greedy, no EOS stop."""
        if job.get("mode") == "prompt_lookup":
            return prompt_lookup(job)
        model = self.model(job["model"])
        prompts: list[list[int]] = job["prompts"]
        max_tokens = int(job["max_tokens"])
        threads = int(job["threads"])
        n_ctx = job.get("n_ctx") or len(prompts) * (max(map(len, prompts)) + max_tokens) + CTX_SLACK
        unified = bool(job.get("kv_unified", True)) and _kv_unified_supported()
        ctx = new_context(model, n_ctx, len(prompts), threads, unified)
        try:
            vocab = lc.llama_model_get_vocab(model)
            n_vocab = lc.llama_vocab_n_tokens(vocab)
            return generate(ctx, n_vocab, prompts, max_tokens) | {
                "n_ctx": lc.llama_n_ctx(ctx),
                "kv_unified": unified,
                "threads": threads,
                "version": lc.__version__,
            }
        finally:
            lc.llama_free(ctx)


def prompt_lookup(job: dict[str, Any]) -> dict[str, Any]:
    """Each prompt alone through `Llama.generate`, with prompt-lookup drafts unless
    `num_pred_tokens` is 0; greedy; the tokens and the decode seconds of each."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = None
    if job["num_pred_tokens"]:
        draft = LlamaPromptLookupDecoding(
            max_ngram_size=job["max_ngram_size"], num_pred_tokens=job["num_pred_tokens"]
        )
    threads = int(job["threads"])
    llm = lc.Llama(
        model_path=job["model"],
        n_ctx=job["n_ctx"],
        n_batch=N_UBATCH,
        n_threads=threads,
        n_threads_batch=threads,
        draft_model=draft,
        # Said here too: with a draft model llama-cpp-python computes every row's logits but
        # sizes their buffer by this argument, which then overflows past n_batch positions.
        logits_all=draft is not None,
        verbose=False,
    )
    stops, max_tokens = set(job["stop_ids"]), int(job["max_tokens"])
    results = []
    for prompt in job["prompts"]:
        tokens: list[int] = []
        first = 0.0
        for token in llm.generate(prompt, temp=0.0, reset=True):
            if not tokens:
                first = time.perf_counter()
            tokens.append(int(token))
            if token in stops or len(tokens) >= max_tokens:
                break
        results.append({"tokens": tokens, "decode_seconds": time.perf_counter() - first})
    return {"results": results, "version": lc.__version__, "threads": threads}


def new_context(model: Any, n_ctx: int, n_seq: int, threads: int, unified: bool) -> Any:
    """A context for `n_seq` sequences over `n_ctx` tokens in all (llama-server's settings).

    Not unified (llama-server's default for `-np N`), each sequence gets n_ctx / n_seq cells
    of its own and attends over those only; unified, all share one buffer of n_ctx cells.
    """
    params = lc.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = N_BATCH
    params.n_ubatch = N_UBATCH
    params.n_seq_max = n_seq
    params.n_threads = threads
    params.n_threads_batch = threads
    if _kv_unified_supported():
        params.kv_unified = unified
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens")
    return ctx


def generate(ctx: Any, n_vocab: int, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Run every sequence to `max_tokens`; the clock covers prefill and decode."""
    sequences = [Sequence(seq_id, list(prompt)) for seq_id, prompt in enumerate(prompts)]
    batch = lc.llama_batch_init(N_BATCH, 0, 1)
    steps = 0
    try:
        started = time.perf_counter()
        while any(len(s.generated) < max_tokens for s in sequences):
            rows = fill_batch(batch, sequences, max_tokens)
            status = lc.llama_decode(ctx, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status} at step {steps}")
            steps += 1
            if rows:
                logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(len(rows), n_vocab))
                now = time.perf_counter() - started
                for sequence, token in zip(rows, logits.argmax(axis=1).tolist(), strict=True):
                    if sequence.first_token_at is None:
                        sequence.first_token_at = now
                    sequence.generated.append(token)
        seconds = time.perf_counter() - started
    finally:
        lc.llama_batch_free(batch)
    return {
        "generated_tokens": sum(len(s.generated) for s in sequences),
        "seconds": seconds,
        "first_token_seconds": [s.first_token_at for s in sequences],
        "decode_calls": steps,
        "first_generated": sequences[0].generated[:8],
    }


def fill_batch(batch: Any, sequences: list[Sequence], max_tokens: int) -> list[Sequence]:
    """Put each generating sequence's last token in the batch, then prompt tokens up to
    n_batch (llama-server's order); return the sequences of the output rows, in row order."""
    rows: list[Sequence] = []
    n = 0

    def add(sequence: Sequence, token: int, position: int, output: bool) -> None:
        nonlocal n
        batch.token[n] = token
        batch.pos[n] = position
        batch.n_seq_id[n] = 1
        batch.seq_id[n][0] = sequence.seq_id
        batch.logits[n] = int(output)
        if output:
            rows.append(sequence)
        n += 1

    for sequence in sequences:
        if sequence.generated and len(sequence.generated) < max_tokens:
            add(sequence, sequence.generated[-1], sequence.position, True)
    for sequence in sequences:
        while sequence.prefilled < len(sequence.prompt) and n < N_BATCH:
            index = sequence.prefilled
            last = index == len(sequence.prompt) - 1
            add(sequence, sequence.prompt[index], index, last)
            sequence.prefilled += 1
        if n == N_BATCH:
            break
    batch.n_tokens = n
    return rows


def _kv_unified_supported() -> bool:
    return any(name == "kv_unified" for name, *_ in lc.llama_context_params._fields_)


def main() -> int:
    """Jobs from stdin, one JSON per line; results (or {"error": ...}) to stdout."""
    results = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever llama.cpp prints: stderr
    if lc is None:
        error = f"no llama_cpp in {sys.executable}: pip install llama-cpp-python there"
        results.write(json.dumps({"error": error}) + "\n")
        return 1
    worker = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = worker.run(json.loads(line))
        except Exception as error:  # reported to the parent, which decides
            reply = {"error": f"{type(error).__name__}: {error}"}
        results.write(json.dumps(reply) + "\n")
        results.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
