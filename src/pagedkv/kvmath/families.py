"""How transformers reads a family's config where it leaves things out: each layer's attention
window, and a missing head size, KV head count or context.

The one rule both the planner (`spec.KVSpec`) and the model (`model/config.py`) follow, kept
beside the KV arithmetic with no torch, so the two cannot drift apart. Where a key is absent
the answer is the transformers config class's default (checked against those classes in the
tests), not hidden_size / heads or "no window".
"""

from __future__ import annotations

from collections.abc import Mapping

from pagedkv.kvmath.errors import ConfigError

# The `model_type` of each architecture with rules of its own, which `architectures` names
# before `model_type` does (as the engine picks a family).
_ARCHITECTURE_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MinistralForCausalLM": "ministral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Families with their own window rule, by `model_type`; any other config (the planner's
# presets include several) windows every layer when it names a window.
_TYPE_FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "ministral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen2",  # Qwen3 windows its layers by Qwen2's rule
}
_QWEN2_MAX_WINDOW_LAYERS = 28  # transformers' default
# transformers' Mistral, Qwen2 and Qwen3 configs window 4,096 tokens when the key is absent.
_DEFAULT_WINDOW = 4096
# What transformers' config class of an architecture (or model_type) gives a key config.json
# leaves out, where that is not the generic rule: head_dim hidden / heads, num_key_value_heads
# as many as the query heads, max_position_embeddings Llama's 2,048 (unknown to the planner).
_MISTRAL = {"num_key_value_heads": 8, "max_position_embeddings": 131072}
_QWEN2 = {"num_key_value_heads": 32, "max_position_embeddings": 32768}
_QWEN3 = {**_QWEN2, "head_dim": 128}
_CLASS_DEFAULTS: dict[str, dict[str, int]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "llama": {"max_position_embeddings": 2048},
    "MistralForCausalLM": _MISTRAL,
    "mistral": _MISTRAL,
    "MinistralForCausalLM": _MISTRAL,
    "ministral": _MISTRAL,
    "Qwen2ForCausalLM": _QWEN2,
    "qwen2": _QWEN2,
    "Qwen3ForCausalLM": _QWEN3,
    "qwen3": _QWEN3,
}


def model_type_of(config: Mapping[str, object]) -> str | None:
    """The config's `model_type`, that of its `architectures` first where those are known."""
    architectures = config.get("architectures")
    if (
        isinstance(architectures, list)
        and architectures
        and architectures[0] in _ARCHITECTURE_TYPES
    ):
        return _ARCHITECTURE_TYPES[architectures[0]]
    model_type = config.get("model_type")
    return model_type if isinstance(model_type, str) else None


def model_family(config: Mapping[str, object]) -> str | None:
    """`llama`, `mistral`, `qwen2` or another `model_type`, from architectures or model_type."""
    model_type = model_type_of(config)
    return None if model_type is None else _TYPE_FAMILIES.get(model_type, model_type)


def layer_windows(config: Mapping[str, object], num_layers: int) -> tuple[int | None, ...]:
    """The attention window of every layer (None: full attention), as transformers applies it.

    The one rule both the planner and the model follow: Llama ignores a stray
    `sliding_window`; Qwen2 and Qwen3 window only with `use_sliding_window`, and then only the
    layers `layer_types` marks "sliding_attention" (or, without it, the layers from
    `max_window_layers` on); Mistral (and Ministral) window the layers `layer_types` marks, or
    else every layer, whatever `use_sliding_window` says; another family windows the layers
    `layer_types` marks, or else every layer unless `use_sliding_window` is false. Mistral,
    Qwen2 and Qwen3 configs without the key have transformers' window of 4,096 tokens (null:
    none). Raises ConfigError naming the field.
    """
    family = model_family(config)
    full: tuple[int | None, ...] = (None,) * num_layers
    default = _DEFAULT_WINDOW if family in ("mistral", "qwen2") else None
    window = config.get("sliding_window", default)
    if window is None or family == "llama":
        return full
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"sliding_window must be an integer >= 1, got {window!r}")
    use_window = config.get("use_sliding_window")
    if use_window is not None and not isinstance(use_window, bool):
        raise ConfigError(f"use_sliding_window must be true or false, got {use_window!r}")
    layer_types = config.get("layer_types")
    if family == "qwen2" and not use_window:
        return full
    if family != "qwen2" and layer_types is None:
        windowless = use_window is False and family != "mistral"
        return full if windowless else (window,) * num_layers
    if layer_types is None:
        first = config.get("max_window_layers")
        first = _QWEN2_MAX_WINDOW_LAYERS if first is None else first
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ConfigError(f"max_window_layers must be an integer >= 0, got {first!r}")
        return tuple(window if i >= first else None for i in range(num_layers))
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ConfigError(f"layer_types must list {num_layers} layer types, got {layer_types!r}")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def class_default(config: Mapping[str, object], key: str) -> int | None:
    """What transformers' config class gives `key` (`head_dim`, `num_key_value_heads`,
    `max_position_embeddings`) when config.json names none: Qwen3's head size 128, Mistral's 8
    KV heads; None where that is the generic rule. The class is the `model_type`'s, as
    transformers and vLLM pick it (the architecture only where the type is unknown here)."""
    model_type = str(config.get("model_type"))
    if model_type in _CLASS_DEFAULTS:
        return _CLASS_DEFAULTS[model_type].get(key)
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        return _CLASS_DEFAULTS.get(str(architectures[0]), {}).get(key)
    return None
