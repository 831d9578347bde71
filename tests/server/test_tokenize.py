"""`/tokenize` and `/detokenize` (vLLM's): the ids transformers' tokenizer gives, the ids the
completion endpoints then run, and text back from ids."""

from __future__ import annotations

import pytest

from tests.server.conftest import RunningServer

PROMPT = "Paged attention stores keys and values in fixed-size blocks."
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a KV block?"},
]


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(num_gpu_blocks=64, max_model_len=96)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_a_prompt_as_transformers_does(server, hf_tokenizer, add_special_tokens) -> None:
    body = {"prompt": PROMPT, "add_special_tokens": add_special_tokens, "return_token_strs": True}
    answer = server.post("/tokenize", body).json()
    expected = hf_tokenizer(PROMPT, add_special_tokens=add_special_tokens)["input_ids"]
    assert answer == {
        "count": len(expected),
        "max_model_len": 96,
        "tokens": expected,
        "token_strs": hf_tokenizer.convert_ids_to_tokens(expected),
    }


def test_tokenize_a_conversation_gives_the_ids_chat_completions_runs(
    server, hf_tokenizer, model_name: str
) -> None:
    answer = server.post("/tokenize", {"messages": MESSAGES}).json()
    text = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert answer["tokens"] == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert answer["token_strs"] is None
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 1, "return_token_ids": True}
    ran = server.post("/v1/chat/completions", body).json()
    assert ran["prompt_token_ids"] == answer["tokens"]
    without = server.post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    expected = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert without.json()["tokens"] == hf_tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_detokenize_is_transformers_decode_with_special_tokens(server, hf_tokenizer) -> None:
    ids = hf_tokenizer(PROMPT)["input_ids"] + [hf_tokenizer.eos_token_id]
    answer = server.post("/detokenize", {"tokens": ids}).json()
    assert answer == {"prompt": hf_tokenizer.decode(ids)}
    round_trip = server.post("/tokenize", {"prompt": answer["prompt"], "add_special_tokens": False})
    assert (
        round_trip.json()["tokens"]
        == hf_tokenizer(answer["prompt"], add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": None}, 400, "prompt"),  # null is omitted: a prompt body
        ("/tokenize", {"prompt": "hi", "model": "another-model"}, 404, "model"),
        ("/detokenize", {"tokens": [1], "model": "another-model"}, 404, "model"),
    ],
)
def test_bad_bodies_name_the_field(server, path, body, status, param) -> None:
    response = server.post(path, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
