"""Beam search: the answer equals vLLM's rule written out here over transformers' logits, and
the beams hold exactly the blocks their common past needs (shared, never copied).

The reference below is vLLM's `LLM.beam_search` loop restated: every live beam proposes its
2W most likely next tokens, an EOS extension completes, the W best of the rest live on, and
after max_tokens steps the W best of all (cumulative logprob over the length, prompt included
and a final EOS not, to the power length_penalty) are the answer. It reads transformers' own
logits, one full forward per beam per step, no cache.

A beam search is a chain of orderings, so a comparison is only meaningful where no ordering
hinges on a near-tie (float rounding differs between machines). The reference measures its
smallest margin at every cut it makes; each case asserts that margin is wide before comparing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import pytest
import torch

from pagedkv.engine import BeamSearchParams, Engine, SamplingParams
from tests.conftest import TinyZoo
from tests.engine.conftest import make_engine, make_llm, run_to_completion
from tests.model.tiny_models import random_prompt, write_tokenizer_files

BLOCK_SIZE = 16
EOS = 2
# Our float32 logprobs and transformers' differ by ~1e-6 a token on the tiny models (~1e-4
# on the built-in one); a cut this much wider than their sum over a search cannot flip.
MIN_MARGIN = 1e-4

NextLogprobs = Callable[[Sequence[int]], torch.Tensor]


@dataclass
class RefBeam:
    """A reference beam: its output tokens (a final EOS included), cumulative logprob, and
    why it ended."""

    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str = "length"


def score_length(beam: RefBeam, num_prompt: int, eos: Collection[int]) -> int:
    """The length a beam's score divides by: prompt and output, a final EOS not counted."""
    length = num_prompt + len(beam.token_ids)
    return length - 1 if beam.token_ids and beam.token_ids[-1] in eos else length


def gap(ranked: list[float], cut: int, scales: list[float] | None = None) -> float:
    """How far the value just inside a cut at `cut` (values ranked, largest first) is from
    the one just outside it, in logprob units: a score gap times the smaller of the two
    beams' length ** length_penalty (inf where nothing is left out)."""
    if cut <= 0 or len(ranked) <= cut:
        return float("inf")
    scale = 1.0 if scales is None else min(scales[cut - 1], scales[cut])
    return (ranked[cut - 1] - ranked[cut]) * scale


def reference_beam_search(
    next_logprobs: NextLogprobs,
    prompt: list[int],
    params: BeamSearchParams,
    eos: Collection[int] = (EOS,),
) -> tuple[list[RefBeam], float]:
    """vLLM's beam search over `next_logprobs`; the best beams, and the smallest margin of
    any cut made (the 2W candidates of a beam, the W beams kept, the answer's order), in
    logprob units. A beam ends on any of the model's `eos` ids."""
    width, num_prompt, penalty = params.beam_width, len(prompt), params.length_penalty

    def scale(beam: RefBeam) -> float:
        return score_length(beam, num_prompt, eos) ** penalty

    def key(beam: RefBeam) -> float:  # vLLM's get_beam_search_score
        return beam.cumulative_logprob / scale(beam)

    def ranked_gap(ranked: list[RefBeam], cut: int) -> float:
        return gap([key(b) for b in ranked], cut, [scale(b) for b in ranked])

    beams, completed, margin = [RefBeam([], 0.0)], [], float("inf")
    for _ in range(params.max_tokens):
        extensions = []
        for beam in beams:
            logprobs = next_logprobs(prompt + beam.token_ids)
            ranked = logprobs.sort(descending=True)
            margin = min(margin, gap(ranked.values.tolist(), 2 * width))
            top = zip(ranked.indices.tolist(), ranked.values.tolist(), strict=True)
            for token, logprob in list(top)[: 2 * width]:
                extended = RefBeam(beam.token_ids + [token], beam.cumulative_logprob + logprob)
                if token in eos and not params.ignore_eos:
                    extended.finish_reason = "stop"
                    completed.append(extended)
                else:
                    extensions.append(extended)
        extensions.sort(key=key, reverse=True)
        margin = min(margin, ranked_gap(extensions, width))
        beams = extensions[:width]
        if not beams:
            break
    completed += beams
    completed.sort(key=key, reverse=True)
    for cut in range(1, min(width, len(completed)) + 1):  # the answer's order and last place
        margin = min(margin, ranked_gap(completed, cut))
    return completed[:width], margin


