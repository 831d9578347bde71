"""ModelConfig: the few numbers and switches of a Llama-style model, read from config.json.

Every family of the registry is the Llama decoder with small differences; this module turns
each family's config.json into the same record (by the rules of its registry entry), so the
decoder has a single code path. Both the
older `rope_theta` + `rope_scaling` keys and the newer `rope_parameters` form are accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.kvmath.families import class_default, layer_windows
from pagedkv.kvmath.spec import ConfigError, ConfigFileError, read_json_object
from pagedkv.model.errors import MalformedModelFile, ModelFileMissing, UnsupportedModel
from pagedkv.model.registry import architecture_of

ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `scaling` is "default", "linear" or "llama3"."""

    theta: float = DEFAULT_ROPE_THETA
    scaling: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of one Llama-style decoder.

    `sliding_windows` holds one entry per layer (None: full attention) because Qwen2 applies
    its window only to some layers, while Mistral applies it to all.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: Path) -> ModelConfig:
        """Build from the parsed config.json; `source` names the file in error messages."""
        fields = _Fields(raw, source)
        architecture = architecture_of(raw, source)
        num_heads = fields.integer("num_attention_heads")
        hidden_size = fields.integer("hidden_size")
        num_kv_heads = fields.integer(
            "num_key_value_heads", class_default(raw, "num_key_value_heads") or num_heads
        )
        if num_heads % num_kv_heads:
            default = raw.get("num_key_value_heads") is None
            raise MalformedModelFile(
                source,
                f"num_attention_heads ({num_heads}) is not a multiple of "
                f"num_key_value_heads ({num_kv_heads}"
                f"{', its config class default: the config names none' if default else ''})",
            )
        head_dim = fields.integer(
            "head_dim", class_default(raw, "head_dim") or hidden_size // num_heads
        )
        if head_dim % 2:
            # RoPE turns pairs of a head's values; transformers refuses an odd head the same way.
            raise UnsupportedModel(
                source, f"head_dim {head_dim} is odd (rotary embeddings rotate pairs of values)"
            )
        hidden_act = raw.get("hidden_act") or "silu"
        if hidden_act not in architecture.hidden_acts:
            supported = " or ".join(map(repr, architecture.hidden_acts))
            raise UnsupportedModel(
                source, f"hidden_act {hidden_act!r} (only {supported} is supported)"
            )
        num_layers = fields.integer("num_hidden_layers")
        max_position_embeddings = fields.integer(
            "max_position_embeddings", class_default(raw, "max_position_embeddings") or 2048
        )
        switches = architecture.bias_switches
        attention_bias = "attention_bias" in switches and fields.boolean("attention_bias", False)
        return cls(
            architecture=architecture.name,
            vocab_size=fields.integer("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=fields.integer("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.number("rms_norm_eps", 1e-6, positive=True),
            max_position_embeddings=max_position_embeddings,
            rope=_rope(raw, fields, max_position_embeddings),
            # Qwen2 always biases q/k/v and never o; elsewhere attention_bias covers all four.
            qkv_bias=architecture.qkv_bias_always or attention_bias,
            o_bias=attention_bias and not architecture.qkv_bias_always,
            mlp_bias="mlp_bias" in switches and fields.boolean("mlp_bias", False),
            tie_word_embeddings=fields.boolean("tie_word_embeddings", False),
            sliding_windows=_sliding_windows(raw, source, num_layers),
        )


def load_config(folder: str | Path) -> ModelConfig:
    """Read and validate `folder/config.json`."""
    path = Path(folder) / "config.json"
    return ModelConfig.from_dict(read_config(folder), path)


def read_config(folder: str | Path) -> dict[str, Any]:
    """The parsed config.json of `folder`: what ModelConfig, KVSpec and the eos ids come from."""
    return read_json(Path(folder) / "config.json", what="the model's config.json")


def with_overrides(
    raw: dict[str, Any], overrides: dict[str, Any] | None, source: Path
) -> tuple[dict[str, Any], Path]:
    """`raw` with vLLM's `hf_overrides` keys replaced (a value replaces the whole key, as
    transformers' `PretrainedConfig.update` does), and the source to name in errors: a bad
    value may now be the override's, not the file's."""
    if not overrides:
        return raw, source
    return {**raw, **overrides}, Path(f"{source} (with hf_overrides)")


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Parse a JSON object from `path` with the planner's reader, raising model errors."""
    if not path.is_file():
        raise ModelFileMissing(path, what)
    try:
        return read_json_object(path)
    except ConfigFileError as error:
        raise MalformedModelFile(path, error.problem) from error


class _Fields:
    """Typed reads from a config dict, raising errors that name the file and the key.

    `prefix` names a nested object (`rope_scaling.`) so its keys are reported in full.
    """

    def __init__(self, raw: dict[str, Any], source: Path, prefix: str = "") -> None:
        self.raw = raw
        self.source = source
        self.prefix = prefix

    def integer(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise MalformedModelFile(
                self.source, f"{self.prefix}{key} must be an integer >= {minimum}, got {value!r}"
            )
        return value

    def number(self, key: str, default: float | None = None, *, positive: bool = False) -> float:
        """A finite number (JSON allows NaN and Infinity; no field of ours means them)."""
        value = self._get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise MalformedModelFile(
                self.source, f"{self.prefix}{key} must be a finite number, got {value!r}"
            )
        if positive and value <= 0:
            raise MalformedModelFile(
                self.source, f"{self.prefix}{key} must be a positive number, got {value!r}"
            )
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise MalformedModelFile(
                self.source, f"{self.prefix}{key} must be true or false, got {value!r}"
            )
        return value

    def _get(self, key: str, default: Any) -> Any:
        # A key set to null means the same as an absent key, as in transformers.
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise MalformedModelFile(
                    self.source, f"required field {self.prefix + key!r} is missing"
                )
            return default
        return value


def _rope(raw: dict[str, Any], top: _Fields, max_position_embeddings: int) -> RopeConfig:
    source = top.source
    # transformers lets the older `rope_scaling` win when both are present; so do we.
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise MalformedModelFile(source, f"{key} must be an object, got {params!r}")
    if any(isinstance(value, dict) for value in params.values()):
        raise UnsupportedModel(source, "per-layer-type rope_parameters are not supported")
    fields = _Fields(params, source, prefix=f"{key}.")
    # Every number below divides or exponentiates: a zero or negative one makes inf or nan
    # frequencies, which would surface only as garbage text.
    theta = fields.number(
        "rope_theta", top.number("rope_theta", DEFAULT_ROPE_THETA, positive=True), positive=True
    )
    scaling = params.get("rope_type", params.get("type", "default"))
    if scaling not in ROPE_TYPES:
        raise UnsupportedModel(
            source, f"rope type {scaling!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    if scaling == "default":
        return RopeConfig(theta=theta)
    factor = fields.number("factor", positive=True)
    if scaling == "linear":
        return RopeConfig(theta=theta, scaling=scaling, factor=factor)
    # llama3: the pre-training context may sit at top level, inside the rope dict, or be absent
    # (max_position_embeddings then). The top level wins where both are, as in transformers,
    # whose rope setup writes it over the dict's (Phi-3 checkpoints keep theirs there).
    original = top.integer(
        "original_max_position_embeddings",
        fields.integer("original_max_position_embeddings", max_position_embeddings),
    )
    low_freq_factor = fields.number("low_freq_factor", positive=True)
    high_freq_factor = fields.number("high_freq_factor", positive=True)
    if high_freq_factor <= low_freq_factor:
        # The blend between the two cut-offs divides by their difference.
        raise MalformedModelFile(
            source,
            f"{key}.high_freq_factor ({high_freq_factor}) must be greater than "
            f"{key}.low_freq_factor ({low_freq_factor})",
        )
    return RopeConfig(
        theta=theta,
        scaling=scaling,
        factor=factor,
        low_freq_factor=low_freq_factor,
        high_freq_factor=high_freq_factor,
        original_max_position_embeddings=original,
    )


def _sliding_windows(raw: dict[str, Any], source: Path, num_layers: int) -> tuple[int | None, ...]:
    try:
        return layer_windows(raw, num_layers)  # the planner's rule too
    except ConfigError as error:
        raise MalformedModelFile(source, str(error)) from error
