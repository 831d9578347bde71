"""The architecture registry: every model family pagedkv runs, and nothing else branches on one.

An entry says how to read a family's config (whether q/k/v always carry biases, which MLP
activations it computes), which module class runs it, what its decode may run in C, and how its
GGUF files name it (the llama.cpp architecture, extra per-layer tensor names, whether q/k rows
are permuted). Adding a family is one module beside `llama.py` (a `DecoderModel` subclass
naming its own `attention_class` or `mlp_class`) plus one entry here; a family with its own
sliding-window rule also names it in `kvmath/spec.py`, the torch-free arithmetic the capacity
planner shares with the model.

Classes are named by import path and imported when a model is built, so reading a config (the
loader, the planner's checks) needs no torch and the family modules may import the config.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.model.errors import MalformedModelFile, UnsupportedModel


@dataclass(frozen=True)
class Architecture:
    """One model family: how its config is read, what runs it, how its GGUF files name it."""

    name: str  # config.json `architectures[0]`
    model_type: str  # config.json `model_type`
    model_class_path: str  # "module:Class" of the DecoderModel subclass that runs it
    qkv_bias_always: bool = False  # q/k/v biased whatever `attention_bias` says (o never)
    # The config.json bias switches its transformers class reads; one it does not read (Mistral's
    # layers have no biases, whatever a config says) is ignored, as transformers ignores it.
    bias_switches: tuple[str, ...] = ("attention_bias", "mlp_bias")
    gguf_arch: str | None = None  # llama.cpp's `general.architecture`, when it has files
    # GGUF per-layer tensor names (`blk.N.<name>`) beyond the Llama set, -> checkpoint module.
    gguf_layer_tensors: Mapping[str, str] = field(default_factory=dict)
    gguf_permutes_qk: bool = False  # llama.cpp permutes q/k rows for interleaved rope
    # Whether a decode step may run this family's layers as one C call (kernels/decode_layer.c):
    # only for the plain Llama layer (RMSNorm, q/k/v, rope, attention, o, SwiGLU MLP), which is
    # what that C code computes; a family with any other layer math says False.
    fused_decode: bool = False
    # config.json `hidden_act` values the family's MLP computes (the Llama MLP: SwiGLU;
    # "swish" is transformers' other name for SiLU).
    hidden_acts: tuple[str, ...] = ("silu", "swish")

    def model_class(self) -> type:
        """The `DecoderModel` subclass that runs this family (imported on first use)."""
        module, _, name = self.model_class_path.partition(":")
        return getattr(importlib.import_module(module), name)


ARCHITECTURES: dict[str, Architecture] = {
    entry.name: entry
    for entry in (
        Architecture(
            name="LlamaForCausalLM",
            model_type="llama",
            model_class_path="pagedkv.model.llama:LlamaModel",
            fused_decode=True,
            gguf_arch="llama",
            gguf_permutes_qk=True,
        ),
        Architecture(
            name="MistralForCausalLM",
            model_type="mistral",
            model_class_path="pagedkv.model.llama:LlamaModel",
            fused_decode=True,
            bias_switches=(),
        ),
        Architecture(
            name="Qwen2ForCausalLM",
            model_type="qwen2",
            model_class_path="pagedkv.model.llama:LlamaModel",
            fused_decode=True,
            qkv_bias_always=True,
            bias_switches=(),
            gguf_arch="qwen2",
        ),
        Architecture(
            name="Qwen3ForCausalLM",
            model_type="qwen3",
            model_class_path="pagedkv.model.qwen3:Qwen3Model",
            bias_switches=("attention_bias",),
            gguf_arch="qwen3",
            gguf_layer_tensors={
                "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm",
            },
        ),
    )
}


def architecture_of(raw: dict[str, Any], source: Path) -> Architecture:
    """The entry a parsed config.json names (`architectures`, else `model_type`)."""
    architectures = raw.get("architectures")
    if architectures:
        if not isinstance(architectures, list) or not isinstance(architectures[0], str):
            raise MalformedModelFile(
                source, f"architectures must be a list of names, got {architectures!r}"
            )
        name = architectures[0]
    else:
        by_type = {entry.model_type: entry.name for entry in ARCHITECTURES.values()}
        if raw.get("model_type") not in by_type:
            raise MalformedModelFile(
                source, "neither 'architectures' nor a known 'model_type' is set"
            )
        name = by_type[raw["model_type"]]
    if name not in ARCHITECTURES:
        raise UnsupportedModel(
            source,
            f"architecture {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})",
        )
    return ARCHITECTURES[name]


def gguf_architecture(gguf_arch: str, source: Path) -> Architecture:
    """The entry of a GGUF file's `general.architecture`."""
    for entry in ARCHITECTURES.values():
        if entry.gguf_arch == gguf_arch:
            return entry
    supported = [entry.gguf_arch for entry in ARCHITECTURES.values() if entry.gguf_arch]
    raise UnsupportedModel(
        source,
        f"GGUF architecture {gguf_arch!r} is not supported (supported: {', '.join(supported)})",
    )
