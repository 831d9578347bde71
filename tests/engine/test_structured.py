"""Structured outputs through the engine, on a tiny random model: the grammar alone must make
its garbage valid. Oracles: `jsonschema` validation, `re.fullmatch`, and the same request run
alone (unconstrained neighbours, preemption) giving the same tokens."""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from dataclasses import replace

import jsonschema
import pytest

from pagedkv.engine import InvalidStructuredOutput, SamplingParams, StructuredOutputsParams
from pagedkv.engine.structured import compiler
from pagedkv.engine.structured import grammar as compiler_grammar
from tests.engine.conftest import make_engine, make_llm, run_to_completion
from tests.structured_schemas import SCHEMAS

MAX_TOKENS = 256  # far above what any of the schemas needs: each must end by its grammar


def constrained(seed: int, max_tokens: int = MAX_TOKENS, n: int = 1, **kind) -> SamplingParams:
    return SamplingParams(
        n=n,
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**kind),
    )


@pytest.fixture(scope="module")
def llm(engine_zoo):
    return make_llm(engine_zoo)


def test_every_schema_gives_valid_json_for_every_sample(llm):
    prompts = [[5, 6, 7 + index] for index in range(len(SCHEMAS))]
    params = [constrained(index, n=3, json=schema) for index, schema in enumerate(SCHEMAS)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for schema, output in zip(SCHEMAS, outputs, strict=True):
        assert len(output.outputs) == 3
        for sample in output.outputs:
            assert sample.finish_reason == "stop", (schema, sample.text)
            jsonschema.validate(json.loads(sample.text), schema)


def test_regex_choice_grammar_and_json_object_outputs_match(llm):
    regex = r"[a-z]{2,5}@[0-9]{1,3}\.(com|org)"
    choices = ["yes", "no", "maybe so", 'quote "this"']
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
    params = [
        constrained(1, n=3, regex=regex),
        constrained(2, n=3, choice=choices),
        constrained(3, n=3, grammar=grammar),
        constrained(4, n=3, json_object=True),
    ]
    outputs = llm.generate([[5, 6, 7]] * 4, params, use_tqdm=False)
    regex_out, choice_out, grammar_out, object_out = (o.outputs for o in outputs)
    assert all(re.fullmatch(regex, s.text) for s in regex_out)
    assert all(s.text in choices for s in choice_out)
    assert all(re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", s.text) for s in grammar_out)
    for sample in object_out:
        if sample.finish_reason == "stop":  # any object may be long: only a whole one parses
            assert isinstance(json.loads(sample.text), dict)
        else:
            assert sample.text.startswith("{")


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(llm):
    plain = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True, n=2),
    ]
    prompts = [[9, 10, 11], [12, 13]]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    mixed_params = [plain[0], constrained(3, n=2, json=SCHEMAS[19]), plain[1]]
    mixed = llm.generate([prompts[0], [4, 5], prompts[1]], mixed_params, use_tqdm=False)
    for before, after in zip(alone, [mixed[0], mixed[2]], strict=True):
        assert [s.token_ids for s in before.outputs] == [s.token_ids for s in after.outputs]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_grammar_state_survives_preemption(engine_zoo, mode):
    """A pool too small for every request preempts some; each sample's tokens still equal
    those it draws in a pool that never preempts, so its grammar state was kept."""
    params = [constrained(i, 56, n=2, json=SCHEMAS[13 + i]) for i in range(6)]
    prompts = [[20 + i] * 8 for i in range(6)]
    results = []
    for blocks in (256, 8):
        engine = make_engine(engine_zoo, num_gpu_blocks=blocks, preemption_mode=mode)
        for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(str(index), prompt, p)
        tokens: dict[tuple[str, int], list[int]] = {}
        stopped = set()
        for outputs in run_to_completion(engine):
            for output in outputs:
                for sample in output.outputs:
                    key = (output.request_id, sample.index)
                    tokens.setdefault(key, []).extend(sample.token_ids)
                    if sample.finish_reason == "stop":
                        stopped.add(key)
        stats = engine.stats
        results.append((tokens, stats.num_swap_preemptions + stats.num_recompute_preemptions))
    (calm, no_preemptions), (tight, preemptions) = results
    assert no_preemptions == 0 and preemptions > 0
    assert tight == calm
    assert len(stopped) >= len(tight) // 2  # the others reached max_tokens
    for request_id, index in stopped:
        text = engine.tokenizer.decode(tight[request_id, index])
        jsonschema.validate(json.loads(text), SCHEMAS[13 + int(request_id)])


