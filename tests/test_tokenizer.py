"""Tokenizer: same ids, text and chat prompts as transformers; eos ids from the right file."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.model.errors import ChatTemplateError, MalformedModelFile, ModelFileMissing
from pagedkv.tokenizer import InvalidText, Tokenizer
from tests.model.tiny_models import write_tokenizer_files

TEXTS = [
    "Paged attention stores keys and values in fixed-size blocks.",
    "Hello world! Ünïcödé and emoji 🙂 must round trip, even unseen words: zyxwvut.",
    "  leading and trailing spaces\tand\nnewlines  ",
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": " What is a block table? "},
    {"role": "assistant", "content": "A map from logical to physical blocks."},
    {"role": "user", "content": "Thanks 🙂"},
]


@pytest.fixture
def folder(tmp_path):
    write_tokenizer_files(tmp_path)
    return tmp_path


@pytest.fixture
def hf_tokenizer(folder):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_decode_round_trips(folder, hf_tokenizer, text):
    tokenizer = Tokenizer.from_folder(folder)
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer(text)["input_ids"]
    assert ids[0] == 1  # tokenizer.json's template adds BOS
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids) == "<s>" + text == hf_tokenizer.decode(ids)  # its default
    assert tokenizer.batch_decode([ids]) == hf_tokenizer.batch_decode([ids])
    assert tokenizer.vocab_size == len(hf_tokenizer) == 300


def test_chat_template_renders_like_transformers(folder, hf_tokenizer):
    tokenizer = Tokenizer.from_folder(folder)
    prompt = tokenizer.render_chat(CONVERSATION)
    assert prompt == hf_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<s><|system|>\nBe brief.</s>\n<|user|>\nWhat is a block table?</s>")
    assert prompt.endswith("<|user|>\nThanks 🙂</s>\n<|assistant|>\n")
    assert not tokenizer.render_chat(CONVERSATION, add_generation_prompt=False).endswith(
        "<|assistant|>\n"
    )
    hf_ids = hf_tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert tokenizer.encode_chat(CONVERSATION) == hf_ids


def test_chat_template_from_chat_template_jinja(folder):
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    (folder / "chat_template.jinja").write_text(config.pop("chat_template"))
    config_path.write_text(json.dumps(config))
    prompt = Tokenizer.from_folder(folder).render_chat(CONVERSATION[:2])
    assert (
        prompt
        == "<s><|system|>\nBe brief.</s>\n<|user|>\nWhat is a block table?</s>\n<|assistant|>\n"
    )


def test_template_rejecting_a_conversation_raises_chat_template_error(folder):
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        Tokenizer.from_folder(folder).render_chat([{"role": "tool", "content": "42"}])


def test_no_chat_template_is_a_clear_error(folder):
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_folder(folder).apply_chat_template(CONVERSATION)


def test_invalid_template_syntax_names_the_file(folder):
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }"
    config_path.write_text(json.dumps(config))
    with pytest.raises(MalformedModelFile, match=r"tokenizer_config\.json: chat_template is not"):
        Tokenizer.from_folder(folder)


@pytest.mark.parametrize(("value", "expected"), [(2, (2,)), ([2, 5, 7], (2, 5, 7))])
def test_eos_ids_come_from_generation_config(tmp_path, value, expected):
    write_tokenizer_files(tmp_path, eos_token_id=value)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert Tokenizer.from_folder(tmp_path).eos_token_ids == expected


def test_eos_ids_fall_back_to_config_then_to_the_eos_token(folder):
    (folder / "generation_config.json").unlink()
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    assert Tokenizer.from_folder(folder).eos_token_ids == (2, 3)
    (folder / "config.json").unlink()
    assert Tokenizer.from_folder(folder).eos_token_ids == (2,)  # "</s>" in tokenizer_config


def test_malformed_eos_id_names_the_file(folder):
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(MalformedModelFile, match=r"generation_config\.json: eos_token_id must be"):
        Tokenizer.from_folder(folder)


def test_missing_tokenizer_json_names_the_file(folder):
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelFileMissing, match=r"tokenizer\.json: missing"):
        Tokenizer.from_folder(folder)


@pytest.mark.parametrize("broken", ["tokenizer.json", "tokenizer_config.json"])
def test_malformed_tokenizer_files_name_the_file(folder, broken):
    (folder / broken).write_text("{not json")
    with pytest.raises(MalformedModelFile, match=rf"{broken.replace('.', '[.]')}: not (a )?valid"):
        Tokenizer.from_folder(folder)


CUSTOM_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{{ tail }}"
)


def test_hugging_face_call_forms_give_what_transformers_gives(folder, hf_tokenizer):
    """Code written against a transformers tokenizer runs on ours: same calls, same results
    (with the arguments whose defaults differ between transformers versions given)."""
    tokenizer = Tokenizer.from_folder(folder)
    text = TEXTS[1]
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert len(tokenizer) == len(hf_tokenizer)
    assert tokenizer.get_vocab() == hf_tokenizer.get_vocab()
    assert tokenizer.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.convert_ids_to_tokens(ids[0]) == hf_tokenizer.convert_ids_to_tokens(ids[0])
    batch = [ids, [*ids[:2], 2]]
    for skip in (True, False):
        assert tokenizer.batch_decode(batch, skip_special_tokens=skip) == (
            hf_tokenizer.batch_decode(batch, skip_special_tokens=skip)
        )
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == 2
    for each in TEXTS:  # tokens of a text and back, and one id's text
        tokens = tokenizer.tokenize(each)
        assert tokens == hf_tokenizer.tokenize(each)
        assert tokenizer.convert_tokens_to_string(tokens) == (
            hf_tokenizer.convert_tokens_to_string(tokens)
        )
    for token_id in (ids[1], 2):
        for skip in (True, False):
            assert tokenizer.decode(token_id, skip_special_tokens=skip) == hf_tokenizer.decode(
                token_id, skip_special_tokens=skip
            )
    assert tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    ) == hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=False
    ) == hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    hf_ids = hf_tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True) == hf_ids
    for source in (text, TEXTS):  # one text, a batch (each its own length, unpadded)
        for special in (True, False):
            ours, theirs = (
                tokenizer(source, add_special_tokens=special),
                hf_tokenizer(source, add_special_tokens=special),
            )
            for key in ("input_ids", "attention_mask"):
                assert ours[key] == getattr(ours, key) == theirs[key]
    with pytest.raises(TypeError):
        tokenizer(text, "a second text")  # transformers' text_pair: not supported


def test_apply_chat_template_takes_transformers_defaults_and_forms(folder, hf_tokenizer):
    """Called as vLLM-era code calls the HF tokenizer vLLM returns: token ids and no
    generation prompt by default, return_dict's input_ids and attention_mask, a list of
    conversations giving a list, tools as the template's variable; tensor options refused."""
    tokenizer = Tokenizer.from_folder(folder)

    def theirs(conversation, **options):
        return hf_tokenizer.apply_chat_template(conversation, return_dict=False, **options)

    assert tokenizer.apply_chat_template(CONVERSATION) == theirs(CONVERSATION)
    assert tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True) == theirs(
        CONVERSATION, add_generation_prompt=True
    )
    as_dict = tokenizer.apply_chat_template(CONVERSATION, return_dict=True)
    expected = hf_tokenizer.apply_chat_template(CONVERSATION, return_dict=True)
    assert as_dict["input_ids"] == expected["input_ids"]
    assert as_dict.attention_mask == expected["attention_mask"]
    batch = [CONVERSATION, CONVERSATION[:2]]
    assert tokenizer.apply_chat_template(batch, tokenize=False) == theirs(batch, tokenize=False)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    template = "{{ tools[0].function.name }}|{{ messages[0].content }}"
    assert tokenizer.apply_chat_template(
        CONVERSATION, tools, chat_template=template, tokenize=False
    ) == theirs(CONVERSATION, tools=tools, chat_template=template, tokenize=False)
    with pytest.raises(ValueError, match="does not take return_tensors"):
        tokenizer.apply_chat_template(CONVERSATION, return_tensors="pt")


