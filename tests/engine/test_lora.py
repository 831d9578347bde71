"""Multi-LoRA serving: greedy output equals transformers + peft with the adapter merged.

Adapters are made by peft itself (`init_lora_weights=False`: random A and B, so every adapter
changes the output), saved with `save_pretrained` as PEFT folders, and served from the KV
pool's blocks. The oracle is peft's `merge_and_unload()`: transformers' own model with each
adapter folded into its weights, its logits taken teacher-forced over the engine's tokens, so a
near tie of a random model can never make the test flaky: every token the engine chose must be
transformers' argmax, or within `TIE` of it.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from pagedkv.engine import (
    BeamSearchParams,
    LoRARejected,
    LoRARequest,
    RequestRejected,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedkv.kvmath.lora import plan_lora
from pagedkv.kvmath.spec import KVSpec
from tests.engine.conftest import make_engine, make_llm, run_to_completion
from tests.engine.test_beam_search import MIN_MARGIN, assert_same_beams, reference_beam_search
from tests.hub_cache import cache_repo, commit_of
from tests.model.tiny_models import random_prompt

peft = pytest.importorskip("peft")

TIE = 1e-4
MAX_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, targets, extra LoraConfig settings) of each adapter the tests make.
ADAPTERS = {
    "all": (8, 16, ALL_TARGETS, {}),
    "attention": (4, 8, ["q_proj", "v_proj"], {}),
    "mlp-rslora": (16, 4, ["gate_proj", "up_proj", "down_proj"], {"use_rslora": True}),
    "patterned": (
        6,
        12,
        ["k_proj", "o_proj", "down_proj"],
        {"rank_pattern": {"o_proj": 2}, "alpha_pattern": {"down_proj": 3}},
    ),
}


def make_adapter(zoo, name: str, kind: str, folder: Path) -> Path:
    """A random PEFT LoRA adapter of `kind` for tiny model `name`, saved in `folder`."""
    rank, alpha, targets, extra = ADAPTERS[kind]
    torch.manual_seed(zlib.crc32(kind.encode()))  # hash() of a str changes from run to run
    base = zoo.hf(name).__class__.from_pretrained(zoo.folder(name), dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **extra
    )
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # peft's random B is small: make each adapter matter
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


def merged_logits(zoo, name: str, adapter: Path | None, tokens: list[int]) -> torch.Tensor:
    """transformers' logits at every position with `adapter` merged into the weights."""
    model = zoo.hf(name).__class__.from_pretrained(zoo.folder(name), dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with torch.no_grad():
        return model.eval()(torch.tensor([tokens])).logits[0]


def assert_greedy(zoo, name: str, adapter: Path | None, prompt: list[int], output: list[int]):
    logits = merged_logits(zoo, name, adapter, prompt + output)
    for step, token in enumerate(output):
        row = logits[len(prompt) - 1 + step]
        assert row.max() - row[token] <= TIE, (
            f"token {step}: the engine chose {token}, transformers+peft {int(row.argmax())} "
            f"({float(row.max() - row[token]):.3g} above it)"
        )


@pytest.fixture(scope="module")
def adapters(engine_zoo, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        (name, kind): make_adapter(engine_zoo, name, kind, root / f"{name}-{kind}")
        for name in ("llama", "qwen3")
        for kind in ADAPTERS
    }


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_each_adapter_alone_matches_peft_merged(engine_zoo, adapters, name):
    llm = make_llm(engine_zoo, name, enable_lora=True, max_loras=2, max_lora_rank=16)
    prompt = random_prompt(23, seed=3)
    for index, kind in enumerate(ADAPTERS, start=1):
        folder = adapters[(name, kind)]
        lora = LoRARequest(kind, index, str(folder))
        [output] = llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=lora)
        assert_greedy(engine_zoo, name, folder, prompt, list(output.outputs[0].token_ids))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_a_batch_mixing_three_adapters_and_base_requests(engine_zoo, adapters, name):
    """Requests of 3 adapters and of none, in one batch: each row gets its own adapter, and
    each output is what that request gives alone (batch invariance extends to adapters)."""
    kinds = ["all", "attention", "mlp-rslora"]
    loras = [LoRARequest(kind, i, str(adapters[(name, kind)])) for i, kind in enumerate(kinds, 1)]
    prompts = [random_prompt(length, seed=length) for length in (9, 40, 17, 33, 5, 21, 60, 12)]
    chosen = [loras[i % 4] if i % 4 < 3 else None for i in range(len(prompts))]
    llm = make_llm(engine_zoo, name, enable_lora=True, max_loras=3, max_lora_rank=16)
    requests = [{"prompt_token_ids": prompt} for prompt in prompts]
    together = llm.generate(requests, GREEDY, lora_request=chosen)
    for prompt, lora, output in zip(prompts, chosen, together, strict=True):
        tokens = list(output.outputs[0].token_ids)
        folder = None if lora is None else Path(lora.lora_path)
        assert_greedy(engine_zoo, name, folder, prompt, tokens)
        [alone] = llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=lora)
        assert list(alone.outputs[0].token_ids) == tokens
        assert alone.outputs[0].cumulative_logprob == output.outputs[0].cumulative_logprob
        assert output.lora_request is lora and alone.lora_request is lora  # vLLM's field
        assert output.outputs[0].lora_request is lora  # and its CompletionOutput's


