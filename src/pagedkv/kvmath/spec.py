"""KV-cache bytes per token from a Hugging Face `config.json`: the one place that arithmetic lives.

Every other KV number in pagedkv (per request, per block, per pool) is derived from
`KVSpec.bytes_per_token`, so a model's memory appetite is worked out once, here:

- standard, multi-query and grouped-query attention store a key and a value vector per KV head
  per layer: `2 x num_hidden_layers x num_key_value_heads x head_dim x bytes`;
- multi-head latent attention (DeepSeek-V2/V3) stores one compressed latent of
  `kv_lora_rank` values plus a shared rotary key of `qk_rope_head_dim` values per layer, from
  which both keys and values are rebuilt, so there is no factor 2;
- a request holds every one of its tokens, as pagedkv's engine keeps them: a sliding-window
  model never attends further back than `sliding_window` tokens, but the engine does not free
  the blocks behind the window (the window is stated, not counted).

Sizes are plain integers of bytes; `GB` is 10^9 bytes and `GiB` 2^30, and `format_bytes`
prints both because capacity sheets and allocators disagree on which one a "GB" is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pagedkv.kvmath.errors import ConfigError
from pagedkv.kvmath.families import class_default, layer_windows

GB = 10**9
GiB = 2**30
MiB = 2**20

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
# vLLM's `kv_cache_dtype` values: auto (the model's dtype) or an fp8 format ("fp8" is e4m3).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

# Spellings found in configs (`torch_dtype`) and on command lines, mapped to the names above.
_DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
}

# A config that names no dtype is loaded in fp16 by every serving stack, so that is what it
# is sized in.
_DEFAULT_DTYPE = "fp16"


class ConfigFileError(ConfigError):
    """A config file is missing, unreadable or not a JSON object; names the file."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


ContextT = TypeVar("ContextT", int, None)


def served_context(requested: int | None, model_context: ContextT) -> int | ContextT:
    """The context a server runs with: `requested` (max_model_len) when given, else the
    model's (None: its config names none). Longer than the model's is refused, by the engine
    and by the plans alike: positions past the trained context have no meaning, and a plan for
    them would size a server that cannot start."""
    if requested is None:
        return model_context
    if model_context is not None and requested > model_context:
        raise ConfigError(
            f"max_model_len {requested} is beyond the model's context length "
            f"{model_context} (max_position_embeddings)"
        )
    return requested


