"""`pagedkv generate`: one prompt (or one chat message) through the engine, streamed.

Text is printed as the engine produces it, piece by piece; with `--n` above 1 each sample is
printed whole once all are done. Timing and KV figures go to stderr, so stdout holds only
the completion.

One request needs a few hundred tokens of KV, not the memory-based pool of a server: unless a
pool size is given, the pool holds what this request can use (`blocks_for_request`), so the
command neither reserves gigabytes nor ever preempts.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.engine import Engine, EngineArgs, SamplingParams
    from pagedkv.weights.load import LoadedModel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--prompt or --chat, sampling flags and engine flags."""
    from pagedkv.commands.sampling_args import add_sampling_args
    from pagedkv.engine.args import EngineArgs

    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text to continue")
    source.add_argument("--chat", help="a user message, answered with the model's chat template")
    parser.add_argument("--system", default=None, help="system message for --chat (only)")
    add_sampling_args(parser, max_tokens=256)
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    """Load the model, stream the completion, report speed on stderr."""
    from pagedkv.commands.sampling_args import sampling_params_from_args
    from pagedkv.engine import Engine, EngineArgs
    from pagedkv.engine.args import flag_error
    from pagedkv.engine.errors import STARTUP_ERRORS
    from pagedkv.weights.load import load

    if args.system is not None and args.chat is None:
        message = "--system needs --chat (a --prompt has no messages)"
        print(f"pagedkv generate: error: {message}", file=sys.stderr)
        return 2
    engine = loaded = None
    try:
        sampling_params_from_args(args)  # a bad flag is named before the model loads
        engine_args = EngineArgs.from_cli_args(args)
        if engine_args.tensor_parallel_size > 1:  # every rank loads its own shard: the engine
            engine = Engine(engine_args)  # loads, and sizes its pool from memory
            tokenizer, defaults = engine.tokenizer, engine.sampling_defaults
        else:
            spec = engine_args.load_spec()
            loaded = load(spec.model, device=spec.device, **spec.load_options())
            tokenizer, defaults = loaded.tokenizer, engine_args.sampling_defaults(loaded.path)
        params = sampling_params_from_args(args, defaults)
        if args.chat is not None:
            messages = [{"role": "user", "content": args.chat}]
            if args.system is not None:
                messages.insert(0, {"role": "system", "content": args.system})
            prompt: str | list[int] = tokenizer.encode_chat(messages)
        else:
            prompt = args.prompt
        if loaded is not None:
            if engine_args.num_gpu_blocks is None and engine_args.kv_cache_memory is None:
                engine_args.num_gpu_blocks = blocks_for_request(engine_args, prompt, params, loaded)
            engine = Engine(engine_args, loaded=loaded)
        engine.add_request("cli", prompt, params)
    except STARTUP_ERRORS as error:
        if engine is not None:
            engine.shutdown()
        print(f"pagedkv generate: error: {flag_error(error)}", file=sys.stderr)
        return 2
    try:
        return _stream(engine, params)
    finally:
        engine.shutdown()  # ends the tensor-parallel workers, if any


def _stream(engine: Engine, params: SamplingParams) -> int:
    """Step until the request finishes, printing its text; the figures go to stderr."""
    started = time.perf_counter()
    samples: dict[int, list[str]] = {}
    num_tokens = 0
    finish_reasons: dict[int, str | None] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            for output in delta.outputs:
                num_tokens += len(output.token_ids)
                samples.setdefault(output.index, []).append(output.text)
                finish_reasons[output.index] = output.finish_reason
                if params.n == 1:
                    sys.stdout.write(output.text)
                    sys.stdout.flush()
    if params.n == 1:
        sys.stdout.write("\n")
    else:
        for index in sorted(samples):
            print(f"--- sample {index} ({finish_reasons[index]}) ---")
            print("".join(samples[index]))
    elapsed = time.perf_counter() - started
    spec = engine.stats.spec_decoding
    print(
        f"[{num_tokens} tokens in {elapsed:.2f} s, {num_tokens / elapsed:.1f} tokens/s; "
        f"finish: {', '.join(str(finish_reasons[i]) for i in sorted(finish_reasons))}"
        + (f"; {spec.describe()}]" if spec.enabled else "]"),
        file=sys.stderr,
    )
    return 0


def blocks_for_request(
    engine_args: EngineArgs,
    prompt: str | list[int],
    params: SamplingParams,
    loaded: LoadedModel,
) -> int:
    """KV blocks that one request's samples can fill: each sample's prompt (as admission
    tokenizes and truncates it) and output, up to the model length, plus one block each for the
    slot the scheduler reserves ahead."""
    from pagedkv.engine.admission import tokenize, truncate
    from pagedkv.kvmath.spec import served_context

    context = served_context(engine_args.max_model_len, loaded.config.max_position_embeddings)
    _, token_ids = tokenize(loaded.tokenizer, prompt, loaded.config.vocab_size)
    prompt_len = len(truncate(token_ids, params, context))
    max_tokens = params.max_tokens if params.max_tokens is not None else context
    tokens = min(prompt_len + max_tokens, context)
    return params.n * (-(-tokens // engine_args.block_size) + 1)
