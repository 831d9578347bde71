"""Bad input gets a clear error naming the problem, and the other requests still finish."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.engine import (
    BeamSearchParams,
    EmptyPrompt,
    Engine,
    EngineArgs,
    PromptTooLong,
    RequestTooLarge,
    SamplingParams,
    TokenOutOfVocabulary,
    TooManySamples,
)
from pagedkv.engine.errors import DuplicateRequest, InvalidTokenId, StepFailed
from pagedkv.memory import MoveKind
from tests.engine.conftest import (
    interrupt_the_second_admission,
    make_engine,
    make_llm,
    run_to_completion,
)
from tests.model.tiny_models import VOCAB_SIZE, random_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.mark.parametrize(
    ("prompt", "params", "error", "message"),
    [
        ([], GREEDY, EmptyPrompt, "empty"),
        ([5, VOCAB_SIZE], GREEDY, TokenOutOfVocabulary, f"{VOCAB_SIZE} is outside"),
        ([5, -1], GREEDY, TokenOutOfVocabulary, "-1 is outside"),
        ([5, "x"], GREEDY, InvalidTokenId, "position 1 is str 'x', expected an int"),
        ([1.0, 2], GREEDY, InvalidTokenId, "position 0 is float 1.0, expected an int"),
        ([5, True], GREEDY, InvalidTokenId, "position 1 is bool True"),
        (
            [5, 6],
            SamplingParams(min_tokens=1, stop_token_ids=[10**6]),
            TokenOutOfVocabulary,
            "stop_token_ids token id 1000000 is outside the model's vocabulary "
            f"\\[0, {VOCAB_SIZE}\\)",
        ),
        (random_prompt(200, 0), GREEDY, PromptTooLong, "prompt has 200 tokens, model allows 200"),
        (random_prompt(10, 0), SamplingParams(n=20, max_tokens=150), RequestTooLarge, "pool"),
    ],
)
def test_bad_requests_are_rejected_and_the_others_finish(
    engine_zoo, prompt, params, error, message
):
    engine = make_engine(engine_zoo, "llama", num_gpu_blocks=64, max_model_len=200)
    engine.add_request("good-1", random_prompt(20, 1), GREEDY)
    with pytest.raises(error, match=message):
        engine.add_request("bad", prompt, params)
    engine.add_request("good-2", random_prompt(30, 2), GREEDY)
    finished = [d.request_id for ds in run_to_completion(engine) for d in ds if d.finished]
    assert sorted(finished) == ["good-1", "good-2"]
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks


def test_an_empty_text_is_its_bos_token_where_the_tokenizer_adds_one(engine_zoo, builtin_gguf):
    """As vLLM's: "" is refused only where it encodes to no tokens (the built-in model's
    tokenizer adds none); the tiny Llama's adds BOS, so "" runs as the prompt [BOS] does."""
    llm = make_llm(engine_zoo, "llama", num_gpu_blocks=64)
    bos = llm.get_tokenizer().encode("")
    assert bos == [llm.get_tokenizer().bos_token_id]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    text, ids = llm.generate(["", {"prompt_token_ids": bos}], params, use_tqdm=False)
    assert text.prompt_token_ids == bos
    assert len(text.outputs[0].token_ids) == 8
    assert text.outputs[0].token_ids == ids.outputs[0].token_ids
    builtin = Engine(EngineArgs(model=str(builtin_gguf), num_gpu_blocks=16))
    with pytest.raises(EmptyPrompt, match="empty"):
        builtin.add_request("empty", "", GREEDY)


def test_more_samples_than_a_step_can_run_are_rejected(engine_zoo):
    engine = make_engine(engine_zoo, "llama", max_num_seqs=4)
    with pytest.raises(TooManySamples, match="n is 5, but one step runs at most 4"):
        engine.add_request("a", [5, 6, 7], SamplingParams(n=5))
    with pytest.raises(TooManySamples, match="a beam search of 5 beams, but one step runs at"):
        engine.add_request("b", [5, 6, 7], beam_search=BeamSearchParams(beam_width=5, max_tokens=4))
    assert not engine.has_unfinished()


