"""LoRA adapters over the OpenAI API, as vLLM serves them: chosen by `model`, listed by
/v1/models, loaded and unloaded at run time behind a flag, drawn on the page map.

The oracle for the text is the offline `LLM` with the same adapter (itself checked against
transformers + peft in tests/engine/test_lora.py): the server must change nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedkv.engine import LLM, LoRARequest, SamplingParams
from pagedkv.server import ServerConfig
from pagedkv.server.adapters import LoRAModulePath, parse_lora_module
from tests.hub_cache import cache_repo, commit_of

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PROMPT = "Paged attention stores keys"
# vLLM's JSON form of --lora-modules, whose base_model_name /v1/models lists as the parent.
DELTA = {"name": "delta", "base_model_name": "org/base-model"}


def make_adapter(model: Path, folder: Path, seed: int, targets: list[str]) -> Path:
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    adapted = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3)
    adapted.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server_lora")
    return {
        "alpha": make_adapter(tiny_model, root / "alpha", 1, ["q_proj", "v_proj", "down_proj"]),
        "beta": make_adapter(tiny_model, root / "beta", 2, ["o_proj", "gate_proj", "up_proj"]),
    }


@pytest.fixture(scope="module")
def server(serve, adapters):
    modules = (
        LoRAModulePath("alpha", str(adapters["alpha"])),
        parse_lora_module(json.dumps(DELTA | {"path": str(adapters["beta"])})),
    )
    config = ServerConfig(lora_modules=modules, allow_runtime_lora_updating=True)
    return serve(config, enable_lora=True, max_loras=2, num_gpu_blocks=256)


def offline(tiny_model: Path, lora: LoRARequest | None) -> str:
    llm = LLM(str(tiny_model), enable_lora=True, max_loras=2, num_gpu_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return llm.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text


def complete(client, model: str) -> str:
    response = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
    )
    return response.choices[0].text


def test_models_lists_the_adapters(client, model_name, adapters, tiny_model):
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {model_name, "alpha", "delta"}
    assert cards[model_name].root == str(tiny_model)  # vLLM's: the model as it was given
    assert cards["alpha"].parent == model_name
    assert cards["alpha"].root == str(adapters["alpha"].resolve())
    assert cards["delta"].parent == "org/base-model"
    assert cards["delta"].root == str(adapters["beta"].resolve())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("alpha", "takes name=path or a JSON object"),
        ('{"name": "a"}', '"name" and "path"'),
        ('{"name": "a", "path": "p", "parent": "b"}', '"name" and "path"'),
        ('{"name": "a", "path": "p", "base_model_name": 3}', "base_model_name must be a string"),
        ('{"name": "a", "path": ', "is not valid JSON"),
    ],
)
def test_a_bad_lora_module_is_named(text, message):
    with pytest.raises(ValueError, match=message):
        parse_lora_module(text)
    assert parse_lora_module("a=b=c") == LoRAModulePath("a", "b=c")


def test_model_chooses_the_adapter(client, model_name, tiny_model, adapters):
    alpha = LoRARequest("alpha", 1, str(adapters["alpha"]))
    assert complete(client, "alpha") == offline(tiny_model, alpha)
    assert complete(client, model_name) == offline(tiny_model, None)
    assert complete(client, "alpha") != complete(client, model_name)
    chat = client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "alpha"
    assert client.completions.create(model="alpha", prompt=PROMPT, max_tokens=2).model == "alpha"


def test_page_map_shows_the_adapter_blocks(server, client):
    complete(client, "alpha")
    with server.http() as http:
        snapshot = http.get("/v1/kv").json()
    [(first, count, name)] = [run for run in snapshot["adapters"] if run[2] == "alpha"]
    assert count > 0
    assert all(snapshot["gpu"][block]["ref_count"] == 1 for block in range(first, first + count))


def test_runtime_load_and_unload(server, client, tiny_model, adapters, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cache_repo(
        tmp_path / "hub", "org/alpha", {commit_of("a"): adapters["alpha"]}, {"main": commit_of("a")}
    )
    with server.http() as http:
        by_repo = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "hub-alpha", "lora_path": "org/alpha"}
        )
        assert by_repo.status_code == 200, by_repo.text  # vLLM's: a repo id, from the cache
        alpha = LoRARequest("hub-alpha", 3, str(adapters["alpha"]))
        assert complete(client, "hub-alpha") == offline(tiny_model, alpha)
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "hub-alpha"}).is_success
        loaded = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": str(adapters["beta"])}
        )
        assert loaded.status_code == 200, loaded.text
        beta = LoRARequest("beta", 2, str(adapters["beta"]))
        assert complete(client, "beta") == offline(tiny_model, beta)
        again = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": str(adapters["beta"])}
        )
        assert again.status_code == 400 and "already served" in again.text
        missing = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": "/nowhere"}
        )
        assert missing.status_code == 400 and "no such folder" in missing.text
        engine = server.app.state.engine_loop.engine
        beta_id = next(
            lora.lora_int_id for lora in engine.loras.requests.values() if lora.lora_name == "beta"
        )
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "beta"}).status_code == 200
        assert beta_id not in engine.list_loras()  # its weights and blocks go with the name
        nameless = http.post("/v1/unload_lora_adapter", json={})
        assert nameless.status_code == 400 and "lora_name" in nameless.text
        gone = http.post("/v1/completions", json={"model": "beta", "prompt": PROMPT})
        assert gone.status_code == 404 and "does not exist" in gone.text
        unknown = http.post("/v1/unload_lora_adapter", json={"lora_name": "beta"})
        assert unknown.status_code == 404


def test_runtime_updates_are_off_without_the_flag(serve):
    plain = serve(enable_lora=True)
    with plain.http() as http:
        response = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
    assert response.status_code == 404
