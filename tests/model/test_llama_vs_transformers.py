"""Our paged model computes what transformers computes, whatever the paging does underneath.

Every tiny architecture (Llama, Llama 3 rope scaling, linear rope scaling with biases, Mistral
with a 16-token sliding window, Qwen2 with biases, tied embeddings and a windowed layer) is
checked on logits (1e-4, float32) and on greedy tokens against transformers, through prefix
cache hits, copy-on-write forks and swapping. Sequences run well past the sliding windows
(16, 24) and the Llama 3 model's 32-token pre-training context.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.tokenizer import Tokenizer
from pagedkv.worker.kv_cache import KVCache
from tests.model.greedy import GreedyRunner, decode, generate
from tests.model.tiny_models import TINY_MODELS, random_prompt

ARCHITECTURES = list(TINY_MODELS)
PROMPT_LENGTHS = [5, 17, 33, 64, 100, 150, 231, 300]
BLOCK_SIZES = [1, 16, 32]
NEW_TOKENS = 16


def blocks_needed(lengths: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in lengths)


def eos_ids(zoo, name: str) -> tuple[int, ...]:
    """The ids that stop generation, as our tokenizer reads them from generation_config.json."""
    return Tokenizer.from_folder(zoo.folder(name)).eos_token_ids


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_logits_match_for_prefill_and_32_decode_steps(zoo, name):
    model = zoo.ours(name)
    block_size = 16
    prompt_lens = [5, 40, 90]
    sequences = [random_prompt(n, seed) for seed, n in enumerate(prompt_lens)]
    assert max(prompt_lens) + 32 > 3 * 32  # past every window and the 32-token context
    cache = KVCache.for_model(model.config, block_size=block_size, num_blocks=32)
    # Deliberately scattered, non-contiguous block tables.
    tables = [
        list(range(31 - i, -1, -3))[: -(-(n + 32) // block_size)] for i, n in enumerate(prompt_lens)
    ]
    inputs = [SequenceInput(list(s), 0, t) for s, t in zip(sequences, tables, strict=True)]
    steps = []
    for _ in range(33):  # the prefill, then 32 decode steps
        logits = model(ForwardBatch.build(inputs, block_size), cache)
        steps.append(logits)
        for seq, token in zip(sequences, logits.argmax(-1).tolist(), strict=True):
            seq.append(token)
        inputs = [
            SequenceInput([s[-1]], len(s) - 1, t) for s, t in zip(sequences, tables, strict=True)
        ]

    ours = torch.stack(steps, dim=1)  # [num_seqs, 33, vocab_size]
    for i, (seq, n) in enumerate(zip(sequences, prompt_lens, strict=True)):
        # transformers, without a cache, over the whole sequence: row p predicts token p + 1.
        expected = zoo.hf_logits(name, seq[:-1])[n - 1 :]
        torch.testing.assert_close(ours[i], expected, atol=1e-4, rtol=0, msg=f"sequence {i}")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_batch_matches_generate(zoo, name, block_size):
    prompts = {f"req{i}": random_prompt(n, seed=100 + i) for i, n in enumerate(PROMPT_LENGTHS)}
    eos = eos_ids(zoo, name)
    num_blocks = blocks_needed([n + NEW_TOKENS for n in PROMPT_LENGTHS], block_size)
    # Prompts enter in chunks of at most 64 tokens, so most steps mix prompt chunks of the
    # long requests with decode tokens of the short ones.
    runner = GreedyRunner(
        zoo.ours(name), block_size=block_size, num_blocks=num_blocks, max_chunk=64
    )

    outputs = generate(runner, prompts, NEW_TOKENS, eos)

    for seq_id, prompt in prompts.items():
        assert outputs[seq_id] == zoo.hf_greedy(name, tuple(prompt), NEW_TOKENS), seq_id
    assert runner.manager.num_free_blocks == num_blocks


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_prefix_cache_hits_read_earlier_requests_blocks(zoo, name, block_size):
    runner = GreedyRunner(
        zoo.ours(name),
        block_size=block_size,
        num_blocks=SHARED_PREFIX_BLOCKS[block_size],
        max_chunk=64,
    )

    prompts, outputs, hits, expected_hits = run_shared_prefix_requests(runner, eos_ids(zoo, name))

    assert hits == expected_hits
    # Every late request hits: blocks of a running request, of a finished one still cached,
    # blocks holding generated tokens. Only the 5-token one needs 1-token blocks to share one.
    assert all(hits[seq_id] > 0 for seq_id in LATE if seq_id != "a5" or block_size == 1)
    for seq_id, prompt in prompts.items():
        assert outputs[seq_id] == zoo.hf_greedy(name, tuple(prompt), NEW_TOKENS), seq_id
    assert runner.manager.stats.evictions == 0  # so `expected_hits` is exact
    assert runner.manager.num_free_blocks == runner.manager.num_gpu_blocks


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_prefix_caching_changes_no_output(zoo, name, block_size):
    eos = eos_ids(zoo, name)
    runs = {}
    for enabled in (False, True):
        runner = GreedyRunner(
            zoo.ours(name),
            block_size=block_size,
            num_blocks=SHARED_PREFIX_BLOCKS[block_size],
            enable_prefix_caching=enabled,
            max_chunk=64,
        )
        runs[enabled] = run_shared_prefix_requests(runner, eos)
        hit_tokens = runner.manager.stats.prefix_hit_tokens
        assert hit_tokens > 0 if enabled else hit_tokens == 0

    (prompts_off, outputs_off, _, _), (prompts_on, outputs_on, _, _) = runs[False], runs[True]
    assert prompts_on == prompts_off
    assert outputs_on == outputs_off


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_forked_children_diverge_with_copy_on_write(zoo, name, block_size):
    prompts = {f"p{n}": random_prompt(n, seed=300 + n) for n in (5, 37, 64, 150, 300)}
    # child: (parent, forked when the parent has produced this many tokens), as n > 1 sampling
    # forks right after the prompt (1) and beam-style branching does later on.
    forks = {
        "p5.1": ("p5", 1),
        "p5.2": ("p5", 1),  # one partial block shared three ways: two copies
        "p37.1": ("p37", 3),
        "p64.1": ("p64", 1),  # 64 tokens fill whole blocks: nothing to copy
        "p150.1": ("p150", 5),
        "p300.1": ("p300", 1),
        "p300.2": ("p300", 9),
    }
    parents = [parent for parent, _ in forks.values()]
    lengths = [len(prompts[seq_id]) + NEW_TOKENS for seq_id in [*prompts, *parents]]
    runner = GreedyRunner(
        zoo.ours(name),
        block_size=block_size,
        num_blocks=blocks_needed(lengths, block_size),
        max_chunk=64,
    )
    forked_from: dict[str, list[int]] = {}  # child: the tokens it shares with its parent
    expected_copies = 0

    def fork_children(step, next_tokens):
        nonlocal expected_copies
        children = []
        for child, (parent, k) in forks.items():
            shared = runner.tokens.get(parent, [])
            if parent in next_tokens and len(shared) == len(prompts[parent]) + k - 1:
                runner.fork(parent, child)
                # The child takes a token of its own where the parent takes the greedy one.
                next_tokens[child] = 3 if next_tokens[parent] != 3 else 4
                forked_from[child] = list(shared)
                expected_copies += len(shared) % block_size != 0  # a shared partial last block
                children.append(child)
        return children

    for seq_id, prompt in prompts.items():
        runner.add(seq_id, prompt)
    outputs = decode(runner, list(prompts), NEW_TOKENS, eos_ids(zoo, name), fork_children)

    assert set(forked_from) == set(forks)
    for seq_id, prompt in prompts.items():
        assert outputs[seq_id] == zoo.hf_greedy(name, tuple(prompt), NEW_TOKENS), seq_id
    for child, shared in forked_from.items():
        first, *rest = outputs[child]
        assert rest == zoo.hf_greedy(name, (*shared, first), NEW_TOKENS - 1), child
    assert runner.manager.stats.cow_copies == expected_copies
    assert expected_copies == (0 if block_size == 1 else 6)
    assert runner.manager.num_free_blocks == runner.manager.num_gpu_blocks


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_swapped_out_sequences_continue_identically_after_swap_in(zoo, name, block_size):
    prompts = {f"req{i}": random_prompt(n, seed=100 + i) for i, n in enumerate(PROMPT_LENGTHS)}
    final_blocks = blocks_needed([n + NEW_TOKENS for n in PROMPT_LENGTHS], block_size)
    runner = GreedyRunner(
        zoo.ours(name),
        block_size=block_size,
        num_blocks=final_blocks,
        num_cpu_blocks=final_blocks,
        max_chunk=64,
    )
    # step: swaps after that step's forward pass. Prompts enter 64 tokens a step, so req7
    # (300 tokens) leaves mid-prompt at step 1 and mid-decode at step 10; the others leave
    # while decoding. An intruder then overwrites every free block, so swap_in must copy; at
    # steps 7-8 full blocks of req5 and req0 are still cached, so swap_in reuses them.
    swaps = {
        1: [("out", "req7"), ("out", "req2")],
        2: [("intruder", None)],
        4: [("in", "req2")],
        5: [("out", "req5"), ("out", "req0")],
        7: [("in", "req7"), ("in", "req5")],
        8: [("in", "req0")],
        10: [("out", "req4"), ("out", "req7")],
        11: [("intruder", None)],
        12: [("in", "req4"), ("in", "req7")],
    }

    swapped_out = []

    def swap(step, next_tokens):
        for action, seq_id in swaps.get(step, []):
            # A sequence that met end-of-sequence early is gone: nothing to swap.
            if action == "out" and seq_id in runner.tokens:
                runner.swap_out(seq_id)
                swapped_out.append(seq_id)
            elif action == "in" and seq_id in runner.swapped:
                runner.swap_in(seq_id)
            elif action == "intruder":
                fill_free_blocks_with_other_kv(runner, seed=step)
        return []

    for seq_id, prompt in prompts.items():
        runner.add(seq_id, prompt)
    outputs = decode(runner, list(prompts), NEW_TOKENS, eos_ids(zoo, name), swap)

    for seq_id, prompt in prompts.items():
        assert outputs[seq_id] == zoo.hf_greedy(name, tuple(prompt), NEW_TOKENS), seq_id
    assert len(swapped_out) >= 6
    # Blocks still cached on the device come back without a copy (req5, req0 at steps 7-8).
    stats = runner.manager.stats
    assert 0 < stats.blocks_swapped_in < stats.blocks_swapped_out
    assert not runner.swapped
    runner.manager.check_invariants()
    assert runner.manager.num_free_blocks == final_blocks
    assert runner.manager.num_free_cpu_blocks == final_blocks


# -- helpers ---------------------------------------------------------------------------------

# Requests that arrive while earlier ones run, each sharing a prefix with an earlier one.
LATE = ("a300_twin", "a200", "a5", "a200_ext", "b_cont", "c_again")
SHARED_PREFIX_BLOCKS = {
    block_size: blocks_needed(
        [n + NEW_TOKENS for n in (300, 150, 64, 300, 240, 5, 280, 180, 97)], block_size
    )
    for block_size in BLOCK_SIZES
}


def run_shared_prefix_requests(runner: GreedyRunner, eos: tuple[int, ...]):
    """Nine requests of 5 to 300 tokens; six arrive later, sharing prefixes of earlier ones.

    Returns the prompts, outputs, prefix-cache hits and hits expected: every full block of the
    longest prefix a request shares with tokens already computed (prompt or generated, by a
    running or a finished request), leaving at least one token to compute.
    """
    a300 = random_prompt(300, seed=200)
    prompts = {
        "a300": a300,
        "b150": random_prompt(150, seed=201),
        "c64": random_prompt(64, seed=202),
    }
    # step: requests arriving after that step's forward pass. a300's prompt is all computed at
    # step 4 (64 tokens a step); c64 finishes and is freed at step 15, its blocks still cached.
    arrivals = {
        4: lambda: {
            "a300_twin": list(a300),
            "a200": a300[:200] + random_prompt(40, seed=203),
            "a5": a300[:5],
        },
        8: lambda: {"a200_ext": prompts["a200"][:230] + random_prompt(50, seed=204)},
        12: lambda: {"b_cont": runner.tokens["b150"] + random_prompt(20, seed=205)},
        18: lambda: {"c_again": prompts["c64"] + random_prompt(33, seed=206)},
    }
    computed: dict[str, list[int]] = {}  # each request's computed tokens, kept once freed
    hits: dict[str, int] = {}
    expected_hits: dict[str, int] = {}

    def admit(step, next_tokens):
        computed.update(
            {
                seq_id: tokens[: runner.num_computed[seq_id]]
                for seq_id, tokens in runner.tokens.items()
            }
        )
        new = arrivals[step]() if step in arrivals else {}
        for seq_id, prompt in new.items():
            expected_hits[seq_id] = 0
            if runner.manager.enable_prefix_caching:
                shared = max(common_prefix_len(prompt, tokens) for tokens in computed.values())
                block_size = runner.manager.block_size
                expected_hits[seq_id] = min(shared, len(prompt) - 1) // block_size * block_size
            hits[seq_id] = runner.add(seq_id, prompt)
            prompts[seq_id] = prompt
        return list(new)

    for seq_id, prompt in prompts.items():
        runner.add(seq_id, prompt)
    outputs = decode(runner, list(prompts), NEW_TOKENS, eos, admit)
    assert set(hits) == set(LATE)
    return prompts, outputs, hits, expected_hits


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def fill_free_blocks_with_other_kv(runner: GreedyRunner, seed: int) -> None:
    """Compute a random prompt over every free block (evicting any cached), then free it."""
    block_size = runner.manager.block_size
    runner.add("intruder", random_prompt(runner.manager.num_free_blocks * block_size, seed))
    assert runner.manager.num_free_blocks == 0
    while runner.num_computed["intruder"] < len(runner.tokens["intruder"]):
        runner.step(["intruder"])
    runner.free("intruder")
