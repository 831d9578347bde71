"""`pagedkv perplexity`: a model's perplexity on a text file, by llama.cpp's method.

As `llama-perplexity` does, the text is tokenised whole and cut into windows of `--n-ctx`
tokens, each starting with the BOS token when the model has one; each window is run from an
empty cache and only the second half of its tokens is scored (each from at least n_ctx / 2
tokens of context), so the figure is comparable across models and with llama.cpp's. The
windows go through the same paged KV cache and attention as serving, in pieces of
`--max-num-batched-tokens` tokens, asking logits only of the scored positions.

Prints the perplexity, tokens scored and tokens/s: run it once per `--quantization` to
measure what quantised weights cost in accuracy, or per `--kv-cache-dtype` for an fp8 cache.

Of the engine's flags it acts on those in `ENGINE_FIELDS`; any other set off its default is
refused before the model loads, since a pool size, a scheduler, sampling, LoRA or tensor
parallelism have nothing to act on here and a flag silently ignored reads as one that acted.
The rule is by exclusion, so a flag added to `EngineArgs` later is refused until used here.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The `EngineArgs` fields `run` reads: the model as loaded, the threads, and the cache and
# pieces each window runs through.
ENGINE_FIELDS = frozenset(
    {
        "model",
        "dtype",
        "device",
        "quantization",
        "revision",
        "threads",
        "block_size",
        "max_num_batched_tokens",
        "kv_cache_dtype",
    }
)


def window_length(text: str) -> int:
    """argparse type of --n-ctx: at least 4 tokens (half of a window is context, half scored)."""
    from pagedkv.commands.arguments import positive_int

    value = positive_int(text)
    if value < 4:
        raise argparse.ArgumentTypeError(f"must be at least 4, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The text file, window size and the engine flags perplexity acts on (the others are
    parsed, to be refused by name, but left out of --help)."""
    from pagedkv.commands.arguments import positive_int
    from pagedkv.engine.args import EngineArgs

    parser.add_argument("file", type=Path, help="UTF-8 text file to score")
    parser.add_argument(
        "--n-ctx",
        type=window_length,
        default=512,
        help="tokens per window, at least 4 (default 512)",
    )
    parser.add_argument(
        "--max-windows", type=positive_int, default=None, help="score only the first N windows"
    )
    EngineArgs.add_cli_args(parser)
    refusable = {field.name for field in fields(EngineArgs)} - ENGINE_FIELDS
    for action in parser._actions:
        if action.dest in refusable:
            action.help = argparse.SUPPRESS
        elif action.dest == "max_num_batched_tokens":  # the engine's text speaks of steps
            action.help = "tokens per forward pass: a window runs in pieces of this many"
            action.help += " (default: %(default)s)"
    parser.epilog = (
        "The engine's other flags (KV pool size, scheduling, context length: --n-ctx sets the "
        "window, sampling, speculative decoding, LoRA, tensor parallelism) do not apply to "
        "perplexity and are refused."
    )