def test_a_draft_model_leaves_adapter_outputs_unchanged(engine_zoo, adapters):
    """Adapter and base requests in one batch, drafted by a draft model: the same tokens and
    logprobs as without speculation. The draft model drafts with its own weights (no adapter
    of the model is one of its), and the model verifies each row with that row's adapter."""
    name = "llama"
    lora = LoRARequest("all", 1, str(adapters[(name, "all")]))
    prompts = [random_prompt(length, seed=length) for length in (14, 31, 22)]
    chosen = [lora, None, lora]
    requests = [{"prompt_token_ids": prompt} for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=2, ignore_eos=True)
    spec = {"model": str(engine_zoo.folder(name)), "num_speculative_tokens": 3}

    def run(**speculation):
        llm = make_llm(engine_zoo, name, enable_lora=True, max_lora_rank=16, **speculation)
        outputs = llm.generate(requests, params, lora_request=chosen)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], llm

    expected, _ = run()
    got, llm = run(speculative_config=spec)
    assert got == expected
    assert llm.engine.scheduler.drafts.stats.num_accepted_tokens > 0  # the base request's


def test_a_pool_smaller_than_every_adapter_finishes_everything(engine_zoo, adapters):
    """Four adapters, room for about one beside the KV it needs: requests queue, idle adapters
    are evicted (LRU), and every request still finishes with its own adapter's output."""
    kinds = list(ADAPTERS)
    loras = [
        LoRARequest(kind, i, str(adapters[("llama", kind)])) for i, kind in enumerate(kinds, 1)
    ]
    probe = make_engine(engine_zoo, "llama", enable_lora=True)
    largest = max(probe.loras.resolve(lora)[1] for lora in loras)
    engine = make_engine(
        engine_zoo, "llama", enable_lora=True, max_loras=4, num_gpu_blocks=largest + 12
    )
    prompts = [random_prompt(30 + 7 * i, seed=i) for i in range(8)]
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, GREEDY, lora_request=loras[index % 4])
    tokens: dict[str, list[int]] = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    assert engine.adapters.num_evictions > 0
    for index, prompt in enumerate(prompts):
        folder = Path(loras[index % 4].lora_path)
        assert_greedy(engine_zoo, "llama", folder, prompt, tokens[str(index)])
    # Only the idle adapters remain: every other block is free again.
    assert (
        engine.manager.num_free_blocks == engine.manager.num_gpu_blocks - engine.adapters.num_blocks
    )


