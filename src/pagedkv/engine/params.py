"""SamplingParams: how one request's tokens are chosen and when its output stops.

The fields and their defaults are vLLM's, so code written against vLLM's `SamplingParams`
runs unchanged. Values are checked when the object is made: a bad value raises `ValueError`
naming the parameter and the value, before the request reaches the engine. Fields may still be
changed afterwards (`sp.stop = [...]`), as vLLM allows, so the engine takes a `clone()` when a
request is added: the checks and derived values run again on what the fields hold then, and
later changes to the caller's object do not reach the queued request.
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pagedkv.engine.outputs import RequestOutputKind
from pagedkv.engine.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# A temperature above 0 is raised to at least this, as vLLM raises it: dividing logits by a
# near-zero number overflows to inf and turns sampling into NaNs.
MIN_TEMPERATURE = 1e-2
MAX_N = 1024


@dataclass
class SamplingParams:
    """Sampling, penalty and stop settings of one request (vLLM's names and defaults)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-k per prompt token (RequestOutput.prompt_logprobs)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # their token sequences are never completed
    # Keep only the prompt's last k tokens (-1: as many as max_model_len leaves room for).
    truncate_prompt_tokens: int | None = None
    # The output must match this JSON schema, regex, choice or grammar (one per request).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older name of structured_outputs (with GuidedDecodingParams), read as it.
    guided_decoding: StructuredOutputsParams | None = None
    # False: token ids only, no text (and no stop strings, whose matching needs the text).
    detokenize: bool = True
    # vLLM's fast-tokenizer path, which ours is, leaves the joins to the tokenizer's decoder,
    # so this changes nothing; accepted so vLLM code runs unchanged.
    spaces_between_special_tokens: bool = True
    # Carried with the request for code of the caller's own, as vLLM's (nothing here reads it).
    extra_args: dict[str, Any] | None = None
    # vLLM's field; its V1 engine refuses per-request logits processors, and so does this one.
    logits_processors: list[Any] | None = None
    # What a step reports of the request (vLLM's RequestOutputKind). None, the default: as the
    # engine reports, `Engine.step` deltas and `LLMEngine.step` (vLLM's) CUMULATIVE, vLLM's
    # default; `LLM.generate` returns whole outputs whatever it says.
    output_kind: RequestOutputKind | None = None
    # vLLM's: no deep copy of extra_args when a request's params are copied (`clone`).
    skip_clone: bool = False
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in _NUMBER_FIELDS:
            setattr(self, name, _plain_number(getattr(self, name)))
        self.stop_strings = _stop_strings(self.stop)
        self.stop = list(self.stop_strings)  # a list, as vLLM's (None and a string made one)
        ids = self.stop_token_ids
        self.stop_token_ids = _id_list("stop_token_ids", [] if ids is None else ids)
        _check_int("n", self.n, minimum=1, maximum=MAX_N)
        _check_number("temperature", self.temperature, minimum=0.0)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s, where logits / temperature overflow: raised to it "
                "(vLLM's rule)",
                self.temperature,
                MIN_TEMPERATURE,
            )
            self.temperature = MIN_TEMPERATURE
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("min_p", self.min_p, minimum=0.0, maximum=1.0)
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_number("presence_penalty", self.presence_penalty, minimum=-2.0, maximum=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, minimum=-2.0, maximum=2.0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)
        if self.seed == -1:  # vLLM's: no seed
            self.seed = None
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(2**63), maximum=2**64 - 1)
        # The engine's max_logprobs caps them; -1 is vLLM's "every token of the vocabulary",
        # which the engine reads as the vocabulary's size when the request is added.
        # A bool counts as vLLM counts it: True is 1, False is 0 (the sampled token's alone).
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))
            if getattr(self, name) not in (None, -1):
                _check_int(name, getattr(self, name), minimum=0)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _id_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            for token_id in self.allowed_token_ids:
                _check_int("allowed_token_ids", token_id, minimum=0)
        self.bad_words = _bad_words(self.bad_words)
        keep = self.truncate_prompt_tokens
        if keep is not None and (
            not isinstance(keep, int) or isinstance(keep, bool) or keep == 0 or keep < -1
        ):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {keep!r}")
        if self.logits_processors:
            raise ValueError(
                "logits_processors are not supported per request (vLLM's V1 engine refuses "
                "them too): logit_bias, allowed_token_ids, bad_words and structured_outputs "
                "shape the logits"
            )
        if self.guided_decoding is not None:
            if self.structured_outputs not in (None, self.guided_decoding):
                raise ValueError(
                    "give structured_outputs or guided_decoding (its older name), not both"
                )
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {so!r}")
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "detokenize",
            "spaces_between_special_tokens",
            "skip_clone",
        ):
            value = getattr(self, name)
            if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
                # numpy's bool (numpy.bool_ before 2.0): the truth it holds
                value = bool(value)
                setattr(self, name, value)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if not self.detokenize and self.stop_strings:
            raise ValueError(
                "stop strings need detokenize=True (they are matched in the text), "
                f"got stop={self.stop!r} with detokenize=False"
            )
        try:
            if self.output_kind is not None:
                self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(
                "output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                f"got {self.output_kind!r}"
            ) from None
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {self.extra_args!r}")

    def clone(self) -> SamplingParams:
        """A checked copy of the fields as they are now (what a request keeps). Checking builds
        its lists and dicts anew (stop, stop ids, logit bias, allowed ids, bad words), so
        editing them leaves these alone, as vLLM's deep copy does; `extra_args` is deep-copied
        too, unless `skip_clone` (vLLM's). The structured-outputs constraint, read only, is
        shared. The older `guided_decoding`, set after construction, is the constraint now,
        as it was vLLM's."""
        copies: dict[str, Any] = {}
        if not self.skip_clone:
            copies["extra_args"] = copy.deepcopy(self.extra_args)
        if self.guided_decoding is not None:
            copies.update(structured_outputs=self.guided_decoding, guided_decoding=None)
        return replace(self, **copies)

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken (temperature 0)."""
        return self.temperature == 0.0


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list | tuple) or not all(isinstance(s, str) for s in strings):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in strings):
        raise ValueError("stop strings must not be empty")
    return tuple(strings)


def _logit_bias(logit_bias: object) -> dict[int, float] | None:
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {logit_bias!r}")
    logit_bias = {
        _plain_number(token_id): _plain_number(bias) for token_id, bias in logit_bias.items()
    }
    for token_id, bias in logit_bias.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token_id!r}")
        _check_number(f"logit_bias[{token_id}]", bias)
    return {token_id: float(bias) for token_id, bias in logit_bias.items()}


def _bad_words(bad_words: object) -> list[str]:
    if bad_words is None:
        return []
    if not isinstance(bad_words, list | tuple) or not all(isinstance(w, str) for w in bad_words):
        raise ValueError(f"bad_words must be a list of strings, got {bad_words!r}")
    for word in bad_words:
        if not word.strip():
            raise ValueError(f"bad_words must not be blank, got {word!r}")
    return list(bad_words)


def _id_list(name: str, value: object) -> list[int]:
    """`value` as a list of token ids, or a ValueError naming `name` (a bare id or a string is
    not a list of them)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}")
    return [_plain_number(token_id) for token_id in value]


# Fields that hold one number: numpy's scalars (a parameter sweep's values) become Python's.
_NUMBER_FIELDS = (
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
    "seed",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)


def _plain_number(value: object) -> object:
    """A number of numpy's types (int64, float32, and float64, a float subclass) as Python's
    int or float; a bool, or anything else, as it is, for the checks to name."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_number(
    name: str, value: object, *, minimum: float | None = None, maximum: float | None = None
) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if maximum is None:
            bound = f">= {minimum}"
        elif minimum is None:
            bound = f"<= {maximum}"
        else:
            bound = f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