def test_duplicate_request_ids_are_rejected(engine_zoo):
    engine = make_engine(engine_zoo, "llama")
    engine.add_request("a", [5, 6, 7], GREEDY)
    with pytest.raises(DuplicateRequest, match="'a' is already in use"):
        engine.add_request("a", [5, 6, 7], GREEDY)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.5, r"temperature must be >= 0.0, got"),  # inf is refused too
        ("top_p", 0.0, "top_p must be in"),
        ("top_p", 1.5, "top_p must be in"),
        ("top_k", -2, "top_k must be"),
        ("min_p", 2.0, "min_p must be in"),
        ("n", 0, "n must be in"),
        ("max_tokens", 0, "max_tokens must be"),
        ("max_tokens", -3, "max_tokens must be"),
        ("min_tokens", 99, "min_tokens must be <= max_tokens"),
        ("presence_penalty", 3.0, "presence_penalty must be in"),
        ("frequency_penalty", float("nan"), "frequency_penalty must be a finite number"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
        ("logprobs", -2, "logprobs must be >= 0"),  # -1: every token; the cap is max_logprobs
        ("stop", [""], "stop strings must not be empty"),
        ("stop", 5, "stop must be a string or a list"),
        ("stop_token_ids", [-1], "stop_token_ids must be"),
        ("seed", "7", "seed must be an integer"),
        ("ignore_eos", "yes", "ignore_eos must be a bool"),
        ("temperature", True, "temperature must be a finite number"),
    ],
)
def test_invalid_sampling_values_name_the_parameter(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 0, "block_size must be a positive integer"),
        ("max_num_seqs", -1, "max_num_seqs must be a positive integer"),
        ("swap_space_gb", -1, "swap_space_gb must be a finite number >= 0"),
        ("preemption_mode", "drop", "preemption_mode must be one of"),
        ("dtype", "int8", "dtype must be one of"),
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be in"),
    ],
)
def test_invalid_engine_settings_name_the_setting(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="unused", **{field: value})


def test_swap_mode_without_swap_space_is_an_error():
    with pytest.raises(ValueError, match="needs swap_space_gb > 0"):
        EngineArgs(model="unused", preemption_mode="swap", swap_space_gb=0)


def test_max_model_len_beyond_the_model_is_an_error(engine_zoo):
    with pytest.raises(ValueError, match="max_model_len 5000 is beyond the model's context"):
        make_engine(engine_zoo, "llama", max_model_len=5000)


def test_generate_with_one_bad_prompt_leaves_nothing_behind(engine_zoo):
    llm = make_llm(engine_zoo, "llama")
    with pytest.raises(TokenOutOfVocabulary):
        llm.generate([[5, 6], [5, 10**9], [7, 8]], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.engine.manager.num_free_blocks == llm.engine.manager.num_gpu_blocks
    outputs = llm.generate([[5, 6], [7, 8]], GREEDY)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]


def test_unbounded_max_tokens_stops_where_the_pool_ends(engine_zoo):
    engine = make_engine(engine_zoo, "llama", num_gpu_blocks=4, block_size=4, max_model_len=200)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    tokens = [t for ds in run_to_completion(engine) for d in ds for t in d.outputs[0].token_ids]
    assert len(tokens) == 4 * 4 - 3  # the whole pool of 16 slots, less the prompt


def test_numpy_integer_token_ids_are_plain_ints(engine_zoo):
    engine = make_engine(engine_zoo, "llama")
    engine.add_request("a", np.array([5, 6, 7], dtype=np.int64), GREEDY)
    tokens = [t for ds in run_to_completion(engine) for d in ds for t in d.outputs[0].token_ids]
    assert len(tokens) == 8 and all(type(t) is int for t in tokens)


def test_a_failing_step_aborts_its_requests_and_the_engine_goes_on(engine_zoo, monkeypatch):
    engine = make_engine(engine_zoo, "llama")
    engine.add_request("a", random_prompt(20, 1), GREEDY)
    engine.add_request("b", random_prompt(30, 2), GREEDY)
    engine.step()
    real_execute = engine.runner.execute

    def broken(output):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(
        StepFailed, match="device lost.*aborted 2 request\\(s\\) it was running: a, b"
    ):
        engine.step()
    monkeypatch.setattr(engine.runner, "execute", real_execute)
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks
    reported = {d.request_id: d.outputs[0].finish_reason for d in engine.step() if d.finished}
    assert reported == {"a": "abort", "b": "abort"}
    engine.add_request("c", random_prompt(10, 3), GREEDY)
    finished = [d.request_id for ds in run_to_completion(engine) for d in ds if d.finished]
    assert finished == ["c"]


