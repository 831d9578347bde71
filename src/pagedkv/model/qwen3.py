"""Qwen3: the Llama decoder with an RMSNorm over each query and key head before rope.

Everything else (explicit `head_dim`, tied or untied embeddings, optional attention biases)
is carried by `ModelConfig`; transformers' `Qwen3ForCausalLM` and llama.cpp's `qwen3` GGUF
files name the two norms `q_norm` / `k_norm` and `attn_q_norm` / `attn_k_norm`.
"""

from __future__ import annotations

from torch import Tensor

from pagedkv.attention.backend import AttentionBackend
from pagedkv.model.config import ModelConfig
from pagedkv.model.decoder import DecoderModel, SelfAttention
from pagedkv.model.layers.norm import RMSNorm


class Qwen3Attention(SelfAttention):
    """Grouped-query attention whose queries and keys are RMS-normalised per head."""

    def __init__(self, config: ModelConfig, index: int, backend: AttentionBackend) -> None:
        super().__init__(config, index, backend)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def normalize_qk(self, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        return self.q_norm(query), self.k_norm(key)


class Qwen3Model(DecoderModel):
    """The Qwen3 decoder."""

    attention_class = Qwen3Attention
