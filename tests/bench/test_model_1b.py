"""`pagedkv.bench.model_1b`: the benchmark's 1B-shape GGUF, written at a small shape here, is a
model both readers take: ours loads it with the shape written and the built-in tokenizer, and
gguf's own dequantiser reads back the weights our loader holds."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from pagedkv.bench.model_1b import SHAPE, write_model_1b
from pagedkv.weights.gguf.model import GGUFModel
from pagedkv.weights.gguf.tensors import gguf_tensors

SMALL = SHAPE | {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128,
                 "attention.head_count": 4, "attention.head_count_kv": 2}  # fmt: skip


@pytest.fixture(scope="module")
def builtin(builtin_gguf) -> GGUFModel:
    return GGUFModel.open(builtin_gguf)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q8_0], ids=lambda t: t.name)
def test_the_model_loads_with_its_shape_and_the_builtin_tokenizer(builtin, tmp_path, qtype):
    path = tmp_path / "small.gguf"
    write_model_1b(path, qtype, SMALL)
    model = GGUFModel.open(path)
    config = model.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (2, 64, 128)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert not config.tie_word_embeddings
    assert config.vocab_size == builtin.config.vocab_size
    text = "Paged attention, 2024."
    assert model.tokenizer().encode(text) == builtin.tokenizer().encode(text)
    theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert theirs["blk.0.ffn_up.weight"].tensor_type == qtype
    ours = dict(gguf_tensors(model.file, config))  # dequantised by our reader
    expected = gguf.quants.dequantize(theirs["blk.1.ffn_down.weight"].data, qtype)
    assert torch.equal(ours["model.layers.1.mlp.down_proj.weight"], torch.from_numpy(expected))
    assert np.all(gguf.quants.dequantize(theirs["output_norm.weight"].data, QType.F32) == 1)
