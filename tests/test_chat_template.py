"""Chat templates as transformers renders them, content as vLLM hands it over.

The oracles: transformers' `apply_chat_template` on the same template (with the messages in
the content format vLLM would pass), and vLLM's stated rule for "auto": "openai" exactly when
the template loops over a message's content.
"""

from __future__ import annotations

import pytest

from pagedkv.model.errors import ChatTemplateError
from pagedkv.tokenizer import Tokenizer
from pagedkv.tokenizer.chat_template import resolve_content_format
from tests.model.tiny_models import write_tokenizer_files

# A template written for multimodal models: it loops over a message's parts, printing text
# parts and a marker for any other kind (so a joined string would print nothing at all).
PARTS_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}[{{ part['text'] }}]{% else %}<media>{% endif %}"
    "{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
STRING_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# transformers' training marker around the assistant's text (SmolLM3's template has it).
GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if message.role == 'assistant' %}"
    "{% generation %}A: {{ message.content }}{% endgeneration %}"
    "{% else %}U: {{ message.content }}{% endif %}\n{% endfor %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "a block?"}],
    },
    {"role": "assistant", "content": "A fixed-size run of KV slots."},
    {"role": "user", "content": None},
]


def openai_form(messages: list[dict]) -> list[dict]:
    """The messages as vLLM's "openai" format passes them: content a list of text parts."""
    out = []
    for message in messages:
        content = message["content"]
        if content is None:
            content = []
        elif isinstance(content, str):
            content = [{"type": "text", "text": content}]
        out.append({**message, "content": content})
    return out


def string_form(messages: list[dict]) -> list[dict]:
    """The messages as vLLM's "string" format passes them: text parts joined by newlines."""
    return [
        {**m, "content": "\n".join(part["text"] for part in openai_form([m])[0]["content"])}
        for m in messages
    ]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(path)
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (PARTS_TEMPLATE, "openai"),
        (STRING_TEMPLATE, "string"),
        # Through a variable set from messages, a slice, an attribute and a filter.
        (
            "{% set turns = messages[1:] %}{% for m in turns %}"
            "{% for c in m.content | selectattr('type', 'equalto', 'text') %}{{ c.text }}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),
        # Templates that take both forms loop over the parts when the content is no string.
        (
            "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}"
            "{% endfor %}",
            "openai",
        ),
        # Loops over other lists, or over `content` of something that is not a message.
        (
            "{% for tool in tools %}{% for c in tool['content'] %}{{ c }}{% endfor %}"
            "{% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "string",
        ),
        (
            "{% for m in messages %}{% for c in m['text'] %}{{ c }}{% endfor %}{% endfor %}",
            "string",
        ),
    ],
)
def test_auto_reads_the_format_the_template_loops_over(template, expected) -> None:
    assert resolve_content_format("auto", template) == expected
    assert resolve_content_format("string", template) == "string"
    assert resolve_content_format("openai", template) == "openai"


def test_a_format_vllm_does_not_have_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="auto, string, openai.*'parts'"):
        resolve_content_format("parts", STRING_TEMPLATE)


@pytest.mark.parametrize("template", [PARTS_TEMPLATE, STRING_TEMPLATE])
@pytest.mark.parametrize("content_format", ["auto", "string", "openai"])
def test_each_format_renders_as_transformers_renders_vllms_messages(
    folder, hf_tokenizer, template, content_format
) -> None:
    tokenizer = Tokenizer.from_folder(folder)
    resolved = {"auto": "openai" if template == PARTS_TEMPLATE else "string"}.get(
        content_format, content_format
    )
    messages = (openai_form if resolved == "openai" else string_form)(CONVERSATION)
    expected = hf_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    rendered = tokenizer.render_chat(
        CONVERSATION, chat_template=template, content_format=content_format
    )
    assert rendered == expected
    if template == PARTS_TEMPLATE and content_format != "string":
        assert "[What is][a block?]" in rendered


