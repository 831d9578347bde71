"""Tokenizer: text <-> token ids, end-of-sequence ids and the chat template of a model folder.

Encoding and decoding use `tokenizer.json` through the `tokenizers` library. The ids that end
generation come from `generation_config.json` (an int or a list), falling back to config.json
and then to tokenizer_config.json's `eos_token`. The chat template comes from
tokenizer_config.json or `chat_template.jinja` and is rendered as transformers renders it, with
each message's content in vLLM's content format (chat_template.py).

The calls users make on a transformers tokenizer (`encode`, `decode`, `batch_decode`,
`tokenize`, `convert_ids_to_tokens`, `convert_tokens_to_ids`, `convert_tokens_to_string`,
`get_vocab`, `len()`, the special tokens, their map and their ids, `model_max_length`,
`apply_chat_template`) work here with transformers' keywords and defaults, since
`LLM.get_tokenizer()` returns this object: `decode` keeps special tokens (the engine's outputs
skip them, as `SamplingParams.skip_special_tokens` says, and pass the flag themselves);
`apply_chat_template` has transformers 4's defaults (token ids, no generation prompt), which
the code written for vLLM's tokenizer assumes.
Past 400 lines as one module: it is that surface, a method a call, over one `tokenizers`
object and the model folder's files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import tokenizers

from pagedkv.model.config import read_json
from pagedkv.model.errors import ChatTemplateError, MalformedModelFile, ModelFileMissing
from pagedkv.tokenizer.chat_template import (
    ENVIRONMENT,
    TENSOR_OPTIONS,
    compile_template,
    cut_after_final_message,
    is_conversation,
    resolve_content_format,
    template_message,
)

# transformers' named special tokens, in its order (`special_tokens_map`, `all_special_tokens`).
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# transformers' model_max_length of a tokenizer whose config gives none: no limit.
VERY_LARGE_INTEGER = int(1e30)


class Tokenizer:
    """A model's tokenizer, its end-of-sequence ids and its chat template."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        extra_special_tokens: Sequence[str] = (),
        model_max_length: int = VERY_LARGE_INTEGER,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.extra_special_tokens = list(extra_special_tokens)  # special beyond the named ones
        self.model_max_length = model_max_length  # the longest input its config names
        self._template = None if chat_template is None else ENVIRONMENT.from_string(chat_template)

    @classmethod
    def from_folder(cls, folder: str | Path, config: Mapping[str, Any] | None = None) -> Tokenizer:
        """Load tokenizer.json, generation_config.json and tokenizer_config.json of `folder`.

        `config` is the folder's parsed config.json when the caller already holds it (read by
        `pagedkv.model.config.read_config`, the one reader); otherwise it is read here.
        """
        folder = Path(folder)
        if config is None:
            config = _optional_json(folder / "config.json")
        tokenizer_config = _optional_json(folder / "tokenizer_config.json")
        template_path = folder / "chat_template.jinja"
        if tokenizer_config.get("chat_template") is None and template_path.is_file():
            tokenizer_config["chat_template"] = template_path.read_text(encoding="utf-8")
        return cls.from_parts(
            _load_tokenizer_json(folder / "tokenizer.json"),
            tokenizer_config,
            generation_config=_optional_json(folder / "generation_config.json"),
            config=config,
            source=folder,
        )

    @classmethod
    def from_parts(
        cls,
        tokenizer: tokenizers.Tokenizer,
        tokenizer_config: Mapping[str, Any],
        generation_config: Mapping[str, Any],
        config: Mapping[str, Any],
        source: Path,
    ) -> Tokenizer:
        """Build from the parsed contents of a folder's files (or a GGUF file's equivalents).

        The end-of-sequence ids come from generation_config, then config, then the eos token
        string; `source` (a folder, or a single file such as a GGUF) is named in errors.
        """
        config_path = _file_in(source, "tokenizer_config.json")
        special_tokens = _special_tokens(tokenizer_config, config_path)
        return cls(
            tokenizer,
            eos_token_ids=_eos_token_ids(
                source, tokenizer, special_tokens, generation_config, config
            ),
            chat_template=_chat_template(source, tokenizer_config),
            special_tokens=special_tokens,
            extra_special_tokens=_extra_special_tokens(tokenizer_config, config_path),
            model_max_length=_model_max_length(tokenizer_config, config_path),
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies tokenizer.json's template (BOS).
        Text no UTF-8 spells is an `InvalidText` naming where."""
        return self._encoding(text, add_special_tokens).ids

    def __call__(self, text: str | Sequence[str], *, add_special_tokens: bool = True) -> Encoding:
        """transformers' call, as scripts written for vLLM's tokenizer use it: `input_ids` and
        an all-ones `attention_mask` of one text, or of each text of a list (not padded). A
        second text (transformers' `text_pair`) is a TypeError, not silently dropped."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return Encoding(input_ids=ids, attention_mask=[1] * len(ids))
        batch = [self.encode(each, add_special_tokens) for each in text]
        return Encoding(input_ids=batch, attention_mask=[[1] * len(ids) for ids in batch])

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `token_ids` (one id or several, as transformers takes them, special tokens
        kept unless told otherwise)."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        """The vocabulary entries `text` encodes to (transformers' call and default)."""
        return self._encoding(text, add_special_tokens).tokens

    def _encoding(self, text: str, add_special_tokens: bool) -> tokenizers.Encoding:
        """The tokenizers library's encoding of `text`; an `InvalidText` where no UTF-8
        spells it."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:
            _check_utf8(text)
            raise

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        """The text of vocabulary entries, as the tokenizer's decoder joins them."""
        decoder = self.tokenizer.decoder
        return decoder.decode(list(tokens)) if decoder is not None else "".join(tokens)

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        """Text of each id sequence (transformers' call; the default is `decode`'s)."""
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        """Each id's vocabulary entry (None for an id outside it), as transformers gives it."""
        if isinstance(ids, int):
            return self.tokenizer.id_to_token(ids)
        return [self.tokenizer.id_to_token(token_id) for token_id in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """Each vocabulary entry's id (None for one not in it), as transformers gives it."""
        if isinstance(tokens, str):
            return self.tokenizer.token_to_id(tokens)
        return [self.tokenizer.token_to_id(token) for token in tokens]

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens the model has (bos_token, eos_token, unk_token, ...), as
        transformers 5 maps them (4 also listed additional_special_tokens here)."""
        return {
            key: self.special_tokens[key]
            for key in SPECIAL_TOKEN_KEYS
            if key in self.special_tokens
        }

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, then the config's additional ones, each once (as
        transformers lists them)."""
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        """The ids of `all_special_tokens`, in that order (those the vocabulary has)."""
        ids = (self.tokenizer.token_to_id(token) for token in self.all_special_tokens)
        return [token_id for token_id in ids if token_id is not None]

    @cached_property
    def max_token_id(self) -> int:
        """The largest id of the vocabulary, added tokens included (vLLM's tokenizer has it)."""
        return max(self.get_vocab().values())

    def get_vocab(self) -> dict[str, int]:
        """Vocabulary entry -> id, added tokens included (transformers' call)."""
        return self.tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        """The vocabulary's size with added tokens, as `len()` of a transformers tokenizer."""
        return self.vocab_size

    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sequence token, None when the model names none."""
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token, None when the model names none."""
        return self.special_tokens.get("eos_token")

    @property
    def unk_token(self) -> str | None:
        """The unknown-text token, None when the model names none."""
        return self.special_tokens.get("unk_token")

    @property
    def pad_token(self) -> str | None:
        """The padding token, None when the model names none."""
        return self.special_tokens.get("pad_token")

    @property
    def pad_token_id(self) -> int | None:
        """The padding token's id, None when the model names none."""
        pad_token = self.special_tokens.get("pad_token")
        return None if pad_token is None else self.tokenizer.token_to_id(pad_token)

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence token's id, None when the model names none."""
        bos_token = self.special_tokens.get("bos_token")
        return None if bos_token is None else self.tokenizer.token_to_id(bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence token's id as transformers gives it: the eos token's, else the
        first id that ends generation (generation stops on any of `eos_token_ids`)."""
        eos_token = self.special_tokens.get("eos_token")
        token_id = None if eos_token is None else self.tokenizer.token_to_id(eos_token)
        if token_id is None and self.eos_token_ids:
            return self.eos_token_ids[0]
        return token_id

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        """transformers' call with its defaults (as transformers 4 gives them, which vLLM-era
        code assumes): the conversation's token ids, or its text with tokenize=False; with
        return_dict, `input_ids` and `attention_mask`. A list of conversations gives a list.

        `tools` and `documents` reach the template as its variables, as do `kwargs` (vLLM's
        chat_template_kwargs). transformers' padding, truncation and tensor options are
        refused by name: the answers here are plain lists.
        """
        asked = sorted(name for name in TENSOR_OPTIONS if kwargs.get(name))
        if asked:
            raise ValueError(f"apply_chat_template does not take {', '.join(asked)} here")
        variables = {key: value for key, value in kwargs.items() if key not in TENSOR_OPTIONS}
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None:
                variables[name] = [dict(item) for item in value]
        if conversation and all(is_conversation(item) for item in conversation):
            return [
                self.apply_chat_template(
                    item,
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tokenize=tokenize,
                    return_dict=return_dict,
                    **variables,
                )
                for item in conversation
            ]
        text = self.render_chat(
            conversation,  # type: ignore[arg-type]
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            template_kwargs=variables,
            content_format=None,  # the messages as given, as transformers renders them
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids)) if return_dict else ids

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        content_format: str | None = "auto",
    ) -> str:
        """Render a conversation (`[{"role": ..., "content": ...}, ...]`) as prompt text.

        `chat_template` replaces the model's; `continue_final_message` ends the text inside
        the last message, so the model continues it rather than starting a new turn.
        `content_format` is vLLM's `chat_template_content_format` (see chat_template.py);
        None hands the template the messages as given, as transformers does.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be True: "
                "the first continues the last message, the second starts a new one"
            )
        source = self.chat_template if chat_template is None else chat_template
        template = self._template if chat_template is None else compile_template(chat_template)
        if template is None or source is None:
            raise ChatTemplateError(
                "this model has no chat template (none in tokenizer_config.json "
                "or chat_template.jinja)"
            )
        if template_kwargs and "messages" in template_kwargs:
            raise ChatTemplateError("chat_template_kwargs may not set 'messages'")
        # vLLM's order: the variables given override the switches and special tokens.
        variables = {
            **self.special_tokens,
            "add_generation_prompt": add_generation_prompt,
            **(template_kwargs or {}),
        }
        if content_format is not None:
            content_format = resolve_content_format(content_format, source)
        rendered = [template_message(message, content_format) for message in messages]
        try:
            text = template.render(messages=rendered, **variables)
        except Exception as error:  # a template is a program: any error is the template's
            raise ChatTemplateError(
                f"chat template failed: {type(error).__name__}: {error}"
            ) from error
        return cut_after_final_message(text, rendered) if continue_final_message else text

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered conversation; the template itself places any BOS."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


class Encoding(dict):
    """What `Tokenizer(...)` returns: a dict whose keys read as attributes too
    (`enc["input_ids"]` and `enc.input_ids`), as transformers' BatchEncoding."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class InvalidText(ValueError):
    """Text holding a lone surrogate, which no UTF-8 bytes spell: how Python keeps bytes that
    were not UTF-8 (in argv, stdin, or a JSON escape such as \\udcff). The tokenizer reads
    only real text."""


def _check_utf8(text: str) -> None:
    """Raise `InvalidText` naming the first character UTF-8 cannot spell, if any."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        where = f"{what} at character {error.start}"
        raise InvalidText(f"the text is not valid UTF-8: {where}") from None


def _load_tokenizer_json(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise ModelFileMissing(path, "the tokenizer")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for any parse failure
        raise MalformedModelFile(path, f"not a valid tokenizers file: {error}") from error


def _optional_json(path: Path) -> dict[str, Any]:
    return read_json(path, what="an optional file") if path.is_file() else {}


def _special_tokens(tokenizer_config: Mapping[str, Any], path: Path) -> dict[str, str]:
    """The named special tokens' strings (SPECIAL_TOKEN_KEYS); transformers saves each as a
    string or {"content": ...}."""
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = tokenizer_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise MalformedModelFile(path, f"{key} must be a string, got {value!r}")
        tokens[key] = value
    return tokens


def _extra_special_tokens(tokenizer_config: Mapping[str, Any], path: Path) -> list[str]:
    """The special tokens the config lists beyond the named ones: transformers 4's
    `additional_special_tokens` or 5's `extra_special_tokens` (a list, or names -> tokens),
    each a string or {"content": ...}."""
    key = "additional_special_tokens"
    if tokenizer_config.get(key) is None:
        key = "extra_special_tokens"
    listed = tokenizer_config.get(key) or []
    if isinstance(listed, dict):
        listed = list(listed.values())
    if not isinstance(listed, list):
        raise MalformedModelFile(path, f"{key} must be a list, got {listed!r}")
    tokens = [item.get("content") if isinstance(item, dict) else item for item in listed]
    if not all(isinstance(token, str) for token in tokens):
        raise MalformedModelFile(path, f"{key} must hold strings, got {listed!r}")
    return tokens


def _model_max_length(tokenizer_config: Mapping[str, Any], path: Path) -> int:
    """The longest input the config names; none named: transformers' "no limit" (1e30)."""
    value = tokenizer_config.get("model_max_length")
    if value is None:
        return VERY_LARGE_INTEGER
    if isinstance(value, float) and value.is_integer():  # 1e30, as some configs write it
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MalformedModelFile(
            path, f"model_max_length must be a positive integer, got {value!r}"
        )
    return value


def _eos_token_ids(
    source: Path,
    tokenizer: tokenizers.Tokenizer,
    special_tokens: dict[str, str],
    generation_config: Mapping[str, Any],
    config: Mapping[str, Any],
) -> tuple[int, ...]:
    for name, values in (("generation_config.json", generation_config), ("config.json", config)):
        value = values.get("eos_token_id")
        if value is None:
            continue
        ids = [value] if isinstance(value, int) else value
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            raise MalformedModelFile(
                _file_in(source, name),
                f"eos_token_id must be an int or a list of ints, got {value!r}",
            )
        return tuple(ids)
    eos_token = special_tokens.get("eos_token")
    eos_id = None if eos_token is None else tokenizer.token_to_id(eos_token)
    return () if eos_id is None else (eos_id,)


def _chat_template(source: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    path = _file_in(source, "tokenizer_config.json")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        # Older multi-template form: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        return None
    if not isinstance(template, str):
        raise MalformedModelFile(path, f"chat_template must be a string, got {template!r}")
    try:
        ENVIRONMENT.parse(template)
    except jinja2.TemplateSyntaxError as error:
        raise MalformedModelFile(path, f"chat_template is not valid jinja: {error}") from error
    return template


def _file_in(source: Path, name: str) -> Path:
    """The file an error is about: `name` inside a folder, or the single source file itself."""
    return source / name if source.is_dir() else source
