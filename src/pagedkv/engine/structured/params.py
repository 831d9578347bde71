"""StructuredOutputsParams: the constraint one request's output must satisfy (vLLM's shape).

Exactly one kind is set: a JSON schema (`json`, a dict or its JSON text), a regular
expression, a list of choices, a grammar (Lark or GBNF text), or `json_object=True` (any JSON
object). The kind and its value are checked here for shape only; whether a schema or a regex
compiles is checked when the request is added (`grammar.grammar_spec`), so a bad one is
refused there with the grammar engine's own message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's `StructuredOutputsParams` fields)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's switches, accepted for what pagedkv always does: JSON without free whitespace
    # (`grammar.JSON_OPTIONS`), objects held to their declared properties (`closed_objects`),
    # one grammar backend (nothing to fall back to). True and False give the same grammar.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    # vLLM's options pagedkv does not implement: refused when set, rather than ignored.
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported: JSON is written "
                "without free whitespace"
            )
        if self.structural_tag is not None:
            raise ValueError(
                "structured_outputs.structural_tag is not supported: one of json, regex, "
                "choice, grammar, json_object constrains the whole output"
            )
        set_kinds = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {set_kinds or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(f"structured_outputs.json must be a dict or a string: {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            choices = self.choice
            if not isinstance(choices, list | tuple) or not choices:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if not all(isinstance(choice, str) for choice in choices):
                raise ValueError(f"structured_outputs.choice must hold strings, got {choices!r}")
            self.choice = list(choices)
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"structured_outputs.{name} must be a bool: {getattr(self, name)!r}"
                )
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool: {self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of `KINDS`."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> str:
        """A text naming the constraint exactly: what compiled grammars are cached by."""
        value = getattr(self, self.kind)
        if isinstance(value, dict | list):
            value = json.dumps(value)  # key order kept: it orders the output too
        return f"{self.kind}:{value}"


@dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's name for the class before 0.10.2 (with SamplingParams' `guided_decoding`), and
    its `backend` field: older vLLM code builds it, and gets the same constraints. One grammar
    engine (llguidance) serves whichever backend is named."""

    backend: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend is not None and not isinstance(self.backend, str):
            raise ValueError(f"guided_decoding.backend must be a string: {self.backend!r}")