def hf_next_logprobs(zoo: TinyZoo, name: str, temperature: float = 0.0) -> NextLogprobs:
    """Log-softmax of transformers' next-token logits (divided by the temperature, if any)."""

    def next_logprobs(token_ids: Sequence[int]) -> torch.Tensor:
        logits = zoo.hf_logits(name, token_ids)[-1].double()
        if temperature > 0:
            logits = logits / temperature
        return logits.log_softmax(dim=-1)

    return next_logprobs


def expected_beams(
    zoo: TinyZoo, name: str, prompt: list[int], params: BeamSearchParams
) -> list[RefBeam]:
    beams, margin = reference_beam_search(
        hf_next_logprobs(zoo, name, params.temperature), prompt, params
    )
    assert margin > MIN_MARGIN, f"case hinges on a near-tie ({margin:.2e}): choose another"
    return beams


def without_eos(beam: RefBeam) -> list[int]:
    """The beam's tokens as the engine's delta gives them by default: a final EOS left out."""
    return beam.token_ids[:-1] if beam.finish_reason == "stop" else beam.token_ids


def assert_same_beams(sequences, prompt: list[int], expected: list[RefBeam]) -> None:
    """The engine's `BeamSearchSequence`s are the reference's beams, in the same order."""
    assert [s.tokens for s in sequences] == [prompt + b.token_ids for b in expected]
    assert [s.finish_reason for s in sequences] == [b.finish_reason for b in expected]
    for sequence, beam in zip(sequences, expected, strict=True):
        assert sequence.cum_logprob == pytest.approx(beam.cumulative_logprob, abs=1e-4)
        assert len(sequence.logprobs) == len(beam.token_ids)
        for token, entry in zip(beam.token_ids, sequence.logprobs, strict=True):
            assert next(iter(entry)) == token  # each position's own token comes first


CASES = {
    "width 2": BeamSearchParams(beam_width=2, max_tokens=14),
    "width 4, length penalty 0.6, temperature 0.8": BeamSearchParams(
        beam_width=4, max_tokens=12, length_penalty=0.6, temperature=0.8
    ),
}


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_beams_equal_the_reference_over_transformers_logits(engine_zoo, name, case):
    params = CASES[case]
    prompts = [random_prompt(length, seed=length) for length in (9, 37)]
    llm = make_llm(engine_zoo, name)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for output, prompt in zip(outputs, prompts, strict=True):
        assert_same_beams(
            output.sequences, prompt, expected_beams(engine_zoo, name, prompt, params)
        )
    assert llm.engine.manager.num_free_blocks == llm.engine.manager.num_gpu_blocks


