"""Speculative decoding changes how fast tokens come, never which: greedy output with drafts
equals the output without, bit for bit, tokens and logprob floats; sampled output is
distributed as plain sampling's.

The oracle of exactness is the engine without speculation (itself checked against
transformers elsewhere), on the request alone. With speculation the same request runs beside a
crowd, in small chunks, from the prefix cache and its host tier, after swap and recompute
preemption, and as n = 3 forks, for every registry family, KV dtype and weight format. Two
drafters: prompt lookup (n-gram), which random tiny models accept now and then, and the model
itself as its own draft model, whose greedy drafts are all accepted (so long runs of kept
drafts, and their rollback where penalties or stops refuse them, are exercised too). Every
run checks the memory manager's invariants after every step (`answers`).
"""

from __future__ import annotations

import json
import shutil
from array import array
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from pagedkv.engine import LLM, Engine, EngineArgs, SamplingParams
from pagedkv.engine.spec import acceptance
from pagedkv.engine.spec.acceptance import (
    DECAY,
    FIRST_PAUSE_STEPS,
    MIN_THRESHOLD,
    Acceptance,
    StepCost,
)
from pagedkv.engine.spec.config import SpeculativeConfig
from pagedkv.engine.spec.draft_model import _PROBES
from pagedkv.engine.spec.ngram import propose_ngram
from pagedkv.engine.structured.params import StructuredOutputsParams
from pagedkv.hub import DEFAULT_MODEL
from pagedkv.model.layers.linear import Linear
from tests.conftest import TinyZoo
from tests.engine.test_batch_invariance import (
    CASES,
    GREEDY,
    TARGET_PROMPT,
    alone,
    answers,
    busy_run,
    engine_for,
    weight_format,
)
from tests.model.tiny_models import TINY_MODELS, build_model_folder, random_prompt

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def draft_model(model: str, k: int = 3) -> dict[str, Any]:
    """A speculative config drafting with `model`."""
    return {"model": model, "num_speculative_tokens": k}


def spec_busy(model: str, params: SamplingParams, spec: dict[str, Any], case: str, **settings):
    """The target's answer in `busy_run` with speculation on, and the engine's draft figures."""
    seed, case_settings = CASES[case]
    answer, _, engine = busy_run(
        model, params, others=6, seed=seed, speculative_config=spec, **settings, **case_settings
    )
    return answer, engine.scheduler.drafts.stats


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_greedy_output_is_unchanged_for_every_family(
    engine_zoo: TinyZoo, family: str, kv_cache_dtype: str
) -> None:
    """Each family, float32 and fp8 KV, n-gram and draft-model drafts, in every case: the
    target's greedy tokens and logprobs equal its answer alone without speculation; so do
    n = 3 greedy forks under swap preemption. Under fp8, n-gram drafts run every case (on
    these random prompts most are rejected: rollback in fp8 slots) and the draft model (its
    own KV in fp8 too) the forks' case: the model drafting for itself, it rejects few."""
    model = str(engine_zoo.folder(family))
    expected = alone(model, GREEDY, kv_cache_dtype=kv_cache_dtype)
    specs = (NGRAM, draft_model(model)) if kv_cache_dtype == "auto" else (NGRAM,)
    for spec in specs:
        accepted = 0
        for case in CASES:
            got, stats = spec_busy(model, GREEDY, spec, case, kv_cache_dtype=kv_cache_dtype)
            assert got == expected, f"{family} {kv_cache_dtype} {spec}: {case}"
            accepted += stats.num_accepted_tokens
        if "model" in spec:
            assert accepted > 0, "the model drafting for itself has its drafts kept"
    forks = SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    got, stats = spec_busy(model, forks, draft_model(model), "swap", kv_cache_dtype=kv_cache_dtype)
    assert got == expected * 3 and stats.num_accepted_tokens > 0


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "int4", "gguf-Q4_0", "gguf-Q8_0"])
def test_greedy_output_is_unchanged_for_every_weight_format(
    engine_zoo, tiny_gguf, weights: str
) -> None:
    """Llama in every weight format, drafted by n-gram lookup and by a Q4_0 GGUF copy of
    itself (close to the model, so some drafts are kept and some are not): equal to the
    request alone without speculation."""
    import gguf

    model, options = weight_format(engine_zoo, tiny_gguf, weights)
    drafter = str(tiny_gguf("llama", qtype=gguf.GGMLQuantizationType.Q4_0))
    expected = alone(model, GREEDY, **options)
    for spec in (NGRAM, draft_model(drafter)):
        for case in ("batched", "prefix-cache", "recompute"):
            got, _ = spec_busy(model, GREEDY, spec, case, **options)
            assert got == expected, f"{weights} {spec}: {case}"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_seed_gives_the_same_samples_with_speculation(engine_zoo, family: str) -> None:
    """Seeded sampling (temperature, top_p, min_p; n = 2) in a crowd, in small chunks, under
    preemption: the same tokens and logprobs with drafts as without. Every row draws as plain
    decoding would and keeps its draft only where it drew it, so a seeded sample's generator
    advances by one draw per token it emits, however many drafts were verified."""
    model = str(engine_zoo.folder(family))
    params = SamplingParams(
        n=2, temperature=0.8, top_p=0.9, min_p=0.05, seed=11, max_tokens=16, ignore_eos=True,
        logprobs=2,
    )  # fmt: skip
    expected = alone(model, params)
    for spec in (NGRAM, draft_model(model)):
        kept = 0
        for case in ("batched", "chunks-of-16", "swap", "recompute"):
            got, stats = spec_busy(model, params, spec, case)
            assert got == expected, f"{family} {spec}: {case}"
            kept += stats.num_accepted_tokens
        if "model" in spec:
            assert kept > 0, "the model drafting for itself has some of its drafts kept"


