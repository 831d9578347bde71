"""`pagedkv demo` runs the memory walk-through end to end."""

from __future__ import annotations

from pagedkv.cli import main


def test_demo_walks_through_every_stage_and_leaks_nothing(capsys) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    # C's 10-token prompt repeats A's first 8 tokens: two blocks of 4 come from the cache.
    assert "8 were already computed" in out
    assert "copy-on-write [(" in out
    assert "swap_out plan" in out and "swap_in plan" in out
    assert "invariants hold, no block leaked" in out