def test_continue_final_message_and_a_given_template_render_as_transformers(folder, hf_tokenizer):
    tokenizer = Tokenizer.from_folder(folder)
    partial = [*CONVERSATION[:2], {"role": "assistant", "content": "A map from  "}]
    assert tokenizer.apply_chat_template(
        partial, tokenize=False, add_generation_prompt=False, continue_final_message=True
    ) == hf_tokenizer.apply_chat_template(
        partial, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert tokenizer.apply_chat_template(
        CONVERSATION, chat_template=CUSTOM_TEMPLATE, tokenize=False, tail="end"
    ) == hf_tokenizer.apply_chat_template(
        CONVERSATION, chat_template=CUSTOM_TEMPLATE, tokenize=False, tail="end"
    )
    with pytest.raises(ValueError, match="continue_final_message .* add_generation_prompt"):
        tokenizer.apply_chat_template(
            partial, add_generation_prompt=True, continue_final_message=True
        )


def test_content_parts_render_as_vllm_joins_them(folder):
    """A list of text parts renders as its texts joined by newlines and None as empty, as vLLM
    renders them; any other part (an image) and any non-message are clear ValueErrors."""
    tokenizer = Tokenizer.from_folder(folder)
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}],
        }
    ]
    assert tokenizer.render_chat(parts) == tokenizer.render_chat(
        [{"role": "user", "content": "hi\nthere"}]
    )
    assert tokenizer.render_chat([{"role": "user", "content": None}]) == tokenizer.render_chat(
        [{"role": "user", "content": ""}]
    )
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    with pytest.raises(ValueError, match="'image_url' is not supported"):
        tokenizer.render_chat([{"role": "user", "content": [image]}])
    with pytest.raises(ValueError, match="must be a dict with a 'role'"):
        tokenizer.render_chat(["hello"])


