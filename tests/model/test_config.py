"""ModelConfig: each family's config.json, in old and new rope forms, becomes one record."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pagedkv.kvmath.families import layer_windows
from pagedkv.kvmath.presets import MODEL_PRESETS
from pagedkv.kvmath.spec import ConfigError, KVSpec
from pagedkv.model.config import ModelConfig, RopeConfig, load_config, read_config
from pagedkv.model.errors import MalformedModelFile, ModelFileMissing, UnsupportedModel
from pagedkv.weights.hf_folder import load_model
from pagedkv.worker.kv_cache import bytes_per_block
from tests.model.logits import hf_prompt_logits, our_prompt_logits
from tests.model.tiny_models import TINY_MODELS, build_model_folder, random_prompt

SOURCE = Path("model/config.json")
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
}
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def parse(**overrides) -> ModelConfig:
    return ModelConfig.from_dict({**LLAMA, **overrides}, SOURCE)


def test_llama_shapes_and_defaults():
    config = parse()
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (32, 32, 8)
    assert config.head_dim == 128  # hidden_size / num_attention_heads when absent
    assert config.rope == RopeConfig(theta=10000.0)
    assert not (config.qkv_bias or config.o_bias or config.mlp_bias or config.tie_word_embeddings)
    assert config.sliding_windows == (None,) * 32
    assert parse(num_key_value_heads=None).num_kv_heads == 32  # absent: multi-head attention


def test_old_and_new_rope_forms_give_the_same_config():
    old = parse(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    new = parse(rope_parameters={**LLAMA3_SCALING, "rope_theta": 500000.0})
    assert old == new
    assert old.rope == RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)


def test_rope_defaults_and_fallbacks():
    assert parse(rope_scaling=None, rope_theta=1e6).rope == RopeConfig(theta=1e6)
    linear = parse(rope_scaling={"type": "linear", "factor": 4.0}).rope  # "type", not "rope_type"
    assert (linear.scaling, linear.factor, linear.theta) == ("linear", 4.0, 10000.0)
    without_original = {
        k: v for k, v in LLAMA3_SCALING.items() if k != "original_max_position_embeddings"
    }
    assert parse(rope_scaling=without_original).rope.original_max_position_embeddings == 131072
    assert (
        parse(
            rope_scaling=without_original, original_max_position_embeddings=4096
        ).rope.original_max_position_embeddings
        == 4096
    )


def test_qwen2_biases_tying_and_per_layer_windows():
    qwen = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4}
    qwen.update(tie_word_embeddings=True, sliding_window=4096, max_window_layers=2)
    config = ModelConfig.from_dict(qwen, SOURCE)
    assert (config.qkv_bias, config.o_bias, config.tie_word_embeddings) == (True, False, True)
    assert config.sliding_windows == (None,) * 4  # use_sliding_window is off (as in Qwen2.5)
    windowed = ModelConfig.from_dict({**qwen, "use_sliding_window": True}, SOURCE)
    assert windowed.sliding_windows == (None, None, 4096, 4096)
    layer_types = ["sliding_attention", "full_attention"] * 2
    typed = ModelConfig.from_dict(
        {**qwen, "use_sliding_window": True, "layer_types": layer_types}, SOURCE
    )
    assert typed.sliding_windows == (4096, None, 4096, None)


def test_mistral_window_applies_to_every_layer():
    mistral = {**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_dict(mistral, SOURCE).sliding_windows == (4096,) * 32
    no_window = {**mistral, "sliding_window": None}
    assert ModelConfig.from_dict(no_window, SOURCE).sliding_windows == (None,) * 32


def test_llama_attention_bias_covers_all_four_projections():
    config = parse(attention_bias=True, mlp_bias=True)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (True, True, True)


def test_model_type_stands_in_for_a_missing_architectures_list():
    config = ModelConfig.from_dict(
        {**LLAMA, "architectures": None, "model_type": "mistral"}, SOURCE
    )
    assert config.architecture == "MistralForCausalLM"


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            UnsupportedModel,
            "'GPT2LMHeadModel' is not supported",
        ),
        ({"architectures": None}, MalformedModelFile, "neither 'architectures'"),
        ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            UnsupportedModel,
            "rope type 'yarn'",
        ),
        (
            {"rope_scaling": {"rope_type": "linear"}},
            MalformedModelFile,
            "'rope_scaling.factor' is missing",
        ),
        ({"num_hidden_layers": "32"}, MalformedModelFile, "num_hidden_layers must be an integer"),
        ({"hidden_size": None}, MalformedModelFile, "'hidden_size' is missing"),
        (
            {"num_key_value_heads": 5},
            MalformedModelFile,
            "not a multiple of num_key_value_heads (5)",
        ),
        ({"tie_word_embeddings": "yes"}, MalformedModelFile, "tie_word_embeddings must be true"),
    ],
)
def test_bad_configs_raise_typed_errors_naming_file_and_field(overrides, error, message):
    with pytest.raises(error) as raised:
        parse(**overrides)
    assert str(raised.value).startswith(f"{SOURCE}: ")
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rms_norm_eps": 0}, "rms_norm_eps must be a positive number, got 0"),
        ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be a positive number, got -1e-05"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number, got nan"),
        ({"rope_theta": 0.0}, "rope_theta must be a positive number, got 0.0"),
        ({"rope_theta": float("inf")}, "rope_theta must be a finite number, got inf"),
        (
            {"rope_scaling": {"type": "linear", "factor": 0.0}},
            "rope_scaling.factor must be a positive number, got 0.0",
        ),
        (
            {"rope_scaling": {"type": "linear", "factor": -2.0}},
            "rope_scaling.factor must be a positive number, got -2.0",
        ),
        (
            {"rope_parameters": {**LLAMA3_SCALING, "factor": 0}},
            "rope_parameters.factor must be a positive number, got 0",
        ),
        (
            {"rope_parameters": {**LLAMA3_SCALING, "rope_theta": -1.0}},
            "rope_parameters.rope_theta must be a positive number, got -1.0",
        ),
        (
            {"rope_scaling": {**LLAMA3_SCALING, "low_freq_factor": 0.0}},
            "rope_scaling.low_freq_factor must be a positive number, got 0.0",
        ),
        (
            {"rope_scaling": {**LLAMA3_SCALING, "high_freq_factor": 1.0}},
            "rope_scaling.high_freq_factor (1.0) must be greater than "
            "rope_scaling.low_freq_factor (1.0)",
        ),
        (
            {"rope_scaling": {**LLAMA3_SCALING, "factor": float("nan")}},
            "rope_scaling.factor must be a finite number, got nan",
        ),
    ],
)
def test_numbers_that_would_make_inf_or_nan_are_rejected(overrides, message):
    with pytest.raises(MalformedModelFile) as raised:
        parse(**overrides)
    assert str(raised.value) == f"{SOURCE}: {message}"


def test_load_config_errors_name_the_file(tmp_path):
    with pytest.raises(ModelFileMissing, match=r"config\.json: missing"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(MalformedModelFile, match=r"config\.json: not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(MalformedModelFile, match="expected a JSON object, got list"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert load_config(tmp_path) == parse()
    # JSON as Python writes it may hold NaN; no config field means it.
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "rms_norm_eps": float("nan")}))
    with pytest.raises(MalformedModelFile, match=r"config\.json: rms_norm_eps must be a finite"):
        load_config(tmp_path)


# --- One reader: the planner's KVSpec and the model's ModelConfig agree on every config ---

_PLANNER_SUPPORTED = [
    name for name, preset in MODEL_PRESETS.items() if "kv_lora_rank" not in preset.config
]
_WINDOW_CASES = {
    # Llama ignores a stray window (transformers does); the planner once windowed it.
    "llama with stray window": {**LLAMA, "sliding_window": 4096},
    "mistral": {**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 4096},
    # Qwen2 windows only layers >= max_window_layers; the planner once windowed all of them.
    "qwen2 upper layers": {
        **LLAMA,
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 16,
    },
    "qwen2 window off": {
        **LLAMA,
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": False,
        "sliding_window": 4096,
    },
    "qwen2 every layer": {
        **LLAMA,
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 0,
    },
    "qwen3 upper layers": {
        **LLAMA,
        "architectures": ["Qwen3ForCausalLM"],
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 20,
    },
    "qwen3 window off": {
        **LLAMA,
        "architectures": ["Qwen3ForCausalLM"],
        "use_sliding_window": False,
        "sliding_window": 4096,
    },
}


def _assert_planner_and_model_agree(raw: dict, source: Path) -> None:
    spec = KVSpec.from_hf_config(raw)
    model = ModelConfig.from_dict(raw, source)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (
        model.num_layers,
        model.num_kv_heads,
        model.head_dim,
    )
    assert spec.max_model_len == model.max_position_embeddings
    windows = set(model.sliding_windows)
    assert spec.sliding_window == (windows.pop() if len(windows) == 1 else None)
    for dtype, name in ((torch.float16, "fp16"), (torch.float32, "fp32")):
        planned = KVSpec.from_hf_config(raw, name).bytes_per_block(16)
        assert planned == bytes_per_block(model, 16, dtype)


@pytest.mark.parametrize("name", _PLANNER_SUPPORTED)
def test_planner_and_model_agree_on_every_llama_family_preset(name):
    _assert_planner_and_model_agree(dict(MODEL_PRESETS[name].config), SOURCE)


@pytest.mark.parametrize("case", list(_WINDOW_CASES))
def test_planner_and_model_agree_on_sliding_windows(case):
    _assert_planner_and_model_agree(_WINDOW_CASES[case], SOURCE)


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_planner_and_model_agree_on_every_tiny_model(zoo, name):
    folder = zoo.folder(name)
    raw = read_config(folder)
    _assert_planner_and_model_agree(raw, folder / "config.json")
    assert KVSpec.from_hf_config(folder) == KVSpec.from_hf_config(raw)


def test_qwen2_partial_window_is_not_a_per_request_cap_for_the_planner():
    spec = KVSpec.from_hf_config(_WINDOW_CASES["qwen2 upper layers"])
    assert spec.sliding_window is None  # the lower layers keep every token
    assert ModelConfig.from_dict(_WINDOW_CASES["qwen2 upper layers"], SOURCE).sliding_windows == (
        (None,) * 16 + (4096,) * 16
    )


@pytest.mark.parametrize("case", ["qwen3 upper layers", "qwen3 window off"])
def test_qwen3_windows_the_layers_transformers_windows(case):
    """The oracle: transformers' own Qwen3Config marks each layer sliding or full."""
    import transformers

    raw = _WINDOW_CASES[case]
    fields = {key: value for key, value in raw.items() if key != "architectures"}
    theirs = transformers.Qwen3Config(**fields).layer_types
    expected = tuple(4096 if kind == "sliding_attention" else None for kind in theirs)
    assert ModelConfig.from_dict(raw, SOURCE).sliding_windows == expected


