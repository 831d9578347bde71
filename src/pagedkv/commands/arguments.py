"""argparse types shared by the subcommands: numbers checked at parse time, with messages
that name the bad value. Every float must be finite: `inf` and `nan` parse as floats, and
would otherwise surface later as an OverflowError or a silently wrong answer."""

from __future__ import annotations

import argparse
import json
import math

from pagedkv.kvmath.spec import GB


def string_list(text: str) -> list[str]:
    """argparse type: a JSON list of strings, as vLLM's list flags take them
    (`--allowed-origins '["https://a.example"]'`)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    value = _number(text, int)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free one) to 65535."""
    value = _number(text, int)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _number(text, float)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {text}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    value = _number(text, float)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def positive_fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def positive_gb(text: str) -> float:
    """argparse type: a size in GB > 0 whose byte count is a finite number."""
    return _bytes_fit(positive_float(text), text)


def non_negative_gb(text: str) -> float:
    """argparse type: a size in GB >= 0 whose byte count is a finite number."""
    return _bytes_fit(non_negative_float(text), text)


def token_counts(text: str) -> list[int]:
    """argparse type: comma-separated token counts, `k` meaning 1024 (`2k,8k,100000`), or a
    JSON list of them (what a `--config` file's `lengths: [2k, 8192]` is read as)."""
    parts = text.split(",")
    if text.strip().startswith("["):
        try:
            parts = [str(item) for item in json.loads(text)]
        except json.JSONDecodeError:
            parts = []
        if not parts:
            raise argparse.ArgumentTypeError(f"not a list of token counts: {text!r}")
    counts = []
    for part in parts:
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        counts.append(positive_int(part.removesuffix("k")) * scale)
    return counts


def _number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _bytes_fit(gigabytes: float, text: str) -> float:
    # 1e300 GB is a finite float, but not once multiplied into bytes.
    if not math.isfinite(gigabytes * GB):
        raise argparse.ArgumentTypeError(f"too large a size: {text} GB")
    return gigabytes


def engine_flags_given(
    args: argparse.Namespace,
    keep: frozenset[str] = frozenset(),
    defaults: dict[str, object] | None = None,
) -> list[str]:
    """The engine flags outside `keep` that the command line set off their defaults (the
    field's, or the command's own in `defaults`), as typed: a switched-off boolean as
    `--no-...`. A command refuses them where they have nothing to act on, since a flag
    silently ignored reads as one that acted. The parsed values are compared, not an
    `EngineArgs`, whose aliases (`--swap-space`) also change the field they alias."""
    from dataclasses import fields

    from pagedkv.engine.args import EngineArgs, cli_flag

    defaults = defaults or {}
    return [
        cli_flag(field.name, negated=getattr(args, field.name) is False)
        for field in fields(EngineArgs)
        if field.name not in keep
        and getattr(args, field.name) != defaults.get(field.name, field.default)
    ]


class KeysAction(argparse.Action):
    """`--api-key KEY`, repeatable: the keys typed replace the environment's default, and an
    empty or blank key (an unset variable in a script) is refused, never an open server."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        value: object,
        option_string: str | None = None,
    ) -> None:
        if not str(value).strip():
            parser.error(f"{option_string}: a key must not be empty")
        keys = getattr(namespace, self.dest)
        keys = [] if keys is None or keys is self.default else keys
        setattr(namespace, self.dest, [*keys, value])
