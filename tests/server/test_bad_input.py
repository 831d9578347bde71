"""Bad requests get 4xx in OpenAI's error shape while the server keeps serving everyone else.

The module's server requires an API key, so the same requests also check authentication.
"""

from __future__ import annotations

import json
import threading

import httpx2
import openai
import pytest

from pagedkv.server import ServerConfig
from tests.server.conftest import RunningServer, all_blocks_free, wait_until
from tests.test_cli import serve_args

API_KEY = "test-key-123"
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(ServerConfig(api_key=API_KEY), num_gpu_blocks=256, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def model_name(server: RunningServer) -> str:
    with server.client() as client:
        return client.models.list().data[0].id


def assert_openai_error(response, status: int, param: str | None = None, says: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"]
    assert says.lower() in error["message"].lower()
    if param is not None:
        assert error["param"] == param
    return error


def post(server: RunningServer, path: str, body: bytes | dict):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with server.http() as http:
        return http.post(path, content=content, headers={"Content-Type": "application/json"})


BAD_COMPLETIONS = [
    pytest.param(b'{"prompt": "hi", ', None, "malformed JSON", id="malformed-json"),
    pytest.param(b"[1, 2]", None, "", id="not-an-object"),
    pytest.param({"prompt": "hi", "max_tokens": "ten"}, "max_tokens", "integer", id="str-int"),
    pytest.param({"prompt": "hi", "max_tokens": 2.5}, "max_tokens", "integer", id="float-int"),
    pytest.param({"prompt": "hi", "temperature": "hot"}, "temperature", "", id="str-float"),
    pytest.param({"prompt": "hi", "stream": "yes"}, "stream", "bool", id="str-bool"),
    pytest.param({"prompt": 5}, "prompt", "must be a string", id="int-prompt"),
    pytest.param({"prompt": []}, "prompt", "non-empty", id="empty-prompt"),
    pytest.param({"prompt": "hi", "max_tokens": -1}, "max_tokens", "", id="negative-max-tokens"),
    pytest.param({"prompt": "hi", "n": 10_000}, "n", "", id="n-10000"),
    pytest.param({"prompt": "hi", "temperature": 3}, "temperature", "", id="temperature-3"),
    pytest.param({"prompt": "hi", "top_p": 0}, "top_p", "", id="top-p-0"),
    pytest.param({"prompt": "hi", "logprobs": 50}, "logprobs", "", id="logprobs-50"),
    pytest.param({"prompt": "hi", "stop": [""]}, "stop", "empty", id="empty-stop"),
    pytest.param({"prompt": [7] * 300}, None, "prompt has 300 tokens", id="prompt-too-long"),
    pytest.param({"prompt": "hi", "max_tokens": 500}, None, "model allows 128", id="no-room"),
    pytest.param({"prompt": [1, 99_999]}, "prompt", "vocabulary", id="token-out-of-vocab"),
    # A union's members each fail: say what the nearest one wanted, or all of them.
    pytest.param({"prompt": "hi", "stop": [1, 2]}, "stop.0", "valid string", id="stop-ints"),
    pytest.param({"prompt": "hi", "stop": 5}, "stop", "string, or a valid array", id="stop-int"),
    pytest.param({"prompt": "hi", "logit_bias": {"5": "x"}}, "logit_bias.5", "", id="bias-str"),
    # The engine's checks name the field too.
    pytest.param({"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias", "", id="bias-id"),
    pytest.param({"prompt": "hi", "stop_token_ids": [99_999]}, "stop_token_ids", "", id="stop-id"),
    pytest.param({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", "", id="allow-0"),
    pytest.param({"prompt": "hi", "bad_words": [" "]}, "bad_words", "", id="blank-bad-word"),
    pytest.param(
        {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens", "", id="min-over-max"
    ),
    pytest.param({"prompt": "hi", "guided_regex": "[a-"}, "guided_regex", "", id="regex"),
    pytest.param(
        {"prompt": "hi", "structured_outputs": {"regex": "[a-"}},
        "structured_outputs",
        "",
        id="structured-regex",
    ),
    pytest.param({"prompt": "hi", "priority": 5}, "priority", "scheduling", id="priority-fcfs"),
]


@pytest.mark.parametrize(("body", "param", "says"), BAD_COMPLETIONS)
def test_bad_completion_requests_get_400(server: RunningServer, body, param, says) -> None:
    assert_openai_error(post(server, "/v1/completions", body), 400, param, says)


BAD_CHATS = [
    pytest.param({"messages": "hi"}, "messages", "", id="messages-str"),
    pytest.param({"messages": []}, "messages", "", id="no-messages"),
    pytest.param({"messages": [{"role": "wizard", "content": "x"}]}, None, "", id="bad-role"),
    pytest.param({"messages": [{"role": "user"}]}, None, "", id="no-content"),
    pytest.param(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages.0.content",
        "'image_url' are not supported",
        id="image-part",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages.0.content",
        "needs a string 'text'",
        id="text-part-without-text",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"}},
        "tool_choice.function",
        "required",
        id="tool-choice-without-function",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": "any"},
        "tool_choice",
        "'required', or an object",
        id="tool-choice-any",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": 5}]},
        "messages.0.content",
        "string or a list of content parts",
        id="int-content",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs",
        "logprobs",
        id="top-logprobs-alone",
    ),
    pytest.param(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
        "top_logprobs",
        "at most 20",
        id="top-logprobs-50",
    ),
]


@pytest.mark.parametrize(("body", "param", "says"), BAD_CHATS)
def test_bad_chat_requests_get_400(server: RunningServer, body, param, says) -> None:
    assert_openai_error(post(server, "/v1/chat/completions", body), 400, param, says)


def test_a_10_mb_body_gets_413(server: RunningServer) -> None:
    body = json.dumps({"prompt": "x" * 10_000_000}).encode()
    assert_openai_error(post(server, "/v1/completions", body), 413, says="larger than")


def test_the_openai_client_raises_bad_request_with_the_message(
    server: RunningServer, model_name: str
) -> None:
    with server.client() as client, pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model_name, prompt="hi", max_tokens=-5)


def test_missing_or_wrong_api_key_gets_401(server: RunningServer, model_name: str) -> None:
    body = {"prompt": "hi", "max_tokens": 1}
    with httpx2.Client(base_url=server.url) as http:  # no key by default
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}]:
            response = http.post("/v1/completions", json=body, headers=headers)
            assert_openai_error(response, 401, says="api key")
            assert_openai_error(http.get("/v1/models", headers=headers), 401)
        assert http.get("/health").status_code == 200  # probes and scrapers need no key
        assert http.get("/metrics").status_code == 200
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=model_name, prompt="hi", max_tokens=1)


def test_any_of_several_api_keys_is_accepted(serve, model_name: str) -> None:
    """vLLM's `--api-key K1 K2`: each key is accepted, no other; an empty one is none."""
    keyed = serve(ServerConfig(api_key=("first", "", "second")), num_gpu_blocks=64)
    body = {"model": model_name, "prompt": "hi", "max_tokens": 1}
    with httpx2.Client(base_url=keyed.url) as http:
        for key, status in [("first", 200), ("second", 200), ("x", 401), ("firstsecond", 401)]:
            headers = {"Authorization": f"Bearer {key}"}
            assert http.post("/v1/completions", json=body, headers=headers).status_code == status
        bare = {"Authorization": "Bearer"}  # the empty key: never one
        assert http.post("/v1/completions", json=body, headers=bare).status_code == 401
    # repeated, as one value each: a model typed after a key is never taken for a second key
    typed = serve_args(["--api-key", "first", "--api-key=second", "/models/m"])
    assert (typed.api_key, typed.model_tag) == (["first", "second"], "/models/m")
    for empty in ("", "  "):  # an unset variable in a script: refused, not an open server
        with pytest.raises(SystemExit):
            serve_args(["--api-key", empty])


def test_page_map_stream_needs_the_key_and_starts_with_a_full_frame(server: RunningServer) -> None:
    with httpx2.Client(base_url=server.url) as http:
        assert http.get("/").status_code == 200  # the page itself asks for the key
        assert_openai_error(http.get("/v1/kv/stream"), 401)
    with server.http() as http, http.stream("GET", "/v1/kv/stream") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        data = next(line for line in stream.iter_lines() if line.startswith("data: "))
    frame = json.loads(data.removeprefix("data: "))
    assert frame["type"] == "full" and len(frame["gpu"]) == frame["num_gpu_blocks"] == 256


def test_unknown_route_gets_404_in_openai_shape(server: RunningServer) -> None:
    with server.http() as http:
        assert_openai_error(http.get("/v1/nothing"), 404)


def test_server_keeps_serving_a_stream_through_a_barrage_of_bad_requests(
    server: RunningServer, model_name: str
) -> None:
    texts: list[str] = []

    def stream() -> None:
        with server.client() as client:
            chunks = client.completions.create(
                model=model_name, prompt="Hello", max_tokens=100, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            texts.append("".join(chunk.choices[0].text for chunk in chunks if chunk.choices))

    worker = threading.Thread(target=stream)
    worker.start()
    for body, *_ in (case.values for case in BAD_COMPLETIONS):
        assert 400 <= post(server, "/v1/completions", body).status_code < 500
    # Bodies just under the 2 MiB limit that nest (or open) two million levels deep: refused
    # by the parser's depth limit as malformed, without harming the server.
    for deep in (b"{" * 2_000_000, b'{"prompt": ' + b"[" * 2_000_000):
        assert_openai_error(post(server, "/v1/completions", deep), 400, says="malformed JSON")
    worker.join(timeout=60)
    assert len(texts) == 1 and texts[0]
    with server.client() as client:
        usage = client.completions.create(
            model=model_name, prompt="Hello", max_tokens=5, extra_body={"ignore_eos": True}
        ).usage
    assert usage.completion_tokens == 5
    wait_until(lambda: all_blocks_free(server))


def test_tokenize_needs_the_key_when_the_server_has_one(server: RunningServer) -> None:
    """vLLM leaves /tokenize open; this server renders conversations there exactly as chat
    completions does (a request's own template too, with --trust-request-chat-template), so
    with --api-key set it takes the key like /v1."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    with httpx2.Client(base_url=server.url) as http:  # no key
        for path in ("/tokenize", "/detokenize"):
            assert_openai_error(http.post(path, json=body), 401, says="api key")
    assert post(server, "/tokenize", body).status_code == 200
    assert post(server, "/detokenize", {"tokens": [5, 6]}).status_code == 200


def test_profile_routes_need_the_key_when_the_server_has_one(serve, tmp_path) -> None:
    """vLLM leaves /start_profile and /stop_profile open; they write files and slow every step
    while recording, so with --api-key set they take the key like /v1."""
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path)}
    keyed = serve(ServerConfig(api_key=API_KEY), num_gpu_blocks=64, profiler_config=profiler)
    with httpx2.Client(base_url=keyed.url) as http:  # no key
        for path in ("/start_profile", "/stop_profile"):
            assert_openai_error(http.post(path), 401, says="api key")
    assert not any(tmp_path.iterdir())
    assert post(keyed, "/start_profile", {}).status_code == 200
    assert post(keyed, "/stop_profile", {}).status_code == 200
    assert len(list(tmp_path.glob("*.pt.trace.json.gz"))) == 1