@pytest.mark.parametrize("case", ["batched", "swap"])
def test_the_engine_seed_gives_the_same_unseeded_samples_with_speculation(
    engine_zoo, case: str
) -> None:
    """Sampling without a request seed (n = 2, in a crowd of seeded, unseeded and greedy
    requests) draws from a stream the engine's seed and the sample's place in the order
    samples were made give it, one draw per token emitted: the same tokens and logprobs with
    drafts as without, however many drafts the step-time-driven rule chose to verify (with one
    stream shared by every row, the drafts verified changed what every later row drew)."""
    model = str(engine_zoo.folder("llama"))
    params = SamplingParams(
        n=2, temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, logprobs=2
    )
    seed, settings = CASES[case]
    expected = busy_run(model, params, others=6, seed=seed, **settings)[0]
    for spec in (NGRAM, draft_model(model)):
        got, stats = spec_busy(model, params, spec, case)
        assert got == expected, f"{spec}: {case}"
        assert stats.num_draft_tokens > 0


# Every setting that changes a position's logits or stops a sample, each checked per
# position of a run of drafts (the draft model drafts from raw logits, masked by a grammar
# only, so the other settings refuse some).
PER_POSITION = {
    "penalties": dict(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.5),
    "logit_bias": dict(logit_bias={17: 4.0, 40: -3.0, 101: 2.5}),
    "bad_words": dict(bad_words=["the", "blocks and"]),
    "allowed_token_ids": dict(allowed_token_ids=list(range(3, 120))),
    "min_tokens": dict(min_tokens=14, ignore_eos=False, stop_token_ids=[5, 9, 11]),
    "stop_strings": dict(stop=["ed", "ar"], ignore_eos=False),
    "regex": dict(structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{4,30}\.")),
    "choice": dict(structured_outputs=StructuredOutputsParams(choice=["paged blocks", "swap"])),
}


@pytest.mark.parametrize("setting", sorted(PER_POSITION))
def test_sampling_settings_apply_at_every_draft_position(engine_zoo, setting: str) -> None:
    """Penalties, logit bias, bad words, allowed ids, min_tokens, stops and structured outputs
    are applied to each draft's position as if the drafts before it had been sampled: the
    answer (tokens, logprobs, text, finish reason) equals the one without speculation."""
    model = str(engine_zoo.folder("llama"))
    params = SamplingParams(
        temperature=0.0, max_tokens=24, logprobs=2, **{"ignore_eos": True, **PER_POSITION[setting]}
    )
    prompts = [TARGET_PROMPT, random_prompt(20, seed=5), TARGET_PROMPT[:30] + TARGET_PROMPT]

    def run(**speculation: Any) -> list[tuple[Any, ...]]:
        llm = LLM(model, num_gpu_blocks=256, max_model_len=512, **speculation)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.engine.scheduler.drafts.stats
        return [
            (o.token_ids, o.logprobs, o.text, o.finish_reason, o.stop_reason)
            for output in outputs
            for o in output.outputs
        ], stats

    expected, _ = run()
    for spec in (NGRAM, draft_model(model)):
        got, stats = run(speculative_config=spec)
        assert got == expected, f"{setting}: {spec}"
    assert stats.num_draft_tokens > 0


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutputsParams(
            json={"type": "object", "properties": {"name": {"type": "string"}}}
        ),
        StructuredOutputsParams(regex=r"([a-z]+ ){3,6}[0-9]{2}\."),
    ],
    ids=["json", "regex"],
)
def test_a_draft_model_drafts_only_what_the_grammar_allows(engine_zoo, structured) -> None:
    """The model drafting for itself under structured outputs drafts what its grammar lets it
    sample, so every draft it verifies is kept: none is computed only to be refused (its raw
    argmax, which the grammar refuses at most positions of a random model, would be)."""
    model = str(engine_zoo.folder("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=structured)
    prompts = [TARGET_PROMPT, random_prompt(20, seed=5)]
    llm = LLM(model, num_gpu_blocks=256, max_model_len=512, speculative_config=draft_model(model))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.engine.scheduler.drafts.stats
    assert stats.num_draft_tokens >= 10
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    plain = LLM(model, num_gpu_blocks=256, max_model_len=512)
    expected = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]


def chi_square_p_value(first: Counter, second: Counter) -> float:
    """The p-value of a chi-square test that two samples come from one distribution
    (categories seen fewer than 5 times in both are pooled)."""
    total_first, total_second = sum(first.values()), sum(second.values())
    categories, pooled = [], [0, 0]
    for key in set(first) | set(second):
        if first[key] + second[key] >= 10:
            categories.append((first[key], second[key]))
        else:
            pooled[0] += first[key]
            pooled[1] += second[key]
    if sum(pooled):
        categories.append(tuple(pooled))
    statistic = 0.0
    for a, b in categories:
        both = a + b
        for observed, total in ((a, total_first), (b, total_second)):
            expected = both * total / (total_first + total_second)
            statistic += (observed - expected) ** 2 / expected
    degrees = len(categories) - 1
    chi2 = torch.distributions.Chi2(torch.tensor(float(degrees), dtype=torch.float64))
    return float(1 - chi2.cdf(torch.tensor(statistic, dtype=torch.float64)))


@pytest.mark.slow
def test_sampled_tokens_are_distributed_as_without_speculation(engine_zoo) -> None:
    """Temperature 1 with top_p: each of the tokens after the first (all verified as drafts of
    the model drafting for itself, kept with probability p(draft), else drawn from the
    residual) follows the same distribution as plain sampling, by a chi-square test over 1,200
    samples each way. The two sides take different seeds: a seed gives the same tokens with
    speculation as without, so shared seeds would compare a sample with itself."""
    model = str(engine_zoo.folder("llama"))
    prompt = TARGET_PROMPT[:12]
    count = 1200

    def samples(first_seed: int, **speculation: Any) -> list[Counter]:
        llm = LLM(model, num_gpu_blocks=2048, max_model_len=256, seed=1, **speculation)
        params = [
            SamplingParams(temperature=1.0, top_p=0.95, max_tokens=4, ignore_eos=True, seed=s)
            for s in range(first_seed, first_seed + count)
        ]
        outputs = llm.generate([{"prompt_token_ids": prompt}] * count, params, use_tqdm=False)
        positions = [Counter() for _ in range(3)]
        for output in outputs:
            for position, token in enumerate(output.outputs[0].token_ids[1:]):
                positions[position][token] += 1
        stats = llm.engine.scheduler.drafts.stats
        return positions, stats

    plain, _ = samples(0)
    speculative, stats = samples(count, speculative_config=draft_model(model))
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both rules were used
    for position in range(3):
        p_value = chi_square_p_value(plain[position], speculative[position])
        assert p_value > 1e-3, f"token {position + 1}: p = {p_value:.2g}"


def test_the_chi_square_test_sees_a_skewed_sampler() -> None:
    """The statistic above has the power to tell: a sample that keeps its argmax a quarter of
    the time more often than it should is rejected."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    fair = Counter(torch.multinomial(probs, 1200, True, generator=generator).tolist())
    skewed_probs = torch.tensor([0.55, 0.225, 0.15, 0.075])
    skewed = Counter(torch.multinomial(skewed_probs, 1200, True, generator=generator).tolist())
    again = Counter(torch.multinomial(probs, 1200, True, generator=generator).tolist())
    assert chi_square_p_value(fair, skewed) < 1e-3
    assert chi_square_p_value(fair, again) > 1e-3


def test_generated_tokens_count_what_outputs_got_when_a_stop_ends_a_run_of_drafts(
    engine_zoo,
) -> None:
    """A stop token in the middle of a run of kept drafts (the model drafting for itself keeps
    them all): the drafts after it are dropped from the output, and from the generated-token
    count too, which equals the output's length as without speculation."""
    model = str(engine_zoo.folder("llama"))
    prompt = random_prompt(20, seed=5)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    [plain] = LLM(model, num_gpu_blocks=64).generate([{"prompt_token_ids": prompt}], free)
    tokens = list(plain.outputs[0].token_ids)
    stop_at = next(i for i in range(5, len(tokens)) if tokens[i] not in tokens[:i])
    params = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[tokens[stop_at]]
    )
    for speculation in ({}, {"speculative_config": draft_model(model, 5)}):
        engine = Engine(EngineArgs(model=model, num_gpu_blocks=64, **speculation))
        engine.add_request("a", prompt, params)
        got: list[int] = []
        while engine.has_unfinished():
            for output in engine.step():
                got += output.outputs[0].token_ids
        assert got == tokens[: stop_at + 1]
        assert engine.stats.generation_tokens_total == stop_at + 1


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_draft_slots_are_reserved_shown_and_given_back(engine_zoo, drafter: str) -> None:
    """Between steps, the page map's draft slots are exactly the drafts each running sample
    will verify (their slots reserved past its tokens): a step gives back the slots of the
    drafts it rejected. At the end every block is free."""
    model = str(engine_zoo.folder("llama"))
    spec = NGRAM if drafter == "ngram" else draft_model(model, 4)
    engine = engine_for(model, num_gpu_blocks=64, speculative_config=spec)
    # The penalty makes the model refuse some of its own raw-argmax drafts.
    params = SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.5, ignore_eos=True)
    for index in range(3):
        engine.add_request(str(index), random_prompt(10 + 7 * index, seed=index), params)
    seen = 0
    while engine.has_unfinished():
        engine.step()
        engine.manager.check_invariants()
        drafts = 0
        for request in engine.scheduler.running:
            for seq in request.live_sequences:
                held = engine.manager.num_tokens(seq.seq_id)
                assert held == len(seq.tokens) + len(seq.draft_token_ids) or (
                    held == len(seq.tokens) - 1 and not seq.draft_token_ids
                )
                drafts += len(seq.draft_token_ids)
        snapshot = engine.kv_snapshot()
        assert sum(block.draft_slots for block in snapshot.gpu) == drafts
        assert all(block.ref_count > 0 for block in snapshot.gpu if block.draft_slots)
        seen = max(seen, drafts)
    assert seen > 0
    stats = engine.scheduler.drafts.stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts were given back
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks


