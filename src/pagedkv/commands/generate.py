"""`pagedkv generate`: one prompt (or one chat message) through the engine, streamed.

Text is printed as the engine produces it, piece by piece; with `--n` above 1 each sample is
printed whole once all are done. Timing and KV figures go to stderr, so stdout holds only
the completion.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--prompt or --chat, sampling flags and engine flags."""
    from pagedkv.commands.sampling_args import add_sampling_args
    from pagedkv.engine.args import EngineArgs

    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text to continue")
    source.add_argument("--chat", help="a user message, answered with the model's chat template")
    parser.add_argument("--system", default=None, help="system message for --chat")
    add_sampling_args(parser, max_tokens=256)
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    """Load the model, stream the completion, report speed on stderr."""
    from pagedkv.commands.sampling_args import sampling_params_from_args
    from pagedkv.engine import Engine, EngineArgs
    from pagedkv.model.errors import ModelError

    try:
        params = sampling_params_from_args(args)
        engine = Engine(EngineArgs.from_cli_args(args))
        if args.chat is not None:
            messages = [{"role": "user", "content": args.chat}]
            if args.system is not None:
                messages.insert(0, {"role": "system", "content": args.system})
            prompt: str | list[int] = engine.tokenizer.encode_chat(messages)
        else:
            prompt = args.prompt
        engine.add_request("cli", prompt, params)
    except (ValueError, ModelError, OSError) as error:
        print(f"pagedkv generate: {error}", file=sys.stderr)
        return 2
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
    print(
        f"[{num_tokens} tokens in {elapsed:.2f} s, {num_tokens / elapsed:.1f} tokens/s; "
        f"finish: {', '.join(str(finish_reasons[i]) for i in sorted(finish_reasons))}]",
        file=sys.stderr,
    )
    return 0
