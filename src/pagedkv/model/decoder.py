"""DecoderModel: the Llama-family decoder every architecture here is made of, written out plainly.

Llama, Mistral and Qwen2 differ only in switches carried by `ModelConfig` (biases, tied
embeddings, per-layer sliding windows); a family whose layers differ (Qwen3's q/k norms)
subclasses a piece and names it in its own module (`qwen3.py`): its attention (`attention_class`)
or its MLP (`mlp_class`). Attention reads and writes K/V only through the paged cache, via the
attention backend chosen when the model is built, so one forward pass serves any mix of
prefills, prefix-cached prefills, prompt chunks and decodes.

A layer is called with its hidden states alone: the forward pass sets the step (batch, KV cache,
rope tables) as the forward context (`attention/context.py`) for its duration, and each layer's
`attn` reads it there. How a step runs the layers (op by op, or runs of them in one C call on the
CPU backend) is the `LayerPath` chosen once per model (`fused_decode.py`).

Under tensor parallelism each projection says how it splits (q/k/v and gate/up column-parallel,
o and down row-parallel, the LM head gathered; `layers/linear.py`), and attention computes with
the heads its projections hold: the same code runs a whole model or one rank's shard.

Parameter names are those of the Hugging Face checkpoints without their `model.` prefix, except
that q/k/v are one fused `qkv_proj` and gate/up one `gate_up_proj` (`layers/linear.py` says how
checkpoint tensors fill them).
"""

from __future__ import annotations

from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedkv.attention.backend import AttentionBackend, select_backend
from pagedkv.attention.batch import ForwardBatch
from pagedkv.attention.context import (
    ForwardContext,
    PagedKVCache,
    forward_context,
    get_forward_context,
)
from pagedkv.attention.layer import Attention
from pagedkv.kernels import native
from pagedkv.model.config import ModelConfig
from pagedkv.model.fused_decode import LayerPath
from pagedkv.model.layers.embedding import Embedding
from pagedkv.model.layers.linear import Linear
from pagedkv.model.layers.norm import RMSNorm
from pagedkv.model.lora import AdapterWeights, lora_step, name_lora_targets
from pagedkv.model.registry import ARCHITECTURES
from pagedkv.model.rope import inverse_frequencies, rope_cos_sin, rotate_qk