def llama_loras(adapters) -> list[LoRARequest]:
    return [
        LoRARequest(kind, i, str(adapters[("llama", kind)])) for i, kind in enumerate(ADAPTERS, 1)
    ]


def assert_only_held_adapters_take_memory(engine) -> None:
    """The worker's host copies are the catalog's, resident adapters are among them, and every
    block no resident adapter holds is free (nothing runs)."""
    held = engine.list_loras()
    assert set(engine.runner.lora_registry) == held and set(engine.adapters.resident) <= held
    free = engine.manager.num_gpu_blocks - engine.adapters.num_blocks
    assert engine.manager.num_free_blocks == free


def test_host_copies_are_bounded_by_max_cpu_loras(engine_zoo, adapters):
    """vLLM's max_cpu_loras: adapters named one after another never pile up on the host. With
    room for two, the least recently named idle one is forgotten (its blocks too), and one
    named again is read again, giving the same output."""
    loras = llama_loras(adapters)
    llm = make_llm(
        engine_zoo, "llama", enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=16
    )
    prompt = {"prompt_token_ids": random_prompt(15, seed=8)}
    first = {}
    for lora in loras:
        [output] = llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)
        first[lora.lora_int_id] = output.outputs[0].token_ids
        assert lora.lora_int_id in llm.engine.list_loras()
        assert_only_held_adapters_take_memory(llm.engine)
    assert llm.engine.list_loras() == {3, 4}
    [again] = llm.generate([prompt], GREEDY, lora_request=loras[0], use_tqdm=False)
    assert again.outputs[0].token_ids == first[1]
    assert llm.engine.list_loras() == {1, 4}
    assert_only_held_adapters_take_memory(llm.engine)


def test_adapters_in_use_are_kept_past_the_bound(engine_zoo, adapters):
    """Four requests with four adapters at once, room for one on the host: none is forgotten
    while its request waits or runs, each output is its adapter's, one is left after."""
    loras = llama_loras(adapters)
    engine = make_engine(engine_zoo, "llama", enable_lora=True, max_lora_rank=16)
    prompts = [random_prompt(12 + i, seed=i) for i in range(len(loras))]
    for index, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(str(index), prompt, GREEDY, lora_request=lora)
    assert engine.list_loras() == {1, 2, 3, 4}
    tokens: dict[str, list[int]] = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
        waiting = {r.lora_id for r in engine.scheduler.waiting} | {
            r.lora_id for r in engine.scheduler.running
        }
        assert waiting <= engine.list_loras()
    for index, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        assert_greedy(engine_zoo, "llama", Path(lora.lora_path), prompt, tokens[str(index)])
    assert len(engine.list_loras()) == 1
    assert_only_held_adapters_take_memory(engine)


def test_remove_lora_forgets_an_adapter_once_no_request_uses_it(engine_zoo, adapters):
    """vLLM's `remove_lora`: an adapter a request runs with stays until the request ends, then
    its weights and blocks go; an idle one goes at once; `add_lora` reads one ahead."""
    first, second = llama_loras(adapters)[:2]
    engine = make_engine(engine_zoo, "llama", enable_lora=True, max_loras=2, max_lora_rank=16)
    prompt = random_prompt(20, seed=4)
    engine.add_request("a", prompt, GREEDY, lora_request=first)
    steps = [engine.step()]
    assert engine.remove_lora(first.lora_int_id) and first.lora_int_id in engine.list_loras()
    steps += run_to_completion(engine)
    tokens = [token for deltas in steps for delta in deltas for token in delta.outputs[0].token_ids]
    assert_greedy(engine_zoo, "llama", Path(first.lora_path), prompt, tokens)
    assert engine.list_loras() == set() and not engine.adapters.resident
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks
    assert not engine.remove_lora(first.lora_int_id)
    assert engine.add_lora(second) and engine.list_loras() == {second.lora_int_id}
    assert engine.remove_lora(second.lora_int_id) and engine.list_loras() == set()


