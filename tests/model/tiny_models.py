"""Seeded tiny Hugging Face model folders, written the way `save_pretrained` writes real ones.

Each folder holds config.json, safetensors weights (sharded for some), a byte-level BPE
`tokenizer.json` trained on a small corpus, tokenizer_config.json with a chat template, and
generation_config.json. transformers is used only here, to make the folders and as the oracle.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 320  # the model's; the tokenizer uses fewer ids, as real checkpoints often do
BOS, EOS, UNK = "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [UNK, BOS, EOS]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = [
    "Paged attention stores keys and values in fixed-size blocks.",
    "A block table maps each sequence's logical blocks to physical ones.",
    "Copy on write lets forked sequences share a prompt until they diverge.",
    "Swapping moves blocks to host memory when the device runs out.",
    "The quick brown fox jumps over the lazy dog, twice; then it rests.",
    "Hello world! Ünïcödé and emoji 🙂 must round trip through bytes.",
]

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    # Wider than the usual 0.02 so random logits are spread out: greedy comparisons then
    # never hinge on a near-tie that float rounding could flip.
    initializer_range=0.25,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclass(frozen=True)
class TinyModel:
    """How to build one tiny checkpoint: a transformers class name and its config."""

    architecture: str
    config: dict[str, Any]
    max_shard_size: str | None = None
    # Rewrite config.json in the older `rope_theta` + `rope_scaling` form after saving.
    legacy_rope: dict[str, Any] | None = None
    # Draw every RMSNorm weight from N(1, 0.5) instead of transformers' ones.
    random_norms: bool = False
    # Added to the build seed: a model whose greedy output ends at EOS within a few tokens of
    # a test prompt cannot show a fork or a swap that comes later, so it is drawn again.
    seed_offset: int = 0


TINY_MODELS: dict[str, TinyModel] = {
    "llama": TinyModel("LlamaForCausalLM", dict(_COMMON, rope_theta=10000.0)),
    # Llama 3.1 scaling with a 32-token "pre-training" context: with head_dim 16 the rope
    # wavelengths fall on both sides of and between the cut-offs (8 and 32 tokens).
    "llama3": TinyModel(
        "LlamaForCausalLM",
        dict(_COMMON, num_key_value_heads=1),
        legacy_rope={
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "llama_linear": TinyModel(
        "LlamaForCausalLM",
        dict(_COMMON, attention_bias=True, mlp_bias=True),
        legacy_rope={"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
    ),
    "mistral": TinyModel(
        "MistralForCausalLM", dict(_COMMON, sliding_window=16, head_dim=32), max_shard_size="60KB"
    ),
    # Qwen2 with every switch on: q/k/v bias, tied embeddings, and a sliding window on the
    # second layer only (layers from max_window_layers on).
    "qwen2": TinyModel(
        "Qwen2ForCausalLM",
        dict(
            _COMMON,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=24,
            max_window_layers=1,
        ),
        max_shard_size="60KB",
    ),
    # Qwen3: per-head q/k RMSNorm and a head_dim (32) that is not hidden_size / heads (16);
    # tied, and untied with attention biases. Norm weights are randomised (transformers
    # initialises them to ones), so a q/k norm loaded wrongly or skipped changes the logits.
    "qwen3": TinyModel(
        "Qwen3ForCausalLM",
        dict(_COMMON, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0),
        random_norms=True,
    ),
    "qwen3_untied": TinyModel(
        "Qwen3ForCausalLM",
        dict(_COMMON, head_dim=32, tie_word_embeddings=False, attention_bias=True),
        max_shard_size="60KB",
        random_norms=True,
        seed_offset=2,
    ),
}


def build_model_folder(
    name: str, folder: Path, seed: int = 0, spec: TinyModel | None = None
) -> Path:
    """Save the seeded tiny model `name` (or `spec`, a model outside `TINY_MODELS`) with
    tokenizer files into `folder`; return it."""
    import transformers

    spec = spec or TINY_MODELS[name]
    config_class = getattr(transformers, spec.architecture.replace("ForCausalLM", "Config"))
    model_class = getattr(transformers, spec.architecture)
    torch.manual_seed(seed + spec.seed_offset)
    model = model_class(config_class(**spec.config)).eval()
    if spec.random_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(1.0, 0.5)
    if spec.max_shard_size is None:
        model.save_pretrained(folder)
    else:
        model.save_pretrained(folder, max_shard_size=spec.max_shard_size)
    if spec.legacy_rope is not None:
        config_path = folder / "config.json"
        config = json.loads(config_path.read_text())
        config.pop("rope_parameters", None)
        config.update(spec.legacy_rope)
        config_path.write_text(json.dumps(config, indent=2))
    write_tokenizer_files(folder)
    return folder


def write_tokenizer_files(folder: Path, eos_token_id: int | list[int] = 2) -> None:
    """tokenizer.json, tokenizer_config.json (with chat template), generation_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer().save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": {"__type": "AddedToken", "content": EOS, "special": True},  # older form
        "unk_token": UNK,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation_config = {"bos_token_id": 1, "eos_token_id": eos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(generation_config, indent=2))


def copy_with_chat_template(source: Path, target: Path, template: str) -> Path:
    """A copy of model folder `source` at `target` whose tokenizer has chat template `template`
    (a tokenizer told apart from the model's own by what it renders)."""
    shutil.copytree(source, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return target


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE over CORPUS, adding BOS to every encoding like Llama's tokenizer."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    return tokenizer


def random_prompt(length: int, seed: int) -> list[int]:
    """Seeded random token ids, avoiding the special ids 0-2."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist()
