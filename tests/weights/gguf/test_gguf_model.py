"""GGUF models: a tiny Llama or Qwen2 written to GGUF comes back as the weights it came from."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from pagedkv.model.config import RopeConfig
from pagedkv.model.errors import (
    MalformedModelFile,
    MissingTensor,
    ModelFileMissing,
    TensorShapeMismatch,
    UnsupportedModel,
)
from pagedkv.model.rope import inverse_frequencies
from pagedkv.tokenizer import Tokenizer
from pagedkv.weights.assemble import checkpoint_state
from pagedkv.weights.gguf.config import _llama3_scaling
from pagedkv.weights.gguf.convert import convert_gguf
from pagedkv.weights.gguf.model import GGUFModel
from pagedkv.weights.hf_folder import load_model
from pagedkv.weights.load import load
from tests.model.logits import our_prompt_logits
from tests.model.tiny_models import random_prompt
from tests.weights.gguf.writer import folder_weights, write_model_gguf


def _state(model) -> dict[str, torch.Tensor]:
    return checkpoint_state(model)


@pytest.mark.parametrize("name", ["llama", "llama_linear", "qwen2", "qwen3", "qwen3_untied"])
def test_f32_gguf_gives_back_the_exact_weights(zoo, tiny_gguf, name):
    """Un-permuting q/k (llama only) and renaming restore every tensor bit for bit."""
    gguf_model = GGUFModel.open(tiny_gguf(name))
    ours = gguf_model.model()
    reference = zoo.ours(name)
    # GGUF has no key for Qwen2's sliding window (llama.cpp attends over the full context).
    full = (None,) * reference.config.num_layers
    assert gguf_model.config == replace(reference.config, sliding_windows=full)
    assert _state(ours).keys() == _state(reference).keys()
    for key, tensor in _state(reference).items():
        assert torch.equal(_state(ours)[key], tensor), key


def test_qwen2_biases_are_not_permuted(zoo, tiny_gguf):
    ours = GGUFModel.open(tiny_gguf("qwen2")).model()
    weights = folder_weights(zoo.folder("qwen2"))
    bias = checkpoint_state(ours)["model.layers.0.self_attn.q_proj.bias"]
    assert torch.equal(bias, torch.from_numpy(weights["model.layers.0.self_attn.q_proj.bias"]))


def test_tied_head_when_output_weight_is_absent(tiny_gguf):
    tied = GGUFModel.open(tiny_gguf("llama", drop_tensors=("lm_head.weight",)))
    assert tied.config.tie_word_embeddings
    assert tied.model().lm_head is None
    untied = GGUFModel.open(tiny_gguf("llama"))
    assert not untied.config.tie_word_embeddings
    assert untied.model().lm_head is not None


def test_quantised_gguf_loads_exactly_what_the_quantisers_inverse_gives(zoo, tiny_gguf):
    """Q8_0 matrices: bit for bit the `gguf` package's quantise-then-dequantise of the
    originals (q/k rows permuted and back: Q8_0 blocks lie within rows, so the order of the
    rows does not change their values); vectors stay float32 and come back unchanged."""
    ours = checkpoint_state(GGUFModel.open(tiny_gguf("llama", qtype=QType.Q8_0)).model())
    originals = folder_weights(zoo.folder("llama"))
    assert ours.keys() == originals.keys()
    for name, original in originals.items():
        expected = original
        if original.ndim == 2:
            expected = gguf.quants.dequantize(
                gguf.quants.quantize(original, QType.Q8_0), QType.Q8_0
            )
            assert not np.array_equal(expected, original), name  # the round trip loses bits
        assert torch.equal(ours[name], torch.from_numpy(expected)), name


def test_load_accepts_a_gguf_file_in_any_dtype(tiny_gguf):
    path = tiny_gguf("llama")
    loaded = load(path, dtype="bfloat16")
    assert loaded.path == path
    assert loaded.name == path.stem
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.tokenizer.eos_token_ids == (2,)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_converted_folder_loads_in_transformers_with_the_same_logits(
    zoo, tiny_gguf, tmp_path, name
):
    import transformers

    folder = convert_gguf(tiny_gguf(name), tmp_path / "converted")
    prompt = torch.tensor([random_prompt(12, seed=5)])
    with torch.no_grad():
        converted = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        expected = zoo.hf(name)(prompt).logits
        torch.testing.assert_close(converted(prompt).logits, expected, atol=1e-5, rtol=1e-5)
    assert _state(load_model(folder)).keys() == _state(zoo.ours(name)).keys()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    text = "Paged attention stores keys 42 times."
    assert hf_tokenizer(text)["input_ids"] == Tokenizer.from_folder(folder).encode(text)


def test_converted_folder_tokenises_like_the_gguf_file(tiny_gguf, tmp_path):
    path = tiny_gguf("llama")
    from_file = GGUFModel.open(path).tokenizer()
    from_folder = Tokenizer.from_folder(convert_gguf(path, tmp_path / "converted"))
    text = "Copy on write lets forked sequences share a prompt."
    assert from_file.encode(text) == from_folder.encode(text)
    assert from_file.encode(text)[0] == 1  # add_bos_token
    assert from_file.eos_token_ids == from_folder.eos_token_ids == (2,)
    assert from_file.chat_template == from_folder.chat_template
    assert from_file.special_tokens == from_folder.special_tokens


def test_convert_refuses_a_folder_that_holds_files(tiny_gguf, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(MalformedModelFile.__base__, match="already exists"):
        convert_gguf(tiny_gguf("llama"), tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_convert_leaves_nothing_when_it_fails(tiny_gguf, tmp_path):
    path = tiny_gguf("llama", qtype=QType.Q8_0)
    path.write_bytes(path.read_bytes()[:-100])  # the last tensor is cut short
    with pytest.raises(MalformedModelFile):
        convert_gguf(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize(
    ("key", "pattern"),
    [
        ("llama.block_count", "metadata key 'llama.block_count' is missing"),
        ("llama.embedding_length", "metadata key 'llama.embedding_length' is missing"),
        ("tokenizer.ggml.tokens", "metadata key 'tokenizer.ggml.tokens' is missing"),
        ("tokenizer.ggml.model", "metadata key 'tokenizer.ggml.model' is missing"),
    ],
)
def test_missing_metadata_names_the_key(tiny_gguf, key, pattern):
    with pytest.raises(MalformedModelFile, match=pattern):
        GGUFModel.open(tiny_gguf("llama", metadata={key: None}))


@pytest.mark.parametrize(
    ("metadata", "pattern"),
    [
        ({"general.architecture": "gpt2"}, "architecture 'gpt2' is not supported"),
        ({"llama.rope.dimension_count": 8}, "rope dimension 8 differ"),
        ({"llama.rope.scaling.type": "yarn"}, "rope scaling 'yarn' is not supported"),
        ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model 'bert' is not supported"),
        ({"tokenizer.ggml.pre": "made-up"}, "tokenizer.ggml.pre 'made-up' is not supported"),
    ],
)
def test_unsupported_metadata_is_named(tiny_gguf, metadata, pattern):
    with pytest.raises(UnsupportedModel, match=pattern):
        GGUFModel.open(tiny_gguf("llama", metadata=metadata))


def test_bad_metadata_values_are_named(tiny_gguf):
    with pytest.raises(MalformedModelFile, match="'tokenizer.ggml.eos_token_id' is token id 999"):
        GGUFModel.open(tiny_gguf("llama", metadata={"tokenizer.ggml.eos_token_id": 999}))


@pytest.mark.parametrize(
    ("family", "dropped", "named"),
    [
        ("llama", "model.layers.1.mlp.up_proj.weight", "blk.1.ffn_up.weight"),
        ("llama", "model.norm.weight", "output_norm.weight"),
        ("mistral", "model.embed_tokens.weight", "token_embd.weight"),
        ("qwen3", "model.layers.0.self_attn.k_norm.weight", "blk.0.attn_k_norm.weight"),
    ],
)
def test_missing_tensors_are_named_as_the_file_holds_them(tiny_gguf, family, dropped, named):
    """llama.cpp's name, not the checkpoint's, so the user can find what is missing in the
    file's own tensor list."""
    path = tiny_gguf(family, drop_tensors=(dropped,))
    with pytest.raises(MissingTensor, match=f"tensor '{re.escape(named)}' is missing"):
        GGUFModel.open(path).model()


