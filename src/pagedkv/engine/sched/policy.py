"""Scheduling policy: the order of the waiting and swapped queues, and who gives way.

vLLM's two policies:
- "fcfs": queues in arrival order; a request preempted by recompute goes back to the front of
  the waiting queue (it arrived before everyone there); the victim of a preemption is the
  newest running request.
- "priority": queues ordered by (priority, arrival), lower values first, and a preempted
  request takes its place by that order; the victim is the running request with the largest
  (priority, arrival): the lowest priority, and the newest among equals.
The scheduler asks the policy for its queues and its victims and does nothing else
differently, so both policies run the same admit / preempt / resume loop.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from pagedkv.engine.errors import PriorityNotSupported
from pagedkv.engine.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


class SchedulingPolicy(ABC):
    """How requests are ordered in the queues and chosen for preemption."""

    name: str

    @abstractmethod
    def new_queue(self) -> RequestQueue:
        """An empty queue (waiting or swapped) in this policy's order."""

    @abstractmethod
    def victim(self, running: list[Request]) -> Request:
        """The running request to preempt when a block cannot be had (`running` is in
        admission order, never empty)."""

    @abstractmethod
    def check_priority(self, priority: int) -> None:
        """Raise `PriorityNotSupported` when a request's priority means nothing here."""


class FCFSPolicy(SchedulingPolicy):
    """First come, first served; the newest running request gives way."""

    name = "fcfs"

    def new_queue(self) -> RequestQueue:
        return FCFSQueue()

    def victim(self, running: list[Request]) -> Request:
        return running[-1]

    def check_priority(self, priority: int) -> None:
        if priority != 0:
            raise PriorityNotSupported(priority, self.name)


class PriorityPolicy(SchedulingPolicy):
    """Lowest (priority, arrival) first; the largest running (priority, arrival) gives way."""

    name = "priority"

    def new_queue(self) -> RequestQueue:
        return PriorityQueue()

    def victim(self, running: list[Request]) -> Request:
        return max(running, key=_order)

    def check_priority(self, priority: int) -> None:
        """Any integer orders requests."""


def make_policy(name: str) -> SchedulingPolicy:
    """The policy called `name` (one of `SCHEDULING_POLICIES`)."""
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy()
    raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {name!r}")


class RequestQueue(ABC):
    """Requests waiting for blocks (or for their swapped-out blocks to come back)."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a request that arrived, or was swapped out, just now."""

    @abstractmethod
    def add_preempted(self, request: Request) -> None:
        """Queue a request preempted by recompute: it arrived before the queued ones."""

    @abstractmethod
    def peek(self) -> Request:
        """The request to try next."""

    @abstractmethod
    def pop(self) -> Request:
        """Take the request `peek` names."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Take out a request wherever it is (an abort)."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The requests in the order they will be tried."""

    @abstractmethod
    def __len__(self) -> int:
        """How many requests are queued."""

    def __contains__(self, request: object) -> bool:
        return any(queued is request for queued in self)


class FCFSQueue(RequestQueue):
    """Arrival order, preempted requests at the front."""

    def __init__(self) -> None:
        self._requests: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._requests.append(request)

    def add_preempted(self, request: Request) -> None:
        self._requests.appendleft(request)

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        return self._requests.popleft()

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)


class PriorityQueue(RequestQueue):
    """A heap on (priority, arrival): a preempted request goes where its order puts it."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []

    def add(self, request: Request) -> None:
        # Arrival numbers are unique, so the heap never compares two requests.
        heapq.heappush(self._heap, (*_order(request), request))

    def add_preempted(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not request]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in sorted(self._heap, key=lambda entry: entry[:2]))

    def __len__(self) -> int:
        return len(self._heap)


def _order(request: Request) -> tuple[int, int]:
    """Lower runs first: the request's priority, then its arrival."""
    return request.priority, request.arrival_index