def test_generate_leaves_nothing_behind_when_a_step_fails(engine_zoo, monkeypatch):
    llm = make_llm(engine_zoo, "llama")
    real_execute = llm.engine.runner.execute
    monkeypatch.setattr(llm.engine.runner, "execute", lambda output: 1 / 0)
    with pytest.raises(StepFailed, match="ZeroDivisionError"):
        llm.generate([[5, 6], [7, 8]], GREEDY)
    assert not llm.engine.has_unfinished()
    monkeypatch.setattr(llm.engine.runner, "execute", real_execute)
    assert [len(o.outputs[0].token_ids) for o in llm.generate([[5, 6]], GREEDY)] == [8]


def fail_once_before_a_plan_with(engine, monkeypatch, kind: MoveKind) -> list:
    """Make the first step whose memory plan has a move of `kind` fail before the plan runs
    (as a draft model's out-of-memory error, or Ctrl-C, would); the failed steps' outputs."""
    failed: list = []
    real_execute = engine.runner.execute

    def execute(output):
        if not failed and any(move.kind is kind for move in output.plan):
            failed.append(output)
            raise RuntimeError("out of memory before the plan ran")
        return real_execute(output)

    monkeypatch.setattr(engine.runner, "execute", execute)
    return failed


def run_out(engine, requests, params, survive: type[BaseException]) -> tuple[dict, int]:
    """Each request's first sample's tokens run to the end on `engine` (None: aborted), and
    how many steps raised `survive` (gone past); memory invariants checked after every step."""
    for request_id, prompt in requests:
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    failures = 0
    while engine.has_unfinished():
        try:
            deltas = engine.step()
        except survive:
            failures += 1
            deltas = []
        engine.manager.check_invariants()
        for delta in deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
            if delta.finished:
                reasons[delta.request_id] = delta.outputs[0].finish_reason
    answers = {rid: None if reasons[rid] == "abort" else tokens[rid] for rid, _ in requests}
    return answers, failures


LONG = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


def greedy_tokens(engine, requests) -> dict[str, list[int] | None]:
    """`run_out` of greedy requests, surviving a StepFailed."""
    return run_out(engine, requests, LONG, StepFailed)[0]


@pytest.mark.parametrize(
    ("kind", "settings"),
    [
        (MoveKind.SWAP_OUT, dict(num_gpu_blocks=10, max_num_batched_tokens=64)),
        (MoveKind.SWAP_IN, dict(num_gpu_blocks=12, max_num_batched_tokens=128)),
        (
            MoveKind.SWAP_OUT,
            dict(num_gpu_blocks=10, kv_offloading_size=0.001, preemption_mode="recompute"),
        ),
    ],
    ids=["swap victim", "swapped back in", "host tier save"],
)
def test_a_step_failing_before_its_memory_plan_leaves_no_kv_it_promised(
    engine_zoo, monkeypatch, kind, settings
):
    """A failed step's plan may never have run: the requests whose blocks it was writing are
    aborted with it, and nothing it would have written is served from the prefix cache or the
    host tier. Oracle: every request that finishes, and the same prompts again with one more
    token (prefix and tier hits), equal a fresh engine's answers."""
    prompts = [(f"r{i}", random_prompt(30 + 3 * i, seed=i)) for i in range(4)]
    engine = make_engine(engine_zoo, "llama", **settings)
    failed = fail_once_before_a_plan_with(engine, monkeypatch, kind)
    survived = greedy_tokens(engine, prompts)
    assert failed, "no step had such a move: choose a smaller pool"
    moved_into = {move.dst for move in failed[0].plan if move.kind is kind}
    assert moved_into and None in survived.values()
    fresh = make_engine(engine_zoo, "llama", num_gpu_blocks=200)
    expected = greedy_tokens(fresh, prompts)
    assert all(got in (None, expected[rid]) for rid, got in survived.items())
    again = [(f"{rid}+", prompt + [7]) for rid, prompt in prompts]
    assert greedy_tokens(engine, again) == greedy_tokens(fresh, again)


