"""vLLM's SamplingParams semantics: fields changed after construction, and the fields users
pass that shape sampling (include_stop_str_in_output, logit_bias, allowed_token_ids,
bad_words).

Oracles: the same request's greedy output without the setting (a stop string cut from it,
the token a bias or a mask must move the argmax to), transformers' logits for which token is
the argmax, and, for per-row settings, the other rows of the same step, which must equal
their outputs when run alone.
"""

from __future__ import annotations

import pytest

from pagedkv.engine import SamplingParams
from tests.engine.conftest import make_llm

MAX_TOKENS = 12
PROMPT = "Paged attention stores keys"


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)


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