def test_max_tokens_cuts_the_json_with_finish_reason_length(llm):
    schema = {"type": "array", "items": SCHEMAS[9], "minItems": 3, "maxItems": 3}
    [output] = llm.generate([[5, 6]], constrained(0, max_tokens=6, json=schema), use_tqdm=False)
    sample = output.outputs[0]
    assert sample.finish_reason == "length" and len(sample.token_ids) == 6
    assert sample.text.startswith("[")
    with pytest.raises(json.JSONDecodeError):
        json.loads(sample.text)


@pytest.mark.parametrize(
    "kind",
    [
        dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}),
        dict(json="{not json"),
        dict(json={"type": "string", "pattern": "[a-"}),
        dict(regex="a(b"),
        dict(grammar="start: missing_rule"),
    ],
)
def test_a_bad_constraint_is_refused_at_add_request_and_leaves_nothing(engine_zoo, kind):
    engine = make_engine(engine_zoo)
    with pytest.raises(InvalidStructuredOutput, match=f"structured_outputs.{next(iter(kind))}"):
        engine.add_request("bad", [1, 2], constrained(0, **kind))
    assert not engine.has_unfinished() and engine.stats.num_waiting == 0
    engine.add_request("bad", [1, 2], SamplingParams(max_tokens=2))  # the id is free again
    assert list(run_to_completion(engine))


def whitespace_outside_strings(text: str) -> list[tuple[int, str]]:
    """(offset, the character before) of each whitespace character outside JSON strings."""
    found, in_string, escaped = [], False, False
    for offset, char in enumerate(text):
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = char == "\\", char != '"'
        elif char == '"':
            in_string = True
        elif char.isspace():
            found.append((offset, text[offset - 1 : offset]))
    return found


def test_json_has_no_free_whitespace_with_or_without_disable_any_whitespace(llm):
    """vLLM's `disable_any_whitespace=True` asks for JSON without free whitespace; pagedkv
    writes it so either way: only the one space after ',' and ':' that json.dumps writes."""
    prompts = [[5, 6, 7 + index] for index in range(len(SCHEMAS))]
    for disable in (True, False):
        params = [
            constrained(index, n=2, json=schema, disable_any_whitespace=disable)
            for index, schema in enumerate(SCHEMAS)
        ]
        for output in llm.generate(prompts, params, use_tqdm=False):
            for sample in output.outputs:
                spaces = whitespace_outside_strings(sample.text)
                assert all(before in (",", ":") for _, before in spaces), sample.text
                assert all(sample.text[offset] == " " for offset, _ in spaces), sample.text
    with pytest.raises(ValueError, match="disable_any_whitespace must be a bool"):
        StructuredOutputsParams(json_object=True, disable_any_whitespace="yes")


def test_vllms_other_structured_output_options_are_taken_or_refused_by_name():
    """Switches that name what pagedkv always does are accepted; options it does not
    implement are refused, naming them, rather than ignored."""
    for switch in ("disable_additional_properties", "disable_fallback"):
        assert StructuredOutputsParams(json_object=True, **{switch: True}).kind == "json_object"
        with pytest.raises(ValueError, match=f"{switch} must be a bool"):
            StructuredOutputsParams(json_object=True, **{switch: 1})
    for option in ("whitespace_pattern", "structural_tag"):
        with pytest.raises(ValueError, match=f"structured_outputs.{option} is not supported"):
            StructuredOutputsParams(json_object=True, **{option: "[ ]*"})


