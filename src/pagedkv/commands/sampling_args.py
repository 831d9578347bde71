"""Sampling flags shared by `pagedkv generate` and `pagedkv chat`: one per SamplingParams field.

The flags mirror the Python names (`max_tokens` -> `--max-tokens`; a field that defaults to
True is turned off by its `--no-` form, `--no-skip-special-tokens`); values are checked by
`SamplingParams` itself, so the command line and the API reject the same things. There is no
per-request `--seed`: a command runs one engine, whose own `--seed` already fixes sampling.
"""

from __future__ import annotations

import argparse

from pagedkv.commands.arguments import non_negative_int, positive_int


def add_sampling_args(
    parser: argparse.ArgumentParser, *, max_tokens: int, samples: bool = True
) -> None:
    """Add `--temperature`, `--max-tokens`, ... with the API's defaults (greedy here).

    `samples=False` leaves out `--n` (n is 1) for a command that shows one answer per prompt.
    """
    group = parser.add_argument_group("sampling")
    if samples:
        group.add_argument("--n", type=positive_int, default=1, help="samples per prompt")
    else:
        parser.set_defaults(n=1)
    group.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)"
    )
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0 = all)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop below min_p x the top")
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument(
        "--max-tokens", type=positive_int, default=max_tokens, help="default: %(default)s"
    )
    group.add_argument("--min-tokens", type=non_negative_int, default=0)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument(
        "--stop-token-ids", type=non_negative_int, nargs="+", default=None, metavar="ID"
    )
    group.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-text")
    group.add_argument(
        "--skip-special-tokens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="leave special tokens such as <s> out of the text (default: %(default)s)",
    )
    group.add_argument(
        "--include-stop-str-in-output",
        action="store_true",
        help="end the text with the stop string (or stop token's text) that ended it",
    )
    group.add_argument(
        "--bad-words",
        action="append",
        default=None,
        metavar="WORD",
        help="a word whose tokens are never completed (repeatable)",
    )
    # Any integer: SamplingParams refuses 0 and below -1, so `-1` (vLLM's "all that fits")
    # passes, which positive_int would refuse.
    group.add_argument(
        "--truncate-prompt-tokens",
        type=int,
        default=None,
        metavar="N",
        help="keep only the prompt's last N tokens (-1: as many as the context holds with "
        "room for one more); in chat, the last N of the whole conversation, so its oldest "
        "turns and the system message drop out of view once it is longer",
    )


def sampling_params_from_args(args: argparse.Namespace):
    """SamplingParams from the parsed flags (raises ValueError naming a bad value)."""
    from pagedkv.engine import SamplingParams

    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        skip_special_tokens=args.skip_special_tokens,
        include_stop_str_in_output=args.include_stop_str_in_output,
        bad_words=args.bad_words,
        truncate_prompt_tokens=args.truncate_prompt_tokens,
    )