def test_mistral_windows_follow_transformers_where_the_config_is_silent_or_typed():
    """The oracle: transformers' own config classes. A Mistral config without the key has
    MistralConfig's window (4,096); one with `layer_types` (Ministral's) windows only the
    layers marked sliding."""
    import transformers

    fields = {key: value for key, value in LLAMA.items() if key != "architectures"}
    silent = {**LLAMA, "architectures": ["MistralForCausalLM"]}
    expected = transformers.MistralConfig(**fields).sliding_window
    assert ModelConfig.from_dict(silent, SOURCE).sliding_windows == (expected,) * 32 == (4096,) * 32
    kinds = ["sliding_attention", "full_attention"] * 16
    typed = {**silent, "sliding_window": 512, "layer_types": kinds}
    theirs = transformers.MinistralConfig(**fields, sliding_window=512, layer_types=kinds)
    windows = tuple(512 if kind == "sliding_attention" else None for kind in theirs.layer_types)
    assert ModelConfig.from_dict(typed, SOURCE).sliding_windows == windows
    _assert_planner_and_model_agree(typed, SOURCE)
    _assert_planner_and_model_agree(silent, SOURCE)


def test_a_qwen3_config_without_head_dim_has_transformers_default():
    import transformers

    # hidden_size / heads is 64 here: the default is not that.
    fields = {
        key: value for key, value in LLAMA.items() if key not in ("architectures", "head_dim")
    }
    fields |= {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8}
    raw = {**fields, "architectures": ["Qwen3ForCausalLM"]}
    expected = transformers.Qwen3Config(**fields).head_dim
    assert ModelConfig.from_dict(raw, SOURCE).head_dim == expected == 128
    _assert_planner_and_model_agree(raw, SOURCE)
    named_by_type = {**fields, "model_type": "qwen3"}  # no architectures: the type says Qwen3
    assert ModelConfig.from_dict(named_by_type, SOURCE).head_dim == 128
    _assert_planner_and_model_agree(named_by_type, SOURCE)


