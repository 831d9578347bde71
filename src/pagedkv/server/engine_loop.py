"""One thread owns the Engine; asyncio handlers talk to it through a command queue.

The Engine is not thread-safe and `step()` is long (a forward pass), so it cannot run on the
event loop. The engine thread drains add / abort / snapshot commands, steps while any request
is unfinished, and hands each step's outputs to the requests' asyncio queues with one
`loop.call_soon_threadsafe` per event loop. Commands are processed in order, so an abort sent
after an add always finds its request; an abort frees the request's blocks before the next
step. After each step the thread publishes the engine's stats (read by /metrics) and, a few
times a second while someone watches the page map, a snapshot of the KV pool: only taking it
needs the engine thread, so everything done with it afterwards happens elsewhere.

On shutdown, `drain()` refuses new requests (`ShuttingDown`) and says when the running ones
have finished; `interrupt_all` ends those still running.

Over 400 lines, and still one idea: every way in is a command on one queue, and the order of
that queue is what each guarantee above rests on, so the commands and the thread that
serves them are read together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.engine.errors import StepFailed
from pagedkv.server.kv_frames import KVSample, KVWatch
from pagedkv.worker.parallel.errors import WorkerFailed

if TYPE_CHECKING:
    from pagedkv.engine import BeamSearchParams, Engine, EngineStats, LoRARequest, SamplingParams
    from pagedkv.engine.metrics import EngineMetrics

logger = logging.getLogger(__name__)

KV_FRAMES_PER_S = 4.0  # page-map updates while requests run
IDLE_FRAME_INTERVAL_S = 1.0  # page-map heartbeat while nothing changes (keeps the chart moving)


class Overloaded(Exception):
    """The waiting queue is full (`--max-waiting`): the client should retry later."""

    def __init__(self, num_waiting: int, max_waiting: int) -> None:
        super().__init__(
            f"server overloaded: {num_waiting} requests waiting beyond the batch's free seats, "
            f"--max-waiting is {max_waiting}"
        )


class EngineFailed(Exception):
    """The engine raised while stepping; the requests it was running are lost."""


class ShuttingDown(Exception):
    """The server is shutting down: it takes no new requests, or ended this one."""


@dataclass
class _Route:
    """Where one engine request's outputs go."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


@dataclass
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    route: _Route
    done: asyncio.Future
    beam_search: BeamSearchParams | None = None
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None