def test_special_tokens_spelled_in_a_constraint_are_plain_text(llm):
    """A grammar is over bytes: `<s>` and `</s>` (this tokenizer's BOS and EOS) written in a
    choice, a regex or a JSON const are those characters, spelled with ordinary tokens."""
    tokenizer = llm.get_tokenizer()
    specials = (tokenizer.decode([1], False), tokenizer.decode([2], False))
    assert specials == ("<s>", "</s>")
    cases = [
        (dict(choice=["<s>old</s> new"]), ["<s>old</s> new"]),
        (dict(regex=r"(ok|no)</s>"), ["ok</s>", "no</s>"]),
        (
            dict(json={"type": "object", "properties": {"html": {"const": "<s>x</s>"}}}),
            ['{"html": "<s>x</s>"}', "{}"],
        ),
    ]
    params = [constrained(seed, n=3, **kind) for seed, (kind, _) in enumerate(cases)]
    outputs = llm.generate([[5, 6, 7]] * len(cases), params, use_tqdm=False)
    for (_, allowed), output in zip(cases, outputs, strict=True):
        for sample in output.outputs:
            assert sample.finish_reason == "stop" and sample.text in allowed, sample
            assert not {1, 2} & set(sample.token_ids[:-1])  # no special id inside the text


def test_constraint_needs_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


def test_a_compiling_grammar_holds_up_no_other_request(engine_zoo, monkeypatch):
    """While one grammar compiles (held here), another request runs to the end; the held one
    waits unadmitted, then runs once its grammar is ready. Compiled grammars are cached."""
    release = threading.Event()
    real_compile = compiler._compile

    def held_compile(vocab, spec):
        release.wait(timeout=60)
        return real_compile(vocab, spec)

    monkeypatch.setattr(compiler, "_compile", held_compile)
    engine = make_engine(engine_zoo)
    engine.add_request("held", [3, 4], constrained(0, json=SCHEMAS[9]))
    engine.add_request("free", [3, 4], SamplingParams(max_tokens=5, ignore_eos=True))
    finished = set()
    while "free" not in finished:
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert engine.stats.num_waiting == 1 and engine.has_unfinished()
    release.set()
    text = ""
    for outputs in run_to_completion(engine):
        text += "".join(o.outputs[0].text for o in outputs if o.request_id == "held")
    jsonschema.validate(json.loads(text), SCHEMAS[9])
    params = StructuredOutputsParams(json=SCHEMAS[9])
    assert engine.grammars.submit(params) is engine.grammars.submit(params)


def test_aborting_a_request_whose_grammar_compiles_leaves_nothing(engine_zoo, monkeypatch):
    release = threading.Event()
    real_compile = compiler._compile
    monkeypatch.setattr(
        compiler, "_compile", lambda vocab, spec: release.wait(60) and real_compile(vocab, spec)
    )
    engine = make_engine(engine_zoo)
    engine.add_request("held", [3, 4], constrained(0, regex="[ab]{4}"))
    assert engine.has_unfinished() and engine.stats.num_waiting == 1
    engine.abort("held")
    [aborted] = engine.step()
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished() and engine.stats.num_waiting == 0
    release.set()


def test_objects_hold_to_their_declared_properties(llm):
    """A schema that says nothing of other keys gets none (xgrammar's strict mode, vLLM's
    default): without that, JSON Schema allows any key, and a random model keeps adding keys
    until max_tokens cuts the JSON off. A schema that allows other keys keeps them allowed."""
    item = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    schema = {
        "type": "object",
        "properties": {"n": SCHEMAS[1], "items": {"type": "array", "items": item, "maxItems": 2}},
        "required": ["n", "items"],
    }
    outputs = llm.generate(
        [[5, 6, 7]] * 4, [constrained(seed, n=3, json=schema) for seed in range(4)], use_tqdm=False
    )
    for sample in (s for output in outputs for s in output.outputs):
        assert sample.finish_reason == "stop", sample.text
        value = json.loads(sample.text)
        jsonschema.validate(value, schema)
        assert set(value) <= {"n", "items"}
        assert all(set(entry) == {"ok"} for entry in value["items"])