@pytest.mark.parametrize("steps_before", [0, 1], ids=["waiting", "mid-prompt"])
def test_aborting_n_samples_before_they_fork_reports_all_n(engine_zoo, steps_before):
    """Samples 1..n-1 are made from the prompt's last row: aborted before it, they still
    end, each with finish_reason "abort", in the request's last delta."""
    engine = make_engine(engine_zoo, "llama", max_num_batched_tokens=16)
    engine.add_request("n3", random_prompt(40, seed=5), SamplingParams(n=3, max_tokens=4))
    for _ in range(steps_before):
        assert engine.step() == []  # a prompt chunk: nothing sampled yet
    engine.abort("n3")
    [delta] = engine.step()
    assert delta.finished
    assert [(o.index, o.finish_reason) for o in delta.outputs] == [(i, "abort") for i in range(3)]
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks


def test_a_schedule_interrupted_after_a_host_tier_hit_serves_nothing_it_promised(
    engine_zoo, monkeypatch
):
    """Ctrl-C while the scheduler admits the second prompt, after the first found its prefix
    in the host tier: the copy back into the GPU never runs, so the blocks it was to fill leave
    the prefix cache with the first request (aborted). Oracle: the prompt again answers as on
    a fresh engine."""
    settings = dict(num_gpu_blocks=12, max_model_len=128, kv_offloading_size=0.001)
    engine = make_engine(engine_zoo, "llama", **settings)
    prefix = random_prompt(53, seed=40)  # 3 full blocks
    evicting = [(f"evict{i}", random_prompt(100, seed=100 + i)) for i in range(3)]
    greedy_tokens(engine, [("prefix", prefix), *evicting])  # into the tier, out of the GPU
    assert engine.manager.offload_stats.num_blocks >= 3
    target = ("target", prefix + random_prompt(6, seed=1))
    interrupt_the_second_admission(engine, monkeypatch)
    engine.add_request(*target, LONG)
    engine.add_request("other", random_prompt(20, seed=2), LONG)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.abort("other")  # as LLM.generate does on Ctrl-C
    engine.manager.check_invariants()
    again = [("again", target[1])]
    fresh = make_engine(engine_zoo, "llama", **settings)
    assert greedy_tokens(engine, again) == greedy_tokens(fresh, again)


def interrupt_once(target, monkeypatch, method: str, when=None, after: bool = False) -> list:
    """Ctrl-C in `target.method` the first time `when(*args, **kwargs)` holds (always, if no
    `when`): before it runs, or `after` it has; the arguments of the call interrupted."""
    real = getattr(target, method)
    interrupted: list = []

    def method_or_interrupt(*args, **kwargs):
        if interrupted or (when is not None and not when(*args, **kwargs)):
            return real(*args, **kwargs)
        interrupted.append(args)
        if after:
            real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(target, method, method_or_interrupt)
    return interrupted


def tokens_after_one_interrupt(engine, requests, params=LONG) -> dict[str, list | None]:
    """`run_out`, one step raising KeyboardInterrupt and nothing aborted by hand; every
    request ends, and every block, device or CPU, is free at the end."""
    answers, interrupts = run_out(engine, requests, params, KeyboardInterrupt)
    assert interrupts == 1
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks
    assert engine.manager.num_free_cpu_blocks == engine.manager.num_cpu_blocks
    assert engine.manager.reset_prefix_cache()  # no sequence left holding blocks
    return answers


THREE = [
    (rid, random_prompt(length, seed))
    for rid, length, seed in [("a", 20, 11), ("b", 27, 12), ("c", 9, 13)]
]


def test_a_schedule_interrupted_after_a_decode_got_a_new_block_aborts_that_request(
    engine_zoo, monkeypatch
):
    """Ctrl-C after b's decode was given a new block (a table change the runner has not
    seen) but before its chunk was made: b is aborted with a, whose chunk the step had
    made, and c, which the step had not reached, answers as on an engine never interrupted."""
    engine = make_engine(engine_zoo, "llama")
    prompts = dict(THREE)

    def new_block_for_a_decode(request, seq, num_new, allocation, *rest):
        decoding = seq.num_computed >= len(prompts[request.request_id])
        return request.request_id == "b" and decoding and allocation.table_update is not None

    interrupt_once(engine.scheduler, monkeypatch, "_chunk", new_block_for_a_decode)
    got = tokens_after_one_interrupt(engine, THREE)
    expected = greedy_tokens(make_engine(engine_zoo, "llama"), THREE)
    assert got == {"a": None, "b": None, "c": expected["c"]}


