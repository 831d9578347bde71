"""`load()`: one entry point for Hugging Face folders, GGUF files and built-in names.

Every expectation is read from the files themselves, with other readers than the loader's:
json for config.json, safetensors' numpy reader for the weights, `tokenizers` for the
tokenizer, `gguf.GGUFReader` for GGUF metadata.
"""

from __future__ import annotations

import json

import gguf
import pytest
import tokenizers
import torch

from pagedkv.hub import UnknownModelName
from pagedkv.weights.assemble import checkpoint_state
from pagedkv.weights.load import LoadedModel, load
from tests.weights.gguf.writer import folder_weights

TEXT = "Copy on write lets forked sequences share a prompt until they diverge."


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_load_folder_gives_the_files_config_weights_and_tokenizer(zoo, name):
    folder = zoo.folder(name)
    loaded = load(folder)
    assert isinstance(loaded, LoadedModel)
    assert (loaded.path, loaded.name) == (folder, str(folder))
    raw = json.loads((folder / "config.json").read_text())
    config = loaded.config
    assert loaded.model.config == config
    assert config.architecture == raw["architectures"][0]
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        raw["vocab_size"],
        raw["hidden_size"],
        raw["intermediate_size"],
    )
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        raw["num_hidden_layers"],
        raw["num_attention_heads"],
        raw["num_key_value_heads"],
        raw["hidden_size"] // raw["num_attention_heads"],
    )
    assert (config.rms_norm_eps, config.max_position_embeddings) == (
        raw["rms_norm_eps"],
        raw["max_position_embeddings"],
    )
    assert config.rope.theta == raw["rope_parameters"]["rope_theta"]
    assert config.tie_word_embeddings == raw["tie_word_embeddings"]

    weights = folder_weights(folder)
    state = checkpoint_state(loaded.model)
    # A tied checkpoint may still carry the head; the model reads logits through the embedding.
    assert state.keys() == weights.keys() - (
        {"lm_head.weight"} if raw["tie_word_embeddings"] else set()
    )
    for key, tensor in state.items():
        assert torch.equal(tensor, torch.from_numpy(weights[key])), key

    generation = json.loads((folder / "generation_config.json").read_text())
    assert loaded.tokenizer.eos_token_ids == (generation["eos_token_id"],)
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert loaded.tokenizer.encode(TEXT) == reference.encode(TEXT).ids


def test_load_in_bfloat16_rounds_the_files_weights(zoo):
    folder = zoo.folder("qwen2")
    loaded = load(folder, dtype="bfloat16")
    weights = folder_weights(folder)
    for key, tensor in checkpoint_state(loaded.model).items():
        expected = torch.from_numpy(weights[key]).to(torch.bfloat16)
        assert torch.equal(tensor, expected), key


def test_load_gguf_gives_the_files_metadata_and_tensors(tiny_gguf):
    path = tiny_gguf("qwen3")
    loaded = load(path)
    assert (loaded.path, loaded.name) == (path, path.stem)
    reader = gguf.GGUFReader(path)

    def field(key: str):
        return reader.fields[key].contents()

    config = loaded.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (
        field("qwen3.block_count"),
        field("qwen3.embedding_length"),
        field("qwen3.feed_forward_length"),
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        field("qwen3.attention.head_count"),
        field("qwen3.attention.head_count_kv"),
        field("qwen3.attention.key_length"),
    )
    assert config.rope.theta == pytest.approx(field("qwen3.rope.freq_base"))
    assert loaded.tokenizer.eos_token_ids == (field("tokenizer.ggml.eos_token_id"),)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hidden_size, vocab_size = (int(n) for n in embedding.shape)  # innermost dimension first
    assert (config.vocab_size, config.hidden_size) == (vocab_size, hidden_size)
    # Stored unquantised (f32) and unpermuted, so the model holds exactly these values.
    stored = torch.from_numpy(embedding.data.copy()).reshape(vocab_size, hidden_size)
    assert torch.equal(checkpoint_state(loaded.model)["model.embed_tokens.weight"], stored)


def test_load_unknown_model_names_it_and_the_builtin_names(tmp_path):
    with pytest.raises(UnknownModelName, match="nowhere.*smollm2-135m-instruct"):
        load(tmp_path / "nowhere")
