"""vLLM's loading keywords: hf_overrides, load_format, tokenizer_mode, cpu_offload_gb and
compilation_config, and its task, implementation and process settings, from Python and from
generated flags (revision: `tests/test_hf_cache.py`).

Oracles: a folder (or GGUF file) whose config.json (metadata) was edited to the overridden
values must give bit-identical outputs and the same context length; the path's own format
decides what load_format accepts; vLLM's documented values decide what is refused.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from pagedkv.engine import LLM, EngineArgs, SamplingParams
from pagedkv.model.errors import ModelError
from tests.engine.conftest import make_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2)
PROMPTS = [[5, 9, 14, 3, 22], [7, 7, 31, 2]]
OVERRIDES = {"rms_norm_eps": 0.25, "max_position_embeddings": 96}
SMALL = dict(num_gpu_blocks=64, swap_space_gb=0.01)


def _edited_folder(source: Path, target: Path, keys: dict) -> Path:
    """A copy of model folder `source` whose config.json has `keys` replaced."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config | keys))
    return target


def _answers(llm: LLM) -> list:
    """Every token id and logprob float of greedy runs over PROMPTS, prompt logprobs too."""
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [
        (
            output.prompt_logprobs,
            [(sample.token_ids, sample.logprobs) for sample in output.outputs],
        )
        for output in outputs
    ]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_hf_overrides_equal_editing_config_json(engine_zoo, tmp_path, name):
    edited = _edited_folder(engine_zoo.folder(name), tmp_path / "edited", OVERRIDES)
    overridden = make_llm(engine_zoo, name, max_model_len=None, hf_overrides=OVERRIDES)
    from_edited = LLM(str(edited), **SMALL)
    plain = make_llm(engine_zoo, name, max_model_len=None)
    assert overridden.engine.max_model_len == from_edited.engine.max_model_len == 96
    assert plain.engine.max_model_len != 96
    assert _answers(overridden) == _answers(from_edited)
    assert _answers(overridden) != _answers(plain)  # the override took effect


def test_hf_overrides_apply_to_a_gguf_files_metadata(engine_zoo, tiny_gguf):
    gguf = tiny_gguf("llama")
    edited = tiny_gguf(
        "llama",
        metadata={
            "llama.attention.layer_norm_rms_epsilon": OVERRIDES["rms_norm_eps"],
            "llama.context_length": OVERRIDES["max_position_embeddings"],
        },
    )
    overridden = LLM(str(gguf), hf_overrides=OVERRIDES, **SMALL)
    from_edited = LLM(str(edited), **SMALL)
    assert overridden.engine.max_model_len == from_edited.engine.max_model_len == 96
    assert _answers(overridden) == _answers(from_edited)


def test_an_override_that_breaks_the_config_is_named_as_the_overrides(engine_zoo):
    with pytest.raises(ModelError, match=r"with hf_overrides.*num_attention_heads"):
        make_llm(engine_zoo, "llama", hf_overrides={"num_key_value_heads": 3})


def test_hf_overrides_from_the_command_line_are_json(engine_zoo):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--hf-overrides", json.dumps(OVERRIDES)])
    assert EngineArgs.from_cli_args(args).hf_overrides == OVERRIDES
    with pytest.raises(ValueError, match="hf_overrides is not valid JSON"):
        EngineArgs(hf_overrides="{max_position_embeddings: 96}")
    with pytest.raises(ValueError, match=r"hf_overrides must be a JSON object .* got \[1\]"):
        EngineArgs(hf_overrides="[1]")