def test_a_schedule_interrupted_after_an_admission_allocated_aborts_that_request(
    engine_zoo, monkeypatch
):
    """Two seats: c and d wait until a and b finish. Ctrl-C after c got its blocks (a table
    no chunk carries yet) but before it started: c is aborted, and d, admitted in the next
    step, answers as on an engine never interrupted."""
    engine = make_engine(engine_zoo, "llama", max_num_seqs=2)
    requests = [*THREE, ("d", random_prompt(14, seed=14))]
    interrupt_once(
        engine.scheduler, monkeypatch, "_start", lambda request, *_: request.request_id == "c"
    )
    got = tokens_after_one_interrupt(engine, requests)
    expected = greedy_tokens(make_engine(engine_zoo, "llama"), requests)
    assert got == {**expected, "c": None}


def survivors_answer_as_never_interrupted(engine_zoo, got, requests, **settings) -> None:
    """Every request not aborted answers as on a fresh engine; at least one was aborted."""
    expected = greedy_tokens(make_engine(engine_zoo, "llama", **settings), requests)
    survivors = {rid: tokens for rid, tokens in got.items() if tokens is not None}
    assert survivors == {rid: expected[rid] for rid in survivors}
    assert len(survivors) < len(requests)


CROWDED = dict(num_gpu_blocks=10, enable_prefix_caching=False)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_schedule_interrupted_while_it_preempts_aborts_the_victim(engine_zoo, monkeypatch, mode):
    """Ctrl-C after the victim left the running queue but before it joined the waiting or
    swapped one: it is aborted with the step, not left in no queue holding its blocks."""
    settings = dict(CROWDED, preemption_mode=mode)
    engine = make_engine(engine_zoo, "llama", **settings)
    # Only a preemption gives back a victim's draft slots (`give_back=True`).
    victims = interrupt_once(
        engine.scheduler.drafts, monkeypatch, "forget", lambda seq, give_back=False: give_back
    )
    got = tokens_after_one_interrupt(engine, THREE)
    [(victim, *_)] = victims
    assert got[victim.seq_id[0]] is None
    survivors_answer_as_never_interrupted(engine_zoo, got, THREE, **settings)


def test_a_schedule_interrupted_after_a_swap_in_aborts_that_request(engine_zoo, monkeypatch):
    """Ctrl-C once a swapped request's blocks are back on the device but before it runs: it
    is aborted (it was left swapped with resident blocks, and every later step failed)."""
    settings = dict(CROWDED, preemption_mode="swap")
    engine = make_engine(engine_zoo, "llama", **settings)
    swapped_in = interrupt_once(engine.manager, monkeypatch, "swap_in", after=True)
    got = tokens_after_one_interrupt(engine, THREE)
    [(seq_id,)] = swapped_in
    assert got[seq_id[0]] is None
    survivors_answer_as_never_interrupted(engine_zoo, got, THREE, **settings)


def test_an_interrupt_after_scheduling_takes_the_step_back(engine_zoo, monkeypatch):
    """Ctrl-C between the schedule and the forward pass (the step's tables reported, never
    sent): the step's requests are aborted; c, still waiting (one seat each for a and b), is
    admitted later and answers as on an engine never interrupted."""
    settings = dict(max_num_seqs=2)
    engine = make_engine(engine_zoo, "llama", **settings)
    interrupt_once(engine, monkeypatch, "_prompt_tokens", lambda output: output.chunks)
    got = tokens_after_one_interrupt(engine, THREE)
    assert got["a"] is None and got["b"] is None
    survivors_answer_as_never_interrupted(engine_zoo, got, THREE, **settings)


@pytest.mark.parametrize("search", ["n=2", "beam"])
def test_an_interrupt_as_samples_fork_leaves_no_block_held(engine_zoo, monkeypatch, search):
    """Ctrl-C right after the manager forked a sample (n = 2 after its prompt, or a beam's
    new branch) but before the request listed it: the abort frees the fork's blocks too."""
    engine = make_engine(engine_zoo, "llama")
    interrupt_once(engine.manager, monkeypatch, "fork", after=True)
    if search == "beam":
        engine.add_request(
            "r", THREE[0][1], beam_search=BeamSearchParams(beam_width=2, max_tokens=8)
        )
        tokens_after_one_interrupt(engine, [])
    else:
        params = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)
        assert tokens_after_one_interrupt(engine, THREE[:1], params) == {"a": None}
