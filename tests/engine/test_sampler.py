"""The sampler against plain-Python oracles written from the parameters' definitions, and its
draws against softmax(logits / temperature) by a chi-square test with a fixed seed."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagedkv.engine.outputs import RequestMetrics
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.penalties import TokenCounts
from pagedkv.engine.request import Request, Sequence
from pagedkv.engine.sampler import (
    Sampler,
    SamplingRow,
    _filtered_probs,
    _nucleus,
    argmax,
    sampling_row,
    token_logprobs,
)
from pagedkv.engine.samples import unseeded_stream
from pagedkv.memory.tokens import SequenceTokens
from tests.engine.conftest import make_llm
from tests.model.tiny_models import random_prompt

VOCAB = 12
STREAMS = itertools.count(1)  # each sampled row's own stream


def row(
    params: SamplingParams, output=(), prompt=(), stop_ids=(), generator=None, vocab=VOCAB
) -> SamplingRow:
    """A row as the engine builds it for a sample with these prompt and output tokens; a
    sampled one without `generator` gets a stream of its own."""
    if generator is None and not params.greedy:
        generator = torch.Generator().manual_seed(next(STREAMS))
    counts = TokenCounts.for_prompt(prompt, vocab, "cpu")
    for token_id in output:
        counts.add(token_id)
    return SamplingRow(params, len(output), list(stop_ids), generator, counts, tuple(output))


def oracle_filtered(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
):
    """The kept distribution, from the definitions in vLLM's order: min_p of the largest
    probability, then top_k of what is left, then top_p (the smallest set of the most likely
    reaching p: a token goes once the ones above it reach p)."""
    scaled = [value / temperature for value in logits]

    def softmax(indices):
        top = max(scaled[i] for i in indices)
        weights = {i: math.exp(scaled[i] - top) for i in indices}
        total = sum(weights.values())
        return {i: w / total for i, w in weights.items()}

    probs = softmax(range(len(scaled)))
    if min_p > 0.0:
        floor = min_p * max(probs.values())
        probs = softmax([i for i, p in probs.items() if p >= floor])
    order = sorted(probs, key=lambda i: -scaled[i])
    probs = softmax(order[:top_k] if top_k > 0 else order)
    if top_p < 1.0:
        mass, nucleus = 0.0, []
        for i in sorted(probs, key=lambda i: -probs[i]):
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += probs[i]
        probs = softmax(nucleus)
    return [probs.get(i, 0.0) for i in range(len(logits))]


@settings(max_examples=200, deadline=None)
@given(
    logits=st.lists(  # distinct values drawn as such: a filter on them starved hypothesis
        st.floats(-5, 5, allow_nan=False).map(lambda x: round(x, 2)),
        min_size=VOCAB,
        max_size=VOCAB,
        unique=True,
    ),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 3, VOCAB]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.05]),
    min_p=st.sampled_from([0.0, 0.1, 0.5]),
)
def test_filtered_distribution_matches_the_definitions(logits, temperature, top_k, top_p, min_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    tensor = torch.tensor([logits], dtype=torch.float64) / temperature
    probs = _filtered_probs(tensor, [row(params)])[0].tolist()
    want = oracle_filtered(logits, temperature, top_k, top_p, min_p)
    assert probs == pytest.approx(want, abs=1e-9)


def test_a_rows_filters_do_not_depend_on_the_other_rows():
    """A row without top_p keeps its whole distribution beside rows with top_p (float32
    cumulative sums overshoot 1.0 over a large vocabulary), bit for bit as alone."""
    logits = torch.randn(3, 50_000, generator=torch.Generator().manual_seed(5)) * 4
    plain = row(SamplingParams(temperature=1.0), vocab=50_000)
    filtered = row(SamplingParams(temperature=1.0, top_p=0.7, top_k=50, min_p=0.01), vocab=50_000)
    as_given = logits.clone()
    alone = _filtered_probs(logits[:1], [plain])
    batched = _filtered_probs(logits, [plain, filtered, filtered])
    nucleus_only = _filtered_probs(logits, [plain, row(SamplingParams(top_p=0.5)), plain])
    assert torch.equal(logits, as_given)  # filtered into new tensors, the caller's left as it was
    assert torch.equal(batched[0], alone[0]) and torch.equal(nucleus_only[0], alone[0])
    assert torch.equal(alone[0], logits[0].softmax(dim=-1))


def chi_square_bound(degrees_of_freedom: int) -> float:
    """The 99.9% quantile of chi-square (Wilson-Hilferty's approximation, a little above the
    exact value): with a fixed seed a correct sampler passes every time, while a wrong
    distribution over thousands of draws lands far above it."""
    k = degrees_of_freedom
    z = 3.0902  # the standard normal's 99.9% quantile
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, pooling tokens expected < 10 times."""
    draws = sum(counts)
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    bins = [[i] for i in order if probs[i] * draws >= 10]
    rest = [i for i in order if probs[i] * draws < 10]
    if rest and sum(probs[i] for i in rest) * draws >= 5:
        bins.append(rest)
    elif rest:
        bins[-1] += rest
    statistic = 0.0
    for tokens in bins:
        expected = sum(probs[i] for i in tokens) * draws
        statistic += (sum(counts[i] for i in tokens) - expected) ** 2 / expected
    return statistic, len(bins) - 1


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_samples_follow_softmax_of_logits_over_temperature(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.2, 0.0])
    params = SamplingParams(temperature=temperature)
    sampler = Sampler()
    counts = torch.zeros(len(logits), dtype=torch.int64)
    for _ in range(6):
        chosen = sampler(logits.repeat(1000, 1), [row(params)] * 1000).token_ids
        counts += torch.bincount(torch.tensor(chosen), minlength=len(logits))
    probs = (logits.double() / temperature).softmax(dim=0).tolist()
    statistic, degrees_of_freedom = chi_square(counts.tolist(), probs)
    assert degrees_of_freedom == len(logits) - 1
    assert statistic < chi_square_bound(degrees_of_freedom), (counts.tolist(), probs)