def test_a_sequence_drafts_what_pays_and_pauses_when_nothing_does() -> None:
    """A draft is verified while the chance that it is kept (the estimated per-draft rate to
    the power of its position) reaches the step's threshold; a sequence whose first draft would
    not pay pauses, probes with one draft after the pause, and waits twice as long when the
    probe fails too; a kept draft resets the wait."""
    acceptance = Acceptance()
    for _ in range(20):
        acceptance.record(4, 4)
    rate = acceptance.rate
    assert rate > 0.9
    assert acceptance.drafts_to_verify(rate**4, 4) == 4
    assert acceptance.drafts_to_verify(rate**2.5, 4) == 2  # drafts 1 and 2 pay, 3 does not
    assert acceptance.drafting
    assert acceptance.drafts_to_verify(rate**0.5, 4) == 0 and not acceptance.drafting
    failing = Acceptance()
    pauses = []
    for _ in range(3):
        for _ in range(10):
            failing.record(4, 0)
        assert failing.drafts_to_verify(0.2, 4) == 0 and not failing.drafting
        steps = 0
        while not failing.drafting:
            failing.step_without_drafts()
            steps += 1
        pauses.append(steps)
        assert failing.drafts_to_verify(0.2, 4) == 1  # the probe
        failing.record(1, 0)
    assert pauses == [FIRST_PAUSE_STEPS, 2 * FIRST_PAUSE_STEPS, 4 * FIRST_PAUSE_STEPS]
    failing.record(1, 1)
    assert failing.next_pause == FIRST_PAUSE_STEPS


