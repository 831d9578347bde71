"""vLLM's SamplingParams semantics: fields changed after construction, and the fields users
pass that shape sampling (include_stop_str_in_output, logit_bias, allowed_token_ids,
bad_words).

Oracles: the same request's greedy output without the setting (a stop string cut from it,
the token a bias or a mask must move the argmax to), transformers' logits for which token is
the argmax, and, for per-row settings, the other rows of the same step, which must equal
their outputs when run alone.
"""

from __future__ import annotations

import shutil

import pytest

from pagedkv.engine import LLM, SamplingParams
from tests.engine.conftest import make_llm
from tests.model.tiny_models import write_tokenizer_files

MAX_TOKENS = 12
PROMPT = "Paged attention stores keys"


def greedy(**fields) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **fields}
    )


@pytest.fixture(scope="module")
def llm(engine_zoo):
    return make_llm(engine_zoo, "llama")


@pytest.fixture(scope="module")
def plain(llm):
    """The prompt's greedy completion with no extra setting: the oracle most tests cut from."""
    [output] = llm.generate(PROMPT, greedy(), use_tqdm=False)
    return output.outputs[0]


def middle(text: str) -> str:
    """A stop string found in the middle of `text`, first occurring at least 2 chars in."""
    for start in range(2, len(text) - 2):
        candidate = text[start : start + 2]
        if text.find(candidate) == start and candidate.strip():
            return candidate
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("as_list", [True, False], ids=["list", "str"])
def test_stop_set_after_construction_is_honoured(llm, plain, as_list):
    stop = middle(plain.text)
    params = greedy()
    params.stop = [stop] if as_list else stop
    [output] = llm.generate(PROMPT, params, use_tqdm=False)
    assert output.outputs[0].text == plain.text[: plain.text.find(stop)]
    assert output.outputs[0].finish_reason == "stop"
    assert output.outputs[0].stop_reason == stop


def test_stop_token_ids_set_after_construction_are_honoured(llm, plain):
    params = greedy()
    params.stop_token_ids = [plain.token_ids[3]]
    [output] = llm.generate(PROMPT, params, use_tqdm=False)
    first = plain.token_ids.index(plain.token_ids[3])
    assert output.outputs[0].token_ids == plain.token_ids[: first + 1]
    assert output.outputs[0].stop_reason == plain.token_ids[3]


def test_a_bad_value_set_after_construction_is_refused_at_use(llm):
    params = greedy()
    params.temperature = -1.0
    with pytest.raises(ValueError, match="temperature .* got -1.0"):
        llm.generate(PROMPT, params, use_tqdm=False)
    params = greedy()
    params.stop = [""]
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        llm.generate(PROMPT, params, use_tqdm=False)


def test_params_changed_after_a_request_is_added_do_not_change_it(llm, plain):
    engine = llm.engine
    params = greedy()
    engine.add_request("changed-later", PROMPT, params)
    params.max_tokens = 2
    params.stop = [middle(plain.text)]
    text = ""
    while engine.has_unfinished():
        for delta in engine.step():
            text += "".join(o.text for o in delta.outputs)
    assert text == plain.text


def test_a_clone_edited_in_place_leaves_the_original_alone(llm, plain):
    """vLLM's clone is a deep copy: appending a stop string to a variant's list must not make
    the original stop there too."""
    base = greedy(stop=["never seen"], logit_bias={1: 0.0}, extra_args={"tags": ["a"]})
    variant = base.clone()
    variant.stop.append(middle(plain.text))
    variant.logit_bias[2] = -5.0
    variant.extra_args["tags"].append("b")
    assert (base.stop, base.logit_bias, base.extra_args) == (
        ["never seen"], {1: 0.0}, {"tags": ["a"]},
    )  # fmt: skip
    [output] = llm.generate(PROMPT, base, use_tqdm=False)
    assert output.outputs[0].text == plain.text
    [output] = llm.generate(PROMPT, variant, use_tqdm=False)
    assert output.outputs[0].finish_reason == "stop"
    # vLLM's skip_clone: extra_args that cannot be copied (a lock) are shared, not copied
    import threading

    lock = threading.Lock()
    assert greedy(extra_args={"lock": lock}, skip_clone=True).clone().extra_args["lock"] is lock