@pytest.mark.parametrize(
    ("draft", "top_k", "top_p", "min_p"),
    [(0, 0, 1.0, 0.0), (0, 0, 1.0, 0.3), (3, 0, 1.0, 0.3), (0, 4, 0.9, 0.2), (2, 0, 0.8, 0.0)],
)
def test_a_verified_draft_leaves_the_filtered_distribution_unchanged(draft, top_k, top_p, min_p):
    """Rejection sampling with a one-hot draft (keep it with its probability, else draw from the
    rest): the token that comes out follows the filtered distribution from its definitions."""
    logits = [1.0, 0.9, 0.4, -0.3, -0.6, -1.0, -1.5]
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    sampler = Sampler()
    counts = torch.zeros(len(logits), dtype=torch.int64)
    for _ in range(6):
        # Each row its own sample (a row refusing its draft ends its sample's draws).
        drafted = [
            replace(row(params, vocab=len(logits)), draft_token_id=draft) for _ in range(1000)
        ]
        chosen = sampler(torch.tensor(logits).repeat(1000, 1), drafted).token_ids
        counts += torch.bincount(torch.tensor(chosen), minlength=len(logits))
    probs = oracle_filtered(logits, 1.0, top_k, top_p, min_p)
    kept = [i for i, p in enumerate(probs) if p > 0]
    assert counts[[i for i in range(len(logits)) if i not in kept]].sum() == 0
    statistic, degrees_of_freedom = chi_square(
        [counts[i].item() for i in kept], [probs[i] for i in kept]
    )
    assert statistic < chi_square_bound(degrees_of_freedom), (counts.tolist(), probs)


def test_llm_generate_samples_first_tokens_from_softmax_over_temperature(engine_zoo):
    """4,000 first tokens of one prompt against transformers' logits at T = 1.7."""
    temperature = 1.7
    prompt = random_prompt(12, seed=21)
    logits = engine_zoo.hf_logits("llama", prompt)[-1].double()
    llm = make_llm(engine_zoo, "llama", seed=3, num_gpu_blocks=512)
    params = SamplingParams(n=250, temperature=temperature, max_tokens=1, ignore_eos=True)
    counts = [0] * len(logits)
    for output in llm.generate([prompt] * 16, params, use_tqdm=False):
        for sample in output.outputs:
            counts[sample.token_ids[0]] += 1
    probs = (logits / temperature).softmax(dim=0).tolist()
    statistic, degrees_of_freedom = chi_square(counts, probs)
    assert degrees_of_freedom >= 5  # enough likely tokens for the test to see the shape
    assert statistic < chi_square_bound(degrees_of_freedom), (statistic, degrees_of_freedom)


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3
    )
    prompt, output = [0, 1], [3, 3, 4]
    want = logits[0].tolist()
    for token in set(prompt + output):  # repetition: divide positive logits, multiply negative
        want[token] = want[token] / 1.5 if want[token] > 0 else want[token] * 1.5
    for token in set(output):
        want[token] -= 0.3 * output.count(token) + 0.4
    got = Sampler()(logits, [row(params, output=output, prompt=prompt, vocab=6)])
    assert got.token_ids == [max(range(6), key=lambda i: want[i])]
    from pagedkv.engine.sampler import _apply_penalties

    penalised = logits.clone()
    _apply_penalties(penalised, [row(params, output=output, prompt=prompt, vocab=6)])
    assert penalised[0].tolist() == pytest.approx(want)


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 9.0, 1.0, 0.5]])  # token 1 (the stop token) is the argmax
    params = SamplingParams(temperature=0.0, min_tokens=2)
    sampler = Sampler()
    assert sampler(logits, [row(params, output=[2], stop_ids=[1])]).token_ids == [2]
    assert sampler(logits, [row(params, output=[2, 2], stop_ids=[1])]).token_ids == [1]


def test_a_seeded_row_does_not_depend_on_its_batch():
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    others = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))

    def draw(batch_logits: torch.Tensor, position: int) -> list[int]:
        """Ten tokens of the seeded row, placed at `position` among unseeded rows."""
        generator = torch.Generator().manual_seed(7)
        rows = [row(SamplingParams(temperature=1.0)) for _ in range(batch_logits.shape[0])]
        rows[position] = row(params, generator=generator)
        sampler = Sampler()
        return [sampler(batch_logits, rows).token_ids[position] for _ in range(10)]

    alone = draw(logits, 0)
    mixed = draw(torch.cat([others[:3], logits, others[3:]]), 3)
    assert alone == mixed


def test_logprobs_are_the_models_log_softmax_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0.0, logprobs=2)
    out = Sampler()(logits, [row(params)])
    chosen, rank, top_ids, top_values = out.logprobs[0]
    log_probs = torch.log_softmax(logits[0], dim=0).tolist()
    assert out.token_ids == [1] and rank == 1
    assert chosen == pytest.approx(log_probs[1])
    assert top_ids == [1, 2] and top_values == pytest.approx([log_probs[1], log_probs[2]])


@pytest.mark.parametrize(
    "processing",
    [
        {"allowed_token_ids": [0, 2]},
        {"bad_words": ["x"]},
        {"logit_bias": {1: -50.0}},
        {"repetition_penalty": 2.0},
        {"min_tokens": 3},
    ],
    ids=lambda fields: next(iter(fields)),
)
def test_processors_leave_the_models_logits_and_their_logprobs_as_given(processing):
    """Each processor writes a copy: the caller's logits and the logprobs (the model's own
    distribution, vLLM's) are what the model gave, beside a row that changes nothing."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.0, 2.5, 1.0]])
    given = logits.clone()
    params = SamplingParams(temperature=0.0, logprobs=4, **processing)
    processed = row(params, output=[1], prompt=[1], stop_ids=[1])
    if "bad_words" in processing:  # the word as its token: 1
        processed = replace(processed, bad_words_token_ids=[[1]])
    out = Sampler()(logits, [processed, row(SamplingParams(temperature=0.0, logprobs=4))])
    assert torch.equal(logits, given)
    assert out.token_ids[0] != 1  # the processor did act: 1 was the argmax
    for index, entry in enumerate(out.logprobs):
        expected = torch.log_softmax(given[index], dim=0)
        assert entry[3] == pytest.approx(expected.sort(descending=True).values.tolist())


def test_a_tied_token_ranks_below_its_ties_as_vllm_counts():
    """vLLM's rank: how many tokens have a logprob at least the chosen one's."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    [(_, rank, _, _)] = token_logprobs(logits, torch.tensor([1]), [0])
    assert rank == 4
    [(_, top_rank, _, _)] = token_logprobs(logits, torch.tensor([0]), [0])
    assert top_rank == 1