@pytest.mark.parametrize(
    "template",
    ["{{ messages + 1 }}", "{{ 1 / 0 }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"],
)
def test_a_template_failing_in_any_way_is_a_chat_template_error(folder, template):
    tokenizer = Tokenizer.from_folder(folder)
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        tokenizer.render_chat(CONVERSATION, chat_template=template)


def test_template_kwargs_override_the_switches_as_in_vllm(folder, hf_tokenizer):
    """vLLM lets chat_template_kwargs set add_generation_prompt; they may not set messages."""
    tokenizer = Tokenizer.from_folder(folder)
    overridden = tokenizer.render_chat(
        CONVERSATION, template_kwargs={"add_generation_prompt": False}
    )
    assert overridden == hf_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=False
    )
    with pytest.raises(ChatTemplateError, match="may not set 'messages'"):
        tokenizer.render_chat(CONVERSATION, template_kwargs={"messages": []})


# The folder is only read: sharing it between examples is safe.
@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=24) | st.text(max_size=12).map(str.encode))
def test_bytes_that_are_not_utf8_are_refused_naming_the_first_bad_byte(folder, data):
    """Text as Python keeps bytes from argv or stdin (surrogateescape): UTF-8 bytes encode as
    their text does; others raise InvalidText naming the first byte Python's decoder refuses."""
    tokenizer = Tokenizer.from_folder(folder)
    text = data.decode("utf-8", "surrogateescape")
    try:
        expected = data.decode("utf-8")
    except UnicodeDecodeError as error:
        with pytest.raises(InvalidText, match=f"byte 0x{data[error.start]:02x} at character"):
            tokenizer.encode(text)
    else:
        assert tokenizer.encode(text) == tokenizer.encode(expected)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {
            "pad_token": "<unk>",
            "model_max_length": 2048,
            "additional_special_tokens": [
                {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
            ],
        },
        {"extra_special_tokens": ["<|im_start|>"], "sep_token": "</s>", "mask_token": "<s>"},
    ],
)
def test_special_tokens_and_limits_read_as_transformers_reads_them(tmp_path, extra):
    """The special-token attributes vLLM-era scripts read (pad_token, the map, every special
    token and id, model_max_length, vLLM's max_token_id), from configs that name more or fewer
    of them, equal what transformers reads from the same files."""
    import tokenizers
    import transformers

    write_tokenizer_files(tmp_path)
    fast = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    fast.add_special_tokens(["<|im_start|>", "<|im_end|>"])  # special, listed or not
    fast.save(str(tmp_path / "tokenizer.json"))
    config_file = tmp_path / "tokenizer_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | extra))
    ours, theirs = (
        Tokenizer.from_folder(tmp_path),
        transformers.AutoTokenizer.from_pretrained(tmp_path),
    )
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "pad_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.model_max_length == theirs.model_max_length
    assert ours.max_token_id == max(theirs.get_vocab().values())