def test_misshapen_tensors_are_named_as_the_file_holds_them(tiny_gguf):
    path = tiny_gguf("llama", metadata={"llama.feed_forward_length": 64})
    with pytest.raises(
        TensorShapeMismatch, match=r"'blk\.\d+\.ffn_\w+\.weight' has shape .*the metadata implies"
    ):
        GGUFModel.open(path).model()


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(MalformedModelFile, match="not a valid GGUF file"):
        GGUFModel.open(path)
    with pytest.raises(ModelFileMissing):
        GGUFModel.open(tmp_path / "absent.gguf")


def test_linear_rope_scaling_maps_to_the_config(tiny_gguf):
    path = tiny_gguf(
        "llama", metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    )
    config = GGUFModel.open(path).config
    assert (config.rope.scaling, config.rope.factor, config.rope.theta) == ("linear", 2.0, 1e4)


def test_float32_metadata_reads_as_the_decimal_it_was_written_from(tiny_gguf, tmp_path):
    config = GGUFModel.open(tiny_gguf("llama")).config
    assert config.rms_norm_eps == 1e-6  # stored as float32 9.99999997e-07
    folder = convert_gguf(tiny_gguf("llama"), tmp_path / "converted")
    assert json.loads((folder / "config.json").read_text())["rms_norm_eps"] == 1e-6