def test_stop_and_bad_words_are_lists_as_vllms_are():
    """vLLM makes `stop` a list (a string one of one, None an empty one), and `bad_words`
    too, so ported code may append to them."""
    assert SamplingParams(stop="x").stop == ["x"]
    assert (SamplingParams().stop, SamplingParams().bad_words) == ([], [])
    params = SamplingParams()
    params.stop.append("y")
    assert params.clone().stop_strings == ("y",)


def test_a_bool_logprobs_counts_as_vllm_counts_it(llm):
    """vLLM reads `logprobs=True` as 1 and False as 0 (the sampled token's alone): the same
    entries as those numbers give, for the prompt's logprobs too."""
    for flag, number in ((True, 1), (False, 0)):
        by_flag, by_number = (
            llm.generate(PROMPT, greedy(logprobs=k, prompt_logprobs=k), use_tqdm=False)[0]
            for k in (flag, number)
        )
        assert by_flag.outputs[0].logprobs == by_number.outputs[0].logprobs
        assert by_flag.prompt_logprobs == by_number.prompt_logprobs
        assert {len(entry) for entry in by_flag.outputs[0].logprobs} <= {1, 1 + number}


def test_include_stop_str_in_output_keeps_the_stop_string(llm, plain):
    stop = middle(plain.text)
    params = greedy(stop=[stop], include_stop_str_in_output=True)
    [output] = llm.generate(PROMPT, params, use_tqdm=False)
    assert output.outputs[0].text == plain.text[: plain.text.find(stop) + len(stop)]
    assert output.outputs[0].finish_reason == "stop"


def test_include_stop_str_in_output_streams_the_same_text(llm, plain):
    stop = middle(plain.text)
    engine = llm.engine
    engine.add_request("streamed", PROMPT, greedy(stop=[stop], include_stop_str_in_output=True))
    text = ""
    while engine.has_unfinished():
        text += "".join(o.text for d in engine.step() for o in d.outputs)
    assert text == plain.text[: plain.text.find(stop) + len(stop)]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_adds_its_text_only_with_include_stop_str_in_output(llm, plain, include):
    """vLLM's detokenizer: a sample stopped by a stop token id (or EOS) leaves that token's text
    out, unless include_stop_str_in_output; the text is then the decoded tokens either way."""
    tokenizer = llm.get_tokenizer()
    ids = plain.token_ids
    at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # its first time
    params = greedy(stop_token_ids=[ids[at]], include_stop_str_in_output=include)
    [output] = llm.generate(PROMPT, params, use_tqdm=False)
    assert list(output.outputs[0].token_ids) == list(ids[: at + 1])
    kept = ids[: at + 1] if include else ids[:at]
    # (less a last character the kept tokens leave incomplete, which vLLM never emits)
    assert output.outputs[0].text == tokenizer.decode(kept).rstrip("\ufffd")


def prompt_ids(llm) -> list[int]:
    return llm.get_tokenizer().encode(PROMPT)


def next_logits(engine_zoo, llm, generated=()):
    """transformers' logits of the token after the prompt and `generated`."""
    return engine_zoo.hf_logits("llama", prompt_ids(llm) + list(generated))[-1]


def run_beside_plain(llm, params: SamplingParams, plain) -> list[int]:
    """The prompt under `params`, in one step with a plain row that must stay unchanged."""
    other, changed = llm.generate([PROMPT, PROMPT], [greedy(), params], use_tqdm=False)
    assert other.outputs[0].token_ids == plain.token_ids
    return changed.outputs[0].token_ids


def test_logit_bias_moves_the_argmax_as_its_arithmetic_says(engine_zoo, llm, plain):
    logits = next_logits(engine_zoo, llm)
    top2 = logits.topk(2).indices.tolist()
    assert plain.token_ids[0] == top2[0]
    gap = float(logits[top2[0]] - logits[top2[1]])
    tokens = run_beside_plain(llm, greedy(logit_bias={top2[1]: gap + 0.5}), plain)
    assert tokens[0] == top2[1]
    tokens = run_beside_plain(llm, greedy(logit_bias={top2[1]: gap - 0.5}), plain)
    assert tokens[0] == top2[0]