def test_closed_objects_closes_declared_objects_only():
    """Every object with `properties` and no word on other keys is closed, wherever a schema
    sits; objects that allow other keys, require undeclared ones, and bare objects are left as
    they are, and so is data (`const`, `enum`, `default`); the input is not changed."""
    declared = {"type": "object", "properties": {"a": {"type": "integer"}}}
    allowing = {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}}
    patterned = {"type": "object", "properties": {}, "patternProperties": {"^x": {}}}
    undeclared = {"type": "object", "properties": {}, "required": ["b"]}
    data = {"const": {"properties": {"a": 1}}, "default": {"properties": {}}}
    schema = {
        "type": "object",
        "properties": {
            "one": declared,
            "many": {"type": "array", "items": declared},
            "either": {"anyOf": [declared, {"type": "object"}]},
            "data": data,
            "undeclared": undeclared,
        },
        "$defs": {"d": declared, "open": allowing, "pattern": patterned},
    }
    closed = compiler_grammar.closed_objects(schema)
    shut = dict(declared, additionalProperties=False)
    assert closed == {
        "type": "object",
        "properties": {
            "one": shut,
            "many": {"type": "array", "items": shut},
            "either": {"anyOf": [shut, {"type": "object"}]},
            "data": data,
            "undeclared": undeclared,
        },
        "$defs": {"d": shut, "open": allowing, "pattern": patterned},
        "additionalProperties": False,
    }
    assert "additionalProperties" not in declared and "additionalProperties" not in schema


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        (
            {
                "allOf": [
                    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
                ]
            },
            {"a": 1, "b": 2},
        ),
        (
            {
                "$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"}}}},
                "$ref": "#/$defs/base",
                "properties": {"b": {"type": "integer"}},
                "required": ["a", "b"],
            },
            {"a": 1, "b": 2},
        ),
        (
            {
                "type": "object",
                "properties": {"kind": {"enum": ["x", "y"]}},
                "required": ["kind"],
                "anyOf": [
                    {"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                    {"properties": {"y": {"type": "string"}}, "required": ["y"]},
                ],
            },
            {"kind": "x", "x": 3},
        ),
    ],
    ids=["allOf", "ref-beside-properties", "anyOf-beside-properties"],
)
def test_objects_put_together_from_parts_stay_open_and_compile(llm, schema, value):
    """Closing one part of such a schema would refuse the others' keys (every value would be
    invalid, or the grammar unsatisfiable): it is left as JSON Schema says, and its outputs
    validate."""
    jsonschema.validate(value, schema)  # the schema is satisfiable
    assert compiler_grammar.closed_objects(schema) == schema
    outputs = llm.generate([[5, 6, 7]], constrained(3, n=4, json=schema), use_tqdm=False)
    for sample in outputs[0].outputs:
        if sample.finish_reason == "stop":
            jsonschema.validate(json.loads(sample.text), schema)


@pytest.mark.parametrize("keyword", [{"uniqueItems": True}, {"contains": {"const": 1}}])
def test_a_keyword_llguidance_cannot_hold_to_is_refused_naming_it(engine_zoo, keyword):
    """vLLM refuses them too: ignored, they would let finished outputs break the schema."""
    engine = make_engine(engine_zoo)
    schema = {"type": "array", "items": {"type": "integer"}, **keyword}
    with pytest.raises(InvalidStructuredOutput, match=next(iter(keyword))):
        engine.add_request("r", [5, 6], constrained(1, json=schema))


def test_a_required_list_of_non_names_is_a_clear_error(engine_zoo):
    schema = {"type": "object", "properties": {"a": {}}, "required": [["a"]]}
    with pytest.raises(InvalidStructuredOutput, match="required"):
        make_engine(engine_zoo).add_request("r", [5, 6], constrained(1, json=schema))


def test_a_schema_nested_past_the_stack_is_a_clear_error(engine_zoo):
    depth = 2000
    text = '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    engine = make_engine(engine_zoo)
    for given in (text, schema):
        with pytest.raises(InvalidStructuredOutput, match="nested too deeply"):
            engine.add_request("r", [5, 6], constrained(1, json=given))


@pytest.mark.parametrize(
    "others",
    [{"allowed_token_ids": [50, 51]}, {"bad_words": ["yes", "no"]}],
    ids=["allowed-ids", "bad-words"],
)
def test_constraints_that_exclude_each_other_end_the_sample_as_abort(llm, others, caplog):
    """Nothing the choice allows may be sampled: the sample ends with finish_reason "abort"
    and no text outside the constraint, never as a successful "stop"; the log gives
    llguidance's reason."""
    choice = StructuredOutputsParams(choice=["yes", "no"])
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature, seed=1, max_tokens=8, structured_outputs=choice, **others
        )
        with caplog.at_level(logging.WARNING, logger="pagedkv.engine.stops"):
            [output] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
        sample = output.outputs[0]
        assert sample.finish_reason == "abort"
        assert any(c.startswith(sample.text) for c in choice.choice)  # a prefix, at most
        # and no token the constraints forbid: the refused one is left out of the record
        if "allowed_token_ids" in others:
            assert set(sample.token_ids) <= set(others["allowed_token_ids"])
        assert llm.get_tokenizer().decode(sample.token_ids) == sample.text
        assert "doesn't satisfy the grammar" in caplog.text


def test_a_grammar_past_llguidances_row_limit_ends_the_sample_as_abort_naming_it(llm, caplog):
    """A choice among 3,000 strings passes llguidance's 2,000 items in a parser row once its
    first token is taken: the sample ends with "abort" (no text past the constraint) and the
    log names the limit, not constraints that exclude each other."""
    choice = StructuredOutputsParams(choice=[f"w{index}" for index in range(3000)])
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice)
    with caplog.at_level(logging.WARNING, logger="pagedkv.engine.stops"):
        [output] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert output.outputs[0].finish_reason == "abort"
    assert any(c.startswith(output.outputs[0].text) for c in choice.choice)
    assert "max is 2000" in caplog.text


def test_a_complete_grammar_ends_the_sample_before_min_tokens(llm):
    """Once the grammar allows only EOS, min_tokens (which masks EOS) would leave nothing to
    sample: the constraint wins and the sample stops whole."""
    params = SamplingParams(
        n=3,
        temperature=1.0,
        seed=2,
        min_tokens=12,
        structured_outputs=StructuredOutputsParams(json={"type": "boolean"}),
    )
    [output] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    for sample in output.outputs:
        assert sample.finish_reason == "stop" and sample.text in ("true", "false")
        assert len(sample.token_ids) < 12  # no filler sampled from an all-masked row


def test_logprobs_are_over_what_the_grammar_allows(llm):
    """vLLM's: under a grammar the returned logprobs are the model's, renormalised over the
    tokens the grammar allows at each position; the others are -inf."""
    choices = ["yes", "no", "maybe"]
    params = SamplingParams(
        temperature=1.0,
        seed=4,
        logprobs=20,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )
    [output] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    sample = output.outputs[0]
    assert sample.text in choices
    for token_id, position in zip(sample.token_ids, sample.logprobs, strict=True):
        finite = [entry.logprob for entry in position.values() if entry.logprob > float("-inf")]
        assert position[token_id].logprob > float("-inf")
        assert sum(math.exp(value) for value in finite) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    ("regex", "ascii_class", "lure"),
    [(r"\d{3}-\d{4}", r"[0-9]{3}-[0-9]{4}", "０١٢३"), (r"\w{6}", r"[0-9a-zA-Z_]{6}", "éßж")],
)
def test_regex_classes_are_javascripts_as_in_json_schema_patterns(llm, regex, ascii_class, lure):
    """ECMA-262's classes, as vLLM's default backend (xgrammar) reads a regex: `\\d` is [0-9],
    `\\w` [0-9a-zA-Z_]. The tokens of non-ASCII digits or letters are pushed far up by a logit
    bias, so any class that admits them would be taken; the JSON-schema pattern agrees."""
    lure_ids = set(llm.get_tokenizer().encode(lure, add_special_tokens=False))
    pattern = {"type": "string", "pattern": f"^{regex}$"}
    params = [
        replace(constrained(seed, n=4, **kind), logit_bias=dict.fromkeys(lure_ids, 30.0))
        for seed, kind in enumerate([{"regex": regex}, {"json": pattern}])
    ]
    regex_out, json_out = (o.outputs for o in llm.generate([[5, 6, 7]] * 2, params, use_tqdm=False))
    assert all(re.fullmatch(ascii_class, s.text) for s in regex_out)
    assert all(re.fullmatch(ascii_class, json.loads(s.text)) for s in json_out)


def test_lark_rules_with_inline_or_keep_prefixes_are_read_as_lark(llm):
    """vLLM's rule: a grammar that defines no rule with "::=" is Lark, so Lark's `?rule`
    (inlined) and `!rule` (tokens kept) are taken, not misread as bad GBNF; a GBNF grammar
    still reads as GBNF. The oracle is each language written as a regex."""
    cases = [  # finite languages: every sample ends by its grammar
        ('?start: sum\n?sum: NUMBER | NUMBER "+" NUMBER\nNUMBER: /[0-9]/', r"[0-9](\+[0-9])?"),
        ('!start: "x" ("y" | "z")', r"x[yz]"),
        ('root ::= "a" [0-9] ("," [0-9])?', r"a[0-9](,[0-9])?"),
    ]
    params = [constrained(seed, n=3, grammar=grammar) for seed, (grammar, _) in enumerate(cases)]
    outputs = llm.generate([[5, 6, 7]] * len(cases), params, use_tqdm=False)
    for (grammar, language), output in zip(cases, outputs, strict=True):
        for sample in output.outputs:
            assert sample.finish_reason == "stop", (grammar, sample.text)
            assert re.fullmatch(language, sample.text), (grammar, sample.text)


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}, "x-guidance"),
        (False, "allows no value"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "use anyOf"),
    ],
    ids=["x-guidance", "false", "overlapping-oneOf"],
)
def test_schemas_the_server_cannot_hold_outputs_to_are_refused_in_its_terms(
    engine_zoo, schema, says
):
    """A schema's own `x-guidance` would replace the server's JSON options (its `lenient`
    drops the refused keywords, and outputs break them); `false` allows nothing; an overlapping
    oneOf names anyOf, not an llguidance option a request cannot set."""
    engine = make_engine(engine_zoo)
    with pytest.raises(InvalidStructuredOutput, match=says) as refused:
        engine.add_request("r", [5, 6], constrained(1, json=json.dumps(schema)))
    assert "coerce_one_of" not in str(refused.value)


def test_the_schema_true_allows_any_json_value(llm):
    """JSON Schema's boolean schema `true` is the empty schema: any value validates."""
    [output] = llm.generate([[5, 6, 7]], constrained(5, n=4, json="true"), use_tqdm=False)
    for sample in output.outputs:
        if sample.finish_reason == "stop":
            jsonschema.validate(json.loads(sample.text), True)


def test_ignore_eos_runs_a_constrained_sample_to_max_tokens(llm):
    """A grammar takes EOS as its end, so under ignore_eos EOS is masked while the grammar
    could go on: the sample runs to max_tokens, as it would unconstrained; a grammar that
    can only end (a whole boolean) still stops."""
    params = SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=15, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(regex="a+"),
    )  # fmt: skip
    [output] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    for sample in output.outputs:
        assert sample.finish_reason == "length" and len(sample.token_ids) == 15
        assert re.fullmatch("a+", sample.text)
    params = SamplingParams(
        n=3, temperature=1.0, seed=4, max_tokens=15, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json={"type": "boolean"}),
    )  # fmt: skip
    [output] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert all(s.finish_reason == "stop" and s.text in ("true", "false") for s in output.outputs)


def test_ignore_eos_keeps_eos_where_the_other_constraints_leave_the_grammar_nothing_else(llm):
    """Under ignore_eos a grammar's EOS is masked only while something else may follow: where
    allowed_token_ids masks every continuation the grammar has, EOS stays and ends the sample
    whole ("stop"), not with a token the grammar refuses ("abort")."""
    tokenizer = llm.get_tokenizer()
    [first] = tokenizer.encode("x", add_special_tokens=False)
    params = SamplingParams(
        temperature=1.0, seed=5, max_tokens=8, ignore_eos=True,
        allowed_token_ids=[first, tokenizer.eos_token_id],
        structured_outputs=StructuredOutputsParams(grammar='start: "x" "yz"?'),
    )  # fmt: skip
    [output] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    sample = output.outputs[0]
    assert (sample.finish_reason, sample.text) == ("stop", "x")
