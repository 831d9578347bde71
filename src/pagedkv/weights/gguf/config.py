"""GGUF metadata -> the keys of a Hugging Face config.json, so both formats share one config path.

A GGUF file describes its model under `{architecture}.*` keys; this module renames them to the
config.json fields `ModelConfig.from_dict` reads, and the same dict is written as config.json
when a GGUF file is converted, so a loaded and a converted GGUF model cannot disagree.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pagedkv.model.errors import MalformedModelFile, UnsupportedModel
from pagedkv.model.registry import gguf_architecture
from pagedkv.weights.gguf.file import GGUFFile

DEFAULT_ROPE_THETA = 10_000.0
DEFAULT_RMS_EPS = 1e-5  # llama.cpp's default when a file omits the key


def config_dict(file: GGUFFile) -> dict[str, Any]:
    """The config.json a Hugging Face checkpoint of this GGUF model would carry."""
    arch = file.architecture
    architecture = gguf_architecture(arch, file.path)
    hidden_size = file.integer(f"{arch}.embedding_length")
    num_heads = _per_model(file, f"{arch}.attention.head_count")
    num_kv_heads = _per_model(file, f"{arch}.attention.head_count_kv", num_heads)
    head_dim = file.integer(f"{arch}.attention.key_length", hidden_size // num_heads)
    value_dim = file.integer(f"{arch}.attention.value_length", head_dim)
    rope_dim = file.integer(f"{arch}.rope.dimension_count", head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise UnsupportedModel(
            file.path,
            f"key length {head_dim}, value length {value_dim} and rope dimension {rope_dim} "
            "differ (only full-rotary attention with equal key and value sizes is supported)",
        )
    theta = file.number(f"{arch}.rope.freq_base", DEFAULT_ROPE_THETA)
    config: dict[str, Any] = {
        "architectures": [architecture.name],
        "model_type": architecture.model_type,
        "vocab_size": _vocab_size(file, arch),
        "hidden_size": hidden_size,
        "intermediate_size": _per_model(file, f"{arch}.feed_forward_length"),
        "num_hidden_layers": file.integer(f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": file.number(f"{arch}.attention.layer_norm_rms_epsilon", DEFAULT_RMS_EPS),
        "max_position_embeddings": file.integer(f"{arch}.context_length"),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(file, arch, theta, head_dim),
        # llama.cpp drops the output matrix of tied models; its absence is the only sign.
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "torch_dtype": "float32",
        # GGUF files carry no sliding window; families without one ignore the key.
        "use_sliding_window": False,
        # Optional biases have no metadata key: the tensors' presence is the switch (a family
        # that always biases q/k/v, and only those, has no switch).
        "attention_bias": not architecture.qkv_bias_always and "blk.0.attn_q.bias" in file.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in file.tensors,
    }
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        token_id = file.optional_id(f"tokenizer.ggml.{gguf_key}", config["vocab_size"])
        if token_id is not None:
            config[key] = token_id
    return config


def _per_model(file: GGUFFile, key: str, default: int | None = None) -> int:
    """A count that some files store per layer (an array): only uniform arrays are supported."""
    value = file.value(key) if default is None else file.value(key, default)
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise UnsupportedModel(file.path, f"metadata {key!r} varies per layer: {value!r}")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MalformedModelFile(file.path, f"metadata {key!r} must be an integer >= 1: {value!r}")
    return value


def _vocab_size(file: GGUFFile, arch: str) -> int:
    """The model's ids; a vocabulary of more tokens is refused (as llama.cpp refuses it): the
    ids past the embedding's rows would fail only once a prompt or a sample reached them."""
    if file.has(f"{arch}.vocab_size"):
        size = file.integer(f"{arch}.vocab_size")
    else:
        embedding = file.tensors.get("token_embd.weight")
        if embedding is None:
            raise MalformedModelFile(file.path, "tensor 'token_embd.weight' is missing")
        size = int(embedding.shape[-1])  # GGUF lists dimensions innermost first
    tokens = file.value("tokenizer.ggml.tokens", [])
    if isinstance(tokens, list) and len(tokens) > size:
        raise MalformedModelFile(
            file.path,
            f"tokenizer.ggml.tokens has {len(tokens)} tokens, more than the model's {size} ids",
        )
    return size