@pytest.fixture(scope="module")
def eos_zoo(engine_zoo, tmp_path_factory) -> TinyZoo:
    """The tiny Llama with its EOS logit spread out (its output row scaled up), so that EOS
    is often among a beam's candidates: searches complete beams on the way."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(engine_zoo.folder("llama"))
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 2.0
    zoo = TinyZoo.__new__(TinyZoo)
    folder = tmp_path_factory.mktemp("eos_llama") / "llama"
    model.save_pretrained(folder)
    write_tokenizer_files(folder)
    zoo.folders = {"llama": folder}
    return zoo


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_completes_a_beam_unless_ignored(eos_zoo, ignore_eos):
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=ignore_eos)
    prompt = random_prompt(21, seed=5)
    expected = expected_beams(eos_zoo, "llama", prompt, params)
    reasons = {beam.finish_reason for beam in expected}
    assert reasons == ({"length"} if ignore_eos else {"stop", "length"})  # the case shows it
    if ignore_eos:  # EOS is still proposed, and scored as vLLM scores a final EOS
        assert any(EOS in beam.token_ids for beam in expected)
    llm = make_llm(eos_zoo, "llama")
    [output] = llm.beam_search([prompt], params)
    assert_same_beams(output.sequences, prompt, expected)
    stopped = [s for s in output.sequences if s.finish_reason == "stop"]
    assert all(s.tokens[-1] == EOS and s.stop_reason == EOS for s in stopped)


def test_the_engine_delta_leaves_a_final_eos_out_as_vllms_server(eos_zoo):
    """`Engine.add_request(beam_search=...)`: one delta, at the end, with the best beams; a
    beam that ended at EOS keeps it only with include_stop_str_in_output."""
    prompt = random_prompt(21, seed=5)
    for keep in (False, True):
        params = BeamSearchParams(beam_width=3, max_tokens=12, include_stop_str_in_output=keep)
        expected = expected_beams(eos_zoo, "llama", prompt, params)
        engine = make_engine(eos_zoo, "llama")
        engine.add_request("beams", prompt, beam_search=params)
        deltas = [delta for step in run_to_completion(engine) for delta in step]
        assert all(not delta.outputs for delta in deltas[:-1]) and deltas[-1].finished
        outputs = deltas[-1].outputs
        assert [o.index for o in outputs] == list(range(len(expected)))
        for output, beam in zip(outputs, expected, strict=True):
            ends = beam.finish_reason == "stop"
            token_ids = beam.token_ids if keep else without_eos(beam)
            assert output.token_ids == token_ids
            assert len(output.logprobs) == len(token_ids)
            assert output.text == engine.tokenizer.decode(token_ids, skip_special_tokens=False)
            assert output.stop_reason == (EOS if ends else None)


def held_blocks_expected(engine: Engine, request_id: str) -> dict[tuple[int, ...], int]:
    """The oracle of sharing: each block a live beam needs, named by every token up to its
    end (the beams' computed tokens, i.e. all but the one sampled last), with how many beams
    need it. Beams whose tokens agree up to a block's end share it; the others cannot."""
    request = engine._requests[request_id]
    needed: dict[tuple[int, ...], int] = {}
    for seq in request.live_sequences:
        computed = seq.token_ids[: seq.num_computed].tolist()
        for end in range(BLOCK_SIZE, len(computed) + BLOCK_SIZE, BLOCK_SIZE):
            key = tuple(computed[:end])
            needed[key] = needed.get(key, 0) + 1
    return needed


def test_beams_share_their_common_past_and_a_dead_beam_frees_only_its_own(engine_zoo):
    """After every step the pool holds one block per distinct block of the beams' tokens, each
    held by as many beams as need it: never a copy of a common block, never a block kept for
    a beam that died. With the prompt shared, far fewer blocks than one table per beam."""
    prompt = random_prompt(150, seed=11)
    params = BeamSearchParams(beam_width=4, max_tokens=40)
    engine = make_engine(engine_zoo, "llama", num_gpu_blocks=96)
    engine.add_request("beams", prompt, beam_search=params)
    shared_steps = 0
    for _ in run_to_completion(engine):
        if "beams" not in engine._requests:
            break
        needed = held_blocks_expected(engine, "beams")
        snapshot = engine.kv_snapshot()
        held = [block for block in snapshot.gpu if block.ref_count > 0]
        assert len(held) == len(needed)
        assert sorted(block.ref_count for block in held) == sorted(needed.values())
        assert all(len(block.holders) == block.ref_count for block in held)
        beams = engine._requests["beams"].live_sequences
        unshared = sum(-(-seq.num_computed // BLOCK_SIZE) for seq in beams)
        if len(beams) == params.beam_width:
            shared_steps += 1
            assert len(held) <= unshared - (len(beams) - 1) * (len(prompt) // BLOCK_SIZE)
    assert shared_steps > 30
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks


@pytest.mark.parametrize(
    "settings",
    [
        dict(preemption_mode="recompute", max_num_batched_tokens=24),
        dict(preemption_mode="swap", swap_space_gb=1.0),
    ],
    ids=["recompute, chunked", "swap"],
)
def test_preemption_and_a_busy_batch_leave_the_beams_unchanged(engine_zoo, settings):
    """A sampled request and two searches in a pool too small for all: the later search is
    preempted, swapped out or recomputed (its beams' rows then come back over several
    steps), and both answers are still the reference's."""
    params = BeamSearchParams(beam_width=3, max_tokens=24, length_penalty=0.8)
    prompts = [random_prompt(30, seed=31), random_prompt(37, seed=38)]
    engine = make_engine(engine_zoo, "llama", num_gpu_blocks=14, **settings)
    engine.add_request("other", random_prompt(50, seed=3), SamplingParams(max_tokens=60, seed=1))
    for index, prompt in enumerate(prompts):
        engine.add_request(f"beams{index}", prompt, beam_search=params)
    results = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            if delta.finished and delta.request_id.startswith("beams"):
                results[delta.request_id] = delta
    metrics = results["beams1"].metrics
    assert metrics.num_swap_preemptions + metrics.num_recompute_preemptions > 0
    for index, prompt in enumerate(prompts):
        expected = expected_beams(engine_zoo, "llama", prompt, params)
        outputs = results[f"beams{index}"].outputs  # a final EOS left out, as vLLM's server
        assert [o.token_ids for o in outputs] == [without_eos(b) for b in expected]
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks


def test_a_search_swapped_out_between_its_beams_rows_comes_back(engine_zoo):
    """Four tokens a step for three beams and a sampled pair: a search is swapped out after
    some beams computed their row and before the others did; swapped in, the computed ones
    wait (no chunk: a step of an empty chunk failed and aborted everyone in it), and the
    search still ends as the reference's, the neighbour as alone."""
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    prompt = random_prompt(20, seed=77)
    neighbour = SamplingParams(n=2, temperature=0.0, max_tokens=40, ignore_eos=True)
    settings = dict(block_size=4, max_num_batched_tokens=4, enable_prefix_caching=False)
    engine = make_engine(engine_zoo, "llama", num_gpu_blocks=24, preemption_mode="swap", **settings)
    engine.add_request("neighbour", [106], neighbour)
    results = {}
    for step in range(400):
        if step == 19:
            engine.add_request("beams", prompt, beam_search=params)
        for delta in engine.step():
            results.setdefault(delta.request_id, []).append(delta)
        engine.manager.check_invariants()
        if not engine.has_unfinished():
            break
    assert engine.stats.num_swap_preemptions > 0
    [beams] = results["beams"]
    expected = expected_beams(engine_zoo, "llama", prompt, params)
    assert [o.token_ids for o in beams.outputs] == [without_eos(b) for b in expected]
    alone = make_engine(engine_zoo, "llama", num_gpu_blocks=64, **settings)
    alone.add_request("neighbour", [106], neighbour)
    assert tokens_by_sample(run_to_completion(alone)) == tokens_by_sample([results["neighbour"]])


def tokens_by_sample(steps) -> dict[int, list[int]]:
    """Each sample's tokens over a run's deltas."""
    tokens: dict[int, list[int]] = {}
    for deltas in steps:
        for delta in deltas:
            for output in delta.outputs:
                tokens.setdefault(output.index, []).extend(output.token_ids)
    return tokens


def test_a_search_stepped_through_the_engine_has_one_delta(engine_zoo):
    """docs/beam-search.md: code stepping the engine gets one delta, when the search ends."""
    engine = make_engine(engine_zoo, "llama")
    engine.add_request("beams", random_prompt(10, seed=1), beam_search=BeamSearchParams(2, 6))
    deltas = [delta for step in run_to_completion(engine) for delta in step]
    assert [(delta.finished, len(delta.outputs)) for delta in deltas] == [(True, 2)]


def test_an_aborted_search_frees_its_blocks_and_reports_its_beams(engine_zoo):
    engine = make_engine(engine_zoo, "llama")
    engine.add_request("beams", random_prompt(40, seed=2), beam_search=BeamSearchParams(4, 30))
    for _ in range(6):
        engine.step()
    engine.abort("beams")
    [delta] = engine.step()
    assert delta.finished and len(delta.outputs) == 4
    assert {o.finish_reason for o in delta.outputs} == {"abort"}
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks


def test_a_search_aborted_before_its_first_step_ends_with_no_tokens(engine_zoo):
    engine = make_engine(engine_zoo, "llama")
    engine.add_request("beams", random_prompt(20, seed=5), beam_search=BeamSearchParams(3, 8))
    engine.abort("beams")
    [delta] = engine.step()
    assert delta.finished
    assert [(o.token_ids, o.text, o.finish_reason) for o in delta.outputs] == [([], "", "abort")]
    assert not engine.has_unfinished()
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks


def test_outputs_have_vllms_shape(engine_zoo):
    llm = make_llm(engine_zoo, "llama")
    prompt = random_prompt(12, seed=4)
    [output] = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=5))
    tokenizer = llm.get_tokenizer()
    for sequence in output.sequences:
        assert sequence.tokens[: len(prompt)] == prompt and len(sequence.tokens) == 17
        assert sequence.text == tokenizer.decode(sequence.tokens, skip_special_tokens=False)
    [by_text] = llm.beam_search(["Paged attention"], BeamSearchParams(beam_width=2, max_tokens=3))
    assert by_text.sequences[0].tokens[:3] == tokenizer.encode("Paged attention")[:3]


def test_a_concurrency_limit_searches_that_many_prompts_at_once(engine_zoo):
    """vLLM's `concurrency_limit`: never more searches in the engine than the limit, and the
    beams are still the reference's."""
    llm = make_llm(engine_zoo, "llama")
    prompts = [random_prompt(length, seed=length) for length in (5, 9, 14, 20, 26)]
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    in_flight: list[int] = []  # searches in the engine as each is added, itself included
    add_request, scheduler = llm.engine.add_request, llm.engine.scheduler

    def counted(*args, **kwargs):
        queues = (scheduler.waiting, scheduler.running, scheduler.swapped, scheduler.compiling)
        in_flight.append(sum(map(len, queues)) + 1)
        return add_request(*args, **kwargs)

    llm.engine.add_request = counted  # type: ignore[method-assign]
    outputs = llm.beam_search(prompts, params, concurrency_limit=2)
    assert len(in_flight) == len(prompts) and max(in_flight) == 2
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = expected_beams(engine_zoo, "llama", prompt, params)
        assert [sequence.tokens[len(prompt) :] for sequence in output.sequences] == [
            beam.token_ids for beam in expected
        ]
    for limit in (0, 1.5, True):
        with pytest.raises(ValueError, match="concurrency_limit must be an integer >= 1"):
            llm.beam_search(prompts, params, concurrency_limit=limit)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(beam_width=0, max_tokens=4), "beam_width must be an integer >= 1"),
        (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be >= 0"),
        (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    ],
)
def test_bad_params_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**fields)