@dataclass
class _Call:
    """Run `function(engine)` on the engine thread; its result resolves `done`."""

    function: Callable[[Engine], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass
class _Drain:
    """From now on, resolve `idle` once no request is in flight."""

    loop: asyncio.AbstractEventLoop
    idle: asyncio.Future


@dataclass
class _Interrupt:
    """End every request in flight with ShuttingDown(reason)."""

    reason: str


_STOP = object()


class EngineLoop:
    """The engine thread and the thread-safe ways in: `add`, `abort`, `call`, `watch_kv`."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting: int | None = None,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.stats: EngineStats = engine.stats  # latest published; replaced, never mutated
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}  # engine thread only
        self._watchers: dict[int, tuple[asyncio.AbstractEventLoop, KVWatch]] = {}
        self._watchers_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._kv_dirty = True
        self._last_frame = 0.0
        self._drained: _Drain | None = None  # engine thread only
        self.failure: str | None = None  # why the engine thread stopped serving, if it did
        self.draining = False  # set (on the event loop) once `drain` has been called

    def health_failure(self) -> str | None:
        """Why the engine cannot serve, if it cannot: its thread stopped, or a tensor-parallel
        worker failed (noticed by the ranks' keepalive even while no request runs)."""
        worker_failure = self.engine.ranks.failure
        return self.failure or (None if worker_failure is None else str(worker_failure))

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    def stop(self) -> None:
        """Abort everything in flight and wait for the engine thread to end."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join()

    async def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        outputs: asyncio.Queue,
        priority: int = 0,
        arrival_time: float | None = None,
        beam_search: BeamSearchParams | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request whose RequestOutputs (or an EngineFailed) will be put on `outputs`
        (a beam search with `beam_search`: then `params` counts only in the metrics).

        `arrival_time` (time.monotonic, default: now) is when its HTTP request arrived: the
        request's latencies then include the wait for this thread, as vLLM's do.

        Raises what `Engine.add_request` raises (RequestRejected), `Overloaded` or, once the
        server drains, `ShuttingDown`; nothing is left queued then. If the caller is cancelled
        while waiting, the request is aborted. Several requests may share one `outputs` queue
        (one per prompt of a batch).
        """
        self._check_alive()
        if self.draining:
            # Checked and queued with no await between, so no add can follow drain's command.
            raise ShuttingDown("server shutting down: it takes no new requests")
        loop = asyncio.get_running_loop()
        route = _Route(loop, outputs)
        done = loop.create_future()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._commands.put(
            _Add(
                request_id,
                prompt,
                params,
                priority,
                arrival,
                route,
                done,
                beam_search,
                lora_request,
                cache_salt,
            )
        )
        try:
            await done
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    def _check_alive(self) -> None:
        failure = self.health_failure()
        if failure is not None:
            raise EngineFailed(failure)

    def abort(self, request_id: str) -> None:
        """Abort a request (its blocks are freed before the next step); unknown ids are ignored."""
        self._commands.put(request_id)

    async def call(self, function: Callable[[Engine], Any]) -> Any:
        """Run `function(engine)` on the engine thread between steps and return its result."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(_Call(function, loop, done))
        return await done

    def drain(self) -> asyncio.Future:
        """Refuse new requests from now on; the future resolves once none is in flight."""
        self.draining = True
        idle = asyncio.get_running_loop().create_future()
        if self._thread.is_alive():
            self._commands.put(_Drain(idle.get_loop(), idle))
        else:  # it failed, so nothing is in flight (or it never ran)
            idle.set_result(None)
        return idle

    def interrupt_all(self, reason: str) -> None:
        """End every request in flight: its client gets ShuttingDown(reason), its blocks are
        freed before the next step."""
        self._commands.put(_Interrupt(reason))

    def watch_kv(self) -> KVWatch:
        """Subscribe to page-map frames; call `unwatch_kv` when done."""
        watch = KVWatch()
        with self._watchers_lock:
            self._watchers[id(watch)] = (asyncio.get_running_loop(), watch)
        self._commands.put(None)  # wake the thread so the first frame comes at once
        return watch

    def unwatch_kv(self, watch: KVWatch) -> None:
        """Stop sending frames to `watch`."""
        with self._watchers_lock:
            self._watchers.pop(id(watch), None)

    # The engine thread.

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished()
                if not self._drain_commands(block=not busy):
                    break
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self.stats = self.engine.stats
                self._maybe_publish_frame()
                self._notify_if_drained()
        except Exception as error:  # a bug outside engine.step(): nothing can run any more
            logger.exception("the engine thread failed")
            self.failure = f"engine thread failed: {error}"
            self._refuse_queued()
        self._abort_all()
        self._notify_if_drained()
        if self.engine.profiler.enabled:  # a profile still recording is written here: torch's
            try:  # profiler must be stopped on the thread that started it
                self.engine.profiler.stop()
            except Exception:
                logger.exception("the profile being recorded could not be written")

    def _refuse_queued(self) -> None:
        """Fail every command still queued once the thread can no longer serve them."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                _resolve(command.route.loop, command.done, error=EngineFailed(self.failure))
            elif isinstance(command, _Call):
                _resolve(command.loop, command.done, error=EngineFailed(self.failure))
            elif isinstance(command, _Drain):  # nothing runs any more
                _resolve(command.loop, command.idle)

    def _drain_commands(self, block: bool) -> bool:
        """Process queued commands (waiting for one if `block`); False once told to stop."""
        timeout = self._frame_wait() if block else None
        try:
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, command: object) -> None:
        if isinstance(command, str):
            # The route stays until the abort's final delta, which the metrics count as a
            # request finished with reason "abort" (as vLLM's do).
            if command in self._routes:
                self.engine.abort(command)
                self._kv_dirty = True
        elif isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Drain):
            self._drained = command
        elif isinstance(command, _Interrupt):
            self._fail_all(ShuttingDown(command.reason))
        elif isinstance(command, _Call):
            try:
                result = command.function(self.engine)
            except Exception as error:  # handed to the caller, which decides what it means
                _resolve(command.loop, command.done, error=error)
            else:
                _resolve(command.loop, command.done, result=result)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                priority=command.priority,
                arrival_time=command.arrival_time,
                beam_search=command.beam_search,
                lora_request=command.lora_request,
                cache_salt=command.cache_salt,
                admit=self._check_waiting,
            )
        except Exception as error:  # RequestRejected and anything else: the caller's 4xx/5xx
            _resolve(command.route.loop, command.done, error=error)
            return
        self._routes[command.request_id] = command.route
        if self.metrics is not None:
            self.metrics.track(command.request_id, command.params)
        self._kv_dirty = True
        _resolve(command.route.loop, command.done, result=None)

    def _check_waiting(self) -> None:
        """Overloaded when `max_waiting` requests already wait: asked of a request only once
        the engine has found nothing wrong with it, so a bad request gets its own 400, not a
        503 that clients retry (and a balancer sends elsewhere) while the server is busy."""
        if self.max_waiting is not None:
            num_waiting = self._queued()
            if num_waiting >= self.max_waiting:
                raise Overloaded(num_waiting, self.max_waiting)

    def _queued(self) -> int:
        """Requests that wait beyond the batch's free seats: `max_num_seqs` less the samples
        running and swapped out (those come back first), taken by the waiting requests in the
        order they will be tried, each by its samples (n, or a beam search's beams); a
        request still compiling its grammar waits. So a burst on an idle server fills the
        batch before any of it counts as waiting. Read on the engine thread."""
        scheduler = self.engine.scheduler
        held = [*scheduler.running, *scheduler.swapped]
        seats = self.engine.args.max_num_seqs - sum(len(r.live_sequences) for r in held)
        queued = len(scheduler.compiling)
        for request in scheduler.waiting:
            seats -= request.params.n if request.beam is None else request.beam.params.beam_width
            queued += seats < 0
        return queued

    def _step(self) -> None:
        """One engine step. Its stats are published before its outputs are handed over, so
        a client that scrapes /metrics after its response never sees the state before it
        (after a failed step, once its requests have been failed)."""
        try:
            outputs = self.engine.step()
        except StepFailed as error:  # the engine aborted the step's requests; the rest go on
            if isinstance(error.__cause__, WorkerFailed):  # no step can run again: stop serving
                failure = EngineFailed(str(error.__cause__))
                self._fail_all(failure)  # every request in flight learns why
                raise failure from error
            logger.exception("engine step failed; failing the requests it was running")
            self._fail(error)
            self.stats = self.engine.stats
            return
        except Exception as error:
            logger.exception("engine step failed; failing every request in flight")
            self._fail_all(EngineFailed(f"engine step failed: {error}"))
            self.stats = self.engine.stats
            return
        self.stats = self.engine.stats
        self._kv_dirty = True
        if self.metrics is not None:
            self.metrics.observe_outputs(outputs, self.engine.last_step_iteration_tokens)
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue
            if output.finished:
                del self._routes[output.request_id]
            deliveries.setdefault(route.loop, []).append((route.outputs, output))
        for loop, items in deliveries.items():
            _call_soon(loop, _deliver, items)

    def _fail(self, failure: StepFailed) -> None:
        """Tell each request's client (the engine has already aborted them) of its own loss."""
        for request_id in failure.request_ids:
            route = self._routes.pop(request_id, None)
            if route is not None:
                error = EngineFailed(failure.message_for(request_id))
                _call_soon(route.loop, _deliver, [(route.outputs, error)])
                if self.metrics is not None:
                    self.metrics.count_abort(request_id)

    def _fail_all(self, error: Exception) -> None:
        for request_id, route in list(self._routes.items()):
            _call_soon(route.loop, _deliver, [(route.outputs, error)])
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("abort of %s failed after an engine error", request_id)
            if self.metrics is not None:
                self.metrics.count_abort(request_id)
        self._routes.clear()

    def _abort_all(self) -> None:
        self._fail_all(ShuttingDown("server shutting down"))

    def _notify_if_drained(self) -> None:
        """Resolve a drain's future once its last request has finished."""
        if self._drained is not None and not self._routes:
            _resolve(self._drained.loop, self._drained.idle)
            self._drained = None

    def _frame_wait(self) -> float:
        """How long an idle thread may sleep before the next page-map frame is due."""
        with self._watchers_lock:
            watched = bool(self._watchers)
        if not watched:
            return IDLE_FRAME_INTERVAL_S
        since = time.monotonic() - self._last_frame
        interval = 1.0 / KV_FRAMES_PER_S if self._kv_dirty else IDLE_FRAME_INTERVAL_S
        return max(0.0, interval - since)

    def _maybe_publish_frame(self) -> None:
        with self._watchers_lock:
            watchers = list(self._watchers.values())
        if not watchers:
            return
        since = time.monotonic() - self._last_frame
        due = 1.0 / KV_FRAMES_PER_S if self._kv_dirty else IDLE_FRAME_INTERVAL_S
        if since < due:
            return
        try:
            sample = KVSample(time.time(), self.engine.kv_snapshot(), self.stats)
        except Exception:  # the page map is not worth stopping the engine for
            logger.exception("page-map snapshot failed")
            return
        finally:
            self._last_frame = time.monotonic()
        self._kv_dirty = False
        for loop, watch in watchers:
            _call_soon(loop, watch.put, sample)


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)


def _resolve(
    loop: asyncio.AbstractEventLoop,
    done: asyncio.Future,
    *,
    result: object = None,
    error: BaseException | None = None,
) -> None:
    def settle() -> None:
        if done.done():  # the waiting handler was cancelled
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    _call_soon(loop, settle)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
        loop.call_soon_threadsafe(callback, *args)