def _rope_scaling(file: GGUFFile, arch: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    kind = file.string(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return _llama3_scaling(file, theta, head_dim)
    if kind == "linear":
        return {"rope_type": "linear", "factor": file.number(f"{arch}.rope.scaling.factor")}
    raise UnsupportedModel(
        file.path, f"rope scaling {kind!r} is not supported (supported: none, linear)"
    )


def _llama3_scaling(file: GGUFFile, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Llama 3.1+ files carry their rope scaling only as `rope_freqs.weight`, one divisor per
    frequency, which llama.cpp applies as they are. Every published Llama 3.x uses low 1, high
    4 and an 8,192-token original context, varying only the factor (the largest divisor); a
    file converted from another config (a smaller model, a longer context) gets the parameters
    that reproduce its divisors (`_fitted`). Divisors no Llama 3 parameters give are refused
    rather than run with the wrong positions.
    """
    tensor = file.tensors.get("rope_freqs.weight")
    if tensor is None:
        return None
    stored = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    if stored.shape != (head_dim // 2,) or not np.all(stored > 0):
        raise MalformedModelFile(
            file.path, f"rope_freqs.weight must hold {head_dim // 2} positive divisors"
        )
    factor = float(stored.max())
    if factor == 1.0:
        return None
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    for low, high, context in ((1.0, 4.0, 8192), _fitted(stored, factor, wavelen)):
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": round(context),
        }
        if high > low > 0 and np.allclose(
            llama3_divisors(scaling, theta, head_dim), stored, rtol=1e-5
        ):
            return scaling
    raise UnsupportedModel(
        file.path, f"rope_freqs.weight is not Llama 3 scaling of any context (factor {factor})"
    )


def _fitted(stored: np.ndarray, factor: float, wavelen: np.ndarray) -> tuple[float, float, float]:
    """(low, high, context) giving these divisors. Frequencies of wavelength below
    context / high keep divisor 1, those above context / low take the factor, and between
    them a frequency keeps the share `(context / wavelen - low) / (high - low)` of its
    unscaled value. Scaling low, high and context together changes none of that, so the
    context is taken as a whole number and low and high follow: from the line through the
    blended shares where there are two or more, from the one share and the gaps beside it
    with one, and from the gap between the unscaled and scaled wavelengths with none."""
    share = (1 / stored - 1 / factor) / (1 - 1 / factor)
    blended = (share > 1e-6) & (share < 1 - 1e-6)
    if blended.sum() >= 2:
        slope, intercept = np.polyfit(1 / wavelen[blended], share[blended], 1)
        if intercept >= 0:
            return 0.0, 0.0, 0.0  # no low > 0 gives this line: refused by the caller
        context = max(1, round(slope / -intercept))  # low 1, near enough
        low = -intercept * context / slope
        return low, low + context / slope, context
    shortest = float(wavelen[share <= 1e-6].min())  # the factor's own divisor is there
    unscaled = wavelen[share >= 1 - 1e-6]
    longest = float(unscaled.max()) if unscaled.size else 0.0
    if blended.sum() == 1:
        # At low 1 the share fixes context = length x (1 + part x (high - 1)): high 4, as
        # published, where that keeps the cut-offs context / high and context in the gaps
        # beside the blended wavelength; else halfway to the largest high that does.
        [length], [part] = wavelen[blended], share[blended]
        most = 1 + (shortest / length - 1) / part  # context below the shortest scaled
        if longest > length * part:  # context / high above the longest unscaled
            most = min(most, (1 - part) / (longest / length - part))
        high = 4.0 if most > 4 else (1 + most) / 2
        exact = length * (1 + part * (high - 1))
        context = max(1, round(exact))
        return context / exact, high * context / exact, context
    longest = longest or shortest / 2
    gap = (shortest - longest) / 4
    context = max(1, round(shortest))
    return context / (shortest - gap), context / (longest + gap), context


def llama3_divisors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores for Llama 3 rope scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    context = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = (context / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, blended)
    )