def run(args: argparse.Namespace) -> int:
    """Score the file and print perplexity, tokens scored and speed."""
    import torch

    from pagedkv.commands.arguments import engine_flags_given
    from pagedkv.engine.args import EngineArgs, cli_flag, flag_error
    from pagedkv.engine.errors import STARTUP_ERRORS
    from pagedkv.weights.load import load
    from pagedkv.worker.threads import physical_cores

    refused = engine_flags_given(args, keep=ENGINE_FIELDS)
    if refused:
        used = ", ".join(cli_flag(f.name) for f in fields(EngineArgs) if f.name in ENGINE_FIELDS)
        print(
            f"pagedkv perplexity: error: {', '.join(refused)} "
            f"{'does' if len(refused) == 1 else 'do'} not apply to perplexity (it runs the "
            "base model in this one process on one window of --n-ctx tokens at a time, each "
            "through a KV cache sized for it, and samples nothing); the engine flags it uses "
            f"are {used}",
            file=sys.stderr,
        )
        return 2
    try:
        engine_args = EngineArgs.from_cli_args(args)
        text = _read_text(args.file)
        torch.set_num_threads(engine_args.threads or physical_cores())
        loaded = load(
            engine_args.model,
            dtype=engine_args.resolved_dtype,
            device=engine_args.device,
            quantization=engine_args.quantization,
            revision=engine_args.revision,
            progress=lambda line: print(line, file=sys.stderr),
        )
    except STARTUP_ERRORS as error:
        print(f"pagedkv perplexity: error: {flag_error(error)}", file=sys.stderr)
        return 2
    context = loaded.config.max_position_embeddings
    if args.n_ctx > context:
        print(
            f"pagedkv perplexity: error: --n-ctx {args.n_ctx} is beyond the model's context of "
            f"{context} tokens (max_position_embeddings)",
            file=sys.stderr,
        )
        return 2
    try:
        result = perplexity(
            loaded.model,
            loaded.tokenizer,
            text,
            n_ctx=args.n_ctx,
            max_windows=args.max_windows,
            block_size=engine_args.block_size,
            max_num_batched_tokens=engine_args.max_num_batched_tokens,
            kv_cache_dtype=engine_args.kv_cache_dtype,
            progress=lambda line: print(line, file=sys.stderr),
        )
    except ValueError as error:
        print(f"pagedkv perplexity: error: {args.file}: {error}", file=sys.stderr)
        return 2
    print(
        f"perplexity {result.perplexity:.4f} over {result.scored} tokens scored "
        f"({result.windows} windows of {args.n_ctx}); {result.tokens_per_s:.1f} tokens/s; "
        f"model {loaded.name}, quantization {engine_args.quantization}, "
        f"kv_cache_dtype {engine_args.kv_cache_dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    return 0


@dataclass(frozen=True)
class Perplexity:
    """exp(mean negative log-likelihood) of the scored tokens, and how it was measured."""

    perplexity: float
    scored: int  # tokens scored
    windows: int
    tokens_per_s: float  # tokens run through the model (every window's) per second


def perplexity(
    model,
    tokenizer,
    text: str,
    *,
    n_ctx: int = 512,
    max_windows: int | None = None,
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    kv_cache_dtype: str = "auto",
    progress: Callable[[str], None] = lambda line: None,
) -> Perplexity:
    """Score `text` with `model` by llama.cpp's method (see the module docstring), its KV
    stored as `kv_cache_dtype` says (vLLM's values)."""
    from pagedkv.worker.kv_cache import kv_cache_torch_dtype

    if n_ctx < 4:
        raise ValueError(f"n_ctx must be at least 4, got {n_ctx}")
    tokens = tokenizer.encode(text, add_special_tokens=False)
    windows = len(tokens) // n_ctx
    if max_windows is not None:
        windows = min(windows, max_windows)
    if windows == 0:
        raise ValueError(f"{len(tokens)} tokens are fewer than one window of n_ctx {n_ctx}")
    bos = tokenizer.bos_token_id
    started = time.perf_counter()
    kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, model.dtype)
    total_nll, scored = 0.0, 0
    for index in range(windows):
        window = tokens[index * n_ctx : (index + 1) * n_ctx]
        if bos is not None:
            window[0] = bos
        nll, count = score_window(model, window, block_size, max_num_batched_tokens, kv_dtype)
        total_nll += nll
        scored += count
        progress(f"[{index + 1}/{windows}] perplexity so far {math.exp(total_nll / scored):.4f}")
    seconds = time.perf_counter() - started
    return Perplexity(math.exp(total_nll / scored), scored, windows, windows * n_ctx / seconds)


def score_window(
    model,
    window: list[int],
    block_size: int,
    max_num_batched_tokens: int,
    kv_dtype: torch.dtype | None = None,
) -> tuple[float, int]:
    """Negative log-likelihood summed over the second half of `window`, and its count.

    Position `i` (from `n_ctx / 2` on) predicts token `i + 1`; the window runs in pieces of
    `max_num_batched_tokens` through a paged cache just large enough for it, storing
    `kv_dtype` (default: the model's).
    """
    import torch

    from pagedkv.attention.batch import ForwardBatch, SequenceInput
    from pagedkv.worker.kv_cache import KVCache

    table = list(range(-(-len(window) // block_size)))
    cache = KVCache.for_model(model, block_size=block_size, num_blocks=len(table), dtype=kv_dtype)
    first = len(window) // 2
    nll, count = 0.0, 0
    step = max_num_batched_tokens
    for start in range(0, len(window) - 1, step):
        piece = window[start : start + step]
        # Logits of the positions in this piece that are scored and have a next token.
        scored_from = max(first, start)
        last = min(start + len(piece), len(window) - 1)
        num_logits = max(0, last - scored_from)
        batch = ForwardBatch.build(
            [
                SequenceInput(
                    piece, start, table, num_logits=num_logits + (start + len(piece) - last)
                )
            ],
            block_size,
            device=model.device,
        )
        logits = model(batch, cache)
        if num_logits == 0:
            continue
        logits = logits[:num_logits]
        targets = torch.tensor(window[scored_from + 1 : last + 1], device=logits.device)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        nll -= log_probs.gather(1, targets.unsqueeze(1)).sum().item()
        count += num_logits
    return nll, count


def _read_text(path: Path) -> str:
    """The file's UTF-8 text; a ValueError naming the file otherwise."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot read it ({error.strerror or error})") from None
