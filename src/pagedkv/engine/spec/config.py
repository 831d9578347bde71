"""SpeculativeConfig: vLLM's `speculative_config`, read and checked once, when the engine starts.

Two methods, as vLLM names them:
- "ngram" (prompt lookup): the drafts are the tokens that followed the sequence's last n tokens
  (n from `prompt_lookup_max` down to `prompt_lookup_min`) where they occurred earlier in its
  prompt or output, in the context most like its own (`ngram.py`). No second model;
  input-grounded work (quoting, editing, summarising) accepts many of them.
- "draft_model": a smaller model of the registry with the same vocabulary drafts greedily.

`{"model": "ngram"}` is vLLM's older spelling of the first (and vLLM fills in that model for
the method, so a config it wrote out names both); a `model` without a `method` means a draft
model. A draft model may name its own `quantization` (pagedkv's: auto, none, int8, int4; the
engine's otherwise); vLLM's `draft_tensor_parallel_size` is taken at 1 (the draft runs whole
on rank 0), and its `revision` picks the snapshot of a draft named by a Hub repo id in the
local Hugging Face cache (as the model's does; nothing is fetched). Every other key, and
every other method (eagle, medusa, mtp...), is refused by name: a setting that silently did
nothing would be a wrong answer to whoever set it.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.quant.schemes import QUANTIZATIONS

SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's default n-gram size when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "quantization",
    "draft_tensor_parallel_size",
    "revision",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How many tokens each step drafts per sequence, and how."""

    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP  # ngram: shortest suffix looked up
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP  # ngram: longest suffix looked up
    model: str | None = None  # draft_model: a folder, .gguf file, built-in name or repo id
    quantization: str | None = None  # draft_model: how its weights are kept (None: the engine's)
    revision: str | None = None  # draft_model named by a repo id: its snapshot (None: main)

    @classmethod
    def parse(
        cls, raw: SpeculativeConfig | Mapping[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """A config from vLLM's dict (or its JSON text, as `--speculative-config` takes it);
        None for None. Raise ValueError naming the key or value that is wrong."""
        if raw is None:
            return None
        if isinstance(raw, SpeculativeConfig):  # built by hand: checked as its dict would be
            raw = raw._as_mapping()
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from error
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"speculative_config must be a dict (JSON object), got {type(raw).__name__}"
            )
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ValueError(
                f"speculative_config key {unknown[0]!r} is not supported (supported: "
                f"{', '.join(_KEYS)})"
            )
        method, model = raw.get("method"), raw.get("model")
        if method in (None, "ngram") and model in ("ngram", "[ngram]"):
            method, model = "ngram", None
        elif method is None and model is not None:
            method = "draft_model"
        if method is None:
            raise ValueError(
                'speculative_config names neither a method nor a model: give "method": '
                '"ngram" (prompt lookup) or "model": a draft model\'s folder, .gguf file or '
                "built-in name"
            )
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method {method!r} is not supported (supported: "
                f"{', '.join(SPECULATIVE_METHODS)})"
            )
        if raw.get("draft_tensor_parallel_size", 1) != 1:
            raise ValueError(
                "speculative_config draft_tensor_parallel_size must be 1 (the draft model runs "
                f"whole on rank 0), got {raw['draft_tensor_parallel_size']!r}"
            )
        k = _count(raw, "num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config num_speculative_tokens must be an integer >= 1")
        if method == "draft_model":
            return cls._draft_model(raw, model, k)
        return cls._ngram(raw, model, k)

    @classmethod
    def _ngram(cls, raw: Mapping[str, Any], model: object, k: int) -> SpeculativeConfig:
        if model is not None:
            raise ValueError(f"speculative_config method 'ngram' takes no model, got {model!r}")
        for name in ("quantization", "revision"):
            if raw.get(name) is not None:
                raise ValueError(f"speculative_config {name} applies to a draft model only")
        low, high = _count(raw, "prompt_lookup_min"), _count(raw, "prompt_lookup_max")
        # vLLM's defaults: one bound given stands for both; neither, 5 and 5.
        low = low if low is not None else high if high is not None else DEFAULT_PROMPT_LOOKUP
        high = high if high is not None else low
        if low > high:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({low}) must be <= prompt_lookup_max "
                f"({high})"
            )
        return cls("ngram", k, prompt_lookup_min=low, prompt_lookup_max=high)

    @classmethod
    def _draft_model(cls, raw: Mapping[str, Any], model: object, k: int) -> SpeculativeConfig:
        if not isinstance(model, str) or not model:
            raise ValueError(
                "speculative_config method 'draft_model' needs a model (a folder, .gguf file or "
                f"built-in name), got {model!r}"
            )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if name in raw:
                raise ValueError(f"speculative_config {name} applies to method 'ngram' only")
        quantization = raw.get("quantization")
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(
                f"speculative_config quantization must be one of {', '.join(QUANTIZATIONS)} "
                f"(or None: the engine's), got {quantization!r}"
            )
        revision = raw.get("revision")
        if revision is not None and not isinstance(revision, str):
            raise ValueError(f"speculative_config revision must be a string, got {revision!r}")
        return cls("draft_model", k, model=model, quantization=quantization, revision=revision)

    def _as_mapping(self) -> dict[str, Any]:
        """vLLM's dict of this config: what `parse` reads."""
        raw: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.model is not None:
            raw["model"] = self.model
        if self.quantization is not None:
            raw["quantization"] = self.quantization
        if self.revision is not None:
            raw["revision"] = self.revision
        lookup = (self.prompt_lookup_min, self.prompt_lookup_max)
        if self.method != "draft_model" or lookup != (DEFAULT_PROMPT_LOOKUP,) * 2:
            raw["prompt_lookup_min"], raw["prompt_lookup_max"] = lookup  # a draft model's refused
        return raw

    def describe(self) -> str:
        """One line for the start-up report."""
        if self.method == "ngram":
            sizes = f"{self.prompt_lookup_min}-{self.prompt_lookup_max}"
            return f"ngram (prompt lookup of {sizes} tokens), {self.num_speculative_tokens} drafts"
        return f"draft model {self.model}, {self.num_speculative_tokens} drafts"


def _count(raw: Mapping[str, Any], name: str) -> int | None:
    """`raw[name]` as an int >= 1 (any integer type, numpy's too, as vLLM's pydantic takes
    them), None when absent; a ValueError naming the key otherwise."""
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
    return int(value)
