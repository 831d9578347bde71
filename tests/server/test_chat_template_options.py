"""`serve --chat-template` and `--chat-template-content-format` (vLLM's): the ids a chat
request runs are transformers' rendering of the template with the messages in the format
vLLM would hand it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.cli import main
from pagedkv.commands.serve_chat import chat_template_text
from pagedkv.model.errors import ChatTemplateError
from pagedkv.server import ServerConfig
from tests.test_chat_template import PARTS_TEMPLATE, openai_form, string_form

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "a KV block?"}],
    },
]


def expected_ids(hf_tokenizer, template: str, messages: list[dict]) -> list[int]:
    text = hf_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    return hf_tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("content_format", "form"),
    [("auto", openai_form), ("openai", openai_form), ("string", string_form)],
)
def test_the_server_template_renders_content_in_the_format_given(
    serve, hf_tokenizer, content_format, form
) -> None:
    config = ServerConfig(
        chat_template=PARTS_TEMPLATE,
        chat_template_content_format=content_format,
        trust_request_chat_template=True,
    )
    server = serve(config, num_gpu_blocks=32, max_model_len=96)
    answer = server.post("/tokenize", {"messages": MESSAGES}).json()
    assert answer["tokens"] == expected_ids(hf_tokenizer, PARTS_TEMPLATE, form(MESSAGES))
    # A request's own template still wins over the server's, its content format read anew
    # under "auto" (a forced format holds for every template, as vLLM's flag does).
    own = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    answer = server.post("/tokenize", {"messages": MESSAGES, "chat_template": own}).json()
    own_form = openai_form if content_format == "openai" else string_form
    assert answer["tokens"] == expected_ids(hf_tokenizer, own, own_form(MESSAGES))


def test_chat_template_is_a_file_or_the_jinja_itself(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(PARTS_TEMPLATE, encoding="utf-8")
    assert chat_template_text(str(path)) == PARTS_TEMPLATE
    # As vLLM reads a template given inline, escapes are read (a shell passes \n as is).
    assert chat_template_text("{{ messages[0]['content'] }}\\n\\tañ\\u00e9") == (
        "{{ messages[0]['content'] }}\n\tañé"
    )
    long_inline = "{{ messages[0]['content'] }}" + "{# a comment #}" * 40  # > 255 characters
    assert chat_template_text(long_inline) == long_inline
    with pytest.raises(ValueError, match="'no/such.jinja' is no file, and no jinja template"):
        chat_template_text("no/such.jinja")
    with pytest.raises(ChatTemplateError, match="not valid jinja"):
        chat_template_text("{% for m in messages %}")


def test_a_bad_chat_template_stops_serve_before_the_model_loads(tmp_path: Path, capsys) -> None:
    missing = str(tmp_path / "nowhere")  # the model: never reached
    assert main(["serve", "--model", missing, "--chat-template", "absent.jinja"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv serve: error: --chat-template: 'absent.jinja' is no file")
    assert "is not a model folder" not in err
    assert main(["serve", "--model", missing, "--chat-template", "{% for m in messages %}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv serve: error: --chat-template: chat_template is not valid jinja")
    assert "Traceback" not in err
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--chat-template-content-format", "parts"])
    assert exit.value.code == 2
    assert "invalid choice: 'parts'" in capsys.readouterr().err


def test_vllms_api_key_variable_is_read_when_pagedkv_s_is_not_set(monkeypatch) -> None:
    """A ported deployment that sets VLLM_API_KEY still requires the key (it ran open)."""
    import argparse

    from pagedkv.commands import serve

    def default_key() -> list[str] | None:  # a list, as vLLM's (several keys may be given)
        parser = argparse.ArgumentParser()
        serve.add_arguments(parser)
        return parser.parse_args([]).api_key

    monkeypatch.delenv("PAGEDKV_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert default_key() == ["from-vllm"]
    monkeypatch.setenv("PAGEDKV_API_KEY", "ours")
    assert default_key() == ["ours"]


def test_every_served_model_name_is_answered_and_the_first_reported(serve) -> None:
    """vLLM's --served-model-name with several names: /v1/models lists each, a request may
    name any, a response reports the first; another name is a 404. On the command line the
    names after the flag are all names (the model is not taken from among them)."""
    from tests.test_cli import serve_args

    args = serve_args(["--model", "m", "--served-model-name", "first", "second"])
    assert (args.model, args.served_model_name) == ("m", ["first", "second"])
    server = serve(ServerConfig(model_name="first", model_aliases=("second",)), num_gpu_blocks=32)
    with server.http() as http:
        listed = [card["id"] for card in http.get("/v1/models").json()["data"]]
    assert listed == ["first", "second"]
    body = {"model": "second", "prompt": "Hello", "max_tokens": 2}
    answer = server.post("/v1/completions", body)
    assert answer.status_code == 200 and answer.json()["model"] == "first"
    assert server.post("/v1/completions", body | {"model": "third"}).status_code == 404


def test_the_response_role_names_a_new_turn_and_a_continued_message_keeps_its_own(serve) -> None:
    """vLLM's --response-role: a reply starting a new turn takes it, whole and streamed; a
    reply continuing the last message (no generation prompt) takes that message's role."""
    import json

    server = serve(ServerConfig(response_role="bot"), num_gpu_blocks=32)
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    assert server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["role"] == (
        "bot"
    )
    streamed = server.post("/v1/chat/completions", body | {"stream": True}).text
    first = json.loads(streamed.split("data: ")[1])
    assert first["choices"][0]["delta"]["role"] == "bot"
    continued = body | {
        "messages": [*body["messages"], {"role": "assistant", "content": "Hi"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    answer = server.post("/v1/chat/completions", continued).json()
    assert answer["choices"][0]["message"]["role"] == "assistant"


# A template that writes past tool calls' arguments with `tojson`, as Qwen's do ("tools" in it:
# the server hands it the calls as given rather than rewriting them as Hermes text).
TOJSON_TEMPLATE = (
    "{% if tools %}{{ tools | length }}{% endif %}{% for m in messages %}{{ m['content'] }}"
    "{% for call in m.get('tool_calls') or [] %}{{ call.function.arguments | tojson }}"
    "{% endfor %}{% endfor %}"
)


def tool_conversation(arguments: str) -> list[dict]:
    """A user turn, an assistant call with these JSON `arguments`, and the tool's answer."""
    call = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": arguments}}
    return [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]


def refusal(response) -> tuple[str, str]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    return error["param"], error["message"]


def test_a_requests_own_template_needs_trust_request_chat_template(serve) -> None:
    """vLLM's rule: a template is a program the server runs, so one a request brings (its
    `chat_template`, or `chat_template_kwargs`' `chat_template`) is a 400 naming the flag,
    on chat completions and /tokenize alike; the server's own template still renders."""
    server = serve(ServerConfig(chat_template=PARTS_TEMPLATE), num_gpu_blocks=32, max_model_len=96)
    own = {"chat_template": "{{ 'ab ' * 4000000 }}"}
    cases = [(own, "chat_template"), ({"chat_template_kwargs": own}, "chat_template_kwargs")]
    for fields, field in cases:
        for path in ("/v1/chat/completions", "/tokenize"):
            param, message = refusal(server.post(path, {"messages": MESSAGES, **fields}))
            assert param == field and "--trust-request-chat-template" in message
    assert server.post("/tokenize", {"messages": MESSAGES}).status_code == 200


def test_a_trusted_template_from_chat_template_kwargs_replaces_the_requests(
    serve, hf_tokenizer
) -> None:
    """vLLM merges `chat_template_kwargs` over the request's switches, `chat_template` among
    them: the kwarg's template is the one rendered, its other keys its variables."""
    server = serve(ServerConfig(trust_request_chat_template=True), num_gpu_blocks=32)
    template = "{{ greeting }}{% for m in messages %}|{{ m['content'] }}{% endfor %}"
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "chat_template": "{{ 'not this one' }}",
        "chat_template_kwargs": {"chat_template": template, "greeting": "Hello"},
    }
    answer = server.post("/tokenize", body).json()
    assert answer["tokens"] == hf_tokenizer("Hello|Hi", add_special_tokens=False)["input_ids"]


def test_rendered_text_the_tokenizer_refuses_is_a_400_naming_the_field(serve) -> None:
    """A lone surrogate that reaches the rendered prompt (a past call's JSON arguments with an
    escaped one, written back by `tojson`; or a template's own text) is the request's fault,
    as is a template that renders nothing for a completion (/tokenize counts no tokens):
    400s naming the field, never a 500."""
    server = serve(
        ServerConfig(chat_template=TOJSON_TEMPLATE, trust_request_chat_template=True),
        num_gpu_blocks=32,
    )
    for path in ("/v1/chat/completions", "/tokenize"):
        surrogate = {"messages": tool_conversation('{"city": "\\udcff"}')}
        param, message = refusal(server.post(path, surrogate))
        assert param == "messages" and "not valid UTF-8" in message
        lone = {"messages": MESSAGES, "chat_template": "{{ '\\udcff' }}{{ messages[0].content }}"}
        param, message = refusal(server.post(path, lone))
        assert param == "chat_template" and "not valid UTF-8" in message
        param, _ = refusal(server.post(path, {**lone, "chat_template": "{{ 1 / 0 }}"}))
        assert param == "chat_template"
    empty = {"messages": MESSAGES, "chat_template": "{{ '' }}"}  # /tokenize counts it (none)
    param, message = refusal(server.post("/v1/chat/completions", empty))
    assert param == "chat_template" and "no tokens" in message
    assert server.post("/tokenize", empty).json()["count"] == 0
    kwarg = {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": 5}}
    assert refusal(server.post("/tokenize", kwarg))[0] == "chat_template_kwargs"
    fine = server.post("/tokenize", {"messages": tool_conversation('{"city": "Oslo"}')})
    assert fine.json()["count"] > 0
