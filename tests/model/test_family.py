"""A family whose MLP differs from Llama's is its own module plus one registry entry.

The module here stands for such a family's file: a `DecoderModel` subclass naming its MLP. Its
entry declares the activation its config says and leaves the one-call C decode off (that code
computes Llama's SwiGLU), so every step runs its layers op by op.
"""

from __future__ import annotations

import json
import shutil

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.model.decoder import MLP, DecoderModel
from pagedkv.model.registry import ARCHITECTURES, Architecture
from pagedkv.weights.load import load
from pagedkv.worker.kv_cache import KVCache


class GeluMLP(MLP):
    """down(gelu(gate(x)) * up(x)): the Llama MLP's weights, another activation."""

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GeluModel(DecoderModel):
    """The family's decoder: Llama's, with `GeluMLP`."""

    mlp_class = GeluMLP


ENTRY = Architecture(
    name="GeluLlamaForCausalLM",
    model_type="gelu_llama",
    model_class_path=f"{__name__}:GeluModel",
    hidden_acts=("gelu_pytorch_tanh",),
)


def test_a_family_with_another_mlp_is_its_module_and_one_entry(zoo, monkeypatch, tmp_path):
    monkeypatch.setitem(ARCHITECTURES, ENTRY.name, ENTRY)
    folder = tmp_path / "gelu"
    shutil.copytree(zoo.folder("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=[ENTRY.name], hidden_act="gelu_pytorch_tanh")
    (folder / "config.json").write_text(json.dumps(config))

    model = load(folder, quantization="int8").model
    assert all(type(layer.mlp) is GeluMLP for layer in model.layers)
    assert [run.weights for run in model.layer_path.runs] == [None]
    cache = KVCache.for_model(model, block_size=4, num_blocks=8)
    prompt = model(ForwardBatch.build([SequenceInput([5, 6, 7], 0, [0, 1])], 4), cache)
    decode = model(ForwardBatch.build([SequenceInput([8], 3, [0, 1])], 4), cache)
    assert torch.isfinite(prompt).all() and torch.isfinite(decode).all()
    plain = load(zoo.folder("llama"), quantization="int8").model
    other = plain(
        ForwardBatch.build([SequenceInput([5, 6, 7], 0, [0, 1])], 4),
        KVCache.for_model(plain, block_size=4, num_blocks=8),
    )
    assert not torch.equal(prompt, other)  # the family's own MLP ran
