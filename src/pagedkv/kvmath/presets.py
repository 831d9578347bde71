"""Built-in model and GPU presets, and turning a `--model` argument into a sized model.

Model presets carry the fields of each model's published Hugging Face `config.json` that
memory planning needs, and the published parameter count (for the weights' share of the
GPU). GPU presets carry the total memory as `nvidia-smi` reports it, in MiB: that total, not
the marketing figure, is what a server's `gpu_memory_utilization` multiplies (an "80GB" H100
reports 81,559 MiB = 85.5 GB = 79.6 GiB).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pagedkv.kvmath.families import model_type_of
from pagedkv.kvmath.spec import (
    DTYPE_BYTES,
    ConfigError,
    KVSpec,
    MiB,
    config_dtype,
    load_config,
)


class UnknownPreset(ConfigError):
    """A `--model` or `--gpu` name that is neither a preset nor a file."""


@dataclass(frozen=True)
class ModelPreset:
    """A published model: its Hugging Face repo, config fields and parameter count."""

    name: str
    hf_repo: str
    config: Mapping[str, object]
    num_params: int
    weight_dtype: str


@dataclass(frozen=True)
class GPUPreset:
    """A GPU and the memory its driver reports."""

    name: str
    product: str
    memory_mib: int

    @property
    def memory_bytes(self) -> int:
        """Total device memory in bytes."""
        return self.memory_mib * MiB


@dataclass(frozen=True)
class Model:
    """A model resolved from `--model`: its KV spec and, when knowable, its weight bytes.

    `weight_source` says where `weight_bytes` came from, because a planner's answer is only as
    good as that number; it is None when the weights cannot be sized (a mixture-of-experts
    config with no checkpoint beside it).
    """

    name: str
    spec: KVSpec
    weight_bytes: int | None
    weight_source: str
    config: Mapping[str, object] | None = None  # its config.json fields
    # The weights as a GPU holds them: pagedkv loads them in bfloat16 there (dtype auto), a
    # float32 checkpoint at half its size, a GGUF file's blocks dequantised. None: unknown.
    gpu_weight_bytes: int | None = None


def _llama(layers, hidden, heads, kv_heads, ffn, vocab, context, dtype="bfloat16", **extra):
    """The config fields of a LLaMA-family (LLaMA, Mistral, Qwen2) decoder.

    `model_type` (llama unless `extra` says otherwise) picks the family's sliding-window rule,
    the same one the model loader applies (`spec.layer_windows`).
    """
    return {
        "model_type": "llama",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "torch_dtype": dtype,
        **extra,
    }


_QWEN2 = {"model_type": "qwen2", "use_sliding_window": False}

MODEL_PRESETS: dict[str, ModelPreset] = {
    preset.name: preset
    for preset in (
        ModelPreset(
            # The built-in default model (`pagedkv pull`); its GGUF file is Q4_1, but the
            # engine runs it dequantised, so its weights are counted in bf16 like the others.
            "smollm2-135m-instruct",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            _llama(30, 576, 9, 3, 1536, 49152, 8192, rope_theta=100000.0, tie_word_embeddings=True),
            134_515_008,
            "bf16",
        ),
        ModelPreset(
            "llama-2-7b",
            "meta-llama/Llama-2-7b-hf",
            _llama(32, 4096, 32, 32, 11008, 32000, 4096, "float16"),
            6_738_415_616,
            "fp16",
        ),
        ModelPreset(
            "llama-2-13b",
            "meta-llama/Llama-2-13b-hf",
            _llama(40, 5120, 40, 40, 13824, 32000, 4096, "float16"),
            13_015_864_320,
            "fp16",
        ),
        ModelPreset(
            "llama-2-70b",
            "meta-llama/Llama-2-70b-hf",
            _llama(80, 8192, 64, 8, 28672, 32000, 4096, "float16"),
            68_976_648_192,
            "fp16",
        ),
        ModelPreset(
            "llama-3-8b",
            "meta-llama/Meta-Llama-3-8B",
            _llama(32, 4096, 32, 8, 14336, 128256, 8192),
            8_030_261_248,
            "bf16",
        ),
        ModelPreset(
            "llama-3-70b",
            "meta-llama/Meta-Llama-3-70B",
            _llama(80, 8192, 64, 8, 28672, 128256, 8192),
            70_553_706_496,
            "bf16",
        ),
        ModelPreset(
            "llama-3.1-8b",
            "meta-llama/Llama-3.1-8B",
            _llama(32, 4096, 32, 8, 14336, 128256, 131072),
            8_030_261_248,
            "bf16",
        ),
        ModelPreset(
            "llama-3.1-70b",
            "meta-llama/Llama-3.1-70B",
            _llama(80, 8192, 64, 8, 28672, 128256, 131072),
            70_553_706_496,
            "bf16",
        ),
        ModelPreset(
            "mistral-7b",
            "mistralai/Mistral-7B-v0.1",
            _llama(32, 4096, 32, 8, 14336, 32000, 32768, model_type="mistral", sliding_window=4096),
            7_241_732_096,
            "bf16",
        ),
        ModelPreset(
            "qwen2.5-0.5b",
            "Qwen/Qwen2.5-0.5B",
            _llama(24, 896, 14, 2, 4864, 151936, 32768, tie_word_embeddings=True, **_QWEN2),
            494_032_768,
            "bf16",
        ),
        ModelPreset(
            "qwen2.5-7b",
            "Qwen/Qwen2.5-7B",
            _llama(28, 3584, 28, 4, 18944, 152064, 131072, **_QWEN2),
            7_615_616_512,
            "bf16",
        ),
        ModelPreset(
            "qwen2.5-72b",
            "Qwen/Qwen2.5-72B",
            _llama(80, 8192, 64, 8, 29568, 152064, 131072, **_QWEN2),
            72_706_203_648,
            "bf16",
        ),
        ModelPreset(
            # 671B parameters in the main model (the 685B on the model card adds the 14B
            # multi-token-prediction module); the published checkpoint stores them in FP8.
            "deepseek-v3",
            "deepseek-ai/DeepSeek-V3",
            {
                "num_hidden_layers": 61,
                "hidden_size": 7168,
                "num_attention_heads": 128,
                "num_key_value_heads": 128,
                "kv_lora_rank": 512,
                "q_lora_rank": 1536,
                "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 128,
                "v_head_dim": 128,
                "intermediate_size": 18432,
                "moe_intermediate_size": 2048,
                "n_routed_experts": 256,
                "n_shared_experts": 1,
                "num_experts_per_tok": 8,
                "vocab_size": 129280,
                "max_position_embeddings": 163840,
                "torch_dtype": "bfloat16",
            },
            671_000_000_000,
            "fp8",
        ),
        ModelPreset(
            # The model of the paged-attention tutorial: LLaMA-7B's shape, 2,048 context,
            # fp16; 2 x 32 x 32 x 128 x 2 B = 512 KiB of KV per token.
            "gpt-tutorial",
            "(paged-attention tutorial)",
            _llama(32, 4096, 32, 32, 11008, 32000, 2048, "float16"),
            6_738_415_616,
            "fp16",
        ),
    )
}

GPU_PRESETS: dict[str, GPUPreset] = {
    gpu.name: gpu
    for gpu in (
        GPUPreset("h100-80gb", "NVIDIA H100 80GB HBM3", 81_559),
        GPUPreset("h200", "NVIDIA H200 141GB HBM3e", 143_771),
        GPUPreset("a100-80gb", "NVIDIA A100 80GB", 81_920),
        GPUPreset("a100-40gb", "NVIDIA A100 40GB", 40_960),
        GPUPreset("l40s", "NVIDIA L40S 48GB", 46_068),
        GPUPreset("l4", "NVIDIA L4 24GB", 23_034),
        GPUPreset("rtx-4090", "NVIDIA GeForce RTX 4090 24GB", 24_564),
    )
}


def gpu_preset(name: str) -> GPUPreset:
    """The GPU preset called `name`, or an error listing the ones there are."""
    try:
        return GPU_PRESETS[name.lower()]
    except KeyError:
        raise UnknownPreset(f"unknown GPU {name!r}; presets: {', '.join(GPU_PRESETS)}") from None


def resolve_model(name_or_path: str, kv_dtype: str | None = None) -> Model:
    """Resolve `--model`: a preset name, a `config.json`, or a model folder.

    Weights come from the preset's published parameter count, else from the `.safetensors`
    files in the folder, else from a dense-decoder parameter count of the config.
    """
    preset = MODEL_PRESETS.get(name_or_path.lower())
    if preset is not None:
        return Model(
            name=preset.name,
            spec=KVSpec.from_hf_config(preset.config, kv_dtype),
            weight_bytes=preset.num_params * DTYPE_BYTES[preset.weight_dtype],
            weight_source=(
                f"{preset.num_params / 1e9:,.2f} B params x "
                f"{DTYPE_BYTES[preset.weight_dtype]} B ({preset.weight_dtype}), published"
            ),
            config=preset.config,
            gpu_weight_bytes=preset.num_params * _gpu_bytes(preset.weight_dtype),
        )
    path = Path(name_or_path)
    if not path.exists():
        raise UnknownPreset(
            f"--model {name_or_path!r} is neither a preset nor an existing path; "
            f"presets: {', '.join(MODEL_PRESETS)}"
        )
    config = load_config(path)
    spec = KVSpec.from_hf_config(config, kv_dtype, source=path)
    name = path.name if path.is_dir() else path.parent.name or path.name
    shards = _checkpoint_files(path) if path.is_dir() else []
    if shards:
        size = sum(shard.stat().st_size for shard in shards)
        dtype = config_dtype(config, str(path))
        source = f"{len(shards)} .safetensors file(s) in {path}"
        loaded = size * _gpu_bytes(dtype) // DTYPE_BYTES[dtype]
        return Model(name, spec, size, source, config, loaded)
    if _is_mixture_of_experts(config):
        return Model(name, spec, None, "unknown: mixture-of-experts config, no checkpoint", config)
    quantization = config.get("quantization_config")
    if isinstance(quantization, Mapping):  # its weights are not values of torch_dtype
        method = quantization.get("quant_method", "unnamed")
        source = f"unknown: a pre-quantised config ({method}) with no checkpoint"
        return Model(name, spec, None, source, config)
    try:
        num_params = dense_param_count(config)
    except ConfigError as error:  # a pool given directly needs no weights
        return Model(name, spec, None, f"unknown: {error}, and no checkpoint", config)
    dtype = config_dtype(config, str(path))
    return Model(
        name,
        spec,
        num_params * DTYPE_BYTES[dtype],
        f"{num_params / 1e9:,.2f} B params x {DTYPE_BYTES[dtype]} B ({dtype}), counted from config",
        config,
        num_params * _gpu_bytes(dtype),
    )


def _gpu_bytes(stored: str) -> int:
    """Bytes a value of a checkpoint stored as `stored` takes on a GPU: bfloat16's 2 for a
    wider float (dtype auto), as stored for a narrower one (fp8 checkpoints stay 1 byte)."""
    return min(DTYPE_BYTES[stored], DTYPE_BYTES["bf16"])


def _checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files the engine's loader reads (`weights/hf_folder.py`): the shards
    `model.safetensors.index.json` names, else `model.safetensors`; none, to count from the
    config. Other files (Mistral's `consolidated.safetensors`, a second copy of the weights)
    are not the model's."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = load_config(index).get("weight_map")
        if not isinstance(weight_map, Mapping) or not weight_map:
            raise ConfigError(f"{index}: no 'weight_map' object naming the shards")
        named = sorted({folder / str(name) for name in weight_map.values()})
        missing = [file.name for file in named if not file.is_file()]
        if missing:
            raise ConfigError(f"{index} names shards that are not there: {', '.join(missing)}")
        return named
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def dense_param_count(config: Mapping[str, object]) -> int:
    """Parameters of a LLaMA-family dense decoder described by `config`.

    Embeddings (and an untied output head), per layer q/k/v/o projections (with the biases
    the family's switches give), a gated MLP of three matrices and two norms, and the final
    norm. Reproduces the published counts of every dense preset exactly, and transformers'
    count of a model of every family pagedkv runs.
    """
    if _is_mixture_of_experts(config):
        raise ConfigError("cannot count parameters of a mixture-of-experts config")
    spec = KVSpec.from_hf_config(config)
    hidden, ffn, vocab, heads = (
        _positive_count(config, key)
        for key in ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads")
    )
    q_dim = heads * spec.head_dim
    kv_dim = spec.num_kv_heads * spec.head_dim
    attention = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    mlp = 3 * hidden * ffn
    model_type = model_type_of(config)
    # Biases as transformers' classes read the switches (`model/registry.py` records the same
    # rules; kvmath sits below it, without torch): Qwen2's q/k/v always, whatever the config
    # says; Llama's and Qwen3's q/k/v/o with attention_bias; Llama's MLP with mlp_bias;
    # Mistral's never.
    if model_type == "qwen2":
        attention += q_dim + 2 * kv_dim
    elif model_type != "mistral" and config.get("attention_bias"):
        attention += q_dim + 2 * kv_dim + hidden
    if model_type == "llama" and config.get("mlp_bias"):
        mlp += 2 * ffn + hidden
    if model_type == "qwen3":  # RMSNorms of each query and key head
        attention += 2 * spec.head_dim
    per_layer = attention + mlp + 2 * hidden
    heads_and_embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return spec.num_layers * per_layer + heads_and_embeddings + hidden


def _positive_count(config: Mapping[str, object], key: str) -> int:
    """`config[key]` as a positive integer; an error naming the key otherwise."""
    if key not in config:
        raise ConfigError(f"config lacks {key}, needed to count parameters")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config {key} must be a positive integer, got {value!r}")
    return value


def _is_mixture_of_experts(config: Mapping[str, object]) -> bool:
    return any(config.get(key) for key in ("n_routed_experts", "num_local_experts", "num_experts"))