def test_prefix_cache_is_keyed_by_adapter(engine_zoo, adapters):
    """The same prompt under two adapters never shares KV blocks; under one it does."""
    engine = make_engine(engine_zoo, "llama", enable_lora=True, max_loras=2)
    prompt = random_prompt(64, seed=9)
    first = LoRARequest("all", 1, str(adapters[("llama", "all")]))
    second = LoRARequest("attention", 2, str(adapters[("llama", "attention")]))
    cached = []
    for request_id, lora in (("a", first), ("b", second), ("c", first), ("d", None)):
        engine.add_request(request_id, prompt, GREEDY, lora_request=lora)
        for deltas in run_to_completion(engine):
            for delta in deltas:
                if delta.finished:
                    cached.append(delta.num_cached_tokens)
    assert cached == [0, 0, 48, 0]


def test_no_cache_salt_reaches_another_adapters_blocks(engine_zoo, adapters):
    """A salt chosen to look like an adapter's key (the salt and id once joined as text) finds
    none of that adapter's blocks, and the base model's answer is its own."""
    engine = make_engine(engine_zoo, "llama", enable_lora=True)
    prompt = random_prompt(64, seed=9)
    lora = LoRARequest("all", 1, str(adapters[("llama", "all")]))
    runs = [
        ("adapter", None, lora),
        ("salted-base", "\x00lora:1", None),
        ("salted-adapter", "x", lora),
        ("joined-salt", "x\x00lora:1", None),
        ("json-salt", "[null, 1]", None),
        ("json-key", json.dumps([None, 1, lora.lora_name, lora.lora_path]), None),
        ("base", None, None),
    ]
    cached, tokens = {}, {}
    for request_id, salt, adapter in runs:
        engine.add_request(request_id, prompt, GREEDY, lora_request=adapter, cache_salt=salt)
        for deltas in run_to_completion(engine):
            for delta in deltas:
                tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
                if delta.finished:
                    cached[delta.request_id] = delta.num_cached_tokens
    assert cached == {name: 0 for name, _, _ in runs}
    base_like = ("salted-base", "joined-salt", "json-salt", "json-key")
    assert all(tokens[name] == tokens["base"] for name in base_like)


def test_an_id_given_again_to_another_adapter_gets_none_of_the_old_ones_kv(engine_zoo, adapters):
    """Once the engine has forgotten an adapter (`remove_lora`, or `max_cpu_loras`), its id
    may name another: the prefix cache serves the new one none of the old one's blocks, and
    its answer is its own (an engine that never saw the first)."""
    first, second = llama_loras(adapters)[:2]
    reused = LoRARequest(second.lora_name, first.lora_int_id, second.lora_path)
    prompt = {"prompt_token_ids": random_prompt(48, seed=6)}

    def llm():
        return make_llm(engine_zoo, "llama", enable_lora=True, max_loras=2, max_lora_rank=16)

    [expected] = llm().generate([prompt], GREEDY, lora_request=reused, use_tqdm=False)
    engine_llm = llm()
    engine_llm.generate([prompt], GREEDY, lora_request=first, use_tqdm=False)
    assert engine_llm.engine.remove_lora(first.lora_int_id)
    [output] = engine_llm.generate([prompt], GREEDY, lora_request=reused, use_tqdm=False)
    assert output.num_cached_tokens == 0
    assert output.outputs[0].token_ids == expected.outputs[0].token_ids


