"""From a request's constraint to an llguidance grammar, and the vocabulary it masks over.

llguidance (rather than xgrammar) because it is one dependency-free wheel and computes masks
on the fly from an Earley parser, so a large schema costs little to compile; the comparison
is in `bench/grammar_engines.py` and docs/structured-outputs.md. Grammars are built for the
engine's own tokenizer, whichever file it came from (tokenizer.json or a GGUF vocabulary):
every token id of the model's vocabulary is given the bytes it stands for (`TokenBytes`);
special tokens and ids the tokenizer does not use can never spell grammar text, only end it
(the EOS ids).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import tokenizers

from pagedkv.engine.errors import InvalidStructuredOutput
from pagedkv.engine.structured.params import StructuredOutputsParams
from pagedkv.engine.token_bytes import TokenBytes

if TYPE_CHECKING:
    from pagedkv.tokenizer import Tokenizer

# What json_object=True means: any JSON object (vLLM's and OpenAI's "json_object").
ANY_OBJECT = '{"type": "object"}'
# JSON is written as `json.dumps` writes it (", " and ": ", no other whitespace): free
# whitespace (vLLM's default) lets a small model spend its max_tokens on blank lines. A keyword
# llguidance does not implement ("uniqueItems", "contains", an unknown "format") is refused
# naming it, as vLLM refuses it: ignored, it would let outputs break the schema.
JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
# Where a JSON Schema holds schemas (everything else, "const", "enum", "default" included, is
# data): keywords holding a map of schemas, a list of them, or one (a list in older drafts).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
TOO_DEEP = "nested too deeply"
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_KEYS_OF_OBJECTS = ("properties", "dependentSchemas", *_OPEN_KEYS)


def closed_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that declares
    `properties`, requires none but those, and says nothing of other keys (no
    `additionalProperties`, `patternProperties` or `unevaluatedProperties`).

    JSON Schema lets such an object carry any other key, so a small model can go on adding
    keys until max_tokens cuts the JSON off. vLLM's default grammar engine (xgrammar, strict
    mode) and OpenAI's strict structured outputs hold objects to their declared properties;
    so do we. A schema that wants other keys says so, and `{"type": "object"}` with no
    properties (json_object's) stays any object. A schema whose objects are put together
    from parts (`allOf`, a `$ref` beside other keywords, `anyOf`/`oneOf` beside
    `properties`) is left as it is: closing one part would refuse the keys of the others.
    """
    return schema if _composes_objects(schema) else _closed(schema)


def _subschemas(schema: dict[str, Any]) -> list[Any]:
    """The schemas directly inside `schema`, by its schema-holding keywords."""
    inside: list[Any] = []
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            inside += schema[key].values()
    for key in (*_SCHEMA_LISTS, *_SCHEMA_ONES):
        value = schema.get(key)
        inside += value if isinstance(value, list) else [value]
    return [each for each in inside if isinstance(each, dict)]


def _composes_objects(schema: Any) -> bool:
    """Whether, anywhere, an object's keys come from more than one schema (see above)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        beside_ref = "$ref" in node and any(key in node for key in (*_KEYS_OF_OBJECTS, "required"))
        branches = "properties" in node and ("anyOf" in node or "oneOf" in node)
        if "allOf" in node or beside_ref or branches:
            return True
        stack += _subschemas(node)
    return False


def _closed(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            closed[key] = {name: _closed(value) for name, value in schema[key].items()}
    for key in (*_SCHEMA_LISTS, *_SCHEMA_ONES):
        value = schema.get(key)
        if isinstance(value, list):
            closed[key] = [_closed(item) for item in value]
        elif isinstance(value, dict):
            closed[key] = _closed(value)
    properties = schema.get("properties")
    required = schema.get("required", [])
    if (
        isinstance(properties, dict)
        and not any(key in schema for key in _OPEN_KEYS)
        and isinstance(required, list)
        and all(isinstance(name, str) and name in properties for name in required)
    ):
        closed["additionalProperties"] = False
    return closed


def grammar_spec(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of `params`; raise `InvalidStructuredOutput` naming what is wrong.

    Checked without the vocabulary (as vLLM's front end does), which is cheap: the costly
    token-level part is left to the compile thread.
    """
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = ANY_OBJECT if kind == "json_object" else params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            spec = llguidance.LLMatcher.grammar_from_json_schema(
                closed_objects(_checked_schema(schema)), defaults=JSON_OPTIONS
            )
        elif kind == "choice":
            spec = llguidance.grammar_from("choice", json.dumps(params.choice))
        elif kind == "regex":
            spec = llguidance.grammar_from("lark", regex_grammar(params.regex))
        else:  # grammar: GBNF where it defines a rule with "::=", else Lark (vLLM's rule)
            syntax = "gbnf" if "::=" in params.grammar else "lark"
            spec = llguidance.grammar_from(syntax, params.grammar)
    except ValueError as error:
        raise InvalidStructuredOutput(kind, _plain(str(error))) from error
    except RecursionError as error:  # a schema nested past Python's stack
        raise InvalidStructuredOutput(kind, TOO_DEEP) from error
    error = llguidance.LLMatcher.validate_grammar(spec)
    if error:
        raise InvalidStructuredOutput(kind, _plain(error))
    return spec


