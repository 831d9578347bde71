"""Rope frequencies equal transformers' for default, linear and Llama 3.1 scaling."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagedkv.model.config import RopeConfig, load_config
from pagedkv.model.rope import apply_rope, inverse_frequencies, rope_cos_sin
from pagedkv.weights.hf_folder import load_model
from tests.model.logits import hf_prompt_logits, our_prompt_logits
from tests.model.tiny_models import TINY_MODELS, build_model_folder, random_prompt

LLAMA31 = RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)  # Llama 3.1 8B's published values


@pytest.mark.parametrize(
    ("rope", "hf_parameters"),
    [
        (RopeConfig(theta=10000.0), {"rope_type": "default", "rope_theta": 10000.0}),
        (
            RopeConfig(theta=10000.0, scaling="linear", factor=4.0),
            {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        ),
        (
            LLAMA31,
            {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ],
)
def test_inverse_frequencies_equal_transformers(rope, hf_parameters):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, rope_parameters=hf_parameters
    )
    if hf_parameters["rope_type"] == "default":
        expected = 1.0 / (10000.0 ** (torch.arange(0, 128, 2).float() / 128))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[hf_parameters["rope_type"]](config, "cpu")
    torch.testing.assert_close(inverse_frequencies(rope, 128), expected, rtol=0, atol=0)


def test_llama3_scaling_keeps_high_slows_low_and_blends_the_middle():
    plain = inverse_frequencies(RopeConfig(theta=500000.0), 128)
    scaled = inverse_frequencies(LLAMA31, 128)
    wavelength = 2 * torch.pi / plain
    high, low = wavelength < 8192 / 4, wavelength > 8192
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    middle = ~high & ~low
    assert middle.any()
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()


def test_rotation_preserves_norms_and_depends_only_on_relative_position():
    inv_freq = inverse_frequencies(RopeConfig(), 16)
    q, k = torch.randn(1, 2, 16), torch.randn(1, 2, 16)

    def rotated_dot(q_pos: int, k_pos: int) -> torch.Tensor:
        cos, sin = rope_cos_sin(inv_freq, torch.tensor([q_pos, k_pos]), torch.float32)
        q_rot = apply_rope(q, cos[:1], sin[:1])
        k_rot = apply_rope(k, cos[1:], sin[1:])
        torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1))
        return (q_rot * k_rot).sum(-1)

    torch.testing.assert_close(rotated_dot(7, 3), rotated_dot(104, 100), atol=1e-4, rtol=1e-4)


def test_a_top_level_pretraining_context_wins_over_the_rope_dicts_as_in_transformers(tmp_path):
    """A config.json with `original_max_position_embeddings` both at top level (64) and in
    its Llama 3 rope dict (32): transformers' rope setup takes the top level's (Phi-3 keeps
    its there), so the logits must be those of 64, transformers' own output the oracle."""
    llama3 = TINY_MODELS["llama3"]
    spec = replace(
        llama3, legacy_rope={**llama3.legacy_rope, "original_max_position_embeddings": 64}
    )
    folder = build_model_folder("llama3", tmp_path / "both", spec=spec)
    assert load_config(folder).rope.original_max_position_embeddings == 64
    prompt = random_prompt(48, seed=3)  # past 64 / 4 tokens: the scaled wavelengths matter
    ours = our_prompt_logits(load_model(folder), prompt)
    torch.testing.assert_close(ours, hf_prompt_logits(folder, prompt), rtol=1e-4, atol=1e-4)
