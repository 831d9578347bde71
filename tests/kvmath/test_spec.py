"""KVSpec: bytes per token from a Hugging Face config, checked against hand arithmetic."""

import json

import pytest

from pagedkv.kvmath.presets import MODEL_PRESETS
from pagedkv.kvmath.spec import ConfigError, GiB, KVSpec, format_bytes

LLAMA_3_8B = MODEL_PRESETS["llama-3-8b"].config


def test_llama_3_8b_fp16_is_128_kib_per_token():
    # 2 (K and V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes
    spec = KVSpec.from_hf_config(LLAMA_3_8B, kv_dtype="fp16")
    assert spec.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072


def test_llama_3_8b_default_dtype_is_the_configs_bf16_same_size():
    spec = KVSpec.from_hf_config(LLAMA_3_8B)
    assert spec.kv_dtype == "bf16"
    assert spec.bytes_per_token == 131_072


def test_llama_3_8b_8k_tokens_is_1_gib_and_128k_is_16_gib():
    spec = KVSpec.from_hf_config(LLAMA_3_8B, kv_dtype="fp16")
    assert spec.bytes_per_request(8 * 1024, 16) == 1 * GiB
    assert spec.bytes_per_request(128 * 1024, 16) == 16 * GiB


@pytest.mark.parametrize(("dtype", "size"), [("fp32", 4), ("fp16", 2), ("bf16", 2), ("fp8", 1)])
def test_kv_dtype_scales_bytes_per_token(dtype, size):
    spec = KVSpec.from_hf_config(LLAMA_3_8B, kv_dtype=dtype)
    assert spec.bytes_per_token == 2 * 32 * 8 * 128 * size


def test_int8_and_torch_dtype_spellings_are_accepted():
    assert KVSpec.from_hf_config(LLAMA_3_8B, kv_dtype="int8").bytes_per_token == 65_536
    config = {**LLAMA_3_8B, "torch_dtype": "float32"}
    assert KVSpec.from_hf_config(config).bytes_per_token == 262_144


def test_gpt_tutorial_is_512_kib_per_token():
    spec = KVSpec.from_hf_config(MODEL_PRESETS["gpt-tutorial"].config)
    assert spec.bytes_per_token == 2 * 32 * 32 * 128 * 2 == 512 * 1024


def test_mla_caches_one_latent_plus_rope_key_without_a_factor_two():
    # DeepSeek-V3: 61 layers x (512 latent + 64 rope) x 2 bytes, not 2 x 128 heads x 128.
    spec = KVSpec.from_hf_config(MODEL_PRESETS["deepseek-v3"].config)
    assert spec.is_mla
    assert spec.values_per_layer == 512 + 64
    assert spec.bytes_per_token == 61 * 576 * 2 == 70_272


def test_head_dim_comes_from_hidden_size_over_heads_when_absent():
    config = {"num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 8}
    spec = KVSpec.from_hf_config(config)
    assert (spec.num_kv_heads, spec.head_dim) == (8, 128)  # no KV heads given: plain MHA
    assert spec.bytes_per_token == 2 * 2 * 8 * 128 * 2  # no dtype given: fp16


def test_explicit_head_dim_wins_over_hidden_size():
    config = {**LLAMA_3_8B, "head_dim": 256}
    assert KVSpec.from_hf_config(config).bytes_per_token == 2 * 32 * 8 * 256 * 2


def test_gpt2_style_field_names_are_read():
    config = {"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024}
    spec = KVSpec.from_hf_config(config)
    assert spec.bytes_per_token == 2 * 12 * 12 * 64 * 2
    assert spec.max_model_len == 1024


def test_a_sliding_window_is_stated_but_every_token_is_held():
    spec = KVSpec.from_hf_config(MODEL_PRESETS["mistral-7b"].config)
    assert spec.sliding_window == 4096
    assert spec.tokens_held(1000) == 1000
    assert spec.tokens_held(32_768) == 32_768
    assert spec.bytes_per_request(32_768, 16) == 32_768 * 131_072
    assert spec.blocks_per_request(32_768, 16) == 2048


def test_layer_types_say_which_layers_are_windowed_in_every_family():
    """transformers windows only the layers `layer_types` marks "sliding_attention"
    (gpt-oss, Gemma): a mix of windowed and full layers has no single window."""
    config = dict(LLAMA_3_8B, model_type="gpt_oss", architectures=["GptOssForCausalLM"])
    config |= {"sliding_window": 128, "num_hidden_layers": 4}
    config["layer_types"] = ["sliding_attention", "full_attention"] * 2
    assert KVSpec.from_hf_config(config).sliding_window is None
    config["layer_types"] = ["sliding_attention"] * 4
    assert KVSpec.from_hf_config(config).sliding_window == 128


def test_sliding_window_is_ignored_when_the_config_disables_it():
    spec = KVSpec.from_hf_config(MODEL_PRESETS["qwen2.5-7b"].config)
    assert spec.sliding_window is None
    assert spec.tokens_held(100_000) == 100_000


def test_blocks_per_request_rounds_up_to_whole_blocks():
    spec = KVSpec.from_hf_config(LLAMA_3_8B)
    assert spec.blocks_per_request(1000, 16) == 63  # 62.5 blocks
    assert spec.blocks_per_request(1008, 16) == 63
    assert spec.bytes_per_block(16) == 16 * 131_072


def test_nested_text_config_is_used_for_multimodal_models():
    spec = KVSpec.from_hf_config({"model_type": "llava", "text_config": dict(LLAMA_3_8B)})
    assert spec.bytes_per_token == 131_072


def test_reads_a_config_file_or_the_folder_holding_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    assert KVSpec.from_hf_config(tmp_path / "config.json").bytes_per_token == 131_072
    assert KVSpec.from_hf_config(tmp_path).bytes_per_token == 131_072


def test_missing_field_is_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 4096, "num_attention_heads": 32}))
    with pytest.raises(ConfigError, match="config.json: missing num_hidden_layers"):
        KVSpec.from_hf_config(path)


def test_negative_value_is_named():
    with pytest.raises(ConfigError, match="num_key_value_heads must be a positive integer, got -8"):
        KVSpec.from_hf_config({**LLAMA_3_8B, "num_key_value_heads": -8})


def test_invalid_json_and_missing_file_are_clear_errors(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        KVSpec.from_hf_config(path)
    with pytest.raises(ConfigError, match="no such config file"):
        KVSpec.from_hf_config(tmp_path / "nope.json")


def test_unknown_dtype_and_indivisible_hidden_size_are_errors():
    with pytest.raises(ConfigError, match="kv dtype 'fp4'"):
        KVSpec.from_hf_config(LLAMA_3_8B, kv_dtype="fp4")
    config = {"num_hidden_layers": 2, "hidden_size": 1000, "num_attention_heads": 3}
    with pytest.raises(ConfigError, match="not a multiple"):
        KVSpec.from_hf_config(config)


def test_negative_token_count_is_an_error():
    with pytest.raises(ConfigError, match="num_tokens"):
        KVSpec.from_hf_config(LLAMA_3_8B).bytes_per_request(-1, 16)


def test_format_bytes_prints_decimal_and_binary_units():
    assert format_bytes(GiB) == "1.07 GB / 1.00 GiB"
    assert format_bytes(131_072) == "131.07 kB / 128.00 KiB"
    assert format_bytes(12) == "12 B"