def test_allowed_token_ids_restrict_every_token(engine_zoo, llm, plain):
    logits = next_logits(engine_zoo, llm)
    allowed = logits.argsort()[100:105].tolist()  # none of them the model's own choice
    tokens = run_beside_plain(llm, greedy(allowed_token_ids=allowed), plain)
    assert set(tokens) <= set(allowed)
    assert tokens[0] == max(allowed, key=lambda t: float(logits[t]))


def test_a_one_token_bad_word_never_appears(llm, plain):
    tokenizer = llm.get_tokenizer()
    word = next(
        tokenizer.decode([t])
        for t in plain.token_ids
        if tokenizer.decode([t]).strip()
        and tokenizer.encode(tokenizer.decode([t]).lstrip(), False) == [t]
    )
    [banned] = tokenizer.encode(word.lstrip(), False)
    tokens = run_beside_plain(llm, greedy(bad_words=[word]), plain)
    assert banned not in tokens


def test_a_two_token_bad_word_masks_its_last_token_after_its_first(engine_zoo, llm, plain):
    tokenizer = llm.get_tokenizer()
    position = next(
        k
        for k in range(1, len(plain.token_ids) - 1)
        if tokenizer.encode(tokenizer.decode(plain.token_ids[k : k + 2]), False)
        == plain.token_ids[k : k + 2]
        and not tokenizer.decode(plain.token_ids[k : k + 2]).startswith(" ")
        and plain.token_ids[k + 1] not in plain.token_ids[: k + 1]
    )
    word = tokenizer.decode(plain.token_ids[position : position + 2])
    tokens = run_beside_plain(llm, greedy(bad_words=[word]), plain)
    assert tokens[: position + 1] == plain.token_ids[: position + 1]
    logits = next_logits(engine_zoo, llm, plain.token_ids[: position + 1])
    logits[plain.token_ids[position + 1]] = float("-inf")
    assert tokens[position + 1] == int(logits.argmax())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logit_bias": {320: 1.0}}, "logit_bias token id 320 is outside .* \\[0, 320\\)"),
        ({"allowed_token_ids": [5, 400]}, "allowed_token_ids token id 400 is outside .*320"),
    ],
)
def test_token_ids_beyond_the_vocabulary_are_refused_at_add_request(llm, fields, message):
    from pagedkv.engine import TokenOutOfVocabulary

    with pytest.raises(TokenOutOfVocabulary, match=message):
        llm.generate(PROMPT, greedy(**fields), use_tqdm=False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be a bool, got 1"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids .* got '5'"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias\\[5\\] must be a finite number"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids must be >= 0, got -1"),
        ({"bad_words": "word"}, "bad_words must be a list of strings, got 'word'"),
        ({"bad_words": ["ok", " "]}, "bad_words must not be blank, got ' '"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids, got 5"),
        ({"allowed_token_ids": 5}, "allowed_token_ids must be a list of token ids, got 5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"detokenize": 1}, "detokenize must be a bool, got 1"),
        ({"detokenize": False, "stop": "x"}, "stop strings need detokenize=True"),
        ({"extra_args": 5}, "extra_args must be a dict or None, got 5"),
    ],
)
def test_bad_values_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        greedy(**fields)