def _llama3_divisors_by_hand(
    theta: float,
    head_dim: int,
    factor: float,
    context: int = 8192,
    low: float = 1.0,
    high: float = 4.0,
) -> np.ndarray:
    """llama.cpp's converter loop for Llama 3 scaling (published: low 1, high 4, 8,192-token
    context; it writes any config's own)."""
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < context / high:
            divisors.append(1.0)
        elif wavelen > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def test_llama3_rope_freqs_tensor_becomes_llama3_scaling(tiny_gguf):
    divisors = _llama3_divisors_by_hand(10000.0, 16, 8.0)
    assert len(set(divisors.tolist())) > 2  # high, low and blended frequencies all present
    gguf_model = GGUFModel.open(tiny_gguf("llama", extra_tensors={"rope_freqs.weight": divisors}))
    rope = gguf_model.config.rope
    assert (rope.scaling, rope.factor, rope.original_max_position_embeddings) == ("llama3", 8, 8192)
    scaled = inverse_frequencies(rope, 16)
    plain = inverse_frequencies(RopeConfig(theta=10000.0), 16)
    torch.testing.assert_close(scaled, plain / torch.from_numpy(divisors), rtol=1e-5, atol=0)
    assert gguf_model.model().lm_head is not None  # the extra tensor is not taken for a weight


@pytest.mark.parametrize(
    ("theta", "head_dim", "context", "low", "high"),
    [
        (500000.0, 16, 32, 1.0, 4.0),  # no blended frequency: between 6.3 and 32.5 tokens
        (500000.0, 16, 100, 1.0, 4.0),  # one blended: 32.5 tokens
        (10000.0, 32, 100, 1.0, 2.0),  # one blended, high 2 x low: no room for 4
        (10000.0, 128, 4096, 1.0, 4.0),  # several
        (500000.0, 128, 131072, 2.0, 8.0),  # several, another low and high
    ],
)
def test_rope_freqs_of_any_llama3_context_give_the_same_frequencies(
    theta, head_dim, context, low, high
):
    """A file converted from a config of another original context is read as llama.cpp reads
    it: each frequency over its stored divisor."""
    divisors = _llama3_divisors_by_hand(theta, head_dim, 8.0, context, low, high)
    file = SimpleNamespace(
        path=Path("model.gguf"), tensors={"rope_freqs.weight": SimpleNamespace(data=divisors)}
    )
    scaling = _llama3_scaling(file, theta, head_dim)
    rope = RopeConfig(
        theta,
        "llama3",
        scaling["factor"],
        scaling["low_freq_factor"],
        scaling["high_freq_factor"],
        scaling["original_max_position_embeddings"],
    )
    plain = inverse_frequencies(RopeConfig(theta=theta), head_dim)
    scaled = inverse_frequencies(rope, head_dim)
    torch.testing.assert_close(scaled, plain / torch.from_numpy(divisors), rtol=1e-5, atol=0)


def test_the_tiny_llama3_converted_as_llama_cpp_does_gives_transformers_logits(zoo, tmp_path):
    """The tiny `llama3` model (a 32-token original context) written as llama.cpp's converter
    writes it, its scaling only in rope_freqs.weight: transformers' logits of the folder."""
    rope = json.loads((zoo.folder("llama3") / "config.json").read_text())["rope_scaling"]
    assert rope["original_max_position_embeddings"] == 32
    divisors = _llama3_divisors_by_hand(500000.0, 16, rope["factor"], 32)
    path = write_model_gguf(
        tmp_path / "llama3.gguf",
        zoo.folder("llama3"),
        extra_tensors={"rope_freqs.weight": divisors},
    )
    prompt = random_prompt(48, seed=9)
    ours = our_prompt_logits(GGUFModel.open(path).model(), prompt)
    torch.testing.assert_close(ours, zoo.hf_logits("llama3", prompt), rtol=1e-4, atol=1e-4)


def test_rope_freqs_of_another_scheme_are_refused(tiny_gguf):
    divisors = _llama3_divisors_by_hand(10000.0, 16, 8.0)
    divisors[0] = 2.0
    path = tiny_gguf("llama", extra_tensors={"rope_freqs.weight": divisors})
    with pytest.raises(UnsupportedModel, match="rope_freqs.weight is not Llama 3 scaling of any"):
        GGUFModel.open(path)