def _checked_schema(schema: Any) -> Any:
    """The schema as llguidance takes it: the boolean schemas as JSON Schema reads them (`true`
    is any value, `false` none), and no `x-guidance` of its own, which would replace
    JSON_OPTIONS (`lenient` ignores the keywords refused above, and outputs break them)."""
    if schema is True:
        return {}
    if schema is False:
        raise ValueError("the schema false allows no value at all")
    if isinstance(schema, dict) and "x-guidance" in schema:
        raise ValueError(
            "x-guidance is not supported: the JSON options are the server's (see "
            "docs/structured-outputs.md)"
        )
    return schema


def _plain(message: str) -> str:
    """llguidance's message, where it names an option of its own that requests cannot set,
    told in the terms of the request."""
    if "coerce_one_of" in message:
        return (
            "oneOf whose branches can match the same value is not supported (outputs could "
            "not be held to exactly one of them): use anyOf"
        )
    return message


def regex_grammar(regex: str) -> str:
    r"""A regex constraint as Lark, its classes read as JavaScript's (ECMA-262), as vLLM's
    default backend (xgrammar) and JSON Schema's `pattern` read them: `\d` is [0-9] and `\w`
    [0-9a-zA-Z_]. llguidance's own regex reads them as Unicode's, so `\d{3}` let a model
    write fullwidth or Arabic-Indic digits."""
    return f"start: /{llguidance.regex_to_lark(regex, 'dw')}/"


def vocabulary(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """An llguidance tokenizer over the model's `vocab_size` ids, from our tokenizer's bytes.

    Takes a fraction of a second (49k tokens), so it is built on the compile thread.
    """
    token_bytes = TokenBytes(tokenizer)
    tokens: list[bytes] = []
    special: list[int] = []
    for token_id in range(vocab_size):
        piece = token_bytes(token_id) if token_id < tokenizer.vocab_size else b""
        if token_id in token_bytes.special_ids or not piece:
            special.append(token_id)
            piece = piece or f"<|unused_{token_id}|>".encode()
        tokens.append(piece)
    eos_ids = [token_id for token_id in tokenizer.eos_token_ids if token_id < vocab_size]
    wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, tokens, special, eos_ids))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos_ids)


class _Vocabulary:
    """What `llguidance.TokenizerWrapper` reads: token bytes, special ids, EOS, and a
    tokenize function (used to tokenize text the grammar forces).

    Forced text is tokenized with special tokens' spellings read as plain text: a grammar is
    over bytes, so `</s>` in a choice or a JSON string is the four characters, never the EOS
    id (which has no bytes, and would leave the grammar no way on). A copy of the tokenizer
    does it, so the engine's own is never switched while the compile thread uses this one."""

    def __init__(
        self, tokenizer: Tokenizer, tokens: list[bytes], special: list[int], eos: Sequence[int]
    ) -> None:
        self._plain_text = tokenizers.Tokenizer.from_str(tokenizer.tokenizer.to_str())
        self._plain_text.encode_special_tokens = True
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = tokenizer.bos_token_id

    def __call__(self, text: bytes) -> list[int]:
        decoded = text.decode("utf-8", "replace")
        return self._plain_text.encode(decoded, add_special_tokens=False).ids
