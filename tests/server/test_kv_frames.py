"""Page-map frames: a full frame first, then only the blocks that changed, names sent once;
a viewer joining mid-stream gets a full frame naming every request the deltas may use."""

from __future__ import annotations

from pagedkv.server.kv_frames import (
    FULL_FRAME_INTERVAL_S,
    KVFrame,
    KVFrameEncoder,
    full_message,
)

FREE = (0, False, ())
CACHED = (0, True, ())


def frame(time: float, gpu: list, cpu: list | None = None) -> KVFrame:
    return KVFrame(time=time, block_size=16, gpu=tuple(gpu), cpu=tuple(cpu or [FREE]), stats={})


def test_first_frame_is_full_with_names_then_deltas_carry_only_changes() -> None:
    encoder = KVFrameEncoder()
    shared = (2, True, (("a", 0, 0), ("a", 1, 0)))
    first = encoder.encode(frame(0.0, [shared, (1, False, (("b", 0, 0),)), FREE]))
    assert first["type"] == "full"
    assert first["names"] == {"0": "a", "1": "b"}
    assert first["gpu"] == [[2, 1, 0, 0, 0, 0, 1, 0], [1, 0, 1, 0, 0], [0, 0]]

    second = encoder.encode(frame(0.25, [shared, CACHED, (1, False, (("c", 0, 1),))]))
    assert second["type"] == "delta"
    assert second["names"] == {"2": "c"}  # only the name it has not sent yet
    assert second["gpu"] == [[1, 0, 1], [2, 1, 0, 2, 0, 1]]
    assert second["cpu"] == []


def test_a_full_frame_is_resent_after_the_interval_and_on_a_resize() -> None:
    encoder = KVFrameEncoder()
    encoder.encode(frame(0.0, [FREE]))
    assert encoder.encode(frame(1.0, [FREE]))["type"] == "delta"
    assert encoder.encode(frame(FULL_FRAME_INTERVAL_S + 1, [FREE]))["type"] == "full"
    assert encoder.encode(frame(FULL_FRAME_INTERVAL_S + 2, [FREE, FREE]))["type"] == "full"


def test_a_joiner_gets_a_full_frame_with_the_whole_name_table_the_deltas_go_on_using() -> None:
    encoder = KVFrameEncoder()
    held_by_a = (1, False, (("a", 0, 0),))
    encoder.encode(frame(0.0, [held_by_a, FREE, FREE]))
    now = frame(0.25, [held_by_a, (1, False, (("b", 0, 0),)), FREE])
    encoder.encode(now)

    joiner = full_message(now, encoder.names)
    assert joiner["type"] == "full" and joiner["names"] == {"0": "a", "1": "b"}
    assert joiner["gpu"] == [[1, 0, 0, 0, 0], [1, 0, 1, 0, 0], [0, 0]]
    # The next delta, sent to everyone, refers to "a" by the index the joiner was given.
    delta = encoder.encode(frame(0.5, [held_by_a, FREE, (1, False, (("a", 0, 1),))]))
    assert delta["names"] == {} and delta["gpu"] == [[1, 0, 0], [2, 1, 0, 0, 0, 1]]