def test_the_step_cost_is_fitted_to_the_steps_timed() -> None:
    """Steps that take 4 ms plus 1.5 ms a row: the fit finds both, and a draft must have a
    27% chance of being kept to pay at batch 1, 92% at 32 sequences."""
    cost = StepCost()
    assert cost.threshold(1) == pytest.approx(0.2)  # no timings yet: a row is a quarter
    for rows in [1, 4, 1, 1, 4, 2, 64, 1, 4, 32, 33]:
        cost.record(rows, 0.004 + 0.0015 * rows, decodes_only=True)
    fixed, per_row = cost.fit()
    assert fixed == pytest.approx(0.004) and per_row == pytest.approx(0.0015)
    assert cost.threshold(1) == pytest.approx(0.0015 / 0.0055)
    assert cost.threshold(32) == pytest.approx(0.048 / 0.052)


def test_drafts_that_are_never_kept_pause_though_the_fit_finds_rows_free() -> None:
    """Timing noise (a loaded machine) can hide a row's cost: steps that take 5 ms whatever
    their rows fit 0 s a row. A draft still needs MIN_THRESHOLD's chance of being kept, so a
    sequence whose drafts are all refused pauses within a few steps rather than never."""
    cost = StepCost()
    for rows in [1, 4, 1, 6, 2, 4]:
        cost.record(rows, 0.005, decodes_only=True)
    assert cost.fit() == pytest.approx((0.005, 0.0))
    assert cost.threshold(1) == cost.threshold(32) == MIN_THRESHOLD
    refused = Acceptance()
    steps = 0
    while refused.drafts_to_verify(cost.threshold(1), 4):
        refused.record(4, 0)
        steps += 1
    assert not refused.drafting
    # the prior (2 kept, 1 refused) decays by DECAY a verification: the rate 2 x DECAY^m over
    # 2 x DECAY^m + (1 - DECAY^m) / (1 - DECAY) + DECAY^m falls below the floor after m steps
    m = next(
        m
        for m in range(1, 100)
        if 2 * DECAY**m / (2 * DECAY**m + (1 - DECAY**m) / (1 - DECAY) + DECAY**m) < MIN_THRESHOLD
    )
    assert steps == m


