"""LlamaModel: the decoder shared by Llama, Mistral and Qwen2, written out plainly in torch.

The three families differ only in switches carried by `ModelConfig`: biases on the q/k/v (and
o) projections, tied input/output embeddings, and a per-layer sliding window. Attention reads
and writes K/V only through the paged cache (`attention.py`), so one forward pass serves any
mix of prefills, prefix-cached prefills, prompt chunks and decodes.

Parameter names are those of the Hugging Face checkpoints without their `model.` prefix, so
the loader maps weights by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedkv.model import triton_dispatch
from pagedkv.model.attention import key_bytes_per_block
from pagedkv.model.batch import ForwardBatch
from pagedkv.model.config import ModelConfig
from pagedkv.model.kv_cache import KVCache
from pagedkv.model.rope import apply_rope, inverse_frequencies, rope_cos_sin


class LlamaModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head of a Llama-style causal LM."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, index) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied models (Qwen2 small sizes) read logits through the embedding matrix itself.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # Not a weight: recomputed from the config, so it is never looked for in a checkpoint.
        self.register_buffer(
            "inv_freq", inverse_frequencies(config.rope, config.head_dim), persistent=False
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> Tensor:
        """Run one step; returns float32 logits `[num_seqs, vocab_size]` of each last token.

        Every layer writes the new tokens' K/V into `kv_cache` at `batch.slot_mapping` before
        attending, so the cache holds their K/V afterwards. Token ids outside the vocabulary and
        positions past `max_position_embeddings` raise `InvalidBatch` subclasses first.
        """
        batch.check_inputs(self.config.vocab_size, self.config.max_position_embeddings)
        kv_cache.check_dtype(self.embed_tokens.weight.dtype)
        hidden = self.embed_tokens(batch.input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, batch.positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, batch, kv_cache)
        last = self.norm(hidden[batch.logits_indices])
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(last, head.weight).float()


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each added back to the residual stream."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch, kv_cache: KVCache
    ) -> Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, batch, kv_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Attention(nn.Module):
    """Grouped-query self-attention over this layer's paged K/V cache."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[index]
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self, hidden: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch, kv_cache: KVCache
    ) -> Tensor:
        num_tokens = hidden.shape[0]
        query = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        key = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        value = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        k_cache, v_cache = kv_cache.layer(self.index)
        triton_dispatch.write_kv(key, value, k_cache, v_cache, batch.slot_mapping)
        # Triton kernels on CUDA read the batch's tensors; the PyTorch path (CPU, and CUDA
        # without triton) reads the step's plan, built once per forward by the first layer.
        metadata = batch.attention_metadata(self.sliding_window, key_bytes_per_block(k_cache))
        out = triton_dispatch.paged_attention(
            query,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.context_lens,
            batch.query_start_loc,
            max(batch.host_query_lens),
            max(batch.host_context_lens),
            self.scale,
            self.sliding_window,
            metadata=metadata,
        )
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 whatever the activations' dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