def test_an_adapter_load_of_a_failed_step_is_written_by_a_later_one(
    engine_zoo, adapters, monkeypatch
):
    """The worker writes an adapter's weights after the step's memory plan; a step failing in
    the plan never wrote them. The adapter stays resident, so a later step writes them:
    later requests with it are its merged model's answers."""
    from pagedkv.engine.errors import StepFailed

    lora = llama_loras(adapters)[0]
    engine = make_engine(engine_zoo, "llama", enable_lora=True, max_lora_rank=16)
    real_execute = engine.runner.kv_cache.execute
    failed = []

    def execute(plan):
        if not failed:
            failed.append(plan)
            raise RuntimeError("out of memory in the plan")
        return real_execute(plan)

    monkeypatch.setattr(engine.runner.kv_cache, "execute", execute)
    prompt = random_prompt(12, seed=2)
    engine.add_request("failed", prompt, GREEDY, lora_request=lora)
    with pytest.raises(StepFailed):
        engine.step()
    [aborted] = engine.step()  # a step with nothing to compute: it reports the abort
    assert aborted.outputs[0].finish_reason == "abort"
    for request_id in ("later", "again"):
        engine.add_request(request_id, prompt, GREEDY, lora_request=lora)
        tokens = [
            token
            for deltas in run_to_completion(engine)
            for delta in deltas
            if delta.request_id == request_id
            for token in delta.outputs[0].token_ids
        ]
        assert_greedy(engine_zoo, "llama", Path(lora.lora_path), prompt, tokens)


def test_llm_beam_search_takes_the_adapter_where_vllm_does(engine_zoo, adapters):
    """`LLM.beam_search(prompts, params, lora_request)`: the beams of the merged model."""
    folder = adapters[("llama", "all")]
    model = engine_zoo.hf("llama").__class__.from_pretrained(
        engine_zoo.folder("llama"), dtype=torch.float32
    )
    merged = peft.PeftModel.from_pretrained(model, folder).merge_and_unload().eval()

    def next_logprobs(tokens) -> torch.Tensor:
        with torch.no_grad():
            return merged(torch.tensor([list(tokens)])).logits[0, -1].double().log_softmax(-1)

    params = BeamSearchParams(beam_width=2, max_tokens=8)
    prompt = random_prompt(19, seed=4)
    expected, margin = reference_beam_search(next_logprobs, prompt, params)
    assert margin > MIN_MARGIN, f"case hinges on a near-tie ({margin:.2e}): choose another"
    llm = make_llm(engine_zoo, "llama", enable_lora=True)
    [output] = llm.beam_search([prompt], params, LoRARequest("all", 1, str(folder)))
    assert_same_beams(output.sequences, prompt, expected)


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "mode"), [("fcfs", "recompute"), ("priority", "swap")])
def test_a_waiting_request_pins_no_adapter(engine_zoo, adapters, policy, mode):
    """Two adapters cannot both stay resident beside one request at full length, though each
    request fits beside its own: a preempted or not-yet-fitting request must let go of its
    adapter, or the request ahead of it can never make room and nothing runs again (the
    engine stalled before). Every request finishes, each with its adapter's greedy tokens."""
    loras = [
        LoRARequest(kind, index, str(adapters[("llama", kind)]))
        for index, kind in enumerate(["all", "attention"], 1)
    ]
    probe = make_engine(engine_zoo, "llama", enable_lora=True)
    small = min(probe.loras.resolve(lora)[1] for lora in loras)
    large = max(probe.loras.resolve(lora)[1] for lora in loras)
    spare = 3
    needed = spare + 1 + small // 2  # blocks of one request at full length
    engine = make_engine(
        engine_zoo,
        "llama",
        enable_lora=True,
        max_loras=2,
        num_gpu_blocks=small + large + spare,
        block_size=16,
        enable_prefix_caching=False,
        preemption_mode=mode,
        scheduling_policy=policy,
    )
    prompts = [random_prompt(20, seed=index) for index in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=needed * 16 - 20, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params, lora_request=loras[index % 2])
    tokens: dict[str, list[int]] = {}
    for _ in range(20 * params.max_tokens):
        if not engine.has_unfinished():
            break
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
        engine.manager.check_invariants()
    assert not engine.has_unfinished(), "the engine stalled"
    for index, prompt in enumerate(prompts):
        assert len(tokens[str(index)]) == params.max_tokens
        folder = Path(loras[index % 2].lora_path)
        assert_greedy(engine_zoo, "llama", folder, prompt, tokens[str(index)][:8])


def test_bad_adapters_are_clear_errors_and_touch_nothing(engine_zoo, adapters, tmp_path):
    engine = make_engine(engine_zoo, "llama", enable_lora=True, max_lora_rank=8)
    engine.add_request("running", random_prompt(10, seed=1), GREEDY)
    good = adapters[("llama", "attention")]
    malformed = tmp_path / "malformed"
    malformed.mkdir()
    (malformed / "adapter_config.json").write_text("{not json")
    biased = tmp_path / "biased"  # peft's lora_bias=True: B carries a bias we cannot add
    biased.mkdir()
    settings = json.loads((adapters[("llama", "attention")] / "adapter_config.json").read_text())
    (biased / "adapter_config.json").write_text(json.dumps(dict(settings, lora_bias=True)))
    big_rank = adapters[("llama", "mlp-rslora")]  # rank 16 > max_lora_rank 8
    other_model = adapters[("qwen3", "all")]  # qwen3's heads are 32 wide, llama's 16
    cases = {
        LoRARequest("missing", 1, str(tmp_path / "nowhere")): "no such folder",
        LoRARequest("malformed", 2, str(malformed)): "is not JSON",
        LoRARequest("biased", 6, str(biased)): "lora_bias=True is not supported",
        LoRARequest("big", 3, str(big_rank)): "above max_lora_rank 8",
        LoRARequest("ok", 5, str(good)): None,
        LoRARequest("reused-id", 5, str(big_rank)): "one id, one adapter",
        LoRARequest("zero", 0, str(good)): "lora_int_id must be an integer >= 1",
        LoRARequest("other", 4, str(other_model)): "another base model",
    }
    for lora, message in cases.items():
        if message is None:
            engine.add_request(lora.lora_name, random_prompt(8, seed=2), GREEDY, lora_request=lora)
            continue
        with pytest.raises(LoRARejected, match=message):
            engine.add_request(lora.lora_name, random_prompt(8, seed=2), GREEDY, lora_request=lora)
    finished = {d.request_id for deltas in run_to_completion(engine) for d in deltas if d.finished}
    assert finished == {"running", "ok"}
    plain = make_engine(engine_zoo, "llama")
    with pytest.raises(LoRARejected, match="enable_lora"):
        plain.add_request("x", [1, 2, 3], GREEDY, lora_request=LoRARequest("ok", 1, str(good)))


def test_the_planner_states_the_blocks_the_engine_takes(engine_zoo, adapters):
    """`pagedkv plan --lora-rank 8` (kvmath/lora.py, from config.json alone) and the engine
    (from the adapter's tensors) agree on an adapter's blocks."""
    engine = make_engine(engine_zoo, "llama", enable_lora=True)
    _, blocks = engine.loras.resolve(LoRARequest("all", 1, str(adapters[("llama", "all")])))
    config = json.loads((engine_zoo.folder("llama") / "config.json").read_text())
    spec = KVSpec.from_hf_config(config, "fp32")
    assert plan_lora(config, spec, rank=8, max_loras=1, block_size=16).blocks_per_adapter == blocks


def test_the_one_call_decode_adds_the_same_products(engine_zoo, adapters, monkeypatch):
    """On quantised weights a step runs the layers in one C call, which adds the LoRA products
    itself (kernels/decode_layer.c): outputs and logprobs equal the op-by-op path's, bit for bit,
    in a batch mixing adapters and base requests."""
    from pagedkv.attention.backend import CPUAttention
    from pagedkv.model import fused_decode

    kinds = ["all", "patterned", "mlp-rslora"]
    loras = [LoRARequest(k, i, str(adapters[("llama", k)])) for i, k in enumerate(kinds, 1)]
    prompts = [{"prompt_token_ids": random_prompt(n, seed=n)} for n in (7, 30, 19, 44, 3)]
    chosen = [loras[0], None, loras[1], loras[2], loras[0]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)

    def run() -> list:
        llm = make_llm(engine_zoo, "llama", enable_lora=True, max_loras=3, quantization="int8")
        outputs = llm.generate(prompts, params, lora_request=chosen)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    fused_with_lora = []
    original = CPUAttention.decode_layers

    def counting(self, *args, **kwargs):
        fused_with_lora.append(kwargs.get("lora", args[5] if len(args) > 5 else None))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CPUAttention, "decode_layers", counting)
    fused = run()
    assert any(lora is not None for lora in fused_with_lora), "no step took the C decode"
    monkeypatch.setattr(fused_decode.LayerPath, "takes_step", lambda self, hidden, context: False)
    assert run() == fused


