"""Engine: the step loop that `LLM.generate` and the server drive.

`add_request` checks and queues a request; `step` runs one step one way, each stage consuming
the last one's data: `scheduler.schedule()` -> `SchedulerOutput` -> `executor.execute()` (the
forward pass over every scheduled chunk, then sampling) -> `ModelRunnerOutput` ->
`scheduler.update()` (append, stops, frees); then it returns what each touched request
produced in this step (deltas). `abort` frees a request's blocks at once. The engine is not
thread-safe: one thread owns it (the server runs it in its engine thread).

(Over 400 lines: admission, the step, taking back a step that fails while it is scheduled or
run, and the counters all read and write one request table; split, each part would reach
into the others'.)
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import replace

import torch

from pagedkv.engine.admission import (
    Limits,
    bad_words_token_ids,
    check_keys,
    check_request,
    tokenize,
    truncate,
)
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.beam_search import BeamSearchParams, BeamState
from pagedkv.engine.errors import DuplicateRequest, StepFailed
from pagedkv.engine.executor import StepExecutor
from pagedkv.engine.generation_defaults import describe as describe_defaults
from pagedkv.engine.invariance import invariance_line
from pagedkv.engine.lora import LoRACatalog, LoRARequest, lora_cache_salt
from pagedkv.engine.outputs import RequestMetrics, RequestOutput
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.request import Request, RequestStatus
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.samples import SampleFactory
from pagedkv.engine.sched.scheduler import Scheduler
from pagedkv.engine.spec.draft_model import DraftModelDrafter, load_draft_model
from pagedkv.engine.spec.drafter import Drafter, NgramDrafter
from pagedkv.engine.stats import EngineStats, KVSnapshot, kv_snapshot, memory_fields, startup_line
from pagedkv.engine.step_profiler import StepProfiler
from pagedkv.engine.stops import take_outputs
from pagedkv.engine.structured.compiler import GrammarCompiler
from pagedkv.hf_cache import HubCacheError
from pagedkv.hub import UnknownModelName
from pagedkv.kvmath.spec import served_context
from pagedkv.memory import KVCacheManager
from pagedkv.memory.adapters import AdapterBlocks
from pagedkv.model.footprint import weight_footprint
from pagedkv.model.lora import lora_slices
from pagedkv.weights.load import LoadedModel, load_tokenizer
from pagedkv.worker.kv_budget import draft_kv_pool, kv_pool
from pagedkv.worker.parallel.ranks import start_ranks
from pagedkv.worker.runner import ModelRunner
from pagedkv.worker.step import SchedulerOutput
from pagedkv.worker.thread_governor import thread_governor

# Seconds of history behind `EngineStats.tokens_per_s`.
THROUGHPUT_WINDOW_S = 10.0


class Engine:
    """A loaded model, its paged KV cache, a scheduler over it, and the requests in flight."""

    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        """Load `args.model` (or take `loaded`, which a caller loaded with these args to size
        the pool from its tokenizer first) and set up the KV pool and the scheduler."""
        started = time.perf_counter()
        self.args = args
        self.device = torch.device(args.device)
        # One thread fewer while other work wants the cores (worker/thread_governor.py).
        self.thread_governor = thread_governor(self.device, args.threads, args.tensor_parallel_size)
        self.profiler = StepProfiler(args.profiler, args.device)
        # A model the caller loaded took its time before this call: count it in the total.
        loaded_before = 0.0 if loaded is None else sum(loaded.seconds.values())
        # This process alone, or rank 0 of a tensor-parallel group (worker/parallel/).
        self.ranks = start_ranks(
            args.tensor_parallel_size, args.load_spec(), preloaded=loaded is not None
        )
        try:  # a start refused from here on must not leave workers waiting for rank 0
            self._set_up(args, loaded or self.ranks.load(), started, loaded_before)
        except BaseException:
            self.ranks.shutdown()
            raise

    def _set_up(
        self, args: EngineArgs, loaded: LoadedModel, started: float, loaded_before: float
    ) -> None:
        """The rest of the start once this rank's model is loaded: the tokenizer, a draft
        model, the KV pool, the scheduler and the step's executor; the start-up lines."""
        pool_started = time.perf_counter()
        self.model_name = loaded.name
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        source = args.separate_tokenizer  # vLLM's tokenizer=: another's than the model's
        if source is not None:
            try:
                self.tokenizer = load_tokenizer(
                    source,
                    self.config.vocab_size,
                    download_dir=args.download_dir,
                    revision=args.tokenizer_revision,
                    model_revision=args.revision,
                )
            except (UnknownModelName, HubCacheError) as error:  # said to be the tokenizer's
                raise ValueError(f"tokenizer: {error}") from error
        self.max_model_len = served_context(args.max_model_len, self.config.max_position_embeddings)
        # SamplingParams keywords the model's generation_config.json recommends (vLLM's "auto").
        self.sampling_defaults = args.sampling_defaults(loaded.path)
        speculative = args.speculative
        if speculative is not None and speculative.num_speculative_tokens >= self.max_model_len:
            raise ValueError(
                f"speculative_config num_speculative_tokens ({speculative.num_speculative_tokens})"
                f" must be less than max_model_len ({self.max_model_len}): no sample has room "
                "for that many drafts"
            )
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            draft = load_draft_model(
                speculative,
                loaded.config,
                self.tokenizer,
                max_model_len=self.max_model_len,
                dtype=args.resolved_dtype,
                device=args.device,
                quantization=speculative.quantization or args.quantization,
                download_dir=args.download_dir,
            )
        # One KV cache config, handed whole to the cache tensors and to the manager.
        draft_net = None if draft is None else draft.model
        cache = self.ranks.kv_budget(args.pool_request(self.max_model_len), loaded.model, draft_net)
        self.kv_cache = kv_pool(loaded.model, cache)
        # What blocks store (auto resolved: float32, bfloat16, fp8_e4m3...) and their bytes.
        self.kv_cache_dtype = cache.kv_dtype_name
        self.kv_bytes_per_block = cache.bytes_per_block
        pool_seconds = time.perf_counter() - pool_started
        self.manager = KVCacheManager(
            cache.num_gpu_blocks,
            cache.block_size,
            cache.num_cpu_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
            num_offload_blocks=cache.num_offload_blocks,
        )
        self.runner = self.ranks.runner(loaded.model, self.kv_cache)
        # LoRA adapters live in the KV pool's blocks while requests use them (`engine/lora.py`).
        self.adapters = (
            AdapterBlocks(self.manager.pool, args.max_loras) if args.enable_lora else None
        )
        self.loras = LoRACatalog(
            self.config,
            args,
            self.kv_cache.adapter_chunk_elements,
            lora_slices(loaded.model),
            cache.num_gpu_blocks,
            self.runner.lora_registry,
            self.adapters,
            in_use=lambda: {request.lora_id for request in self._requests.values()},
        )
        self.scheduler = Scheduler(self.manager, args.scheduler_config(), self.adapters)
        drafter: Drafter | None = None
        if draft is not None:
            draft_cache = draft_kv_pool(draft.model, cache, args.kv_cache_dtype)
            drafter = DraftModelDrafter(ModelRunner(draft.model, draft_cache))
        elif speculative is not None:
            drafter = NgramDrafter(speculative)
        self.executor = StepExecutor(
            self.runner,
            Sampler(),
            self.tokenizer,
            drafter=drafter,
            num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size)
        self._samples = SampleFactory(
            self.tokenizer, self.config.vocab_size, self.device, args.seed
        )
        self._limits = Limits(
            vocab_size=self.config.vocab_size,
            max_model_len=self.max_model_len,
            num_gpu_blocks=self.manager.num_gpu_blocks,
            block_size=self.manager.block_size,
            max_samples=min(args.max_num_seqs, args.max_num_batched_tokens),
            max_logprobs=self.config.vocab_size if args.max_logprobs == -1 else args.max_logprobs,
        )
        self._requests: dict[str, Request] = {}
        self._aborted: dict[str, Request] = {}  # by id: aborts whose last delta is unreported
        self._eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self._step_seconds = 0.0
        self._sampled_last_step = 0
        self.last_step_num_tokens = 0  # tokens the last step's forward pass computed
        # vLLM's iteration tokens of the last step: prompt tokens computed, plus tokens sampled.
        self.last_step_iteration_tokens = 0
        print(
            f"{weight_footprint(loaded.model).describe()}; {torch.get_num_threads()} CPU threads",
            file=sys.stderr,
        )
        print(cache.describe(self.max_model_len), file=sys.stderr)
        invariance = invariance_line(self.device, args.tensor_parallel_size, args.resolved_dtype)
        print(invariance, file=sys.stderr)
        if speculative is not None:
            print(f"speculative decoding: {speculative.describe()}", file=sys.stderr)
        if self.sampling_defaults:
            print(describe_defaults(self.sampling_defaults), file=sys.stderr)
        phases = {**loaded.seconds, "KV pool": pool_seconds}
        total = loaded_before + time.perf_counter() - started
        print(startup_line(total, phases), file=sys.stderr)

    # -- requests --------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """What a request given no SamplingParams samples with: the model's generation config
        over SamplingParams' own defaults (vLLM's `get_default_sampling_params`)."""
        return SamplingParams(**self.sampling_defaults)

    def add_request(
        self,
        request_id: str,
        prompt: str | SequenceOf[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        beam_search: BeamSearchParams | None = None,
        lora_request: LoRARequest | None = None,
        admit: Callable[[], None] | None = None,
    ) -> None:
        """Check and queue a request; raise a `RequestRejected` naming why it cannot run.

        `arrival_time` (time.monotonic, default: now) is when the request reached the caller,
        e.g. the HTTP server, so its latencies include the caller's own queueing. Prefix-cache
        blocks are shared only between requests with the same `cache_salt` (and adapter).

        `priority` orders requests under `scheduling_policy="priority"` (lower runs first);
        under "fcfs" it must be 0. The request keeps a checked copy of `params` as they are now
        (a `ValueError` names a field set to a bad value after construction).

        With `beam_search` the request is a beam search (`beam_search.py`): its one delta,
        when it finishes, has the best beams as its outputs, their text decoded with special
        tokens unless `params` says `skip_special_tokens` (of `params`, only that is read).

        With `lora_request` (an engine with `enable_lora`) its rows go through that adapter,
        read and checked the first time its id is used (`engine/lora.py`).

        `admit` is the caller's own limit (a server's queue cap), called once the request has
        passed every check and before it is queued: what it raises refuses the request, so a
        request that is bad in itself is refused for that first, as vLLM's front end
        validates a request before any queue sees it; nothing is loaded or compiled for it
        before `admit` lets it in (its adapter is read, and its pool fit with the adapter's
        blocks checked, after).
        """
        if beam_search is not None:
            params = beam_search.sampling_params(params is not None and params.skip_special_tokens)
        params = params.clone() if params is not None else self.default_sampling_params()
        if request_id in self._requests:
            raise DuplicateRequest(request_id)
        # Reusing the id of an aborted request whose abort is not yet reported: the caller
        # has moved on, and reporting it now would end the new request under the same id.
        self._aborted.pop(request_id, None)
        check_keys(priority, cache_salt)
        # Before anything is made for it: a refused request must not use up a random stream
        # (the next unseeded request would draw another) or load an adapter.
        self.scheduler.policy.check_priority(priority)
        prompt_text, token_ids = tokenize(self.tokenizer, prompt, self.config.vocab_size)
        token_ids = truncate(token_ids, params, self.max_model_len)
        so = params.structured_outputs
        spec = None  # its grammar, once checked
        if admit is not None:  # the request's own checks that make nothing, then the caller's
            check_request(token_ids, params, self._limits, beam_search is not None)
            spec = None if so is None else self.grammars.check(so)
            admit()
        lora_id, lora_blocks = self.loras.resolve(lora_request)
        # The adapter's blocks and the request's KV must fit the pool together.
        limits = replace(self._limits, num_gpu_blocks=self._limits.num_gpu_blocks - lora_blocks)
        max_tokens = check_request(token_ids, params, limits, beam_search is not None)
        grammar = None if so is None else self.grammars.submit(so, spec)
        metrics = RequestMetrics(
            arrival_time=time.monotonic() if arrival_time is None else arrival_time
        )
        request = Request(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=token_ids,
            params=params,
            max_tokens=max_tokens,
            sequences=[self._samples.new(request_id, 0, token_ids, params, grammar)],
            metrics=metrics,
            cache_salt=lora_cache_salt(cache_salt, lora_request),
            priority=priority,
            bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words or []),
            grammar=grammar,
            eos_token_ids=self._eos_token_ids,
            eos_token_id=self.tokenizer.eos_token_id,
            lora_id=lora_id,
            lora_blocks=lora_blocks,
            lora_request=lora_request,
        )
        first = request.sequences[0]
        if beam_search is not None:
            request.beam = BeamState(beam_search, len(token_ids), max_tokens, self._eos_token_ids)
        for index in range(1, 1 if beam_search is not None else params.n):
            seq = self._samples.new(request_id, index, token_ids, params, grammar)
            if first.counts is not None:  # the prompt's mask is the request's: one for all
                seq.counts = first.counts.sibling()
            request.forks.append(seq)
        self.scheduler.add(request)
        self._requests[request_id] = request

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its last delta says finish_reason "abort"."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self.scheduler.remove(request)
        if request.beam is not None:  # its live beams are its answer so far
            request.beam.finish([seq.index for seq in request.live_sequences], "abort")
        request.end("abort")
        request.metrics.finished_time = time.monotonic()
        self._aborted[request_id] = request

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's: read and check an adapter before a request names it (or LoRARejected)."""
        self.loras.resolve(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """vLLM's: forget an adapter now, or once its requests end; False if not held."""
        return self.loras.forget(lora_id)

    def list_loras(self) -> set[int]:
        """vLLM's: the ids of the adapters held."""
        return set(self.loras.requests)

    def shutdown(self) -> None:
        """End the tensor-parallel workers, if any (also done at exit), and a profile being
        recorded (its trace written; call it on the thread that runs the steps); no step runs
        after."""
        try:
            if self.profiler.enabled:
                self.profiler.stop()
        finally:
            self.ranks.shutdown()

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running or swapped (or an abort is unreported)."""
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; report every request that changed, as its output_kind says."""
        if self.has_unfinished():  # a step that runs requests, as vLLM's profiler counts them
            self.profiler.step_started()
        with self.profiler.span("step"):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        self.thread_governor.apply()
        try:
            with self.profiler.span("schedule"):
                output = self.scheduler.schedule()
        except BaseException:
            if (interrupted := self.scheduler.interrupted) is not None:  # it will never run
                self._take_back(interrupted.output, interrupted.touched)
            raise
        try:  # from here on the step's chunks carry what the runner must get, or are taken back
            self.last_step_num_tokens = output.num_batched_tokens
            prompt_tokens = self._prompt_tokens(output)
            touched = self._run(output)
        except BaseException as error:
            request_ids = self._take_back(output)
            if not isinstance(error, Exception):
                raise
            raise StepFailed(request_ids, error) from error
        self.last_step_iteration_tokens = prompt_tokens + self._sampled_last_step
        with self.profiler.span("outputs"):
            changed = (*touched.values(), *self._aborted.values())
            reports = [request.report(self._delta(request)) for request in changed]
        self._aborted.clear()
        self.loras.trim()  # adapters whose last request ended may go
        seconds = time.perf_counter() - started
        self.thread_governor.observe(seconds)
        self._step_seconds += seconds
        return [report for report in reports if report is not None]

    def _take_back(self, output: SchedulerOutput, touched: Iterable[str] = ()) -> list[str]:
        """Abort what a failed (or interrupted) step touched: the requests it computed, those
        holding blocks its memory plan, perhaps never run, was writing or its chunks were to
        compute (`discard_plan`), and the ones an interrupted schedule `touched`;
        their ids."""
        moved = {seq_id[0] for seq_id in self.manager.discard_plan(output.plan)}
        if self.adapters is not None:  # LoRA weights the step may not have written
            self.adapters.retry(output.adapters)
        request_ids = sorted(moved | {chunk.seq_id[0] for chunk in output.chunks} | set(touched))
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    def _run(self, output: SchedulerOutput) -> dict[str, Request]:
        """Execute the step and record it; the requests with a delta to report, by id."""
        with self.profiler.span("execute"):
            result = self.executor.execute(output, self._requests)
        with self.profiler.span("update"):
            touched = self.scheduler.update(output, result)
        now = time.monotonic()
        for request in touched:
            if request.metrics.first_token_time is None:
                # Once per request, as vLLM counts: the whole prompt, cached tokens included,
                # and never again when a preemption makes it recompute.
                request.metrics.first_token_time = now
                self._prompt_tokens_total += len(request.prompt_token_ids)
            if request.status is RequestStatus.FINISHED:
                request.metrics.finished_time = now
                del self._requests[request.request_id]
        self._sampled_last_step = self.scheduler.last_step_tokens
        if self._sampled_last_step:
            self._generation_tokens_total += self._sampled_last_step
            self._recent_tokens.append((now, self._sampled_last_step))
        # A beam search has one delta, when it finishes (its best beams).
        ended = RequestStatus.FINISHED
        return {r.request_id: r for r in touched if r.beam is None or r.status is ended}

    def _prompt_tokens(self, output: SchedulerOutput) -> int:
        """Tokens of the step's chunks that prefill (a prompt, or a preempted sequence's tokens
        again), as vLLM counts prompt tokens per iteration; a decode's token was counted when it
        was sampled."""
        return sum(
            len(chunk.token_ids) - chunk.num_draft_tokens
            for chunk in output.chunks
            if chunk.num_computed < len(self._requests[chunk.seq_id[0]].prompt_token_ids)
        )

    def _delta(self, request: Request) -> RequestOutput:
        """What each sample produced since the last delta (clearing the per-step buffers); a
        finished beam search's best beams."""
        finished = request.status is RequestStatus.FINISHED
        if request.beam is None:
            outputs = take_outputs(request)
        else:
            outputs = request.beam.answer(self.tokenizer, request.params.skip_special_tokens)
        for output in outputs:  # vLLM's CompletionOutput names the adapter too
            output.lora_request = request.lora_request
        prompt_logprobs = None
        scored = len(request.prompt_logprobs) == len(request.prompt_token_ids)
        if request.scores_prompt and scored and not request.prompt_logprobs_reported:
            prompt_logprobs = request.prompt_logprobs
            request.prompt_logprobs_reported = True
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=request.metrics,
            lora_request=request.lora_request,
            num_cached_tokens=request.metrics.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    # -- reporting -------------------------------------------------------------------------

    @property
    def max_logprobs(self) -> int:
        """Logprobs a request may ask per token (vLLM's -1, no cap, read as the vocabulary)."""
        return self._limits.max_logprobs

    @property
    def stats(self) -> EngineStats:
        """Queues, KV memory, prefix cache, preemptions and throughput now."""
        now = time.monotonic()
        while self._recent_tokens and now - self._recent_tokens[0][0] > THROUGHPUT_WINDOW_S:
            self._recent_tokens.popleft()
        recent = sum(count for _, count in self._recent_tokens)
        # At least a second: right after a burst the span is tiny and the rate meaningless.
        span = max(now - self._recent_tokens[0][0], 1.0) if self._recent_tokens else 1.0
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            num_swapped=len(self.scheduler.swapped),
            num_swap_preemptions=self.scheduler.num_swap_preemptions,
            num_recompute_preemptions=self.scheduler.num_recompute_preemptions,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            tokens_per_s=recent / span,
            step_seconds_total=self._step_seconds,
            forward_seconds_total=self.runner.forward_seconds,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_bytes_per_block=self.kv_bytes_per_block,
            tensor_parallel_size=self.args.tensor_parallel_size,
            cpu_threads=self.thread_governor.threads,
            spec_decoding=self.scheduler.drafts.stats.snapshot(),
            **memory_fields(self.manager),
        )

    def kv_snapshot(self) -> KVSnapshot:
        """Every GPU and CPU block: ref count, prefix-cache state and holders; LoRA runs."""
        return kv_snapshot(self.manager, self._requests.values(), self.loras.runs(self.adapters))
