"""Write small GGUF files the way llama.cpp's converter does, from known Hugging Face weights.

Only the test suite writes GGUF: `write_model_gguf` renames tensors, applies the converter's
q/k row permutation for the `llama` architecture, stores config.json fields under GGUF keys,
and stores the tiny byte-level BPE tokenizer of `tests.model.tiny_models` as `gpt2` metadata.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import load_file

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
CONTROL, NORMAL = 3, 1


def folder_weights(folder: Path) -> dict[str, np.ndarray]:
    """Every float32 tensor of a tiny model folder (single or sharded safetensors)."""
    weights: dict[str, np.ndarray] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(path))
    return weights


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation: each head's halves become interleaved pairs."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_metadata(config: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The `{arch}.*` keys llama.cpp's converter writes for a config.json."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    theta = config.get("rope_theta") or scaling.get("rope_theta", 10000.0)
    linear = scaling.get("rope_type", scaling.get("type")) == "linear"
    return {
        f"{arch}.rope.scaling.type": "linear" if linear else None,
        f"{arch}.rope.scaling.factor": float(scaling["factor"]) if linear else None,
        f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": config.get("num_key_value_heads", heads),
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.rope.freq_base": float(theta),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{arch}.vocab_size": config["vocab_size"],
    }


def tokenizer_metadata(tokenizer_json: Path, pre: str = "gpt-2") -> dict[str, Any]:
    """A tokenizers BPE file as GGUF `gpt2` tokenizer metadata (ids 0-2: control tokens)."""
    data = json.loads(tokenizer_json.read_text())
    vocab = dict(data["model"]["vocab"])
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [CONTROL if i < 3 else NORMAL for i in range(len(tokens))],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }


def write_model_gguf(
    path: Path,
    folder: Path,
    *,
    arch: str = "llama",
    qtype: QType = QType.F32,
    metadata: Mapping[str, Any] | None = None,
    drop_tensors: tuple[str, ...] = (),
    extra_tensors: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """Write tiny model `folder` as a GGUF file; 2-D weights stored as `qtype`.

    `metadata` overrides or adds keys (a value of None removes one); `drop_tensors` names
    Hugging Face tensors to leave out; `extra_tensors` are added under their GGUF names.
    """
    config = json.loads((folder / "config.json").read_text())
    keys = gguf_metadata(config, arch) | tokenizer_metadata(folder / "tokenizer.json")
    keys |= dict(metadata or {})
    tensors = {}
    for name, weight in folder_weights(folder).items():
        if name in drop_tensors or (name == "lm_head.weight" and config["tie_word_embeddings"]):
            continue
        if arch == "llama" and ".q_proj." in name:
            weight = permute_rows(weight, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            weight = permute_rows(weight, config["num_key_value_heads"])
        tensors[gguf_name(name)] = weight
    tensors |= dict(extra_tensors or {})
    return write_gguf(path, keys.pop("general.architecture", arch), keys, tensors, qtype)


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face tensor name."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def write_gguf(
    path: Path,
    arch: str,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    qtype: QType = QType.F32,
) -> Path:
    """A GGUF file with these keys and tensors; 2-D float tensors quantised to `qtype`.

    A tensor given as a `(uint8 blocks, QType)` pair is written raw.
    """
    writer = gguf.GGUFWriter(path, arch)
    for key, value in metadata.items():
        if value is not None:
            _add_key(writer, key, value)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        elif tensor.ndim == 2 and qtype != QType.F32:
            writer.add_tensor(name, _encode(tensor, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(tensor, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _encode(tensor: np.ndarray, qtype: QType) -> np.ndarray:
    if qtype == QType.F16:
        return tensor.astype(np.float16).view(np.uint8)
    return gguf.quants.quantize(tensor.astype(np.float32), qtype)


def _add_key(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))
