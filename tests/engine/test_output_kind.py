"""`SamplingParams.output_kind` (vLLM's RequestOutputKind) through `Engine.step`.

The oracle: the same request reported as deltas, in the same steps (batch invariance makes
the tokens equal). A cumulative report is every delta so far joined; a final-only request
reports once, that join, when it finishes.
"""

from __future__ import annotations

import pytest

from pagedkv.engine import RequestOutputKind, SamplingParams
from tests.engine.conftest import make_engine, make_llm, run_to_completion
from tests.model.tiny_models import random_prompt

PROMPT = random_prompt(30, seed=7)


def params(kind: RequestOutputKind, **extra) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=12, logprobs=2, n=2, ignore_eos=True, output_kind=kind, **extra
    )


def joined(deltas) -> list[tuple[list[int], str, int]]:
    """Per sample (by index): token ids, text and logprob entries of the deltas so far."""
    samples: dict[int, tuple[list[int], str, int]] = {}
    for delta in deltas:
        for piece in delta.outputs:
            ids, text, count = samples.get(piece.index, ([], "", 0))
            samples[piece.index] = (
                ids + piece.token_ids,
                text + piece.text,
                count + len(piece.logprobs),
            )
    return [samples[index] for index in sorted(samples)]


def whole(output) -> list[tuple[list[int], str, int]]:
    return [(list(o.token_ids), o.text, len(o.logprobs)) for o in output.outputs]


@pytest.fixture(scope="module")
def engine(engine_zoo):
    return make_engine(engine_zoo, "llama")


def test_each_kind_reports_what_the_deltas_of_the_same_steps_add_up_to(engine) -> None:
    kinds = {
        "delta": RequestOutputKind.DELTA,
        "cumulative": RequestOutputKind.CUMULATIVE,
        "final": RequestOutputKind.FINAL_ONLY,
    }
    for request_id, kind in kinds.items():
        engine.add_request(request_id, PROMPT, params(kind))
    deltas, cumulative, finals, held = [], [], [], []
    for step in run_to_completion(engine):
        by_id = {output.request_id: output for output in step}
        if "delta" in by_id:
            deltas.append(by_id["delta"])
        if "cumulative" in by_id:
            report = by_id["cumulative"]
            assert whole(report) == joined(deltas)  # the same steps' deltas, joined
            assert report.finished == deltas[-1].finished
            cumulative.append(report)
            held.append((whole(report), report.metrics.finished_time))
        if "final" in by_id:
            finals.append(by_id["final"])
    assert len(cumulative) == len(deltas) > 2
    # Reports already handed out are copies: later steps did not grow them.
    assert [(whole(r), r.metrics.finished_time) for r in cumulative] == held
    assert held[0][1] is None and held[-1][1] is not None
    [final] = finals
    assert final.finished and whole(final) == joined(deltas)
    assert [o.finish_reason for o in final.outputs] == ["length", "length"]


def test_an_aborted_final_only_request_reports_once_with_what_it_had(engine) -> None:
    engine.add_request("cut", PROMPT, params(RequestOutputKind.FINAL_ONLY))
    engine.add_request("cut-deltas", PROMPT, params(RequestOutputKind.DELTA))
    reports, deltas = [], []
    for _ in range(4):
        for output in engine.step():
            (reports if output.request_id == "cut" else deltas).append(output)
    assert reports == []
    engine.abort("cut")
    engine.abort("cut-deltas")
    for step in run_to_completion(engine):
        for output in step:
            (reports if output.request_id == "cut" else deltas).append(output)
    [report] = reports
    assert report.finished and whole(report) == joined(deltas)
    assert {o.finish_reason for o in report.outputs} == {"abort"}


def test_generate_returns_whole_outputs_whatever_the_kind(engine_zoo) -> None:
    llm = make_llm(engine_zoo, "llama")
    expected = llm.generate([PROMPT], params(RequestOutputKind.DELTA), use_tqdm=False)[0]
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY, 0, 2):
        given = params(kind)
        [output] = llm.generate([PROMPT], given, use_tqdm=False)
        assert whole(output) == whole(expected)
        assert given.output_kind == kind  # the caller's object is left as it was


def test_output_kind_takes_vllms_values_and_names_a_bad_one() -> None:
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams().output_kind is None  # the engine's way: Engine deltas
    assert SamplingParams(skip_clone=True).skip_clone is True
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind .* got 7"):
        SamplingParams(output_kind=7)
    with pytest.raises(ValueError, match="skip_clone must be a bool"):
        SamplingParams(skip_clone="yes")