def test_the_step_cost_of_a_row_is_a_decode_row_once_decodes_were_timed() -> None:
    """Prompt rows (no logits) at 0.5 ms, decode rows at 1.5 ms: prompt steps set the fit only
    until decode steps of two sizes were timed, then the decode steps alone do."""
    cost = StepCost()
    for rows in [64, 128, 32]:
        cost.record(rows, 0.004 + 0.0005 * rows, decodes_only=False)
    cost.record(1, 0.0055, decodes_only=True)
    assert cost.fit()[1] < 0.001  # one decode size: the prompts still decide
    for rows in [3, 1, 6, 2]:
        cost.record(rows, 0.004 + 0.0015 * rows, decodes_only=True)
    cost.record(256, 0.004 + 0.0005 * 256, decodes_only=False)
    assert cost.fit() == pytest.approx((0.004, 0.0015))


def test_an_engine_whose_drafts_never_pay_verifies_few(engine_zoo) -> None:
    """Random text: the n-gram drafts of a random model are mostly refused, so most steps of a
    long answer verify no drafts at all."""
    model = str(engine_zoo.folder("mistral"))
    engine = engine_for(model, num_gpu_blocks=64, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    answers(engine, [("a", random_prompt(30, seed=3), params)])
    stats = engine.scheduler.drafts.stats
    assert stats.acceptance_rate < 0.3 and stats.num_drafts < 120 / 2


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "method 'eagle' is not supported"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min (4) must be <= prompt_lookup_max (2)",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_length": 4}, "'draft_length'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
        ({"num_speculative_tokens": 2}, "names neither a method nor a model"),
        ({}, "names neither a method nor a model"),
        ({"method": "ngram", "model": "m", "num_speculative_tokens": 2}, "takes no model"),
        (
            {"model": "m", "num_speculative_tokens": 2, "quantization": "fp4"},
            "quantization must be one of auto, none, int8, int4 (or None: the engine's), got 'fp4'",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"},
            "quantization applies to a draft model only",
        ),
        (
            {"model": "m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            "draft_tensor_parallel_size must be 1 (the draft model runs whole on rank 0), got 2",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "revision": "main"},
            "revision applies to a draft model only",
        ),
        ({"model": "m", "num_speculative_tokens": 2, "revision": 7}, "revision must be a string"),
        ('{"method": "ngram", ', "not valid JSON"),
        ([3], "must be a dict"),
    ],
)
def test_bad_speculative_configs_are_refused_at_start(config: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(model="unused", speculative_config=config)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (SpeculativeConfig("eagle", 3), "method 'eagle' is not supported"),
        (SpeculativeConfig("ngram", 0), "num_speculative_tokens must be an integer >= 1"),
        (
            SpeculativeConfig("ngram", 3, prompt_lookup_min=4, prompt_lookup_max=2),
            r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)",
        ),
        (SpeculativeConfig("ngram", 3, 0, 0), "prompt_lookup_min must be an integer >= 1"),
        (SpeculativeConfig("ngram", 3, model="m"), "takes no model"),
        (SpeculativeConfig("draft_model", 3), "needs a model"),
        (
            SpeculativeConfig("draft_model", 3, prompt_lookup_min=2, model="m"),
            "prompt_lookup_min applies to method 'ngram' only",
        ),
    ],
)
def test_a_speculative_config_built_by_hand_is_checked_as_its_dict(config, message) -> None:
    """EngineArgs takes a SpeculativeConfig as well as vLLM's dict: the same checks apply
    (an unchecked one ran 'eagle' as n-gram, and a lookup of 0 failed the first step)."""
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="unused", speculative_config=config)
    good = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2)
    assert EngineArgs(model="unused", speculative_config=good).speculative == good
    drafted = SpeculativeConfig("draft_model", 2, model="m")
    assert EngineArgs(model="unused", speculative_config=drafted).speculative == drafted


