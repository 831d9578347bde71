"""Which stop string ends a sample, and where the text is cut: vLLM's rule.

The oracle is vLLM's `check_stop_strings` as it reads: for each stop string in the list's
order, search the text from `1 - new_char_count - len(stop)` characters before its end (a
negative offset, as vLLM passes it to `str.find`); the first string found ends the sample at
that occurrence. The engine asks once a token, with the text before that token as "before".
"""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.stops import _find_stop_string

texts = st.text(alphabet="ab p", max_size=14)


def vllm_check_stop_strings(text: str, stops: list[str], previous: int, include: bool):
    """(the text kept, the stop string) after one token took the text from `previous`
    characters to all of `text`."""
    new_char_count = len(text) - previous
    for stop in stops:
        index = text.find(stop, 1 - new_char_count - len(stop))
        if index == -1:
            continue
        return text[: index + len(stop) if include else index], stop
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


# 500: at hypothesis's 100, a stop order planted by length escaped one run in ten.
@settings(max_examples=500, deadline=None)
@given(data=st.data(), text=texts, previous=st.integers(0, 13), include=st.booleans())
def test_the_first_stop_of_the_list_found_in_the_new_text_wins(data, text, previous, include):
    stops = data.draw(stop_strings(text))
    previous = min(previous, max(len(text) - 1, 0))  # the token added at least a character
    seq = SimpleNamespace(text=text, finish_reason=None, stop_reason=None)
    _find_stop_string(seq, tuple(stops), previous, include)
    assert (seq.text, seq.stop_reason) == vllm_check_stop_strings(text, stops, previous, include)
    assert seq.finish_reason == ("stop" if seq.stop_reason else None)


def test_a_later_stop_in_the_list_loses_even_when_it_ends_first():
    """One token `' Paris'` after `'The capital is'`: 'Pa' ends first, but 'is' comes first in
    the list and ends in the token's text, so vLLM stops on it (the 'is' of the earlier text
    ended before the token and does not count)."""
    for include, kept in ((False, "The capital is Par"), (True, "The capital is Paris")):
        seq = SimpleNamespace(text="The capital is Paris", finish_reason=None, stop_reason=None)
        _find_stop_string(seq, ("is", "Pa"), len("The capital is"), include)
        assert (seq.text, seq.stop_reason) == (kept, "is")


def test_overlapping_stops_in_one_token_go_to_the_list_order():
    for stops, expected in (([" p", "I p"], ("/I", " p")), (["I p", " p"], ("/", "I p"))):
        seq = SimpleNamespace(text="/I p", finish_reason=None, stop_reason=None)
        _find_stop_string(seq, tuple(stops), 1, include=False)
        assert (seq.text, seq.stop_reason) == expected
