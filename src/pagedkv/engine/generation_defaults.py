"""The sampling defaults a model's creator recommends, read as vLLM reads them.

A Hugging Face folder's `generation_config.json` often carries the settings its model was
tuned to sample with (Qwen2.5-Instruct: temperature 0.7, top_p 0.8, top_k 20, repetition
penalty 1.05). vLLM's `generation_config="auto"` makes them the defaults: of a request given
no SamplingParams (`LLM.generate`, `LLM.chat`, `LLM.get_default_sampling_params()`), and of
each field a server request leaves out. Only values that differ from transformers' own
defaults count (vLLM reads `GenerationConfig.to_diff_dict()`), and `max_new_tokens` is
`max_tokens`. A folder without the file gives the same keys of its config.json, where older
checkpoints kept them (vLLM's `GenerationConfig.from_model_config` fallback). `"vllm"` ignores
both; any other value names a folder holding a generation_config.json. vLLM's
`override_generation_config` sets keys over either, as given (a null takes one away).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedkv.engine.params import SamplingParams

FILE_NAME = "generation_config.json"
# The sampling keys vLLM reads, each with transformers' GenerationConfig default (a value
# equal to it is not in the diff, so it sets nothing).
_TRANSFORMERS_DEFAULTS: dict[str, object] = {
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "min_p": None,
    "max_new_tokens": None,
}


def sampling_defaults(
    generation_config: str, model_path: Path, override: dict[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams keywords the model's generation config sets (empty: none), with vLLM's
    `override_generation_config` over them (its values as given, transformers' defaults
    included; a null removes the file's); checked by SamplingParams itself, so a bad file or
    override fails at start-up, naming it."""
    from_file = _from_file(generation_config, model_path)
    if not override:
        return from_file
    unknown = sorted(set(override) - set(_TRANSFORMERS_DEFAULTS))
    if unknown:
        raise ValueError(
            f"override_generation_config: {', '.join(map(repr, unknown))} not taken (it sets "
            f"{', '.join(_TRANSFORMERS_DEFAULTS)})"
        )
    # vLLM merges, then drops what is null: a null takes the file's value away.
    merged = dict(from_file)
    for key, value in override.items():
        merged["max_tokens" if key == "max_new_tokens" else key] = value
    merged = {key: value for key, value in merged.items() if value is not None}
    try:
        SamplingParams(**merged)
    except (TypeError, ValueError) as error:
        raise ValueError(f"override_generation_config: {error}") from None
    return merged


def _from_file(generation_config: str, model_path: Path) -> dict[str, Any]:
    if generation_config == "vllm":
        return {}
    folder = model_path if generation_config == "auto" else Path(generation_config)
    if generation_config != "auto" and not (folder / FILE_NAME).is_file():
        raise ValueError(f"generation_config {generation_config!r}: no {FILE_NAME} there")
    path = folder / FILE_NAME
    if not path.is_file():  # vLLM's fallback: the generation keys of the model's config
        path = folder / "config.json"
    if not path.is_file():  # a GGUF file
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable JSON file ({error})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    defaults = {
        "max_tokens" if key == "max_new_tokens" else key: raw[key]
        for key, default in _TRANSFORMERS_DEFAULTS.items()
        if raw.get(key) is not None and raw[key] != default
    }
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None
    return defaults


def describe(defaults: dict[str, Any]) -> str:
    """The start-up line naming the defaults in force (vLLM warns about them likewise)."""
    settings = ", ".join(f"{key} {value}" for key, value in defaults.items())
    return (
        f"sampling defaults from the model's {FILE_NAME} (or config.json) and "
        "override_generation_config, for requests given no SamplingParams and server fields "
        f"left out: {settings} (generation_config='vllm' ignores the file)"
    )
