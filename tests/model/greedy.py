"""A tiny greedy driver for tests: KVCacheManager decides, KVCache moves bytes, model computes.

Not the engine (that is a later issue): no scheduler, no sampling, no preemption policy. It
exists so tests can drive the model through exactly the seam the engine will use: allocate ->
forward -> mark_computed, append / swap_out / swap_in -> KVCache.execute(plan), fork, free.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.memory import KVCacheManager, MemoryPlan
from pagedkv.model.decoder import DecoderModel
from pagedkv.worker.kv_cache import KVCache

# `between_steps(step, next_tokens) -> ids of sequences it added`; see `decode`.
BetweenSteps = Callable[[int, dict[Hashable, int]], Iterable[Hashable]]


class GreedyRunner:
    """Sequences in a paged cache, advanced one forward pass at a time."""

    def __init__(
        self,
        model: DecoderModel,
        *,
        block_size: int,
        num_blocks: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        max_chunk: int | None = None,
    ) -> None:
        self.model = model
        self.manager = KVCacheManager(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching)
        self.cache = KVCache.for_model(
            model, block_size=block_size, num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks
        )
        self.max_chunk = max_chunk  # split prompts into chunks of at most this many tokens
        self.tokens: dict[Hashable, list[int]] = {}
        self.num_computed: dict[Hashable, int] = {}
        self.swapped: set[Hashable] = set()
        self.num_forwards = 0

    def add(self, seq_id: Hashable, prompt: Sequence[int]) -> int:
        """Allocate a prompt; returns the number of leading tokens found in the prefix cache."""
        num_cached = self.manager.allocate(seq_id, prompt)
        self.tokens[seq_id] = list(prompt)
        self.num_computed[seq_id] = num_cached
        return num_cached

    def step(self, seq_ids: Iterable[Hashable] | None = None) -> dict[Hashable, int]:
        """One forward over the given (default: all resident) sequences' uncomputed tokens.

        Returns the greedy next token of every sequence whose tokens are now all computed
        (nothing, without a forward pass, when no chosen sequence has tokens to compute).
        """
        chosen = [
            seq_id
            for seq_id in (self.tokens if seq_ids is None else seq_ids)
            if seq_id not in self.swapped and self.num_computed[seq_id] < len(self.tokens[seq_id])
        ]
        if not chosen:
            return {}
        inputs = []
        for seq_id in chosen:
            start = self.num_computed[seq_id]
            end = len(self.tokens[seq_id])
            if self.max_chunk is not None:
                end = min(end, start + self.max_chunk)
            inputs.append(
                SequenceInput(
                    self.tokens[seq_id][start:end], start, self.manager.block_table(seq_id)
                )
            )
        batch = ForwardBatch.build(inputs, self.manager.block_size)
        logits = self.model(batch, self.cache)
        self.num_forwards += 1
        next_tokens = {}
        for row, (seq_id, seq_input) in enumerate(zip(chosen, inputs, strict=True)):
            self.num_computed[seq_id] += len(seq_input.token_ids)
            self.manager.mark_computed(seq_id, self.num_computed[seq_id])
            if self.num_computed[seq_id] == len(self.tokens[seq_id]):
                next_tokens[seq_id] = int(logits[row].argmax())
        return next_tokens

    def append(self, seq_id: Hashable, token: int) -> MemoryPlan:
        """Add a token to compute next step, copying a shared last block first (CoW)."""
        plan = self.manager.append(seq_id, [token])
        self.cache.execute(plan)
        self.tokens[seq_id].append(token)
        return plan

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares the parent's blocks and tokens."""
        self.manager.fork(parent_id, child_id)
        self.tokens[child_id] = list(self.tokens[parent_id])
        self.num_computed[child_id] = self.num_computed[parent_id]

    def swap_out(self, seq_id: Hashable) -> MemoryPlan:
        """Move the sequence's KV to the CPU swap space; returns the plan it executed."""
        plan = self.manager.swap_out(seq_id)
        self.cache.execute(plan)
        self.swapped.add(seq_id)
        return plan

    def swap_in(self, seq_id: Hashable) -> MemoryPlan:
        """Bring the sequence's KV back into (possibly different) device blocks."""
        plan = self.manager.swap_in(seq_id)
        self.cache.execute(plan)
        self.swapped.discard(seq_id)
        return plan

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's blocks."""
        self.manager.free(seq_id)
        self.swapped.discard(seq_id)
        del self.tokens[seq_id], self.num_computed[seq_id]


def generate(
    runner: GreedyRunner,
    prompts: Mapping[Hashable, Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Collection[int] = (),
) -> dict[Hashable, list[int]]:
    """Greedy-generate for all prompts in one running batch; returns each one's new tokens."""
    for seq_id, prompt in prompts.items():
        runner.add(seq_id, prompt)
    return decode(runner, list(prompts), max_new_tokens, eos_token_ids)


def decode(
    runner: GreedyRunner,
    seq_ids: Sequence[Hashable],
    max_new_tokens: int,
    eos_token_ids: Collection[int] = (),
    between_steps: BetweenSteps | None = None,
) -> dict[Hashable, list[int]]:
    """Run the sequences (prompt chunks first) until each has `max_new_tokens` new tokens or
    hits an end-of-sequence id, then free it; returns each one's new tokens.

    `between_steps(step, next_tokens)`, when given, runs after each forward pass and before
    its tokens are appended, where a scheduler would act. It may swap sequences out and in, and
    add or fork sequences: it returns the ids of those it added, to run from then on, and puts a
    forked child's first token into `next_tokens`. The token of a sequence it swapped out is
    appended once the sequence is back.
    """
    outputs: dict[Hashable, list[int]] = {seq_id: [] for seq_id in seq_ids}
    running = dict.fromkeys(seq_ids)  # ordered, so batches are laid out the same every run
    held_back: dict[Hashable, int] = {}
    step = idle_steps = 0
    while running:
        for seq_id in [seq_id for seq_id in held_back if seq_id not in runner.swapped]:
            runner.append(seq_id, held_back.pop(seq_id))
        num_forwards = runner.num_forwards
        next_tokens = runner.step(running)
        if between_steps is not None:
            for seq_id in between_steps(step, next_tokens):
                outputs.setdefault(seq_id, [])
                running[seq_id] = None
        for seq_id, token in next_tokens.items():
            outputs[seq_id].append(token)
            if token in eos_token_ids or len(outputs[seq_id]) == max_new_tokens:
                del running[seq_id]
                runner.free(seq_id)
            elif seq_id in runner.swapped:
                held_back[seq_id] = token
            else:
                runner.append(seq_id, token)
        idle_steps = 0 if runner.num_forwards > num_forwards else idle_steps + 1
        if idle_steps > 100:
            raise RuntimeError(f"nothing ran for 100 steps: {list(running)} stay swapped out")
        step += 1
    return outputs