def test_vllm_spellings_and_defaults() -> None:
    """vLLM's older `{"model": "ngram"}` (and the method with the model vLLM fills in for it),
    a JSON string as `--speculative-config` passes it, and vLLM's defaults for the lookup sizes
    (one given stands for both; neither: 5)."""
    old = EngineArgs(speculative_config={"model": "[ngram]", "num_speculative_tokens": 2})
    assert (old.speculative.method, old.speculative.prompt_lookup_min) == ("ngram", 5)
    both = {"method": "ngram", "model": "ngram", "num_speculative_tokens": 2}
    assert EngineArgs(speculative_config=both).speculative == old.speculative
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    parsed = EngineArgs(speculative_config=text).speculative
    assert (parsed.prompt_lookup_min, parsed.prompt_lookup_max) == (3, 3)
    drafted = EngineArgs(speculative_config={"model": "m", "num_speculative_tokens": 2})
    assert drafted.speculative.method == "draft_model"


def test_a_draft_model_keeps_its_own_quantization(engine_zoo) -> None:
    """vLLM's speculative `quantization` is the draft's alone: a float model drafted by itself in
    int8 (with vLLM's draft_tensor_parallel_size 1 and revision None taken) keeps float
    projections while its draft's are int8, and its greedy answer equals the one alone."""
    model = str(engine_zoo.folder("llama"))
    spec = draft_model(model) | {
        "quantization": "int8",
        "draft_tensor_parallel_size": 1,
        "revision": None,
    }
    engine = engine_for(model, num_gpu_blocks=64, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompt = random_prompt(20, seed=4)
    got = answers(engine, [("a", prompt, params)])[0]["a"]
    plain = engine_for(model, num_gpu_blocks=64)
    assert got == answers(plain, [("a", prompt, params)])[0]["a"]
    assert engine.scheduler.drafts.stats.num_accepted_tokens > 0

    def bits(net: torch.nn.Module) -> set[int | None]:
        layers = [m for m in net.modules() if isinstance(m, Linear)]
        return {None if m.qweight is None else m.qweight.bits for m in layers}

    assert bits(engine.runner.model) == {None}
    assert bits(engine.executor.drafter.runner.model) == {8}


def test_a_draft_model_with_another_vocabulary_is_refused(engine_zoo, tmp_path: Path) -> None:
    """A draft whose tokenizer splits text otherwise (same vocabulary size) is refused when the
    engine starts, naming the draft model."""
    target = engine_zoo.folder("llama")
    other = tmp_path / "other-tokenizer"
    shutil.copytree(target, other)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(["completely different words here"] * 5, trainer)
    tokenizer.save(str(other / "tokenizer.json"))
    with pytest.raises(ValueError, match="draft model needs the model's tokenizer"):
        Engine(EngineArgs(model=str(target), speculative_config=draft_model(str(other))))


def test_a_draft_padded_to_other_vocabulary_rows_is_named_as_such(engine_zoo, tmp_path) -> None:
    """The same tokenizer with embedding rows padded to another size (Qwen2.5's 151936 against
    152064) is refused, as vLLM refuses it, saying that is the difference, not the tokenizer."""
    spec = TINY_MODELS["llama"]
    padded = replace(spec, config={**spec.config, "vocab_size": spec.config["vocab_size"] + 3})
    folder = build_model_folder("llama", tmp_path / "padded", spec=padded)
    target = engine_zoo.folder("llama")
    sizes = padded.config["vocab_size"], spec.config["vocab_size"]
    rows = f"has {sizes[0]} vocabulary rows .* and the model {sizes[1]}, though both tokenizers"
    with pytest.raises(ValueError, match=rows):
        Engine(EngineArgs(model=str(target), speculative_config=draft_model(str(folder))))


def test_integer_counts_of_any_integer_type_are_taken() -> None:
    """numpy's integers are integers, as vLLM's pydantic config takes them; a float is not."""
    config = {
        "method": "ngram",
        "num_speculative_tokens": np.int64(3),
        "prompt_lookup_max": np.int32(4),
    }
    parsed = EngineArgs(model="unused", speculative_config=config).speculative
    assert (parsed.num_speculative_tokens, parsed.prompt_lookup_max) == (3, 4)
    assert type(parsed.num_speculative_tokens) is int
    with pytest.raises(
        ValueError, match=r"num_speculative_tokens must be an integer >= 1, got 3.0"
    ):
        EngineArgs(model="unused", speculative_config={**config, "num_speculative_tokens": 3.0})


def test_a_draft_model_with_its_tokens_at_other_ids_is_refused(engine_zoo, tmp_path: Path) -> None:
    """Same size, same split of the probe texts, but two tokens trade ids: its drafts would
    mean other tokens, so it is refused naming a token that moved."""
    target = engine_zoo.folder("llama")
    swapped = tmp_path / "swapped-ids"
    shutil.copytree(target, swapped)
    data = json.loads((swapped / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    probed = {  # the ids of the texts the check also tokenizes: none of them may move
        token_id
        for text in _PROBES
        for token_id in Tokenizer.from_file(str(target / "tokenizer.json")).encode(text).ids
    }
    first, second = [token for token in sorted(vocab, key=vocab.get) if vocab[token] not in probed][
        -2:
    ]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (swapped / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    named = min(first, second)  # the first that moved, by name
    with pytest.raises(ValueError, match=f"gives {named!r} another id than the model"):
        Engine(EngineArgs(model=str(target), speculative_config=draft_model(str(swapped))))


def test_a_draft_folder_that_is_no_model_is_named_as_the_draft(engine_zoo, tmp_path: Path) -> None:
    """A folder that exists but holds no model is the draft's fault, named as such (it read
    as the served model's missing config.json)."""
    target = engine_zoo.folder("llama")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=rf"^speculative_config model '{empty}': .*config.json"):
        Engine(EngineArgs(model=str(target), speculative_config=draft_model(str(empty))))


def test_a_draft_model_that_is_not_there_is_named_as_the_draft(engine_zoo, tmp_path: Path) -> None:
    """A draft model path that is no model is refused at start as the speculative_config's, not
    in words that would blame the model being served."""
    target = engine_zoo.folder("llama")
    missing = str(tmp_path / "no-such-draft")
    with pytest.raises(ValueError, match=rf"^speculative_config model: '{missing}' is not a model"):
        Engine(EngineArgs(model=str(target), speculative_config=draft_model(missing)))


def test_a_draft_model_with_a_shorter_context_is_refused(engine_zoo, tmp_path: Path) -> None:
    """A draft that cannot read every position a sequence reaches (max_model_len) is refused
    when the engine starts, naming both lengths; a max_model_len within its context runs."""
    target = engine_zoo.folder("llama")
    short = tmp_path / "short-context"
    shutil.copytree(target, short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"allows 64 positions.*max_model_len 1024"):
        Engine(EngineArgs(model=str(target), speculative_config=draft_model(str(short))))
    drafted = draft_model(str(short))
    fits = Engine(EngineArgs(model=str(target), max_model_len=64, speculative_config=drafted))
    assert fits.max_model_len == 64


def test_more_drafts_than_the_context_holds_are_refused_at_start(engine_zoo) -> None:
    """k drafts need k positions after a sample's last token: k >= max_model_len could never
    be verified, and would size per-position counters by k (10**9 of them), so the engine
    refuses it, naming both; k = max_model_len - 1 starts."""
    model = str(engine_zoo.folder("llama"))
    for k in (64, 10**9):
        spec = {**NGRAM, "num_speculative_tokens": k}
        with pytest.raises(
            ValueError, match=rf"num_speculative_tokens \({k}\).*max_model_len \(64\)"
        ):
            Engine(EngineArgs(model=model, max_model_len=64, speculative_config=spec))
    spec = {**NGRAM, "num_speculative_tokens": 63}
    engine = Engine(EngineArgs(model=model, max_model_len=64, speculative_config=spec))
    assert engine.scheduler.drafts.stats.num_speculative_tokens == 63


def test_draft_model_blocks_cost_both_models_bytes(engine_zoo) -> None:
    """The pool counts each block at the model's K/V bytes plus the draft's, so the same memory
    holds fewer blocks, and the start-up line says the draft's share."""
    model = str(engine_zoo.folder("llama"))
    memory = 1 << 20
    plain = engine_for(model, kv_cache_memory=memory)
    drafted = engine_for(model, kv_cache_memory=memory, speculative_config=draft_model(model))
    per_block = plain.kv_bytes_per_block
    assert drafted.kv_bytes_per_block == 2 * per_block
    assert drafted.manager.num_gpu_blocks == memory // (2 * per_block)
    assert plain.manager.num_gpu_blocks == memory // per_block


def every_draft_verified(
    prompt: list[int], output: list[int], spec: dict[str, Any], max_tokens: int
) -> tuple[int, int, int]:
    """(drafts, draft tokens, accepted) of verifying every n-gram draft, replayed over the
    plain greedy `output`: a step keeps the drafts that equal the next tokens, then one more."""
    lookup = spec["prompt_lookup_min"], spec["prompt_lookup_max"], spec["num_speculative_tokens"]
    drafts = tokens = accepted = 0
    at = 1  # the prefill samples the first token; drafting starts after it
    while at < len(output):
        proposed = propose_ngram(array("q", prompt + output[:at]), *lookup)
        proposed = proposed[: max(0, max_tokens - at - 1)]
        kept = 0
        while kept < len(proposed) and proposed[kept] == output[at + kept]:
            kept += 1
        if proposed:
            drafts, tokens, accepted = drafts + 1, tokens + len(proposed), accepted + kept
        at += kept + 1
    return drafts, tokens, accepted


@pytest.mark.slow
def test_the_builtin_model_copies_faster_with_the_same_answer(builtin_gguf, monkeypatch) -> None:
    """The built-in model quoting a passage back: n-gram drafts are mostly kept (the point of
    prompt lookup), and the answer is the one without speculation, tokens and logprobs. Rows
    are free in tests (`drafts_by_acceptance_alone`) and no chance of being kept is too low
    here, so every draft is verified: the counts must be the replay's over the plain answer."""
    passage = (
        "Paged attention keeps the keys and values of every token in fixed-size blocks, found "
        "through a block table per sequence, so memory is allocated as tokens arrive and "
        "shared between requests with a common prefix."
    )
    conversation = [{"role": "user", "content": f"Repeat this text exactly:\n\n{passage}"}]
    params = SamplingParams(temperature=0.0, max_tokens=48, logprobs=1)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 2,
    }
    monkeypatch.setattr(acceptance, "MIN_THRESHOLD", 0.0)
    plain = LLM(DEFAULT_MODEL, num_gpu_blocks=256).chat(conversation, params, use_tqdm=False)
    llm = LLM(DEFAULT_MODEL, num_gpu_blocks=256, speculative_config=spec)
    fast = llm.chat(conversation, params, use_tqdm=False)
    answer = list(plain[0].outputs[0].token_ids)
    assert list(fast[0].outputs[0].token_ids) == answer
    assert fast[0].outputs[0].logprobs == plain[0].outputs[0].logprobs
    stats = llm.engine.scheduler.drafts.stats
    replayed = every_draft_verified(list(plain[0].prompt_token_ids), answer, spec, 48)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == replayed
    assert stats.acceptance_rate > 0.5 and stats.mean_accepted_length > 2
