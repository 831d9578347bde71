"""One request, one answer: a request's tokens and logprob floats, bit for bit, whatever the
engine does around it.

The oracle is the request run alone (a roomy pool, no prefix cache, whole-prompt prefill).
Against it the same request runs beside other requests at any position of a step, with its
prompt in small chunks, served in part from the prefix cache or its host tier, after swap or
recompute preemption, and as each sample of n > 1 (greedy forks, and seeded sampling). Every
registry family, weight format and KV dtype is covered; hypothesis draws random batch
compositions, chunk budgets and pool sizes. Equality is exact: `==` on token ids and on the
logprob floats (what the README's "One request, one answer" promises).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from pagedkv.engine import LLM, Engine, EngineArgs, SamplingParams
from pagedkv.engine.outputs import RequestMetrics
from pagedkv.hub import DEFAULT_MODEL
from tests.conftest import TinyZoo
from tests.model.tiny_models import TINY_MODELS, random_prompt

# A sample's answer: its token ids, then per token the logprob of every token returned.
Answer = tuple[tuple[int, ...], tuple[tuple[tuple[int, float], ...], ...]]
ALONE = dict(num_gpu_blocks=256, enable_prefix_caching=False, max_num_batched_tokens=2048)
TARGET_PROMPT = random_prompt(45, seed=1234)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.9, max_tokens=12, ignore_eos=True, logprobs=3, seed=7
)


def engine_for(model: str, **settings: Any) -> Engine:
    options: dict[str, Any] = dict(swap_space_gb=0.01, max_model_len=512, block_size=16)
    options.update(settings)
    return Engine(EngineArgs(model=model, **options))


def answers(
    engine: Engine,
    requests: list[tuple[str, list[int], SamplingParams]],
    arrivals: list[int] | None = None,
) -> tuple[dict[str, list[Answer]], dict[str, RequestMetrics]]:
    """Run `requests` (request i added before step arrivals[i]; all at once by default) to
    the end; every sample's answer and each request's metrics, by request id."""
    arrivals = arrivals or [0] * len(requests)
    pending = sorted(((when, i) for i, when in enumerate(arrivals)), reverse=True)
    outputs: dict[str, dict[int, tuple[list[int], list]]] = {}
    metrics: dict[str, RequestMetrics] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[-1][0] <= step:
            request_id, prompt, params = requests[pending.pop()[1]]
            engine.add_request(request_id, prompt, params)
        for delta in engine.step():
            metrics[delta.request_id] = delta.metrics
            for sample in delta.outputs:
                tokens, logprobs = outputs.setdefault(delta.request_id, {}).setdefault(
                    sample.index, ([], [])
                )
                tokens.extend(sample.token_ids)
                logprobs.extend(sample.logprobs or [])
        engine.manager.check_invariants()
        step += 1
    answered = {
        request_id: [
            (
                tuple(tokens),
                tuple(tuple(sorted((t, lp.logprob) for t, lp in entry.items())) for entry in lps),
            )
            for _, (tokens, lps) in sorted(samples.items())
        ]
        for request_id, samples in outputs.items()
    }
    return answered, metrics


def alone(model: str, params: SamplingParams, **settings: Any) -> list[Answer]:
    """The oracle: the target request by itself."""
    engine = engine_for(model, **{**ALONE, **settings})
    return answers(engine, [("target", TARGET_PROMPT, params)])[0]["target"]


def crowd(count: int, seed: int, shared: list[int] | None = None):
    """`count` other requests: random prompts (some sharing a prefix with the target's, so the
    prefix cache serves them or the target), greedy and sampled, n 1 to 3."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        prompt = random_prompt(rng.randint(1, 60), seed=rng.randrange(10**6))
        if shared is not None and rng.random() < 0.5:
            prompt = shared[: rng.randint(1, len(shared))] + prompt
        params = SamplingParams(
            n=rng.choice([1, 1, 2, 3]),
            temperature=rng.choice([0.0, 1.0]),
            max_tokens=rng.randint(1, 40),
            ignore_eos=True,
            seed=rng.choice([None, index]),
        )
        requests.append((f"other{index}", prompt, params))
    return requests


def busy(
    model: str, params: SamplingParams, *, others: int, seed: int, **settings: Any
) -> list[Answer]:
    """The target's answer in `busy_run`."""
    return busy_run(model, params, others=others, seed=seed, **settings)[0]


def busy_run(
    model: str, params: SamplingParams, *, others: int, seed: int, **settings: Any
) -> tuple[list[Answer], RequestMetrics, Engine]:
    """The target's answer and metrics after `others` requests, arriving while they run, with
    a warm-up copy of its prompt first so the prefix cache (when on) serves most of it; and the
    engine that ran them."""
    requests = crowd(others, seed, shared=TARGET_PROMPT)
    warm = ("warm", TARGET_PROMPT[:40], SamplingParams(max_tokens=2, ignore_eos=True))
    # Last in the queue, so the scheduler's preemption (youngest first) reaches it.
    requests = [warm, *requests, ("target", TARGET_PROMPT, params)]
    rng = random.Random(seed)
    arrivals = sorted(rng.randint(0, 4) for _ in requests)  # the target last, at step 4
    engine = engine_for(model, **settings)
    answered, metrics = answers(engine, requests, arrivals)
    return answered["target"], metrics["target"], engine


# Settings that each change how the target's tokens are grouped or where its K/V come from,
# with the crowd's seed. The schedule does not depend on the tokens a model picks (every
# request ignores EOS), so in the small-pool cases the target itself is preempted for every
# model (see test_preemption_cases_really_preempt_the_target).
CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "batched": (1, dict(num_gpu_blocks=256, enable_prefix_caching=False)),
    "chunks-of-16": (
        2,
        dict(num_gpu_blocks=256, enable_prefix_caching=False, max_num_batched_tokens=16),
    ),
    "prefix-cache": (
        3,
        dict(num_gpu_blocks=256, enable_prefix_caching=True, max_num_batched_tokens=24),
    ),
    "swap": (7, dict(num_gpu_blocks=32, preemption_mode="swap", enable_prefix_caching=False)),
    "recompute": (
        3,
        dict(num_gpu_blocks=32, preemption_mode="recompute", enable_prefix_caching=True),
    ),
    "host-tier": (8, dict(num_gpu_blocks=32, enable_prefix_caching=True, kv_offloading_size=0.01)),
}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_every_family(engine_zoo: TinyZoo, family: str, kv_cache_dtype: str) -> None:
    """Each family, float32: the target's greedy answer in every case equals its answer alone,
    and so does each of n = 3 greedy forks."""
    model = str(engine_zoo.folder(family))
    expected = alone(model, GREEDY, kv_cache_dtype=kv_cache_dtype)
    for case, (seed, case_settings) in CASES.items():
        got = busy(
            model, GREEDY, others=12, seed=seed, kv_cache_dtype=kv_cache_dtype, **case_settings
        )
        assert got == expected, f"{family} {kv_cache_dtype}: {case}"
    forks = SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    seed, swap = CASES["swap"]
    got = busy(model, forks, others=12, seed=seed, kv_cache_dtype=kv_cache_dtype, **swap)
    assert got == expected * 3, f"{family} {kv_cache_dtype}: greedy forks"


def weight_format(engine_zoo, tiny_gguf, weights: str) -> tuple[str, dict[str, Any]]:
    """The tiny Llama in `weights` (float32, bfloat16, int8, int4 or gguf-<type>, a GGUF file
    kept in its own blocks under "auto"): the model to load and the engine settings."""
    import gguf

    if weights.startswith("gguf-"):
        qtype = getattr(gguf.GGMLQuantizationType, weights.removeprefix("gguf-"))
        return str(tiny_gguf("llama", qtype=qtype)), {}
    model = str(engine_zoo.folder("llama"))
    if weights == "float32":
        return model, {}
    return model, {"dtype": weights} if weights == "bfloat16" else {"quantization": weights}


