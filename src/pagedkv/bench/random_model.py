"""The benchmark's default model: a seeded random Llama of about 20M parameters, made on first use.

Random weights are enough to measure throughput (every request runs to its exact length with
ignore_eos), and a seeded model needs no download. It is written as a Hugging Face folder so
that pagedkv and transformers load the very same weights.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

# Built-in name of the seeded random Llama, as `--model` takes it.
RANDOM_MODEL = "random-llama-20m"


def random_model_folder(seed: int = 0, root: Path | None = None) -> Path:
    """The seeded random Llama of about 20M parameters as a Hugging Face folder (made once).

    8 layers of width 384 (6 heads, 2 KV heads of 64), MLP 1152, and a byte-level BPE tokenizer
    of 8192 ids trained on seeded pseudo-words, so every id the model can emit decodes.
    """
    from pagedkv.hub import cache_dir

    root = root if root is not None else cache_dir() / "bench"
    folder = root / f"{RANDOM_MODEL}-seed{seed}"
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{folder.name}.partial-{time.time_ns()}"
    _write_random_model(staging, seed)
    try:
        staging.rename(folder)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _write_random_model(folder: Path, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer(seed, vocab_size=8192)
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=384,
        intermediate_size=1152,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": (
            "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
            "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
        ),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def _train_tokenizer(seed: int, vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    syllables = sorted({rng.choice(letters) + rng.choice("aeiouy") for _ in range(400)})
    words = [
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(60_000)
    ]
    corpus = [" ".join(words[i : i + 20]) for i in range(0, len(words), 20)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer
