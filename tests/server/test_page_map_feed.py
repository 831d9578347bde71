"""The page-map stream costs the same however many watch it, and only so many may.

Viewers here read `/v1/kv/stream` as the page does and rebuild the pool from its full and
delta frames, so a frame encoded once for all of them must still rebuild, for each one
(including one that joins mid-stream), the same pool.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from typing import Any

import httpx2
import pytest

from pagedkv.server import ServerConfig
from pagedkv.server.kv_frames import KVFrame, KVFrameEncoder
from tests.server.conftest import HANG_GUARD_S, RunningServer, slow_down, wait_until

MAX_VIEWERS = 8
LONG = {"prompt": "Hello", "max_tokens": 60, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(ServerConfig(max_page_map_viewers=MAX_VIEWERS), num_gpu_blocks=64)


def test_each_tick_is_encoded_once_off_the_engine_thread_for_every_viewer(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    encodes = spy(monkeypatch, KVFrameEncoder, "encode")
    captures = spy(monkeypatch, KVFrame, "capture")
    slow_down(server, 0.02)  # the requests span several ticks
    viewers = [Viewer(server) for _ in range(MAX_VIEWERS - 1)]
    with server.http() as http:
        first = http.post("/v1/completions", json=LONG | {"n": 2})
        late = Viewer(server)  # joins a stream that has been going for a while
        viewers.append(late)
        second = http.post("/v1/completions", json=LONG)
    assert first.status_code == second.status_code == 200
    # Every viewer holds the same pool at every tick they all saw, the late one included.
    wait_until(lambda: len(common_ticks(viewers)) >= 2)
    for tick in common_ticks(viewers):
        assert len({json.dumps(viewer.pools[tick]) for viewer in viewers}) == 1
    assert any(held(late.pools[tick]) for tick in common_ticks(viewers)), "nothing to compare"
    most_frames = max(len(viewer.pools) for viewer in viewers)  # the first viewer's, about
    assert len(encodes) <= most_frames + 2, "a tick is encoded once, not once per viewer"
    assert captures and "pagedkv-engine" not in captures
    stop(viewers)
    wait_until(lambda: no_viewers(server))


def test_viewers_past_the_cap_get_503_and_a_freed_place_is_taken_again(
    server: RunningServer,
) -> None:
    viewers = [Viewer(server) for _ in range(MAX_VIEWERS)]
    wait_until(lambda: all(viewer.pools for viewer in viewers))
    with server.http() as http:
        refused = http.get("/v1/kv/stream")
    assert refused.status_code == 503 and "Retry-After" in refused.headers
    error = refused.json()["error"]
    assert error["code"] == "too_many_viewers" and "--max-page-map-viewers" in error["message"]
    stop([viewers.pop()])
    another = Viewer(server, retry=True)
    wait_until(lambda: bool(another.pools))
    stop([*viewers, another])
    wait_until(lambda: no_viewers(server))


class Viewer(threading.Thread):
    """A page-map client: rebuilds the pool from each frame, keeping it by frame time."""

    def __init__(self, server: RunningServer, retry: bool = False) -> None:
        super().__init__(daemon=True)
        self.url = f"{server.url}/v1/kv/stream"
        self.retry = retry
        self.pools: dict[float, list[Any]] = {}
        self._names: dict[int, str] = {}
        self._gpu: list[Any] = []
        self.hang_up = threading.Event()
        self.start()
        wait_until(lambda: bool(self.pools) or not self.is_alive())

    def run(self) -> None:
        """Read frames until stopped; with `retry`, reconnect after a refusal (the page's way)."""
        while not self.hang_up.is_set():
            with httpx2.stream("GET", self.url, timeout=HANG_GUARD_S) as response:
                if response.status_code != 200:
                    if not self.retry:
                        return
                    time.sleep(0.1)
                    continue
                for line in response.iter_lines():
                    if self.hang_up.is_set():
                        return
                    if line.startswith("data: "):
                        self._apply(json.loads(line.removeprefix("data: ")))

    def _apply(self, frame: dict[str, Any]) -> None:
        if frame["type"] == "full":
            self._names.clear()
            self._gpu = list(frame["gpu"])
        else:
            for block_id, *block in frame["gpu"]:
                self._gpu[block_id] = block
        self._names.update({int(index): name for index, name in frame["names"].items()})
        self.pools[frame["time"]] = [self._resolve(block) for block in self._gpu]

    def _resolve(self, block: list[Any]) -> list[Any]:
        """A block with its holders' names instead of their indices in the name table."""
        ref_count, cached, *holders = block
        triples = [holders[i : i + 3] for i in range(0, len(holders), 3)]
        return [ref_count, cached, [[self._names[r], s, p] for r, s, p in triples]]


def stop(viewers: list[Viewer]) -> None:
    """Hang up, each at its next frame (an idle stream still sends one a second)."""
    for viewer in viewers:
        viewer.hang_up.set()
    for viewer in viewers:
        viewer.join(timeout=HANG_GUARD_S)


def common_ticks(viewers: list[Viewer]) -> list[float]:
    """Frame times every viewer has rebuilt."""
    times = set.intersection(*(set(viewer.pools) for viewer in viewers))
    return sorted(times)


def held(pool: list[Any]) -> bool:
    """True if some block of `pool` has a holder."""
    return any(block[2] for block in pool)


def spy(monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> list[str]:
    """The name of the thread of every call to `owner.name` (a method or a classmethod),
    which still does what it did."""
    threads: list[str] = []
    real = getattr(owner, name)

    def recorded(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args)

    # A function on the class is an instance method; a classmethod comes out already bound.
    monkeypatch.setattr(
        owner, name, recorded if inspect.isfunction(real) else staticmethod(recorded)
    )
    return threads


def no_viewers(server: RunningServer) -> bool:
    """True once the server has seen every viewer hang up."""
    return server.app.state.drain.page_map.num_viewers == 0