def test_arguments_of_the_wrong_kind_are_named(llm):
    """Sampling settings as a dict, or a chat that is not a list of messages: TypeErrors that
    say what was expected, before any work."""
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate(PROMPT, {"temperature": 0.0}, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams, got dict"):
        llm.generate([PROMPT], [{"temperature": 0.0}], use_tqdm=False)
    for messages in ("hello", {"role": "user", "content": "hi"}, None):
        with pytest.raises(TypeError, match="messages must be a list of"):
            llm.chat(messages, use_tqdm=False)


def test_a_stop_string_counts_only_past_min_tokens(llm):
    """vLLM's detokenizer: a stop string must end in the text of a token past the first
    min_tokens; ending in the min_tokens-th token's text, it does not stop the sample."""
    tokenizer = llm.get_tokenizer()
    [long] = llm.generate(PROMPT, greedy(max_tokens=64), use_tqdm=False)
    ids = list(long.outputs[0].token_ids)

    def piece(at: int) -> str:  # the text token `at` adds
        return tokenizer.decode(ids[: at + 1])[len(tokenizer.decode(ids[:at])) :]

    at = next(
        at
        for at in range(2, len(ids) - 1)
        if piece(at).strip()
        and "\ufffd" not in piece(at)  # whole characters, after a prefix that stays as it is
        and tokenizer.decode(ids[: at + 1]).startswith(tokenizer.decode(ids[:at]))
        and tokenizer.decode(ids).find(piece(at)) == len(tokenizer.decode(ids[:at]))
    )
    stop = piece(at)
    [past_min] = llm.generate(
        PROMPT, greedy(stop=[stop], min_tokens=at, max_tokens=64), use_tqdm=False
    )
    assert past_min.outputs[0].finish_reason == "stop"
    assert len(past_min.outputs[0].token_ids) == at + 1
    [at_min] = llm.generate(
        PROMPT, greedy(stop=[stop], min_tokens=at + 1, max_tokens=64), use_tqdm=False
    )
    assert len(at_min.outputs[0].token_ids) > at + 1  # token at + 1's text did not stop it
    # Nor may a longer stop string's wider search reach back to that occurrence later.
    longer = greedy(stop=[stop, "\x00" * 16], min_tokens=at + 1, max_tokens=64)
    [with_longer] = llm.generate(PROMPT, longer, use_tqdm=False)
    assert with_longer.outputs[0].token_ids == at_min.outputs[0].token_ids


def test_min_tokens_bans_eos_under_ignore_eos_too(llm):
    """vLLM's min_tokens masks every EOS id, ignore_eos or not: with EOS pushed far above
    everything, the first min_tokens tokens are still not EOS (and later ones are)."""
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, min_tokens=4, logit_bias={eos: 100.0}
    )
    [output] = llm.generate(PROMPT, params, use_tqdm=False)
    tokens = list(output.outputs[0].token_ids)
    assert eos not in tokens[:4] and tokens[4:] == [eos, eos]


def test_an_eos_id_other_than_the_tokenizers_reports_itself(engine_zoo, llm, plain, tmp_path):
    """generation_config's extra EOS ids are vLLM's stop_token_ids: the stop_reason is the id;
    the tokenizer's own EOS gives None."""
    folder = tmp_path / "llama"
    shutil.copytree(engine_zoo.folder("llama"), folder)
    other = plain.token_ids[3]
    write_tokenizer_files(folder, eos_token_id=[2, other])
    two_eos = LLM(str(folder), num_gpu_blocks=128, swap_space_gb=0.01, max_model_len=1024)
    [output] = two_eos.generate(PROMPT, SamplingParams(temperature=0.0), use_tqdm=False)
    sample = output.outputs[0]
    assert sample.finish_reason == "stop" and sample.stop_reason == other
    assert list(sample.token_ids) == list(plain.token_ids[: plain.token_ids.index(other) + 1])
    biased = SamplingParams(temperature=0.0, logit_bias={2: 100.0})
    [own] = two_eos.generate(PROMPT, biased, use_tqdm=False)
    assert list(own.outputs[0].token_ids) == [2] and own.outputs[0].stop_reason is None
    # vLLM checks the tokenizer's own EOS before stop_token_ids: listed there too, still None.
    listed = SamplingParams(temperature=0.0, logit_bias={2: 100.0}, stop_token_ids=[2])
    [own_listed] = two_eos.generate(PROMPT, listed, use_tqdm=False)
    assert own_listed.outputs[0].stop_reason is None
    ignoring = SamplingParams(
        temperature=0.0, logit_bias={2: 100.0}, stop_token_ids=[2], ignore_eos=True
    )
    [as_stop_id] = two_eos.generate(PROMPT, ignoring, use_tqdm=False)
    assert as_stop_id.outputs[0].stop_reason == 2  # with ignore_eos only the list stops it


