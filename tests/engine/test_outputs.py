"""Stops, streaming text, parallel sampling, seeds and aborts, checked through the engine."""

from __future__ import annotations

import pytest

from pagedkv.engine import SamplingParams
from tests.engine.conftest import make_engine, make_llm, run_to_completion
from tests.model.tiny_models import random_prompt

PROMPT = random_prompt(40, seed=4)


@pytest.fixture(scope="module")
def llm(engine_zoo):
    return make_llm(engine_zoo, "llama")


def greedy(llm, max_tokens=24, **extra):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)
    return llm.generate([PROMPT], params)[0].outputs[0]


def test_max_tokens_ends_with_length(llm):
    out = greedy(llm, max_tokens=7)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_id_ends_output_at_that_token(llm):
    full = greedy(llm).token_ids
    stop = full[5]
    out = greedy(llm, stop_token_ids=[stop])
    end = full.index(stop)
    assert out.token_ids == full[: end + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == llm.get_tokenizer().decode(full[:end])


def test_stop_string_cuts_text_before_it_even_across_tokens(llm):
    tokenizer = llm.get_tokenizer()
    full = greedy(llm)
    # A stop string that starts inside one token's text and ends inside a later one.
    pieces = [tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    boundary = next(i for i in range(4, len(pieces)) if len(pieces[i - 1]) >= 2)
    start = len(pieces[boundary - 1]) - 1
    stop = full.text[start : start + 3]
    assert len(stop) == 3 and "\ufffd" not in stop
    out = greedy(llm, stop=[stop, "never-appears"])
    assert out.text == full.text[: full.text.find(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_streamed_pieces_join_to_the_final_text_with_multibyte_characters(engine_zoo):
    engine = make_engine(engine_zoo, "llama")
    tokenizer = engine.tokenizer
    emoji = tokenizer.encode("Ünïcödé and emoji 🙂", add_special_tokens=False)
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3, n=3)
    for index in range(6):  # random tokens of a byte-level vocabulary split characters often
        engine.add_request(str(index), emoji + random_prompt(5, seed=index), params)
    pieces: dict[tuple[str, int], list[str]] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            for out in delta.outputs:
                pieces.setdefault((delta.request_id, out.index), []).append(out.text)
                tokens.setdefault((delta.request_id, out.index), []).extend(out.token_ids)
    held_back = 0
    for key, texts in pieces.items():
        # The decoded tokens, less a last character they leave incomplete (vLLM never emits it)
        final = tokenizer.decode(tokens[key], skip_special_tokens=True).rstrip("\ufffd")
        assert "".join(texts) == final
        held_back += sum(1 for t in texts if t == "")
    assert held_back > 0  # some steps did hold back an incomplete character


def test_n_4_at_temperature_1_shares_the_prompt_blocks_and_differs(engine_zoo):
    engine = make_engine(engine_zoo, "llama")
    prompt = random_prompt(40, seed=8)  # two full blocks and a partial third
    engine.add_request("r", prompt, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=1))
    engine.step()  # prefill, fork, first tokens
    engine.step()  # each sample appends: the partial block is copied for all but one
    held = engine.manager.num_gpu_blocks - engine.manager.num_free_blocks
    assert held == 2 + 4  # unshared, four samples would hold 4 x 3 = 12
    outputs = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            for out in delta.outputs:
                outputs.setdefault(out.index, []).extend(out.token_ids)
    assert len({tuple(tokens) for tokens in outputs.values()}) > 1


def test_seeded_sampling_reproduces_across_runs_and_batch_mixes(engine_zoo):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1234)
    noise = SamplingParams(temperature=1.0, max_tokens=20)

    def run(companions: int) -> list[int]:
        engine = make_engine(engine_zoo, "llama")
        for index in range(companions):
            engine.add_request(f"other{index}", random_prompt(10 + index, seed=index), noise)
        engine.add_request("seeded", PROMPT, params)
        tokens = []
        for deltas in run_to_completion(engine):
            for delta in deltas:
                if delta.request_id == "seeded":
                    tokens.extend(delta.outputs[0].token_ids)
        return tokens

    alone = run(0)
    assert run(0) == alone
    assert run(5) == alone


def test_abort_mid_run_frees_blocks_at_once_and_reports_abort(engine_zoo):
    engine = make_engine(engine_zoo, "llama")
    params = SamplingParams(temperature=0.0, max_tokens=30)
    for index in range(3):
        engine.add_request(str(index), random_prompt(50, seed=index), params)
    for _ in range(3):
        engine.step()
    held_before = engine.manager.num_gpu_blocks - engine.manager.num_free_blocks
    engine.abort("1")
    held_after = engine.manager.num_gpu_blocks - engine.manager.num_free_blocks
    assert held_after == held_before - 4  # 50 prompt + 3 tokens: 4 blocks of 16
    engine.manager.check_invariants()
    finished = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            if delta.finished:
                finished[delta.request_id] = delta.outputs[0].finish_reason
    assert finished == {"1": "abort", "0": "length", "2": "length"}
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks


def test_cache_salt_keeps_prefix_blocks_apart(engine_zoo):
    engine = make_engine(engine_zoo, "llama")
    prompt = random_prompt(70, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    outputs, cached = {}, {}
    for request_id, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")):
        engine.add_request(request_id, prompt, params, cache_salt=salt)
        for deltas in run_to_completion(engine):
            for delta in deltas:
                outputs.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
                cached[delta.request_id] = delta.metrics.num_cached_tokens
    assert outputs["a"] == outputs["b"] == outputs["c"]
    # Only "c" found blocks: the four full ones "a" (the same tenant) left in the cache.
    assert cached == {"a": 0, "b": 0, "c": 64}


def test_llm_reads_a_prompt_dicts_cache_salt(engine_zoo):
    """vLLM's `{"prompt_token_ids": ..., "cache_salt": ...}`: the salt keeps blocks apart."""
    llm = make_llm(engine_zoo, "llama")
    prompt = random_prompt(70, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    cached = [
        llm.generate({"prompt_token_ids": prompt, "cache_salt": salt}, params, use_tqdm=False)[
            0
        ].num_cached_tokens
        for salt in ("tenant-1", "tenant-2", "tenant-1", None)
    ]
    assert cached == [0, 0, 64, 0]
    with pytest.raises(ValueError, match="cache_salt is str '', expected a non-empty str"):
        llm.generate({"prompt": "hi", "cache_salt": ""}, params, use_tqdm=False)


def test_kv_snapshot_names_every_holder_of_every_block(engine_zoo):
    engine = make_engine(engine_zoo, "llama")
    prompt = random_prompt(40, seed=8)  # two full blocks and a partial third
    engine.add_request("r", prompt, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1))
    engine.step()  # prefill and fork: both samples hold all three blocks
    snapshot = engine.kv_snapshot()
    held = [block for block in snapshot.gpu if block.ref_count > 0]
    assert len(held) == 3 and all(block.ref_count == 2 for block in held)
    for block in held:
        assert sorted(block.holders) == [
            ("r", 0, block.holders[0][2]),
            ("r", 1, block.holders[0][2]),
        ]
    assert sorted(b.holders[0][2] for b in held) == [0, 1, 2]
    assert [b.cached for b in sorted(held, key=lambda b: b.holders[0][2])] == [True, True, False]
    # Swapped out, the same request is found in the CPU pool instead.
    request = engine.scheduler.running[0]
    plan = engine.scheduler.manager.swap_out(request.sequences[0].seq_id)
    engine.kv_cache.execute(plan)
    snapshot = engine.kv_snapshot()
    on_cpu = [block for block in snapshot.cpu if block.ref_count > 0]
    assert sorted(b.holders[0] for b in on_cpu) == [("r", 0, 0), ("r", 0, 1), ("r", 0, 2)]
    assert snapshot.to_dict()["cpu"][on_cpu[0].block_id]["holders"] == [list(on_cpu[0].holders[0])]


def test_stats_count_prompt_and_generated_tokens(engine_zoo):
    engine = make_engine(engine_zoo, "llama", enable_prefix_caching=False)
    prompts = [random_prompt(length, seed=length) for length in (3, 17, 40)]
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, SamplingParams(max_tokens=5, ignore_eos=True, n=2))
    for _ in run_to_completion(engine):
        pass
    stats = engine.stats
    assert stats.prompt_tokens_total == 3 + 17 + 40  # each prompt computed once, then forked
    assert stats.generation_tokens_total == 3 * 2 * 5
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
    assert stats.kv_usage == 0.0


def test_the_queue_gauges_count_requests_whatever_their_samples(engine_zoo):
    """Running, waiting and swapped count requests alike (an n = 4 request is one of each),
    so their sum is the number of requests in flight."""
    engine = make_engine(engine_zoo, "llama", max_num_seqs=4)
    params = SamplingParams(max_tokens=6, ignore_eos=True, n=4, temperature=1.0)
    for request_id in ("first", "second"):
        engine.add_request(request_id, random_prompt(9, seed=3), params)
    engine.step()  # the first takes the four seats; the second waits for them
    stats = engine.stats
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (1, 1, 0)
    for _ in run_to_completion(engine):
        pass


def test_chat_renders_the_template_and_answers_each_conversation(llm):
    conversations = [
        [{"role": "user", "content": "Hello world"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paged?"}],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    chats = llm.chat(conversations, params)
    tokenizer = llm.get_tokenizer()
    # The tiny template: <s><|user|>\nHello world</s>\n<|assistant|>\n
    assert tokenizer.decode(chats[0].prompt_token_ids, skip_special_tokens=False) == (
        "<s><|user|>\nHello world</s>\n<|assistant|>\n"
    )
    direct = llm.generate([c.prompt_token_ids for c in chats], params)
    assert [c.outputs[0].token_ids for c in chats] == [d.outputs[0].token_ids for d in direct]
    single = llm.chat(conversations[0], params)
    assert single[0].outputs[0].token_ids == chats[0].outputs[0].token_ids