class SelfAttention(nn.Module):
    """Grouped-query self-attention: q/k/v, rope, paged attention (`attn`), o."""

    def __init__(self, config: ModelConfig, index: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size,
            (q_size, kv_size, kv_size),
            bias=config.qkv_bias,
            parts=("q_proj", "k_proj", "v_proj"),
            parallel="column",
            part_units=(config.num_heads, config.num_kv_heads, config.num_kv_heads),
            replicated_parts=("k_proj", "v_proj"),
        )
        self.o_proj = Linear(q_size, (config.hidden_size,), bias=config.o_bias, parallel="row")
        # The heads this layer computes: all of them, or this rank's under tensor parallelism.
        self.q_size, self.kv_size, _ = self.qkv_proj.part_sizes
        self.attn = Attention(
            index,
            self.q_size // config.head_dim,
            self.kv_size // config.head_dim,
            config.head_dim,
            config.sliding_windows[index],
            backend,
        )

    def forward(self, hidden: Tensor) -> Tensor:
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split(
            (self.q_size, self.kv_size, self.kv_size), dim=-1
        )
        query = query.view(num_tokens, self.attn.num_heads, self.head_dim)
        key = key.view(num_tokens, self.attn.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.attn.num_kv_heads, self.head_dim)
        query, key = self.normalize_qk(query, key)
        context = get_forward_context()
        query, key = rotate_qk(query, key, context.cos, context.sin)
        out = self.attn(query, key, value)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def normalize_qk(self, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head transform of queries and keys before rope: none in the Llama family."""
        return query, key


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size,
            (size, size),
            bias=config.mlp_bias,
            parts=("gate_proj", "up_proj"),
            parallel="column",
        )
        self.down_proj = Linear(size, (config.hidden_size,), bias=config.mlp_bias, parallel="row")

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


def silu_mul(gate_up: Tensor) -> Tensor:
    """`silu(gate) * up` of `[tokens, 2 * inter]` (gate, then up). On the CPU one C call whose
    exp has the same bits for every element (`kernels/rowwise.c`), so a row's result never
    depends on where it falls among the step's rows; a 16-bit model's come back rounded."""
    kernels = native.cpu_kernels(gate_up)
    if kernels is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.dtype != torch.float32 or not rows.is_contiguous():
        rows = rows.to(torch.float32).contiguous()
    inter = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], inter, dtype=torch.float32)
    kernels.silu_mul(rows.data_ptr(), rows.shape[0], inter, out.data_ptr())
    return out.view(*gate_up.shape[:-1], inter).to(gate_up.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each added back to the residual stream."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: Tensor) -> Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head of a Llama-style causal LM.

    Built under a `torch.device(...)` context and a default dtype, its weights are allocated
    there uninitialised (the loader fills them); `attention_backend` defaults to the one
    `select_backend` picks for that device. A family whose layers differ names its own
    `attention_class` (built with `(config, index, backend)`) or `mlp_class` (with `(config)`).
    """

    attention_class: type[nn.Module] = SelfAttention
    mlp_class: type[nn.Module] = MLP

    def __init__(
        self, config: ModelConfig, attention_backend: AttentionBackend | None = None
    ) -> None:
        super().__init__()
        self.config = config
        backend = attention_backend or select_backend(torch.get_default_device())
        self.attention_backend = backend
        self.embed_tokens = Embedding(
            config.vocab_size, config.hidden_size, reads_logits=config.tie_word_embeddings
        )
        self.layers = nn.ModuleList(
            DecoderLayer(
                self.attention_class(config, index, backend), self.mlp_class(config), config
            )
            for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The LoRA adapters resident in the KV pool, by id (`model/lora.py`; the worker loads
        # and evicts them), and each adaptable projection's layer index.
        self.lora_adapters: dict[int, AdapterWeights] = {}
        for index, layer in enumerate(self.layers):
            name_lora_targets(layer, index)
        # Tied models read logits through the embedding matrix itself.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(
                config.hidden_size,
                (config.vocab_size,),
                bias=False,
                parallel="column",
                gather_output=True,
            )
        )
        # Not a weight: recomputed from the config, so it is never looked for in a checkpoint.
        self.register_buffer(
            "inv_freq",
            inverse_frequencies(config.rope, config.head_dim).to(torch.get_default_device()),
            persistent=False,
        )

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype, hence the dtype K/V are computed in (and stored in, unless
        the cache is fp8)."""
        return self.embed_tokens.dtype

    @property
    def num_kv_heads(self) -> int:
        """KV heads each layer stores: the config's, or this rank's under tensor parallelism
        (one replicated head when the config has fewer KV heads than ranks)."""
        return self.layers[0].self_attn.attn.num_kv_heads

    @property
    def device(self) -> torch.device:
        """Where the weights (and so the KV cache) live."""
        return self.inv_freq.device

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: PagedKVCache) -> Tensor:
        """Run one step; returns float32 logits `[num_logits, vocab_size]` of the rows each
        sequence asked for (`SequenceInput.num_logits`: its last token, unless it says otherwise).
        Under tensor parallelism every rank runs it and rank 0 gets the logits (the other ranks
        their own vocabulary slice's).

        Every layer writes the new tokens' K/V into `kv_cache` at `batch.slot_mapping` before
        attending, so the cache holds their K/V afterwards. Token ids outside the vocabulary and
        positions past `max_position_embeddings` raise `InvalidBatch` subclasses first.
        """
        batch.check_inputs(self.config.vocab_size, self.config.max_position_embeddings)
        kv_cache.check_dtype(self.dtype)
        hidden = self.embed_tokens(batch.input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, batch.positions, hidden.dtype)
        with (
            forward_context(ForwardContext(batch, kv_cache, cos, sin)),
            lora_step(self.lora_adapters, batch),
        ):
            hidden = self.layer_path(hidden)
        # A decode or verification step wants every row's logits, in order: no gather then
        # (an index op right after the layers' C call took ~70 us of a 6 ms step).
        if batch.logits_indices.shape[0] < hidden.shape[0]:
            hidden = hidden[batch.logits_indices]
        last = self.norm(hidden)
        if self.lm_head is None:
            return self.embed_tokens.logits(last).float()
        return self.lm_head(last).float()

    @cached_property
    def layer_path(self) -> LayerPath:
        """How a step runs the layers (`fused_decode.py`), chosen once, by the first forward
        pass: only then are the weights loaded and quantised, which decides the layers the
        CPU backend's one-call decode takes. A plain attribute, not a submodule."""
        allowed = ARCHITECTURES[self.config.architecture].fused_decode
        return LayerPath(self.layers, self.attention_backend, allowed)

    def quantize(self, scheme: str) -> None:
        """Keep every projection and the embedding table quantised (`Linear.quantize` says
        what `scheme` means); call before loading."""
        for module in self.modules():
            if isinstance(module, (Linear, Embedding)):
                module.quantize(scheme)

    def checkpoint_name(self, name: str) -> str:
        """The Hugging Face checkpoint's name for module path `name` (`layers.0.mlp.up_proj`)."""
        return name if name.startswith("lm_head") else f"model.{name}"

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Checkpoint tensors deliberately not loaded: derived from the config, or redundant."""
        if name.endswith("rotary_emb.inv_freq"):
            return True  # older checkpoints saved the rope buffer; we recompute it
        # Some tied checkpoints still carry a copy of the embedding as the head.
        return name == "lm_head.weight" and self.config.tie_word_embeddings