def test_a_search_too_wide_for_the_pool_is_refused(engine_zoo):
    """W beams may each come back from a preemption with blocks of their own: the pool must
    hold that worst case, as for n samples."""
    engine = make_engine(engine_zoo, "llama", num_gpu_blocks=8)
    with pytest.raises(Exception, match="blocks"):
        engine.add_request("wide", random_prompt(40, seed=1), beam_search=BeamSearchParams(8, 24))


@pytest.mark.slow
def test_the_builtin_model_equals_the_reference(builtin_hf_model):
    """The built-in SmolLM2 in float32 against transformers reading the same GGUF file."""
    from pagedkv.engine import LLM
    from pagedkv.hub import DEFAULT_MODEL

    def next_logprobs(token_ids: Sequence[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = builtin_hf_model(torch.tensor([list(token_ids)])).logits
        return logits[0, -1].double().log_softmax(-1)

    llm = LLM(DEFAULT_MODEL, quantization="none", num_gpu_blocks=256)
    eos = llm.get_tokenizer().eos_token_ids
    prompt = llm.get_tokenizer().encode_chat(
        [{"role": "user", "content": "Write a haiku about memory."}]
    )
    params = BeamSearchParams(beam_width=4, max_tokens=8)
    expected, margin = reference_beam_search(next_logprobs, prompt, params, eos)
    assert margin > 3e-3, f"case hinges on a near-tie ({margin:.2e})"
    [output] = llm.beam_search([prompt], params)
    assert [s.tokens for s in output.sequences] == [prompt + b.token_ids for b in expected]
    for sequence, beam in zip(output.sequences, expected, strict=True):
        assert sequence.cum_logprob == pytest.approx(beam.cumulative_logprob, abs=1e-3)
