"""argparse types shared by the subcommands: numbers checked at parse time, with messages
that name the bad value."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    value = _number(text, int)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    value = _number(text, float)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {text}")
    return value


def token_counts(text: str) -> list[int]:
    """argparse type: comma-separated token counts, `k` meaning 1024 (`2k,8k,100000`)."""
    counts = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        counts.append(positive_int(part.removesuffix("k")) * scale)
    return counts


def _number(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