# fp8 KV stores the activations, whatever weight format made them: the quantised formats
# compute float32 activations, as float32 weights do, so fp8 runs beside each activation dtype.
@pytest.mark.parametrize(
    ("weights", "kv_cache_dtype"),
    [
        *((weights, "auto") for weights in ("int8", "int4", "gguf-Q4_0", "gguf-Q8_0")),
        *((weights, kv) for weights in ("float32", "bfloat16") for kv in ("auto", "fp8")),
    ],
)
def test_every_weight_format(engine_zoo, tiny_gguf, weights: str, kv_cache_dtype: str) -> None:
    """Llama in every weight format (GGUF files kept in their own blocks under "auto"):
    greedy and seeded n = 2 sampling, in every case, equal the request alone."""
    model, options = weight_format(engine_zoo, tiny_gguf, weights)
    options["kv_cache_dtype"] = kv_cache_dtype
    seeded = dataclasses.replace(SEEDED, n=2)
    for params in (GREEDY, seeded):
        expected = alone(model, params, **options)
        for case, (seed, case_settings) in CASES.items():
            got = busy(model, params, others=12, seed=seed, **options, **case_settings)
            assert got == expected, f"{weights} {kv_cache_dtype}: {case}, {params}"


def test_preemption_cases_really_preempt_the_target(engine_zoo) -> None:
    """The small-pool cases do what they are named for: the target itself is swapped out or
    recomputed (else the equalities above would prove less than they say)."""
    model = str(engine_zoo.folder("llama"))
    for case in ("swap", "recompute", "host-tier"):
        seed, case_settings = CASES[case]
        _, metrics, _ = busy_run(model, GREEDY, others=12, seed=seed, **case_settings)
        assert metrics.num_swap_preemptions + metrics.num_recompute_preemptions > 0, case


@hypothesis_settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    others=st.integers(0, 40),
    budget=st.sampled_from([8, 16, 24, 64, 2048]),
    blocks=st.sampled_from([32, 40, 64, 256]),
    preemption=st.sampled_from(["swap", "recompute"]),
    prefix_caching=st.booleans(),
    host_tier=st.booleans(),
    quantization=st.sampled_from(["none", "int8", "int4"]),
    seed=st.integers(0, 2**16),
)
def test_random_batches(
    engine_zoo, others, budget, blocks, preemption, prefix_caching, host_tier, quantization, seed
) -> None:
    """Random crowds, chunk budgets, pool sizes and preemption modes: the target's greedy and
    seeded answers equal its answers alone."""
    model = str(engine_zoo.folder("mistral" if seed % 2 else "qwen2"))
    engine_settings = dict(
        num_gpu_blocks=blocks,
        max_num_batched_tokens=budget,
        preemption_mode=preemption,
        enable_prefix_caching=prefix_caching,
        kv_offloading_size=0.01 if host_tier and prefix_caching else 0.0,
        quantization=quantization,
    )
    for params in (GREEDY, SEEDED):
        expected = alone(model, params, quantization=quantization)
        got = busy(model, params, others=others, seed=seed, **engine_settings)
        assert got == expected, f"{engine_settings} {params}"


@pytest.mark.slow
def test_the_builtin_model(builtin_gguf) -> None:
    """The built-in model (SmolLM2-135M-Instruct, kept quantised): the same chat twice through
    `LLM.chat` gives the same answer, the second served from the prefix cache (the case this
    guarantee was written for), and the target request's answer in small chunks, beside a
    crowd and after recompute preemption equals its answer alone."""
    llm = LLM(DEFAULT_MODEL, num_gpu_blocks=256)
    conversation = [{"role": "user", "content": "Name three rivers of Europe and their seas."}]
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)
    first, second = (llm.chat(conversation, params, use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.outputs[0].logprobs == first.outputs[0].logprobs
    expected = alone(DEFAULT_MODEL, GREEDY)
    for case in ("chunks-of-16", "prefix-cache", "recompute"):
        seed, case_settings = CASES[case]
        assert busy(DEFAULT_MODEL, GREEDY, others=8, seed=seed, **case_settings) == expected, case
