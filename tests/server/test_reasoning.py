"""`--reasoning-parser` through the server: a chat reply's think block comes back as
`reasoning` (and `reasoning_content`), the rest as content, whole and streamed. The oracles:
the same request to a server without the parser (the tiny model's greedy text is the same
there), split by the rule written out in test_reasoning_split; and a regex grammar that makes
the model write a think block, whose groups are the two parts."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pagedkv.server import ServerConfig
from tests.server.conftest import RunningServer
from tests.server.test_reasoning_split import rule

MESSAGES = [{"role": "user", "content": "Think, then answer."}]
# A template whose generation prompt opens a think block, as DeepSeek-R1's does.
OPENING = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)
THINK_THEN_ANSWER = r"<think>([a-z]{1,8})</think>([a-z ]{1,8})"


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    config = ServerConfig(reasoning_parser="qwen3", trust_request_chat_template=True)
    return serve(config, num_gpu_blocks=256, seed=0)


@pytest.fixture(scope="module")
def plain(serve) -> RunningServer:
    return serve(ServerConfig(trust_request_chat_template=True), num_gpu_blocks=256, seed=0)


def chat(server: RunningServer, **fields: Any) -> dict[str, Any]:
    body = {"messages": MESSAGES, "temperature": 0.0, "max_tokens": 12, **fields}
    answer = server.post("/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def streamed(server: RunningServer, **fields: Any) -> list[dict[str, Any]]:
    """The choices of a streamed chat completion's chunks (each with its delta), in order."""
    with server.client() as client:
        chunks = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=MESSAGES,
            temperature=0.0,
            max_tokens=12,
            stream=True,
            extra_body=fields,
        )
        return [chunk.choices[0].model_dump() for chunk in chunks if chunk.choices]


def joined(choices: list[dict[str, Any]], name: str) -> str | None:
    pieces = [c["delta"].get(name) for c in choices if c["delta"].get(name) is not None]
    return "".join(pieces) if pieces else None


@pytest.mark.parametrize("template", [None, OPENING], ids=["no-block", "block-opened"])
def test_the_reply_splits_as_the_rule_splits_the_plain_text(server, plain, template) -> None:
    fields = {"chat_template": template} if template else {}
    text = chat(plain, **fields)["choices"][0]["message"]["content"]
    reasoning, content = rule(text, prompt_open=template is not None)
    message = chat(server, **fields)["choices"][0]["message"]
    assert message.get("reasoning") == reasoning
    assert message.get("reasoning_content") == reasoning
    assert message["content"] == content
    deltas = streamed(server, **fields)
    assert joined(deltas, "reasoning") == reasoning
    assert joined(deltas, "reasoning_content") == reasoning
    assert (joined(deltas, "content") or None) == content


@pytest.mark.parametrize("stream", [False, True])
def test_a_think_block_the_model_writes_comes_back_apart(server, stream) -> None:
    fields = {"structured_outputs": {"regex": THINK_THEN_ANSWER}, "max_tokens": 40}
    raw = chat(server, **fields) if not stream else None
    if stream:
        deltas = streamed(server, **fields)
        assert not any("think>" in str(value) for c in deltas for value in c["delta"].values())
        reasoning, content = joined(deltas, "reasoning"), joined(deltas, "content")
    else:
        assert raw is not None
        message = raw["choices"][0]["message"]
        reasoning, content = message["reasoning"], message["content"]
    whole = f"<think>{reasoning}</think>{content}"
    match = re.fullmatch(THINK_THEN_ANSWER, whole)
    assert match is not None and match.groups() == (reasoning, content)


def test_include_reasoning_false_leaves_it_out(server) -> None:
    fields = {"structured_outputs": {"regex": THINK_THEN_ANSWER}, "max_tokens": 40}
    full = chat(server, **fields)["choices"][0]["message"]
    message = chat(server, include_reasoning=False, **fields)["choices"][0]["message"]
    assert "reasoning" not in message and "reasoning_content" not in message
    assert message["content"] == full["content"]
    deltas = streamed(server, include_reasoning=False, **fields)
    assert joined(deltas, "reasoning") is None
    assert joined(deltas, "content") == full["content"]


def test_a_grammar_after_an_opened_block_is_refused(server) -> None:
    body = {
        "messages": MESSAGES,
        "chat_template": OPENING,
        "response_format": {"type": "json_object"},
    }
    answer = server.post("/v1/chat/completions", body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "response_format"
    assert "think block" in answer.json()["error"]["message"]


def test_a_past_turns_reasoning_reaches_the_template(server, hf_tokenizer) -> None:
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": "4", "reasoning": "two and two"},
        {"role": "user", "content": "And 3+3?"},
    ]
    answer = server.post("/tokenize", {"messages": messages, "chat_template": OPENING}).json()
    rendered = [{k: v for k, v in m.items() if k != "reasoning"} for m in messages]
    rendered[1]["reasoning_content"] = "two and two"  # what thinking models' templates read
    text = hf_tokenizer.apply_chat_template(
        rendered, chat_template=OPENING, tokenize=False, add_generation_prompt=True
    )
    assert "[two and two]" in text
    assert answer["tokens"] == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    older = dict(messages[1], reasoning_content="two and two")
    del older["reasoning"]
    again = server.post("/tokenize", {"messages": [messages[0], older, messages[2]],
                                      "chat_template": OPENING}).json()  # fmt: skip
    assert again["tokens"] == answer["tokens"]
    refused = server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x", "reasoning": "y"}]},
    )
    assert refused.status_code == 400


def test_only_the_generation_prompt_or_a_continued_reply_opens_a_block(server, plain) -> None:
    """A user asking about `<think>` opens nothing: the reply splits as one after a prompt
    without a block (and a grammar is no 400); an assistant message continued after its own
    `<think>` is continued inside the block."""
    asking = [{"role": "user", "content": "What is the <think> tag for?"}]
    text = chat(plain, messages=asking)["choices"][0]["message"]["content"]
    message = chat(server, messages=asking)["choices"][0]["message"]
    reasoning, content = rule(text, prompt_open=False)
    assert (message.get("reasoning"), message["content"]) == (reasoning, content)
    constrained = {"messages": asking, "structured_outputs": {"regex": "[a-z]{3}"}}
    assert server.post("/v1/chat/completions", constrained).status_code == 200
    continued = {
        "messages": [*MESSAGES, {"role": "assistant", "content": "<think>Two and"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    text = chat(plain, **continued)["choices"][0]["message"]["content"]
    message = chat(server, **continued)["choices"][0]["message"]
    reasoning, content = rule(text, prompt_open=True)
    assert (message.get("reasoning"), message["content"]) == (reasoning, content)
    refused = {"chat_template": OPENING, "guided_regex": "[a-z]{3}", "messages": MESSAGES}
    answer = server.post("/v1/chat/completions", refused)
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "guided_regex")


@pytest.mark.parametrize("template", [None, OPENING], ids=["no-block", "block-opened"])
def test_streamed_token_ids_add_up_with_the_parser_on(server, template) -> None:
    fields = {"return_token_ids": True, "ignore_eos": True}
    fields |= {"chat_template": template} if template else {}
    whole = chat(server, **fields)["choices"][0]["token_ids"]
    deltas = streamed(server, **fields)
    ids = [token for choice in deltas for token in choice.get("token_ids") or []]
    assert ids == whole and len(whole) == 12
