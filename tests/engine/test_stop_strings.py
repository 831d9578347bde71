"""Which stop string ends a sample, and where the text is cut: vLLM's rule.

The oracle adds the text a character at a time and stops at the first character where a stop
string ends, taking the first of the list where several end there; only text after what the
sample had before the step counts (an occurrence that ended earlier, inside min_tokens, does
not). The engine checks a whole step's new text at once, however many tokens it added.
"""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from pagedkv.engine.stops import _find_stop_string

texts = st.text(alphabet="ab p", max_size=14)


def character_at_a_time(text: str, stops: list[str], previous: int, include: bool):
    for end in range(previous + 1, len(text) + 1):
        for stop in stops:
            if text[:end].endswith(stop):
                return text[: end if include else end - len(stop)], stop
    return text, None


@st.composite
def stop_strings(draw, text: str) -> list[str]:
    """Stops, most of them cut from the text (so they occur, and overlap), some not."""
    cut = st.tuples(st.integers(0, len(text)), st.integers(1, 4)).map(
        lambda at: text[at[0] : at[0] + at[1]]
    )
    anything = st.text(alphabet="ab p", min_size=1, max_size=4)
    stops = draw(st.lists(st.one_of(cut, cut, anything), min_size=1, max_size=4))
    return [stop for stop in stops if stop] or ["b"]


@given(data=st.data(), text=texts, previous=st.integers(0, 14), include=st.booleans())
def test_the_stop_that_completes_first_wins_ties_to_list_order(data, text, previous, include):
    stops = data.draw(stop_strings(text))
    previous = min(previous, len(text))
    seq = SimpleNamespace(text=text, finish_reason=None, stop_reason=None)
    _find_stop_string(seq, tuple(stops), previous, include)
    assert (seq.text, seq.stop_reason) == character_at_a_time(text, stops, previous, include)
    assert seq.finish_reason == ("stop" if seq.stop_reason else None)


def test_the_qa_case_overlapping_stops_in_one_token():
    """`'I p'` starts first but `' p'` is the same token's end: both end together, so the
    list's first wins, whatever starts first (vLLM's check_stop_strings)."""
    for stops, expected in (([" p", "I p"], ("/I", " p")), (["I p", " p"], ("/", "I p"))):
        seq = SimpleNamespace(text="/I p", finish_reason=None, stop_reason=None)
        _find_stop_string(seq, tuple(stops), 1, include=False)
        assert (seq.text, seq.stop_reason) == expected
