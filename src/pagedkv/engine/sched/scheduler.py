"""Scheduler: which sequences run this step, how many tokens each, and who gives way.

(Over 400 lines: one step's whole decision, admission, preemption and update, in one place.)

One token budget per step (`max_num_batched_tokens`) is shared by everything, as in vLLM v1:
there are no separate prefill and decode phases. Each step:
1. running requests, oldest first: each live sequence gets its next tokens (one for a
   decode, a chunk for a prompt), with budget kept back so every running decode gets a token;
   when a sequence cannot get a block, the policy's victim is preempted (swapped to the CPU
   pool when it fits there and swap is on, else freed to be recomputed) and its chunks of
   this step, if it had any, are taken back;
2. swapped requests, in the policy's order, when nothing was preempted this step;
3. waiting requests, in the policy's order, when nothing is swapped, while the pool keeps a
   watermark of free blocks (so admitting does not force a preemption on the next decode).
   No one is preempted from here on, so the full blocks the step's chunks will compute are
   published to the prefix cache first (`mark_scheduled`), and again after each admission:
   prompts admitted together share their common prefix from the first step (vLLM V1's rule).
   A new request whose structured-output grammar still compiles waits apart (`compiling`)
   and joins the waiting queue once it is ready, so it holds up no one behind it.
After the step has run, `update` consumes what it produced (`ModelRunnerOutput`: the tokens
the engine sampled from logits, or the simulator made up) and calls nobody back: it counts the
chunks computed, forks the samples of prompts that just finished, appends each sampled token
and applies the stops, then frees finished samples and retires finished requests.
The memory (`KVMemory`: the paged `KVCacheManager`, or the simulator's slab) decides where
tokens live. The scheduler asks it for slots chunk by chunk (`allocate_slots`, None when they
do not fit) and every move it plans goes into one ordered `MemoryPlan` the runner executes
before the forward pass. The scheduler owns each sequence's computed count and tells the memory
(`mark_computed`). The runner keeps the block tables; each chunk carries only the change to its
sequence's table, and `dropped` names the tables to forget. `SchedulerOutput` is plain data.

Speculative decoding's drafts verify in a decode's chunk, in lookahead slots that
`DraftSlots` (`drafts.py`) reserves, settles and gives back.

With LoRA adapters (`memory/adapters.py`), a request is admitted only once its adapter is
resident in the pool (loaded into a run of free blocks if it is not) and its KV fits too; it
holds the adapter until it leaves. Idle adapters give their blocks back when KV needs them,
before anyone is preempted.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from pagedkv.engine.request import Request, RequestStatus, Sequence
from pagedkv.engine.sched.beams import advance_beams
from pagedkv.engine.sched.config import SchedulerConfig
from pagedkv.engine.sched.drafts import DraftSlots
from pagedkv.engine.sched.kv_memory import KVMemory
from pagedkv.engine.sched.output import ModelRunnerOutput
from pagedkv.engine.sched.policy import make_policy
from pagedkv.engine.stops import append_sampled
from pagedkv.memory import Allocation, MemoryPlan
from pagedkv.memory.adapters import AdapterBlocks
from pagedkv.worker.step import ScheduledChunk, SchedulerOutput

# Blocks kept free when admitting, as a share of the pool (at least one block).
WATERMARK_FRACTION = 0.01
# When only compiling grammars are left, a step waits this long for one (rather than spin).
COMPILE_WAIT_S = 0.01

SeqId = tuple[str, int]


class Scheduler:
    """Queues of requests over one `KVMemory`; `schedule()` builds each step, `update()`
    records what the runner computed."""

    def __init__(
        self, manager: KVMemory, config: SchedulerConfig, adapters: AdapterBlocks | None = None
    ) -> None:
        self.manager = manager
        self.adapters = adapters
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.preemption_mode = config.preemption_mode
        self.policy = make_policy(config.policy)
        self.watermark_blocks = max(1, int(manager.num_gpu_blocks * WATERMARK_FRACTION))
        self.waiting = self.policy.new_queue()
        self.running: list[Request] = []  # in admission order
        self.swapped = self.policy.new_queue()
        # New requests whose grammar still compiles, in arrival order: queued once it is ready.
        self.compiling: list[Request] = []
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        self._arrivals = itertools.count()
        self._dropped: list[SeqId] = []  # tables the runner must forget, sent with the next step
        # The step `schedule` was building when it raised, for the engine to take back.
        self.interrupted: InterruptedStep | None = None
        # Moves of draft reservations made by `update`, run with the next step.
        self.drafts = DraftSlots(manager, self.watermark_blocks, config.num_speculative_tokens)
        # Tokens the last step added to outputs: drafts past a stop are not among them.
        self.last_step_tokens = 0

    # -- queues ----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request (behind the waiting ones of its priority)."""
        self.policy.check_priority(request.priority)
        request.arrival_index = next(self._arrivals)
        request.status = RequestStatus.WAITING
        if request.grammar_ready:
            self.waiting.add(request)
        else:
            self.compiling.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of its queue and free every block its samples hold."""
        for queue in (self.waiting, self.running, self.swapped, self.compiling):
            if request in queue:
                queue.remove(request)
        for seq in request.sequences:
            self.free_sequence(seq)
        self._release_adapter(request)
        request.status = RequestStatus.FINISHED

    def free_sequence(self, seq: Sequence) -> None:
        """Release one sample's blocks (GPU or CPU) if it holds any."""
        if seq.seq_id in self.manager:
            self.manager.free(seq.seq_id)
            seq.num_computed = 0
            self.drafts.forget(seq)
            self._dropped.append(seq.seq_id)

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running or swapped."""
        return bool(self.waiting or self.running or self.swapped or self.compiling)

    @property
    def num_waiting(self) -> int:
        """Requests not admitted yet: queued, or waiting for their grammar."""
        return len(self.waiting) + len(self.compiling)

    # -- the step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks; preempt, resume and admit as the pool allows.

        If choosing raises part way (Ctrl-C, a bug), `interrupted` is the step built so far:
        its plan and published blocks promise KV no forward pass will write, and the engine
        takes them back as it does a failed step's, with every request whose blocks or queue
        it touched (a table change or cached count no chunk may carry yet, a victim between
        queues, a swap-in half recorded).
        """
        self._queue_compiled()
        num_decoding = sum(len(request.live_sequences) for request in self.running)
        step = _Step(self.max_num_batched_tokens, self.drafts.threshold(num_decoding))
        self.interrupted = None
        try:
            self._choose(step)
            if self.adapters is not None:
                step.output.adapters = self.adapters.take_changes()
        except BaseException:
            self.interrupted = InterruptedStep(step.output, step.touched)
            self._dropped += step.output.dropped  # preempted before it raised
            raise
        self._dropped += step.output.dropped
        if step.output.chunks or step.output.plan or step.output.adapters:  # the runner runs it
            step.output.dropped, self._dropped = self._dropped, []
        else:
            step.output.dropped = []
            if self.compiling:  # nothing runs: wait a moment for a grammar
                self.compiling[0].grammar.wait(COMPILE_WAIT_S)  # type: ignore[union-attr]
        return step.output

    def _choose(self, step: _Step) -> None:
        """The step's chunks, in order: running requests, swapped ones resumed, waiting ones
        admitted."""
        step.output.plan.extend(self.drafts.take_plan())
        # A request's decodes stay as counted here until its turn (or its preemption).
        running = [(request, self._num_decodes(request)) for request in self.running]
        step.decodes_after = sum(decodes for _, decodes in running)
        for request, decodes in running:
            if request.status is RequestStatus.RUNNING:
                step.decodes_after -= decodes
                self._schedule_running(request, step)
        if not step.output.preempted:
            while self.swapped and self._try_resume(self.swapped.peek(), step):
                self.swapped.pop()
        if not self.swapped and not step.output.preempted:
            self._publish(step)
            while self.waiting and self._try_admit(self.waiting.peek(), step):
                self.waiting.pop()
                self._publish(step)

    def _queue_compiled(self) -> None:
        """Requests whose grammar has compiled join the waiting queue (in arrival order)."""
        for request in [r for r in self.compiling if r.grammar_ready]:
            self.compiling.remove(request)
            self.waiting.add(request)

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Record an executed step; return the requests that sampled, in chunk order.

        Each chunk's tokens are counted computed (their full blocks may enter the prefix
        cache); a prompt that just finished forks its other samples (they share its blocks);
        each sampled token is appended and the stops applied. A chunk with drafts counts
        computed only its last token and the drafts kept, and gives back the slots of the rest.
        Finished samples free their blocks; a request whose samples all finished leaves the
        scheduler (status FINISHED). The others reserve slots for their next drafts.
        """
        self.manager.commit_scheduled()
        if result.step_seconds is not None:
            self.drafts.step_cost.record(
                output.num_batched_tokens, result.step_seconds, output.decodes_only
            )
        running = {request.request_id: request for request in self.running}
        touched: dict[str, Request] = {}
        verified: dict[SeqId, ScheduledChunk] = {}
        for chunk in output.chunks:
            request = running[chunk.seq_id[0]]
            seq = request.sequence(chunk.seq_id[1])
            if chunk.num_draft_tokens:
                verified[seq.seq_id] = chunk  # counted once its drafts are settled, below
            else:
                seq.num_computed = chunk.num_computed + len(chunk.token_ids)
                self.manager.mark_computed(seq.seq_id, seq.num_computed)
            if chunk.sample:
                touched[request.request_id] = request
        for request_id, entries in result.prompt_logprobs.items():
            running[request_id].prompt_logprobs.extend(entries)
        for request in touched.values():
            if not request.forked:  # all n samples drew from the prompt's logits
                self._fork(request)
        self.last_step_tokens = len(result.beam_candidates)  # a beam's row gives its beams one
        for seq_id, sampled in result.sampled.items():
            request = touched[seq_id[0]]
            seq = request.sequence(seq_id[1])
            num_kept = append_sampled(request, seq, sampled)
            self.last_step_tokens += num_kept
            chunk = verified.get(seq_id)
            if chunk is None:
                seq.acceptance.step_without_drafts()
            else:
                self.drafts.settle(seq, chunk, num_accepted=len(sampled) - 1, num_kept=num_kept)
        for request in touched.values():
            if request.beam is not None:
                advance_beams(request, result.beam_candidates, self.manager, self.free_sequence)
            for seq in request.sequences:
                if seq.finished:
                    self.free_sequence(seq)
                elif seq.seq_id in result.sampled:
                    self.drafts.reserve(request, seq, result.draft_token_ids.get(seq.seq_id, []))
            if request.all_samples_finished:
                self.remove(request)
        return list(touched.values())

    def _fork(self, request: Request) -> None:
        """The prompt is computed: samples 1..n-1 share sample 0's blocks."""
        first = request.sequences[0]
        for seq in request.forks:
            request.sequences.append(seq)  # first: an abort frees what the manager holds
            self.manager.fork(first.seq_id, seq.seq_id, seq.tokens)
            seq.num_computed = first.num_computed
        request.forks = []

    def _schedule_running(self, request: Request, step: _Step) -> None:
        chunks: list[ScheduledChunk] = []
        seqs = request.live_sequences
        for index, seq in enumerate(seqs):
            num_new = self._num_to_compute(seq)
            owed = step.decodes_after + len(seqs) - 1 - index
            if num_new > 1:  # a prompt chunk leaves budget for the decodes still to come
                num_new = min(num_new, step.budget - owed)
            num_new = min(num_new, step.budget)
            if num_new <= 0:
                continue
            # A decode verifies the drafts that pay (`acceptance.py`), as many as the budget
            # the decodes after it leave.
            drafts = seq.draft_token_ids if num_new == 1 else []
            drafts = drafts[: max(0, step.budget - 1 - owed)]
            if drafts:
                drafts = drafts[
                    : seq.acceptance.drafts_to_verify(step.draft_threshold, len(drafts))
                ]
            while (allocation := self._allocate(seq, num_new, step, len(drafts))) is None:
                if drafts:  # verify no drafts rather than preempt anyone for them
                    drafts = []
                    continue
                if self.adapters is not None and self.adapters.evict_idle():
                    continue  # an adapter no one uses gives way before any request
                victim = self.policy.victim(self.running)
                if self.running.index(victim) > self.running.index(request):
                    step.decodes_after -= self._num_decodes(victim)  # no longer owed a token
                self._preempt(victim, step)
                if victim is request:
                    step.budget += sum(len(chunk.token_ids) for chunk in chunks)
                    return
            chunks.append(self._chunk(request, seq, num_new, allocation, step.output.plan, drafts))
            step.budget -= num_new + len(drafts)
        step.num_seqs += len(chunks)
        step.output.chunks.extend(chunks)

    def _publish(self, step: _Step) -> None:
        """Offer the prefix cache the full blocks of the chunks scheduled since the last call
        (their tokens in the record, not drafts), for the prompts admitted after them; only
        while prompts wait, since only an admission looks them up."""
        if self.waiting:
            for chunk in step.output.chunks[step.num_published :]:
                num_tokens = chunk.num_computed + len(chunk.token_ids) - chunk.num_draft_tokens
                self.manager.mark_scheduled(chunk.seq_id, num_tokens)
        step.num_published = len(step.output.chunks)

    def _try_resume(self, request: Request, step: _Step) -> bool:
        """Swap a request back in if its adapter, its blocks and this step's tokens fit;
        schedule it."""
        if not self._hold_adapter(request):
            return False
        if not self._fits(request, step):
            self._release_adapter(request)  # only a running request pins its adapter
            return False
        step.touched.add(request.request_id)
        for seq in request.live_sequences:
            step.output.plan.extend(self.manager.swap_in(seq.seq_id))
        self._start(request, step, [])
        return True

    def _try_admit(self, request: Request, step: _Step) -> bool:
        """Allocate a waiting request's blocks (and load its adapter) if they fit with the
        watermark; schedule it."""
        if not self._hold_adapter(request):
            return False
        if not self._fits(request, step):
            self._release_adapter(request)  # only a running request pins its adapter
            return False
        allocations: list[Allocation] = []
        step.touched.add(request.request_id)
        for seq in request.live_sequences:
            allocation = self.manager.allocate_slots(
                seq.seq_id,
                seq.tokens,
                len(seq.tokens),
                cache_salt=request.cache_salt,
                read_cache=not request.scores_prompt,
                count_lookup=not request.metrics.num_recompute_preemptions,
            )
            if allocation is None:
                # Host-tier saves and copy-backs of the allocations made still run in this
                # step: saved blocks are registered in the tier, and copies into the freed
                # blocks match what the prefix cache says they hold.
                for done, made in zip(request.live_sequences, allocations, strict=False):
                    step.output.plan.extend(made.plan)
                    self.free_sequence(done)
                self._release_adapter(request)
                return False
            seq.num_computed = allocation.num_cached
            allocations.append(allocation)
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.monotonic()
            request.metrics.num_cached_tokens = allocations[-1].num_cached
        self._start(request, step, allocations)
        return True

    def _fits(self, request: Request, step: _Step) -> bool:
        """Room in this step for the request's samples and tokens, and in the pool for its
        blocks (all its tokens, with the watermark kept free while others run), idle LoRA
        adapters giving their blocks back if the pool alone is short."""
        seqs = request.live_sequences
        if step.num_seqs + request.num_samples_to_run > self.max_num_seqs:
            return False
        if step.budget < len(seqs):
            return False
        needed = sum(self._blocks_for(len(seq.token_ids)) for seq in seqs)
        while needed + self._watermark() > self.manager.num_free_blocks:
            if self.adapters is None or not self.adapters.evict_idle():
                return False
        return True

    def _start(self, request: Request, step: _Step, allocations: list[Allocation]) -> None:
        """A request that just got its blocks runs from this step on: every live sample with
        tokens to compute gets a chunk now (its `allocations` when it was just admitted, one
        per sample). A swapped-in beam search may have none for some beams: computed before
        the swap, they wait for the others' rows, as `_schedule_running` leaves them."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        seqs = request.live_sequences
        for index, seq in enumerate(seqs):
            # The caller checked a token per sample fits: keep one for each sample after this.
            num_new = min(self._num_to_compute(seq), step.budget - (len(seqs) - 1 - index))
            if num_new <= 0:
                continue
            allocation = allocations[index] if allocations else self._allocate(seq, num_new, step)
            assert allocation is not None, "the caller checked that the request's blocks fit"
            step.output.chunks.append(
                self._chunk(request, seq, num_new, allocation, step.output.plan)
            )
            step.budget -= num_new
            step.num_seqs += 1

    def _allocate(
        self, seq: Sequence, num_new: int, step: _Step, num_drafts: int = 0
    ) -> Allocation | None:
        """Slots for a held sample's next `num_new` tokens and `num_drafts` drafts after them
        (None: the pool cannot hold them)."""
        step.touched.add(seq.seq_id[0])
        return self.manager.allocate_slots(
            seq.seq_id, seq.tokens, seq.num_computed + num_new, num_lookahead_tokens=num_drafts
        )

    def _chunk(
        self,
        request: Request,
        seq: Sequence,
        num_new: int,
        allocation: Allocation,
        plan: MemoryPlan,
        drafts: list[int] | None = None,
    ) -> ScheduledChunk:
        """The chunk of a sample's next `num_new` tokens and its `drafts`, whose slots
        `allocation` made (its moves join the step's plan)."""
        drafts = drafts or []
        plan.extend(allocation.plan)
        num_computed = seq.num_computed
        end = num_computed + num_new
        sample = end == len(seq.tokens)
        # Rows that score prompt tokens not scored yet (a recompute never scores them twice).
        num_prompt = len(request.prompt_token_ids)
        scores_prompt = (
            request.scores_prompt
            and len(request.prompt_logprobs) < num_prompt
            and num_computed < num_prompt
        )
        return ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids[num_computed:end].tolist() + drafts,
            num_computed=num_computed,
            table_update=self.drafts.table_update(seq, allocation),
            sample=sample,
            num_logits=(num_new if scores_prompt else int(sample)) + len(drafts),
            num_draft_tokens=len(drafts),
            lora_id=request.lora_id,
        )

    def _hold_adapter(self, request: Request) -> bool:
        """Take a reference on the request's adapter (loading it if it is not resident);
        False if the pool has no room for it now. Only running requests hold one: a waiting
        or swapped request that pinned an adapter could keep the request ahead of it from
        ever loading its own."""
        if request.lora_id and not request.holds_adapter:
            assert self.adapters is not None, "the engine adds LoRA requests with adapters on"
            if self.adapters.acquire(request.lora_id, request.lora_blocks) is None:
                return False
            request.holds_adapter = True
        return True

    def _release_adapter(self, request: Request) -> None:
        """Drop the request's reference on its adapter: it stays resident, idle, until the
        pool needs its blocks."""
        if request.holds_adapter and self.adapters is not None:
            self.adapters.release(request.lora_id)
            request.holds_adapter = False

    def _preempt(self, request: Request, step: _Step) -> None:
        """Move the request's blocks to the CPU pool, or free them to be recomputed; either
        way it lets go of its adapter (it takes it again when it runs)."""
        seqs = request.live_sequences
        step.touched.add(request.request_id)  # between queues until the end
        self.running.remove(request)
        self._unschedule(request, step)
        self._release_adapter(request)
        for seq in seqs:  # its drafts are dropped: their slots go back before anything moves
            self.drafts.forget(seq, give_back=True)
        cpu_needed = sum(len(self.manager.block_table(seq.seq_id)) for seq in seqs)
        if self.preemption_mode == "swap" and cpu_needed <= self.manager.num_free_cpu_blocks:
            for seq in seqs:
                step.output.plan.extend(self.manager.swap_out(seq.seq_id))
                step.output.dropped.append(seq.seq_id)
            request.status = RequestStatus.SWAPPED
            self.swapped.add(request)
            request.metrics.num_swap_preemptions += 1
            self.num_swap_preemptions += 1
            step.output.preempted.append((request.request_id, "swap"))
            return
        for seq in seqs:
            self.manager.free(seq.seq_id)
            seq.num_computed = 0
            step.output.dropped.append(seq.seq_id)
        request.status = RequestStatus.WAITING
        self.waiting.add_preempted(request)
        request.metrics.num_recompute_preemptions += 1
        self.num_recompute_preemptions += 1
        step.output.preempted.append((request.request_id, "recompute"))

    def _unschedule(self, request: Request, step: _Step) -> None:
        """Take back the chunks a victim was given earlier in this step (under "priority" it
        may have run before the request that needs its blocks) with their budget."""
        ids = {seq.seq_id for seq in request.sequences}
        taken = [chunk for chunk in step.output.chunks if chunk.seq_id in ids]
        if not taken:
            return
        step.output.chunks = [chunk for chunk in step.output.chunks if chunk.seq_id not in ids]
        step.budget += sum(len(chunk.token_ids) for chunk in taken)
        step.num_seqs -= len(taken)

    # -- arithmetic ------------------------------------------------------------------------

    def _num_to_compute(self, seq: Sequence) -> int:
        return len(seq.tokens) - seq.num_computed

    def _num_decodes(self, request: Request) -> int:
        """The request's samples that compute one token (decodes, not prompt chunks)."""
        return sum(1 for seq in request.live_sequences if self._num_to_compute(seq) == 1)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.manager.block_size)

    def _watermark(self) -> int:
        """Free blocks to keep when resuming or admitting: none when nothing else runs."""
        return self.watermark_blocks if self.running else 0


@dataclass
class _Step:
    """Running totals while one step is being scheduled."""

    budget: int
    draft_threshold: float  # the least chance of being kept a draft needs to pay this step
    num_seqs: int = 0
    # Decodes of the running requests not scheduled yet, in this step's order: each is owed
    # one token of the budget (kept as a count: summing them per request was quadratic).
    decodes_after: int = 0
    num_published: int = 0  # leading chunks of `output` whose blocks `_publish` offered
    output: SchedulerOutput = field(default_factory=SchedulerOutput)
    # Requests whose blocks or queue this step changed (ids): given slots, preempted, resumed.
    touched: set[str] = field(default_factory=set)


@dataclass
class InterruptedStep:
    """A step `schedule` was building when it raised: what it had chosen, and the requests whose
    blocks or queue it touched. The manager reports a table change (and a new prompt's cached
    count) once, to a chunk that may not exist; a victim may be in no queue."""

    output: SchedulerOutput
    touched: set[str]
