"""Sampling flags shared by `pagedkv generate` and `pagedkv chat`: one per SamplingParams field.

The flags mirror the Python names (`max_tokens` -> `--max-tokens`; a field that defaults to
True is turned off by its `--no-` form, `--no-skip-special-tokens`); values are checked by
`SamplingParams` itself, so the command line and the API reject the same things. There is no
per-request `--seed`: a command runs one engine, whose own `--seed` already fixes sampling.

A field the model's generation config sets (`Engine.sampling_defaults`: its
generation_config.json, `--generation-config`, `--override-generation-config`) and the command
line leaves out takes the model's value, as a server request leaving it out does; the engine
prints those defaults at start-up. Otherwise the command's own default holds: greedy.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from pagedkv.commands.arguments import non_negative_int, positive_int

# SamplingParams fields the flags give.
FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "bad_words",
    "truncate_prompt_tokens",
)
# The commands' defaults of the fields a generation config may set (`max_tokens` is each
# command's own): greedy decoding, nothing cut.
FALLBACKS: dict[str, Any] = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def add_sampling_args(
    parser: argparse.ArgumentParser, *, max_tokens: int, samples: bool = True
) -> None:
    """Add `--temperature`, `--max-tokens`, ...: those a generation config may set default to
    None (the model's value, else FALLBACKS' or `max_tokens`), the rest to the API's.

    `samples=False` leaves out `--n` (n is 1) for a command that shows one answer per prompt.
    """
    group = parser.add_argument_group(
        "sampling", "unset, a field the model's generation config sets takes its value"
    )
    parser.set_defaults(fallback_max_tokens=max_tokens)
    if samples:
        group.add_argument("--n", type=positive_int, default=1, help="samples per prompt")
    else:
        parser.set_defaults(n=1)
    group.add_argument("--temperature", type=float, help="0 = greedy (else: 0)")
    group.add_argument("--top-p", type=float, help="nucleus mass to keep (else: 1)")
    group.add_argument("--top-k", type=int, help="keep the k most likely (else: 0 = all)")
    group.add_argument("--min-p", type=float, help="drop below min_p x the top (else: 0)")
    group.add_argument("--repetition-penalty", type=float, help="else: 1")
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--max-tokens", type=positive_int, help=f"else: {max_tokens}")
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


def sampling_params_from_args(
    args: argparse.Namespace, model_defaults: Mapping[str, Any] | None = None
):
    """SamplingParams from the parsed flags, a field left unset taken from `model_defaults`
    (`Engine.sampling_defaults`), else the command's default (raises ValueError naming a bad
    value; without `model_defaults`, it checks the flags before the model loads)."""
    from pagedkv.engine import SamplingParams

    fallbacks = {**FALLBACKS, "max_tokens": args.fallback_max_tokens, **(model_defaults or {})}
    fields = {name: getattr(args, name) for name in FIELDS}
    for name, value in fallbacks.items():
        if fields.get(name) is None:
            fields[name] = value
    return SamplingParams(**fields)
