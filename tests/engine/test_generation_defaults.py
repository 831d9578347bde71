"""A model's generation_config.json sampling settings are the defaults, as vLLM reads them.

Oracle: vLLM's rule (`ModelConfig.get_diff_sampling_param`): of repetition_penalty,
temperature, top_k, top_p, min_p and max_new_tokens, the values that differ from
transformers' GenerationConfig defaults (1.0, 1.0, 50, 1.0, None, None), max_new_tokens as
max_tokens; `generation_config="vllm"` reads none. A `top_k` of 1 makes sampling greedy, so
the outputs are checked against explicit greedy SamplingParams.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedkv.engine import LLM, SamplingParams
from tests.engine.conftest import make_llm

PROMPTS = ["Paged attention", "Blocks of sixteen tokens"]


def with_generation_config(zoo, tmp_path: Path, settings: dict) -> Path:
    """The tiny Llama folder, its generation_config.json given `settings` too."""
    folder = tmp_path / "llama"
    shutil.copytree(zoo.folder("llama"), folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return folder


def small_llm(folder: Path, **settings) -> LLM:
    return LLM(str(folder), num_gpu_blocks=64, swap_space_gb=0.01, max_model_len=256, **settings)


def test_the_models_settings_are_the_defaults_of_generate_and_chat(engine_zoo, tmp_path) -> None:
    settings = {"top_k": 1, "temperature": 0.7, "max_new_tokens": 3, "top_p": 1.0}
    llm = small_llm(with_generation_config(engine_zoo, tmp_path, settings))
    defaults = llm.get_default_sampling_params()
    # top_p 1.0 is transformers' default: not in the diff, so not a setting.
    assert (defaults.top_k, defaults.temperature, defaults.max_tokens) == (1, 0.7, 3)
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    answers = llm.generate(PROMPTS, use_tqdm=False)
    expected = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in answers] == [o.outputs[0].token_ids for o in expected]
    assert all(len(o.outputs[0].token_ids) <= 3 for o in answers)
    messages = [{"role": "user", "content": "Hi"}]
    [chat] = llm.chat(messages, use_tqdm=False)
    [chat_greedy] = llm.chat(messages, greedy, use_tqdm=False)
    assert chat.outputs[0].token_ids == chat_greedy.outputs[0].token_ids


def test_transformers_defaults_and_generation_config_vllm_set_nothing(engine_zoo, tmp_path) -> None:
    folder = with_generation_config(
        engine_zoo, tmp_path, {"temperature": 1.0, "top_k": 50, "repetition_penalty": 1.1}
    )
    assert small_llm(folder).engine.sampling_defaults == {"repetition_penalty": 1.1}
    ignoring = small_llm(folder, generation_config="vllm")
    assert ignoring.get_default_sampling_params() == SamplingParams()


def test_without_the_file_config_json_gives_them_as_in_vllm(engine_zoo, tmp_path) -> None:
    """vLLM's fallback (`GenerationConfig.from_model_config`): a folder without a
    generation_config.json takes the same keys from config.json, by the same rule; with one,
    config.json's are not read."""
    folder = tmp_path / "llama"
    shutil.copytree(engine_zoo.folder("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    settings = {"temperature": 0.6, "top_k": 50, "max_new_tokens": 5}
    (folder / "config.json").write_text(json.dumps({**config, **settings}))
    (folder / "generation_config.json").unlink()
    assert small_llm(folder).engine.sampling_defaults == {"temperature": 0.6, "max_tokens": 5}
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert small_llm(folder).engine.sampling_defaults == {}


def test_a_plain_folder_has_no_defaults(engine_zoo) -> None:
    llm = make_llm(engine_zoo, "llama")
    assert llm.engine.sampling_defaults == {}
    assert llm.get_default_sampling_params() == SamplingParams()


@pytest.mark.parametrize(
    ("settings", "says"),
    [({"temperature": -1.0}, "temperature"), ({"top_p": 0}, "top_p")],
)
def test_a_bad_generation_config_fails_at_start_naming_the_file(
    engine_zoo, tmp_path, settings, says
) -> None:
    folder = with_generation_config(engine_zoo, tmp_path, settings)
    with pytest.raises(ValueError, match=rf"generation_config.json: {says}"):
        small_llm(folder)


def test_generation_config_names_a_folder_holding_one(engine_zoo, tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"min_p": 0.2}))
    llm = make_llm(engine_zoo, "llama", generation_config=str(other))
    assert llm.engine.sampling_defaults == {"min_p": 0.2}
    with pytest.raises(ValueError, match="no generation_config.json there"):
        make_llm(engine_zoo, "llama", generation_config=str(tmp_path / "missing"))


def test_override_generation_config_sets_keys_over_the_file_as_given(engine_zoo, tmp_path) -> None:
    """vLLM's `override_generation_config`: its keys over the file's diff, values as given
    (top_p 1.0 too, transformers' default), over nothing with generation_config="vllm"."""
    folder = with_generation_config(engine_zoo, tmp_path, {"temperature": 0.7, "top_k": 20})
    override = {"temperature": 0.5, "top_p": 1.0, "max_new_tokens": 7}
    merged = small_llm(folder, override_generation_config=override).engine.sampling_defaults
    assert merged == {"temperature": 0.5, "top_k": 20, "top_p": 1.0, "max_tokens": 7}
    alone = small_llm(folder, generation_config="vllm", override_generation_config='{"top_k": 3}')
    assert alone.get_default_sampling_params() == SamplingParams(top_k=3)
    # vLLM merges, then drops nulls: a null takes the file's value away.
    removed = small_llm(folder, override_generation_config={"temperature": None})
    assert removed.engine.sampling_defaults == {"top_k": 20}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"presence_penalty": 0.5}, "'presence_penalty' not taken"),
        ({"temperature": -1.0}, "override_generation_config: temperature"),
        ("[1]", "override_generation_config must be a JSON object"),
    ],
)
def test_a_bad_override_is_refused_at_start_naming_it(engine_zoo, override, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_llm(engine_zoo, override_generation_config=override)