def test_continue_final_message_cuts_after_the_last_text_part(folder, hf_tokenizer) -> None:
    tokenizer = Tokenizer.from_folder(folder)
    partial = [
        {"role": "user", "content": "Define a block."},
        {"role": "assistant", "content": [{"type": "text", "text": "A block is  "}]},
    ]
    assert tokenizer.render_chat(
        partial,
        chat_template=PARTS_TEMPLATE,
        add_generation_prompt=False,
        continue_final_message=True,
    ) == hf_tokenizer.apply_chat_template(
        openai_form(partial),
        chat_template=PARTS_TEMPLATE,
        tokenize=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )


def test_a_model_template_with_generation_blocks_loads_and_renders_as_transformers(
    tmp_path, hf_tokenizer
) -> None:
    write_tokenizer_files(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(GENERATION_TEMPLATE, encoding="utf-8")
    import json

    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config), encoding="utf-8")
    tokenizer = Tokenizer.from_folder(tmp_path)
    messages = string_form(CONVERSATION)
    assert tokenizer.render_chat(
        messages, add_generation_prompt=False
    ) == hf_tokenizer.apply_chat_template(
        messages, chat_template=GENERATION_TEMPLATE, tokenize=False
    )
    assert "A: A fixed-size run of KV slots." in tokenizer.render_chat(messages)


def test_an_unclosed_generation_block_is_a_syntax_error(folder) -> None:
    tokenizer = Tokenizer.from_folder(folder)
    with pytest.raises(ChatTemplateError, match="not valid jinja"):
        tokenizer.render_chat(
            CONVERSATION, chat_template="{% generation %}{{ messages[0].content }}"
        )


# How tool-use templates (Qwen2.5's, Hermes') write a past call: its arguments with tojson.
TOOL_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% if m.tool_calls is defined %}{% for call in m.tool_calls %}"
    "<call>{{ call.function.name }} {{ call.function.arguments | tojson }}</call>"
    "{% endfor %}{% else %} (no calls){% endif %}\n{% endfor %}"
)


def test_past_tool_calls_reach_the_template_with_object_arguments_as_vllm_hands_them(
    folder, hf_tokenizer, caplog
) -> None:
    """vLLM parses a past call's JSON arguments into an object for the template; none, or
    text that is no JSON object, becomes {} (a warning, not a failed conversation); an empty
    list of calls is dropped."""

    def call(arguments):
        return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}

    def assistant(*calls):
        return {"role": "assistant", "content": None, "tool_calls": list(calls)}

    given = [
        {"role": "user", "content": "go"},
        assistant(call('{"city": "Paris", "days": [1, 2]}'), call("")),
        assistant(call("not json"), call("[1, 2]")),
        assistant(),
    ]
    as_vllm = [
        {"role": "user", "content": "go"},
        assistant(call({"city": "Paris", "days": [1, 2]}), call({})),
        assistant(call({}), call({})),
        {"role": "assistant", "content": ""},
    ]
    tokenizer = Tokenizer.from_folder(folder)
    rendered = tokenizer.render_chat(
        given, chat_template=TOOL_TEMPLATE, add_generation_prompt=False
    )
    assert rendered == hf_tokenizer.apply_chat_template(
        string_form(as_vllm), chat_template=TOOL_TEMPLATE, tokenize=False
    )
    assert '<call>f {"city": "Paris", "days": [1, 2]}</call>' in rendered
    assert "no JSON object" in caplog.text
    assert given[1]["tool_calls"][0]["function"]["arguments"].startswith("{")  # not changed
    with pytest.raises(ValueError, match="tool_calls entry must be a function call"):
        tokenizer.render_chat([assistant("f")], chat_template=TOOL_TEMPLATE)


@pytest.mark.parametrize("content", ["", "  ", None, []])
@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_continuing_a_final_message_with_no_text_is_refused_alike(folder, content, content_format):
    """Continuing an empty last message: one clear error in either format (the string form
    returned the whole rendered text, the parts form said the text did not appear)."""
    tokenizer = Tokenizer.from_folder(folder)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]
    with pytest.raises(ChatTemplateError, match="last message has no text to continue"):
        tokenizer.render_chat(
            messages,
            chat_template=STRING_TEMPLATE,
            add_generation_prompt=False,
            continue_final_message=True,
            content_format=content_format,
        )
