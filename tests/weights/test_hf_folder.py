"""Loader: single and sharded safetensors, three dtypes, and errors that name file and cause."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.model.errors import (
    MalformedModelFile,
    MissingTensor,
    ModelError,
    ModelFileMissing,
    TensorShapeMismatch,
    UnsupportedModel,
)
from pagedkv.weights.hf_folder import load_model
from pagedkv.weights.load import load
from pagedkv.worker.kv_cache import KVCache
from tests.model.tiny_models import random_prompt
from tests.weights.gguf.writer import folder_weights


@pytest.fixture
def llama_copy(zoo, tmp_path):
    """A writable copy of the single-file tiny Llama folder."""
    return shutil.copytree(zoo.folder("llama"), tmp_path / "llama")


@pytest.fixture
def sharded_copy(zoo, tmp_path):
    """A writable copy of the sharded tiny Qwen2 folder."""
    return shutil.copytree(zoo.folder("qwen2"), tmp_path / "qwen2")


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_sharded_checkpoint_loads_the_same_weights_as_a_single_file(zoo, tmp_path):
    single = load_model(zoo.folder("llama"))
    zoo.hf("llama").save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded = load_model(tmp_path)
    assert single.state_dict().keys() == sharded.state_dict().keys()
    for name, tensor in single.state_dict().items():
        assert torch.equal(tensor, sharded.state_dict()[name]), name


def test_tied_model_reads_logits_through_the_embedding(zoo):
    folder = zoo.folder("qwen2")
    model = load_model(folder)
    assert model.lm_head is None
    assert "lm_head.weight" not in dict(model.named_parameters())
    assert all(not p.requires_grad for p in model.parameters())
    final_hidden: list[torch.Tensor] = []
    model.norm.register_forward_hook(lambda module, args, out: final_hidden.append(out.clone()))
    prompt = random_prompt(20, seed=4)
    cache = KVCache.for_model(model.config, block_size=16, num_blocks=2)
    logits = model(ForwardBatch.build([SequenceInput(prompt, 0, [0, 1])], 16), cache)
    embedding = torch.from_numpy(folder_weights(folder)["model.embed_tokens.weight"])
    [hidden] = final_hidden  # the final norm's output at the last position
    torch.testing.assert_close(logits, hidden @ embedding.T, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_half_precision_is_as_close_to_float32_as_transformers(zoo, name, dtype):
    import transformers

    model = load_model(zoo.folder(name), dtype=dtype)
    dtype = model.embed_tokens.weight.dtype
    assert dtype in (torch.bfloat16, torch.float16)
    assert all(p.dtype == dtype for p in model.parameters())
    prompt = random_prompt(60, seed=3)
    cache = KVCache.for_model(model.config, block_size=16, num_blocks=8, dtype=dtype)
    ours = model(ForwardBatch.build([SequenceInput(prompt, 0, [3, 1, 7, 5])], 16), cache)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        zoo.folder(name), attn_implementation="eager", dtype=dtype
    )
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0, -1].float()
    exact = zoo.hf_logits(name, prompt)[-1]
    assert ours.dtype == torch.float32
    assert (ours - exact).abs().max() <= 2 * (theirs - exact).abs().max() + 1e-3


def test_unsupported_dtype_is_rejected(zoo):
    with pytest.raises(ValueError, match="dtype 'float64' is not supported"):
        load_model(zoo.folder("llama"), dtype="float64")


def test_missing_config(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(ModelFileMissing, match=r"llama/config\.json: missing"):
        load_model(llama_copy)


def test_malformed_config_json(llama_copy):
    (llama_copy / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]')
    with pytest.raises(MalformedModelFile, match=r"config\.json: not valid JSON"):
        load_model(llama_copy)


def test_unsupported_architecture(llama_copy):
    edit_config(llama_copy, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedModel, match=r"config\.json: architecture 'GPTNeoXForCausalLM'"):
        load_model(llama_copy)


def test_no_safetensors(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ModelFileMissing, match=r"model\.safetensors: missing \(no weights"):
        load_model(llama_copy)


def test_missing_tensor_names_file_and_tensor(llama_copy):
    path = llama_copy / "model.safetensors"
    weights = load_file(path)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, path)
    with pytest.raises(MissingTensor) as raised:
        load_model(llama_copy)
    assert str(raised.value).endswith(
        "model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' is missing"
    )


def test_shape_disagreeing_with_config(llama_copy):
    edit_config(llama_copy, intermediate_size=96)
    with pytest.raises(
        TensorShapeMismatch,
        match=r"down_proj.weight. has shape \[64, 128\], config\.json implies \[64, 96\]",
    ):
        load_model(llama_copy)


def test_unexpected_tensor(llama_copy):
    path = llama_copy / "model.safetensors"
    weights = load_file(path)
    weights["model.layers.0.self_attn.q_proj.qweight"] = torch.zeros(2)
    save_file(weights, path)
    with pytest.raises(
        MalformedModelFile, match="unexpected tensor 'model.layers.0.self_attn.q_proj.qweight'"
    ):
        load_model(llama_copy)


def test_corrupt_safetensors(llama_copy):
    (llama_copy / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(MalformedModelFile, match=r"model\.safetensors: not a valid safetensors"):
        load_model(llama_copy)


def test_shard_named_in_the_index_but_absent(sharded_copy):
    index = json.loads((sharded_copy / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (sharded_copy / shard).unlink()
    with pytest.raises(ModelFileMissing, match=rf"{shard}: missing \(a shard named in"):
        load_model(sharded_copy)


def test_index_listing_a_tensor_its_shard_lacks(sharded_copy):
    index_path = sharded_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(MissingTensor, match=rf"{shard}: tensor 'model.layers.0.mlp.extra.weight'"):
        load_model(sharded_copy)


def test_tensor_absent_from_the_index_names_the_index(sharded_copy):
    index_path = sharded_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.1.self_attn.k_proj.bias"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(MissingTensor) as raised:
        load_model(sharded_copy)
    assert isinstance(raised.value, ModelError)
    assert str(raised.value).endswith(
        "model.safetensors.index.json: tensor 'model.layers.1.self_attn.k_proj.bias' is missing"
    )


def test_index_naming_a_shard_with_a_non_string(sharded_copy):
    index_path = sharded_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = 3
    index_path.write_text(json.dumps(index))
    with pytest.raises(MalformedModelFile) as raised:
        load_model(sharded_copy)
    assert str(raised.value).endswith(
        "model.safetensors.index.json: weight_map['model.norm.weight'] must be a shard file "
        "name, got 3"
    )


@pytest.mark.parametrize("where", ["relative", "absolute", "parent"])
def test_index_may_not_point_outside_the_folder(sharded_copy, tmp_path, where):
    index_path = sharded_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    # A real shard lies outside, so only the name check stands between the index and it.
    outside = tmp_path / "outside.safetensors"
    shutil.copy(sharded_copy / index["weight_map"]["model.norm.weight"], outside)
    shard = {"relative": "../outside.safetensors", "absolute": str(outside), "parent": ".."}[where]
    index["weight_map"]["model.norm.weight"] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(MalformedModelFile) as raised:
        load_model(sharded_copy)
    assert str(raised.value).endswith(
        f"model.safetensors.index.json: weight_map['model.norm.weight'] names shard {shard!r}, "
        "which is not a file name inside the model folder"
    )


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_integer_and_fp8_weights_are_rejected_not_cast(llama_copy, dtype):
    """Codes of a pre-quantised checkpoint (integers, or fp8 whose scales live in other
    tensors) cast to float would be plausible-looking wrong weights."""
    path = llama_copy / "model.safetensors"
    weights = load_file(path)
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"], dtype=dtype)
    save_file(weights, path)
    dtype_name = str(dtype).removeprefix("torch.")
    with pytest.raises(MalformedModelFile) as raised:
        load_model(llama_copy)
    assert f"model.safetensors: tensor 'model.norm.weight' has dtype {dtype_name}, " in str(
        raised.value
    )
    assert "pre-quantised checkpoints are not read" in str(raised.value)


@pytest.mark.parametrize("method", ["fp8", "gptq", "compressed-tensors"])
def test_a_pre_quantised_checkpoint_is_refused_by_its_quantization_config(llama_copy, method):
    """A config.json whose quantization_config names a method (its float weights may hold
    pre-scaled values) is refused naming the method, before any weight is read."""
    config_path = llama_copy / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {"quant_method": method}
    config_path.write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match=f"quant_method '{method}'.*not read"):
        load(str(llama_copy))