def test_vllms_seed_and_temperature_conventions():
    assert SamplingParams(seed=-1).seed is None  # no seed
    assert SamplingParams(temperature=1e-4).temperature == 0.01  # raised, not greedy
    assert not SamplingParams(temperature=1e-4).greedy and SamplingParams(temperature=0).greedy


def tied_row(seed: int, masked: float) -> list[float]:
    """300 logits of seven levels, so most values tie, a share `masked` of them -inf (as a
    grammar or allowed_token_ids leaves them), one at least finite."""
    rng = random.Random(seed)
    values = [rng.choice((-3, -2, -1, 0, 1, 2, 3)) for _ in range(300)]
    values = [-math.inf if rng.random() < masked else value for value in values]
    values[rng.randrange(300)] = rng.choice((-3, 3))
    return values


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.builds(tied_row, st.integers(0, 2**32), st.sampled_from((0.0, 0.5, 0.99))),
            st.integers(0, 305),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_top_logprobs_list_ties_by_token_id_whatever_the_other_rows_ask(rows):
    """Logits of a few levels, so most values tie, and masked tokens (-inf, often more than a
    row asks for): each row's top entries are its largest log-softmax values, equal values by
    token id (a plain-Python sort of the row, the oracle), the same alone as beside rows
    asking for more or fewer."""
    logits = torch.tensor([values for values, _ in rows], dtype=torch.float32) / 4
    counts = [count for _, count in rows]
    chosen = torch.zeros(len(rows), dtype=torch.long)
    entries = token_logprobs(logits, chosen, counts)
    log_softmax = torch.log_softmax(logits, dim=-1)
    for index, (values, count) in enumerate(rows):
        expected = log_softmax[index].tolist()
        ranked = sorted(range(len(values)), key=lambda token_id: (-expected[token_id], token_id))
        _, _, top_ids, top_values = entries[index]
        assert top_ids == ranked[:count]
        assert top_values == [expected[token_id] for token_id in ranked[:count]]
        alone = token_logprobs(logits[index : index + 1], chosen[:1], [count])
        assert alone[0][2:] == (top_ids, top_values)


def oracle_nucleus(probs: list[float], top_p: float) -> set[int]:
    """top_p's tokens from the definition: by probability, equal ones by token id, each kept
    while those before it hold less than p (summed in float64)."""
    mass, kept = 0.0, set()
    for token_id in sorted(range(len(probs)), key=lambda token_id: (-probs[token_id], token_id)):
        if mass >= top_p:
            break
        assume(abs(mass - top_p) > 1e-5)  # a sum at p itself would hinge on rounding
        kept.add(token_id)
        mass += probs[token_id]
    return kept


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 2**31 - 1),  # which token gets which level
            st.integers(1, 6),  # levels: few, so that most probabilities tie
            st.sampled_from([0.0, 0.3, 2.0, 9.0]),  # logit gap between levels
            st.sampled_from([0.05, 0.3, 0.55, 0.8, 0.97]),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_top_p_keeps_the_nucleus_by_probability_then_token_id(rows):
    """Over 1,500 tokens (more than the candidates top_p looks among first), with levels from
    flat to one far above the rest: the kept tokens are the definition's, each row's the same
    alone as beside the others."""
    vocab = 1500
    logits = torch.stack(
        [
            torch.randint(levels, (vocab,), generator=torch.Generator().manual_seed(seed)) * gap
            for seed, levels, gap, _ in rows
        ]
    ).float()
    top_p = torch.tensor([p for *_, p in rows])
    kept = _nucleus(logits, top_p)
    for index, (*_, p) in enumerate(rows):
        probs = logits[index : index + 1].softmax(dim=-1)[0].tolist()
        assert set(kept[index].nonzero()[:, 0].tolist()) == oracle_nucleus(probs, p)
        assert torch.equal(
            _nucleus(logits[index : index + 1], top_p[index : index + 1])[0], kept[index]
        )


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    output=st.lists(st.integers(10, 19), max_size=6),
    kept=st.lists(st.integers(20, 29), max_size=6),
    word_lengths=st.lists(st.integers(1, 12), min_size=1, max_size=3),
)
def test_bad_words_see_the_output_and_the_drafts_kept_before_a_row(
    prompt, output, kept, word_lengths
):
    """A row verifying a draft compares bad words with the sample's output followed by the
    drafts before it: the last (longest word - 1) of those tokens, however short the prompt
    (never a prompt token: the oracle builds the list and cuts it)."""
    tokens = SequenceTokens(("r", 0), prompt)
    tokens.extend(output)
    seq = Sequence(("r", 0), 0, tokens, len(prompt))
    request = Request(
        request_id="r",
        prompt=None,
        prompt_token_ids=prompt,
        params=SamplingParams(temperature=0.0, bad_words=["x"]),
        max_tokens=16,
        sequences=[seq],
        metrics=RequestMetrics(arrival_time=0.0),
        bad_words_token_ids=[[30] * length for length in word_lengths],
    )
    seen = [*output, *kept]
    tail = max(word_lengths) - 1
    expected = seen[max(0, len(seen) - tail) :] if tail else []
    assert list(sampling_row(request, seq, kept).output_tail) == expected