def test_an_adapter_named_by_repo_id_is_read_from_the_hugging_face_cache(
    engine_zoo, adapters, tmp_path, monkeypatch
):
    """vLLM's lora_path may be a Hub repo id: the repo's folder in the local Hugging Face cache
    is the adapter (greedy output as PEFT's merged model gives); one the cache lacks is named."""
    folder = adapters[("llama", "attention")]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cache_repo(tmp_path / "hub", "org/lora", {commit_of("a"): folder}, {"main": commit_of("a")})
    llm = make_llm(engine_zoo, "llama", enable_lora=True, max_lora_rank=16)
    prompt = random_prompt(23, seed=3)
    hub = LoRARequest("hub", 1, "org/lora")
    [output] = llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=hub)
    assert_greedy(engine_zoo, "llama", folder, prompt, list(output.outputs[0].token_ids))
    absent = LoRARequest("absent", 2, "org/absent")
    with pytest.raises(LoRARejected, match="nor a repo in the Hugging Face cache"):
        llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=absent)
    (tmp_path / "hub" / "models--org--lora" / "refs" / "main").write_text("../../outside")
    broken = LoRARequest("broken", 3, "org/lora")
    with pytest.raises(LoRARejected, match="holds '../../outside', not a commit hash"):
        llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=broken)
    cache_repo(tmp_path / "hub", "org/part", {commit_of("p"): folder}, {"main": commit_of("p")})
    snapshot = tmp_path / "hub" / "models--org--part" / "snapshots" / commit_of("p")
    (snapshot / "adapter_model.safetensors").unlink()  # a download of some files only
    part = LoRARequest("part", 4, "org/part")
    fetch = f"`hf download org/part adapter_model.safetensors --revision {commit_of('p')}`"
    with pytest.raises(LoRARejected, match="has no adapter_model.safetensors") as lacking:
        llm.generate([{"prompt_token_ids": prompt}], GREEDY, lora_request=part)
    assert str(lacking.value).endswith(fetch)


class Full(Exception):
    """A caller's limit (a server's queue cap) refusing every request."""


def refuse() -> None:
    raise Full


def test_a_request_the_callers_limit_refuses_loads_and_compiles_nothing(engine_zoo, adapters):
    """`admit` is asked after the request's own checks and before its adapter is read or its
    grammar compiled: a request it refuses leaves the adapter catalog and the grammar cache
    as they were, while one that is bad in itself is refused for that, not by the limit."""
    engine = make_engine(engine_zoo, "llama", enable_lora=True, max_lora_rank=16)
    schema = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}}
    )
    params = SamplingParams(max_tokens=4, structured_outputs=schema)
    with pytest.raises(Full):
        engine.add_request(
            "a",
            random_prompt(5, seed=1),
            params,
            lora_request=llama_loras(adapters)[0],
            admit=refuse,
        )
    assert engine.list_loras() == set() and len(engine.grammars._cache) == 0
    bad = SamplingParams(max_tokens=4, stop_token_ids=[engine.config.vocab_size])
    with pytest.raises(RequestRejected, match="stop_token_ids"):
        engine.add_request("b", random_prompt(5, seed=1), bad, admit=refuse)
    engine.add_request("c", random_prompt(5, seed=1), params, lora_request=llama_loras(adapters)[0])
    assert engine.list_loras() == {1} and len(engine.grammars._cache) == 1