def test_numpy_scalars_are_the_numbers_they_hold():
    """A parameter sweep's numpy values make the same SamplingParams as Python's numbers
    (vLLM's checks compare them as numbers too); a bad one is still named."""
    import numpy as np

    swept = SamplingParams(
        temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int64(40),
        max_tokens=np.int32(7), seed=np.uint64(3), logprobs=np.int16(2), ignore_eos=np.True_,
        stop_token_ids=np.array([3, 4]), allowed_token_ids=np.arange(5, 9),
        logit_bias={np.int64(6): np.float32(1.5)},
    )  # fmt: skip
    plain = SamplingParams(
        temperature=0.5, top_p=0.9, top_k=40, max_tokens=7, seed=3, logprobs=2, ignore_eos=True,
        stop_token_ids=[3, 4], allowed_token_ids=[5, 6, 7, 8], logit_bias={6: 1.5},
    )  # fmt: skip
    assert swept == plain
    assert type(swept.max_tokens) is int and type(swept.ignore_eos) is bool
    assert type(swept.top_p) is float  # numpy's float64 subclasses float: made plain too
    assert {type(i) for i in swept.stop_token_ids + swept.allowed_token_ids} == {int}
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        SamplingParams(max_tokens=np.int64(0))


def test_guided_decoding_is_structured_outputs_under_its_older_name(llm):
    """vLLM before 0.10.2: `SamplingParams(guided_decoding=GuidedDecodingParams(...))`. The
    same constraint, so the same output as `structured_outputs`; both at once is an error."""
    from pagedkv import GuidedDecodingParams, StructuredOutputsParams

    choices = ["blocks", "pages", "tables"]
    old = greedy(guided_decoding=GuidedDecodingParams(choice=choices))
    new = greedy(structured_outputs=StructuredOutputsParams(choice=choices))
    [by_old, by_new] = llm.generate([PROMPT, PROMPT], [old, new], use_tqdm=False)
    assert by_old.outputs[0].text == by_new.outputs[0].text and by_old.outputs[0].text in choices
    with pytest.raises(ValueError, match="structured_outputs or guided_decoding"):
        greedy(
            structured_outputs=StructuredOutputsParams(choice=choices),
            guided_decoding=GuidedDecodingParams(regex="a+"),
        )
    # Its `backend` is taken (one grammar engine serves every name), and a constraint set on
    # `guided_decoding` after construction is the one the request runs with.
    later = greedy(guided_decoding=GuidedDecodingParams(choice=["x"], backend="xgrammar"))
    later.guided_decoding = GuidedDecodingParams(choice=choices)
    [by_later] = llm.generate([PROMPT], later, use_tqdm=False)
    assert by_later.outputs[0].text == by_new.outputs[0].text


def test_per_request_logits_processors_are_refused_as_vllms_v1_refuses_them():
    assert greedy(logits_processors=None).logits_processors is None
    assert greedy(logits_processors=[]).max_tokens == MAX_TOKENS
    with pytest.raises(ValueError, match="logits_processors are not supported per request"):
        greedy(logits_processors=[lambda token_ids, logits: logits])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_settings_that_mask_every_token_end_the_sample_as_abort(llm, plain, temperature, caplog):
    """allowed_token_ids that are all stop ids, before min_tokens lets them stop: nothing may
    be sampled, so the sample ends with "abort" and no text (no token the settings forbid is
    drawn and shown), named in the log; a request beside it runs as alone."""
    import logging

    token = plain.token_ids[0]
    exclusive = greedy(
        temperature=temperature, seed=3, allowed_token_ids=[token], stop_token_ids=[token],
        min_tokens=2,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="pagedkv.engine.stops"):
        masked, beside = llm.generate([PROMPT, PROMPT], [exclusive, greedy()], use_tqdm=False)
    assert masked.outputs[0].finish_reason == "abort" and masked.outputs[0].text == ""
    assert masked.outputs[0].token_ids == []  # the token drawn from nothing is left out
    assert "masked every token" in caplog.text
    assert beside.outputs[0].text == plain.text