def test_load_format_must_match_the_models_files(engine_zoo, tiny_gguf):
    folder, gguf = engine_zoo.folder("llama"), tiny_gguf("llama")
    assert LLM(str(folder), load_format="safetensors", **SMALL).engine.config.num_layers > 0
    assert LLM(str(gguf), load_format="gguf", **SMALL).engine.config.num_layers > 0
    with pytest.raises(
        ValueError, match=r"load_format .gguf.: model .* is read from a Hugging Face"
    ):
        LLM(str(folder), load_format="gguf", **SMALL)
    with pytest.raises(
        ValueError, match=r"load_format 'safetensors': model .* is read from a \.gguf"
    ):
        LLM(str(gguf), load_format="safetensors", **SMALL)
    with pytest.raises(ValueError, match=r"load_format must be one of .*'gguf'.* got 'pt'"):
        EngineArgs(load_format="pt")


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"tokenizer_mode": "slow"}, r"tokenizer_mode must be one of \('auto', 'hf'\)"),
        ({"tokenizer_mode": "mistral"}, r"tokenizer_mode .* got 'mistral'"),
        ({"revision": 3}, r"revision must be a string, got 3"),
        ({"tokenizer_revision": ["v1"]}, r"tokenizer_revision must be a string"),
        ({"cpu_offload_gb": 4}, r"cpu_offload_gb 4 is not supported"),
        ({"compilation_config": [3]}, r"compilation_config must be a level \(int\) or a dict"),
        ({"pipeline_parallel_size": 2}, r"pipeline_parallel_size 2 is not supported"),
        ({"data_parallel_size": 4}, r"data_parallel_size 4 is not supported"),
        ({"task": "embed"}, r"task 'embed' is not supported: .* generative"),
        ({"runner": "pooling"}, r"runner 'pooling' is not supported"),
        ({"model_impl": "transformers"}, r"model_impl 'transformers' is not supported"),
        ({"distributed_executor_backend": "ray"}, r"distributed_executor_backend 'ray'"),
        (
            {"distributed_executor_backend": "uni", "tensor_parallel_size": 2},
            r"'uni' is not supported: .* \(mp; uni at tensor_parallel_size 1\)",
        ),
        ({"skip_tokenizer_init": True}, r"skip_tokenizer_init is not supported: .* detokenizes"),
        ({"enable_sleep_mode": True}, r"enable_sleep_mode is not supported"),
        ({"max_seq_len_to_capture": "8k"}, r"max_seq_len_to_capture must be an integer"),
    ],
)
def test_vllm_values_pagedkv_cannot_honour_are_refused_by_name(keywords, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**keywords)


def test_vllm_values_that_mean_what_pagedkv_does_are_accepted():
    for keywords in (
        {"tokenizer_mode": "hf"},
        {"revision": None, "tokenizer_revision": None, "cpu_offload_gb": 0},
        {"pipeline_parallel_size": 1, "data_parallel_size": 1},
        {"compilation_config": 3},
        {"compilation_config": {"level": 3}},
        {"task": "generate", "runner": "generate", "model_impl": "vllm"},
        {"distributed_executor_backend": "mp", "tensor_parallel_size": 2},
        {"distributed_executor_backend": "uni"},
    ):
        EngineArgs(**keywords)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for flag, parsed in (("3", 3), ('{"level": 0}', {"level": 0})):
        args = parser.parse_args(["--compilation-config", flag, "--tokenizer-mode", "hf"])
        assert EngineArgs.from_cli_args(args).compilation_config == parsed


def test_vllm_settings_that_only_tune_vllm_change_no_output(engine_zoo):
    """The custom all-reduce, CUDA graph capture, asynchronous scheduling and a Hub token tune
    how vLLM reaches its outputs: taken, every token and logprob float as without them."""
    tuned = make_llm(
        engine_zoo,
        disable_custom_all_reduce=True,
        max_seq_len_to_capture=256,
        async_scheduling=True,
        hf_token="hf_unused",
        task="generate",
        distributed_executor_backend="mp",
    )
    assert _answers(tuned) == _answers(make_llm(engine_zoo))
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    flags = ["--disable-custom-all-reduce", "--max-seq-len-to-capture", "256", "--task", "generate"]
    args = EngineArgs.from_cli_args(parser.parse_args(flags))
    assert (args.disable_custom_all_reduce, args.max_seq_len_to_capture) == (True, 256)