@pytest.mark.parametrize(
    ("config_class", "architecture"),
    [
        ("LlamaConfig", "LlamaForCausalLM"),
        ("MistralConfig", "MistralForCausalLM"),
        ("MistralConfig", None),
        ("Qwen2Config", "Qwen2ForCausalLM"),
        ("Qwen3Config", "Qwen3ForCausalLM"),
        ("Qwen3Config", None),
    ],
)
def test_keys_left_out_take_transformers_class_defaults(config_class, architecture):
    """The oracle: transformers' config class built from the same keys. KV heads, head size
    and context left out of config.json are its defaults (Mistral's 8 KV heads and 131,072
    positions, Qwen's 32 and 32,768), not the query heads or Llama's 2,048; the planner
    reads the same."""
    import transformers

    fields = {"num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 32}
    theirs = getattr(transformers, config_class)(**fields)
    raw = {**fields, "model_type": theirs.model_type, "intermediate_size": 512, "vocab_size": 300}
    if architecture is not None:
        raw["architectures"] = [architecture]
    ours = ModelConfig.from_dict(raw, SOURCE)
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // 32
    assert (ours.num_kv_heads, ours.head_dim, ours.max_position_embeddings) == (
        theirs.num_key_value_heads,
        head_dim,
        theirs.max_position_embeddings,
    )
    _assert_planner_and_model_agree(raw, SOURCE)


def test_the_class_of_defaults_is_the_model_types_as_transformers_picks_it():
    """A config naming `MistralForCausalLM` with `model_type` "llama" is a LlamaConfig to
    transformers (AutoConfig goes by the type): its defaults, not Mistral's."""
    import transformers

    fields = {"num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 32}
    raw = {**fields, "model_type": "llama", "architectures": ["MistralForCausalLM"]}
    raw |= {"intermediate_size": 512, "vocab_size": 300}
    theirs = transformers.AutoConfig.for_model("llama", **fields)
    ours = ModelConfig.from_dict(raw, SOURCE)
    assert (ours.num_kv_heads, ours.max_position_embeddings) == (
        theirs.num_key_value_heads,
        theirs.max_position_embeddings,
    )
    _assert_planner_and_model_agree(raw, SOURCE)


def test_kv_heads_that_do_not_divide_the_query_heads_are_refused_by_both():
    """Qwen2Config's default of 32 KV heads over 14 query heads: the error says where the 32
    comes from, and the planner refuses the config too."""
    raw = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_hidden_layers": 2,
        "hidden_size": 896,
        "num_attention_heads": 14,
        "intermediate_size": 512,
        "vocab_size": 300,
    }
    with pytest.raises(MalformedModelFile, match=r"\(32, its config class default"):
        ModelConfig.from_dict(raw, SOURCE)
    with pytest.raises(ConfigError, match="14 is not a multiple of num_key_value_heads 32"):
        KVSpec.from_hf_config(raw)


def _transformers_windows(config) -> tuple[int | None, ...]:
    """Each layer's window as transformers' own config class sets it."""
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    window = config.sliding_window
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


@pytest.mark.parametrize(
    ("config_class", "architecture", "extra"),
    [
        ("MistralConfig", "MistralForCausalLM", {"use_sliding_window": False}),
        ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
        ("MinistralConfig", "MinistralForCausalLM", {}),
        ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 2}),
        ("Qwen3Config", None, {"use_sliding_window": True, "max_window_layers": 3}),
        ("Qwen3Config", None, {"use_sliding_window": False}),
    ],
)
def test_windows_are_the_ones_transformers_configs_set(config_class, architecture, extra):
    """The oracle: transformers' config class built from the same keys (a key left out takes
    its default: a 4,096-token window where these families have one)."""
    import transformers

    fields = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, **extra}
    theirs = getattr(transformers, config_class)(**fields)
    raw = {**fields, "model_type": theirs.model_type, "intermediate_size": 512, "vocab_size": 300}
    if architecture is not None:
        raw["architectures"] = [architecture]
    assert layer_windows(raw, 4) == _transformers_windows(theirs)


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3"])
def test_bias_switches_a_family_does_not_read_are_ignored_as_transformers_ignores_them(
    name, tmp_path
):
    """`attention_bias` and `mlp_bias` written into a config whose transformers class has no
    such bias (Mistral: both; Qwen2, Qwen3: `mlp_bias`; Qwen2 always biases q/k/v): the
    checkpoint transformers saves has no bias tensors and loads; ours must load it and give
    transformers' own logits."""
    spec = TINY_MODELS[name]
    spec = replace(spec, config={**spec.config, "attention_bias": True, "mlp_bias": True})
    folder = build_model_folder(name, tmp_path / name, spec=spec)
    assert json.loads((folder / "config.json").read_text())["mlp_bias"] is True
    prompt = random_prompt(20, seed=5)
    ours = our_prompt_logits(load_model(folder), prompt)
    torch.testing.assert_close(ours, hf_prompt_logits(folder, prompt), rtol=1e-4, atol=1e-4)