@pytest.mark.slow
def test_tokens_far_below_the_top_are_drawn_at_their_probability():
    """One token of probability ~0.99 and 2^20 tokens of 1e-8 each (1% together): 1,000
    draws take about 10.5 of them (Poisson; 2-22 holds with probability 0.999). A token of p
    wins only when its Exp(1) noise is below about p, so noise on a coarse grid near 0
    (-log U with U on float32's 2^-24 steps) draws them almost never (~0.15 of 1,000: two or
    more with probability 0.01)."""
    tail = 2**20
    logits = torch.full((25, tail + 1), math.log(1e-8))
    logits[:, 0] = math.log(1 - tail * 1e-8)
    sampler = Sampler()
    rows = [row(SamplingParams(temperature=1.0), vocab=tail + 1)] * 25
    drawn = sum(token_id != 0 for _ in range(40) for token_id in sampler(logits, rows).token_ids)
    assert 2 <= drawn <= 22


def first_largest(values: list[float]) -> int:
    """The first NaN's index if there is one, else the first index of the largest value."""
    nans = [index for index, value in enumerate(values) if math.isnan(value)]
    return nans[0] if nans else values.index(max(values))


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.lists(
            st.sampled_from((0.0, 1.5, -2.0, 3.25, math.inf, -math.inf, math.nan)),
            min_size=3,
            max_size=40,
        ),
        min_size=1,
        max_size=5,
    ),
    step=st.integers(1, 3),
)
def test_argmax_takes_the_first_largest_and_nan_above_all(rows: list[list[float]], step: int):
    width = min(len(values) for values in rows)
    values = torch.tensor([values[:width] for values in rows])[:, ::step]  # strided too
    expected = [first_largest(row.tolist()) for row in values]
    assert argmax(values).tolist() == expected
    assert int(argmax(values[0])) == expected[0]


def test_unseeded_samples_never_share_a_cpu_stream():
    """The CPU generator keeps 32 bits of a seed (seeds 2^32 apart give one stream), so the
    unseeded samples' seeds are a bijection of their numbers into 32 bits: 2^17 numbers, 2^17
    streams, under each engine seed, and another engine seed gives other streams."""
    same = [torch.Generator().manual_seed(s).initial_seed() for s in (5, 5 + 2**32)]
    draws = [torch.rand(4, generator=torch.Generator().manual_seed(s)) for s in (5, 5 + 2**32)]
    assert same[0] != same[1] and torch.equal(draws[0], draws[1])
    count = 2**17
    for engine_seed in (0, 1, 2**40 + 7):
        seeds = [unseeded_stream(engine_seed, number) for number in range(count)]
        assert len(set(seeds)) == count and max(seeds) < 2**32
    assert unseeded_stream(0, 5) != unseeded_stream(1, 5)
