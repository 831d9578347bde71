"""The packed-weights cache: a mapped load is the re-packed load, tensor for tensor, and a
cache that no longer stands for its file is never used.

The oracle is a load with the cache out of the way (`MIN_CACHED_BYTES` above the file's size):
the same file re-packed from its blocks, as every load did before the cache.
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.parallel.group import TPGroup, sharding
from pagedkv.quant.formats import QuantizedTensor
from pagedkv.weights.gguf import packed
from pagedkv.weights.gguf.model import GGUFModel
from pagedkv.weights.gguf.tensors import gguf_tensors
from pagedkv.weights.load import load
from pagedkv.worker.kv_cache import KVCache
from tests.model.tiny_models import random_prompt

QTYPES = [QType.Q4_0, QType.Q4_1, QType.Q5_1, QType.Q8_0]
BLOCK_SIZE = 16


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Every file is cached (no size floor), into a folder of the test's own."""
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(packed, "MIN_CACHED_BYTES", 0)
    return tmp_path / "cache" / "packed"


def weights(path) -> list[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The tensors a load of `path` builds its model from (quantised ones as they are)."""
    file = GGUFModel.open(path)
    stream = gguf_tensors(file.file, file.config, keep_quantized=True)
    return list(packed.packed_tensors(file.file, stream))


def uncached(path, monkeypatch) -> list[tuple[str, torch.Tensor | QuantizedTensor]]:
    with monkeypatch.context() as patch:
        patch.setattr(packed, "MIN_CACHED_BYTES", path.stat().st_size + 1)
        return weights(path)


def assert_same(first: list, second: list) -> None:
    assert [name for name, _ in first] == [name for name, _ in second]
    for (name, tensor), (_, other) in zip(first, second, strict=True):
        assert type(tensor) is type(other), name
        if isinstance(tensor, QuantizedTensor):
            assert (tensor.bits, tensor.group_size) == (other.bits, other.group_size), name
            for field in ("values", "scales", "mins"):
                assert torch.equal(getattr(tensor, field), getattr(other, field)), name
        else:
            assert torch.equal(tensor, other), name


def _never_repacked():
    raise AssertionError("re-packed although the cache is current")
    yield


def logits(path, prompt: list[int]) -> torch.Tensor:
    """The last position's logits of the model `load` gives for `path` (quantisation auto)."""
    model = load(path, progress=lambda line: None).model
    blocks = -(-len(prompt) // BLOCK_SIZE)
    cache = KVCache.for_model(model, block_size=BLOCK_SIZE, num_blocks=blocks)
    batch = ForwardBatch.build([SequenceInput(prompt, 0, list(range(blocks)))], BLOCK_SIZE)
    return model(batch, cache)[0]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_a_mapped_load_is_the_repacked_load(tiny_gguf, cache, monkeypatch, qtype):
    path = tiny_gguf("llama", qtype=qtype)
    expected = uncached(path, monkeypatch)
    assert not cache.exists()
    first = weights(path)  # re-packs and writes the cache
    [written] = cache.iterdir()
    assert written == packed.cache_path(path)
    mapped = list(packed.packed_tensors(GGUFModel.open(path).file, _never_repacked()))
    assert_same(first, expected)
    assert_same(mapped, expected)
    assert any(isinstance(t, QuantizedTensor) for _, t in mapped)


def test_download_dir_holds_the_packed_weights_instead_of_the_cache(tiny_gguf, cache, tmp_path):
    """vLLM's download_dir takes the model's files, the re-packed cache among them."""
    path = tiny_gguf("llama", qtype=QType.Q4_0)
    folder = str(tmp_path / "models")
    load(path, download_dir=folder, progress=lambda line: None)
    assert packed.cache_path(path, folder).is_file() and not cache.exists()


def test_a_model_loaded_from_the_cache_computes_the_same_logits(tiny_gguf, cache, monkeypatch):
    path = tiny_gguf("qwen2", qtype=QType.Q4_0)
    prompt = random_prompt(20, seed=1)
    with monkeypatch.context() as patch:
        patch.setattr(packed, "MIN_CACHED_BYTES", path.stat().st_size + 1)
        expected = logits(path, prompt)
    first = logits(path, prompt)  # writes the cache
    assert packed.cache_path(path).is_file()
    assert torch.equal(first, expected)
    assert torch.equal(logits(path, prompt), expected)


def test_a_changed_source_is_repacked(tiny_gguf, cache, monkeypatch):
    path = tiny_gguf("llama", qtype=QType.Q8_0)
    weights(path)
    other = tiny_gguf("qwen2", qtype=QType.Q8_0)  # other weights (and header) at the same path
    os.replace(other, path)
    assert_same(weights(path), uncached(path, monkeypatch))


def test_a_touched_source_is_repacked(tiny_gguf, cache, monkeypatch):
    """Same bytes, new mtime: the stamp differs, so the file is re-packed and the cache
    rewritten (the mtime is what a changed file of the same size and header shows)."""
    path = tiny_gguf("llama", qtype=QType.Q4_0)
    weights(path)
    before = torch.load(packed.cache_path(path), weights_only=True)["stamp"]
    os.utime(path, ns=(0, before["mtime_ns"] + 10**9))
    weights(path)
    after = torch.load(packed.cache_path(path), weights_only=True)["stamp"]
    assert after["mtime_ns"] == before["mtime_ns"] + 10**9
    assert after == packed.stamp(GGUFModel.open(path).file)


def test_a_corrupt_cache_is_repacked_and_rewritten(tiny_gguf, cache, monkeypatch):
    path = tiny_gguf("llama", qtype=QType.Q4_1)
    weights(path)
    target = packed.cache_path(path)
    target.write_bytes(target.read_bytes()[:1000])
    assert_same(weights(path), uncached(path, monkeypatch))
    assert torch.load(target, weights_only=True)["stamp"] == packed.stamp(GGUFModel.open(path).file)


def test_an_unwritable_cache_leaves_the_load_as_it_was(tiny_gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("PAGEDKV_CACHE", str(blocker))
    monkeypatch.setattr(packed, "MIN_CACHED_BYTES", 0)
    path = tiny_gguf("llama", qtype=QType.Q8_0)
    assert_same(weights(path), uncached(path, monkeypatch))


def test_small_files_are_not_cached(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path / "cache"))
    weights(tiny_gguf("llama", qtype=QType.Q8_0))  # kilobytes: re-packing beats mapping
    assert not (tmp_path / "cache").exists()


def test_only_rank_0_of_a_tensor_parallel_load_writes_the_cache(tiny_gguf, cache, monkeypatch):
    """The ranks of a group load the same file: rank 1 re-packs its tensors without keeping
    them for a cache (rank 0 writes the one file), and later maps rank 0's."""
    path = tiny_gguf("llama", qtype=QType.Q8_0)
    expected = uncached(path, monkeypatch)
    with sharding(TPGroup(rank=1, size=2)):
        load(path, progress=lambda line: None)
    assert not cache.exists()
    with sharding(TPGroup(rank=0, size=2)):
        load(path, progress=lambda line: None)
    assert packed.cache_path(path).is_file()
    assert_same(list(packed.packed_tensors(GGUFModel.open(path).file, _never_repacked())), expected)