@dataclass(frozen=True)
class KVSpec:
    """How many bytes of KV cache one token of one request costs, and how many tokens it keeps.

    MLA models set `kv_lora_rank` (and `qk_rope_head_dim`); every other model sets
    `num_kv_heads` and `head_dim`. `max_model_len` is the context the model was trained for,
    kept so callers can flag request lengths beyond it.
    """

    num_layers: int
    kv_dtype: str
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    sliding_window: int | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.kv_dtype not in DTYPE_BYTES:
            raise ConfigError(f"kv dtype {self.kv_dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        _require_positive("num_layers", self.num_layers)
        if self.is_mla:
            _require_positive("qk_rope_head_dim", self.qk_rope_head_dim, allow_zero=True)
        else:
            _require_positive("num_kv_heads", self.num_kv_heads)
            _require_positive("head_dim", self.head_dim)
        if self.sliding_window is not None:
            _require_positive("sliding_window", self.sliding_window)
        if self.max_model_len is not None:
            _require_positive("max_model_len", self.max_model_len)

    def served_context(self, max_model_len: int | None) -> int | None:
        """The context a server of this model runs with (`served_context`)."""
        return served_context(max_model_len, self.max_model_len)

    @property
    def is_mla(self) -> bool:
        """Whether the model caches a compressed latent (MLA) instead of per-head K and V."""
        return self.kv_lora_rank > 0

    @property
    def values_per_layer(self) -> int:
        """Cached numbers per token per layer: K and V for every KV head, or one MLA latent."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_value(self) -> int:
        """Bytes of one cached number in the KV dtype."""
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def bytes_per_token(self) -> int:
        """Bytes of KV cache one token adds, over all layers."""
        return self.num_layers * self.values_per_layer * self.bytes_per_value

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of one paged-KV block holding `block_size` tokens."""
        _require_positive("block_size", block_size)
        return block_size * self.bytes_per_token

    def tokens_held(self, num_tokens: int) -> int:
        """Tokens a request of `num_tokens` keeps in cache: all of them. pagedkv's block table
        keeps a windowed layer's old tokens too (a server that frees them would hold only
        `sliding_window` tokens a request; the plan says so beside its figures)."""
        _require_positive("num_tokens", num_tokens, allow_zero=True)
        return num_tokens

    def bytes_per_request(self, num_tokens: int, block_size: int) -> int:
        """Bytes of KV cache a request of `num_tokens` tokens holds at its longest: the whole
        blocks of `block_size` tokens its tokens fill."""
        return self.blocks_per_request(num_tokens, block_size) * self.bytes_per_block(block_size)

    def blocks_per_request(self, num_tokens: int, block_size: int) -> int:
        """Paged blocks a request of `num_tokens` holds: its tokens rounded up to whole blocks."""
        _require_positive("block_size", block_size)
        return math.ceil(self.tokens_held(num_tokens) / block_size)

    def formula(self) -> str:
        """The bytes-per-token product spelled out, for people checking the arithmetic."""
        bytes_each = f"{self.bytes_per_value} B ({self.kv_dtype})"
        if self.is_mla:
            return (
                f"{self.num_layers} layers x ({self.kv_lora_rank} latent + "
                f"{self.qk_rope_head_dim} rope) x {bytes_each}"
            )
        return (
            f"2 x {self.num_layers} layers x {self.num_kv_heads} KV heads x "
            f"{self.head_dim} head dim x {bytes_each}"
        )

    def to_dict(self) -> dict[str, object]:
        """The spec and its derived sizes as plain JSON-ready values."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "attention": "mla" if self.is_mla else "mha/gqa",
            "kv_dtype": self.kv_dtype,
            "sliding_window": self.sliding_window,
            "max_model_len": self.max_model_len,
            "bytes_per_token": self.bytes_per_token,
        }

    @classmethod
    def from_hf_config(
        cls,
        config: str | Path | Mapping[str, object],
        kv_dtype: str | None = None,
        source: str | Path | None = None,
    ) -> KVSpec:
        """Read a spec from a `config.json` path, a model folder holding one, or a loaded dict.

        `kv_dtype` overrides the config's `torch_dtype` (a server may store KV in fp8 while the
        weights stay in bf16); `source` names a loaded dict's file in errors.
        """
        source = "config" if source is None else str(source)
        if not isinstance(config, Mapping):
            source = str(config)
            config = load_config(config)
        fields = text_config(config)
        field = _FieldReader(fields, source)
        num_layers = field.positive_int("num_hidden_layers", "n_layer", "num_layers")
        dtype = normalize_dtype(kv_dtype) if kv_dtype else config_dtype(fields, source)
        try:
            windows = set(layer_windows(fields, num_layers))
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from error
        # One block table serves every layer, so a request keeps all its tokens unless every
        # layer forgets the same ones.
        window = windows.pop() if len(windows) == 1 else None
        max_len = field.optional_positive_int(
            "max_position_embeddings", "n_positions"
        ) or class_default(fields, "max_position_embeddings")
        kv_lora_rank = field.optional_positive_int("kv_lora_rank")
        if kv_lora_rank is not None:
            return cls(
                num_layers=num_layers,
                kv_dtype=dtype,
                kv_lora_rank=kv_lora_rank,
                qk_rope_head_dim=field.positive_int("qk_rope_head_dim"),
                sliding_window=window,
                max_model_len=max_len,
            )
        num_heads = field.positive_int("num_attention_heads", "n_head")
        num_kv_heads = (
            field.optional_positive_int("num_key_value_heads")
            or class_default(fields, "num_key_value_heads")
            or num_heads
        )
        if num_heads % num_kv_heads:  # grouped-query attention shares each KV head evenly
            raise ConfigError(
                f"{source}: num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        head_dim = field.optional_positive_int("head_dim") or class_default(fields, "head_dim")
        if head_dim is None:
            hidden = field.positive_int("hidden_size", "n_embd", "d_model")
            if hidden % num_heads:
                raise ConfigError(
                    f"{source}: hidden_size {hidden} is not a multiple of "
                    f"num_attention_heads {num_heads}, and no head_dim is given"
                )
            head_dim = hidden // num_heads
        return cls(
            num_layers=num_layers,
            kv_dtype=dtype,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            sliding_window=window,
            max_model_len=max_len,
        )


def load_config(path: str | Path) -> dict[str, object]:
    """Load a `config.json`, given as the file or the model folder that holds it.

    The one reader of config.json in pagedkv: the planner's KVSpec and the model's
    ModelConfig are both derived from what it returns.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigFileError(path, "no such config file")
    return read_json_object(path)


