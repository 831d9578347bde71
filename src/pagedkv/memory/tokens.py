"""A sequence's tokens as one record (`SequenceTokens`), and the check every token id passes.

Every id must be a Python int (not a bool: `True` is no token) in [0, 2**63), the range block
hashes encode. Checking in every call that takes ids, whether prefix caching is on or off,
means no later step (hashing a block once it is computed, caching it) can fail on a bad id,
so those steps stay all-or-nothing. The int64 array is also what hashing reads: a block's
bytes are a slice of it, with no per-token encoding.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Hashable, Sequence
from operator import countOf

from pagedkv.memory.errors import InvalidTokenIds

TOKEN_TYPECODE = "q"
BYTES_PER_TOKEN = array(TOKEN_TYPECODE).itemsize
# The byte of each int64 that holds its sign bit, in the machine's byte order.
_SIGN_BYTE = BYTES_PER_TOKEN - 1 if sys.byteorder == "little" else 0


class SequenceTokens:
    """One sequence's token ids: the one record of them, which nothing copies.

    The engine's sequence owns it and appends each sampled token; `KVCacheManager` is handed
    the same object and keeps no copy: it reads a block's ids from it to hash the block. The
    detokenizer decodes from it. Ids are checked as they enter.
    """

    __slots__ = ("seq_id", "token_ids")

    def __init__(self, seq_id: Hashable, token_ids: Sequence[int] = ()) -> None:
        self.seq_id = seq_id  # names the sequence in errors
        self.token_ids = token_array(seq_id, token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append token ids; raises `InvalidTokenIds` (and appends none) on a bad one."""
        self.token_ids.extend(token_array(self.seq_id, token_ids))

    def copy(self, seq_id: Hashable) -> SequenceTokens:
        """A record of the same ids for another sequence (a fork)."""
        twin = SequenceTokens(seq_id)
        twin.token_ids = array(TOKEN_TYPECODE, self.token_ids)
        return twin


def token_array(seq_id: Hashable, token_ids: Sequence[int]) -> array:
    """`token_ids` as an int64 array; raises `InvalidTokenIds` naming the first bad id.

    The checks run at C speed over the whole input (one type pass, one conversion, one scan
    of the sign bytes); only a rejected input is searched id by id for the message. Counting
    exact `int` types (an identity test per id) is the cheapest type pass and rules out bools.
    """
    if countOf(map(type, token_ids), int) != len(token_ids):
        raise _first_invalid(seq_id, token_ids)
    try:
        tokens = array(TOKEN_TYPECODE, token_ids)
    except OverflowError:  # beyond the int64 range
        raise _first_invalid(seq_id, token_ids) from None
    if not tokens.tobytes()[_SIGN_BYTE::BYTES_PER_TOKEN].isascii():  # a sign bit is set
        raise _first_invalid(seq_id, token_ids)
    return tokens


def _first_invalid(seq_id: Hashable, token_ids: Sequence[int]) -> InvalidTokenIds:
    for position, token_id in enumerate(token_ids):
        if type(token_id) is not int or not 0 <= token_id < 2**63:
            return InvalidTokenIds(seq_id, position, token_id)
    raise AssertionError("token_array rejected valid token ids")