def test_swish_is_silu_as_transformers_reads_it(tmp_path):
    """`hidden_act: swish` names SiLU in transformers' activations: the model loads and gives
    transformers' own logits."""
    spec = replace(
        TINY_MODELS["llama"], config={**TINY_MODELS["llama"].config, "hidden_act": "swish"}
    )
    folder = build_model_folder("llama", tmp_path / "swish", spec=spec)
    assert json.loads((folder / "config.json").read_text())["hidden_act"] == "swish"
    prompt = random_prompt(20, seed=5)
    ours = our_prompt_logits(load_model(folder), prompt)
    torch.testing.assert_close(ours, hf_prompt_logits(folder, prompt), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("head_dim", [5, 7, 64])
def test_an_odd_head_dim_is_refused_as_transformers_refuses_it(head_dim):
    """Rotary embeddings turn pairs of a head's values, so an odd head cannot be rotated:
    transformers' config class refuses it, and so do we, rather than running it wrong."""
    import transformers

    raw = {**LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim}
    fields = {key: value for key, value in raw.items() if key != "architectures"}
    try:
        transformers.LlamaConfig(**fields)
    except Exception:  # noqa: BLE001  # its validator's error type varies by version
        with pytest.raises(UnsupportedModel, match=f"head_dim {head_dim} is odd"):
            ModelConfig.from_dict(raw, SOURCE)
    else:
        assert ModelConfig.from_dict(raw, SOURCE).head_dim == head_dim