def read_json_object(path: Path) -> dict[str, object]:
    """Parse the JSON object in `path` (a config, or another model file such as a shard index)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigFileError(path, f"not valid JSON ({exc})") from exc
    except OSError as exc:
        raise ConfigFileError(path, f"cannot be read ({exc.strerror})") from exc
    if not isinstance(data, dict):
        raise ConfigFileError(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def config_dtype(config: Mapping[str, object], source: str = "config") -> str:
    """The dtype a config says its weights are in (`torch_dtype`, or transformers' newer
    `dtype`), as a `DTYPE_BYTES` key; an error naming the key and `source` otherwise."""
    fields = text_config(config)
    key = "torch_dtype" if fields.get("torch_dtype") else "dtype"
    try:
        return normalize_dtype(fields.get(key))
    except ConfigError:
        raise ConfigError(
            f"{source}: {key} {fields[key]!r} is not a dtype the planner sizes "
            f"({', '.join(sorted(DTYPE_BYTES))}, or their torch names)"
        ) from None


def normalize_dtype(name: object) -> str:
    """Map a dtype spelling (`bfloat16`, `fp8_e4m3`; None: unspecified) to a `DTYPE_BYTES` key."""
    if name is None:
        return _DEFAULT_DTYPE
    key = str(name).lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ConfigError(f"kv dtype {name!r} is not one of {sorted(DTYPE_BYTES)}")
    return key


def format_bytes(num_bytes: float) -> str:
    """`1.07 GB / 1.00 GiB`: decimal and binary units side by side, the larger unit that fits."""
    for decimal, binary, dname, bname in (
        (GB, GiB, "GB", "GiB"),
        (10**6, MiB, "MB", "MiB"),
        (10**3, 2**10, "kB", "KiB"),
    ):
        if abs(num_bytes) >= decimal:
            return f"{num_bytes / decimal:,.2f} {dname} / {num_bytes / binary:,.2f} {bname}"
    return f"{num_bytes:,.0f} B"


def text_config(config: Mapping[str, object]) -> Mapping[str, object]:
    """Multimodal configs nest the language model's fields under `text_config`."""
    nested = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(nested, Mapping):
        return nested
    return config


def _require_positive(name: str, value: object, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"{name} must be {kind} integer, got {value!r}")


class _FieldReader:
    """Reads integer fields under any of their historical names, naming the file on failure."""

    def __init__(self, config: Mapping[str, object], source: str) -> None:
        self.config = config
        self.source = source

    def optional_positive_int(self, *names: str) -> int | None:
        for name in names:
            value = self.config.get(name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ConfigError(
                        f"{self.source}: {name} must be a positive integer, got {value!r}"
                    )
                return value
        return None

    def positive_int(self, *names: str) -> int:
        value = self.optional_positive_int(*names)
        if value is None:
            raise ConfigError(f"{self.source}: missing {' / '.join(names)}")
        return value
