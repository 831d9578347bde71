"""The responses the Responses API keeps (`store`, on by default as OpenAI's): what
`previous_response_id` continues and `GET /v1/responses/{id}` returns.

OpenAI keeps a stored response for 30 days. A server that kept every one would grow for as long
as it runs, so this one keeps `MAX_STORED_RESPONSES` in memory and forgets the one least
recently made or read first; a forgotten id is then a 404, as an unknown one is. (Entries of
one conversation share its message dicts: a chain of k turns holds k lists of references.)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1000


@dataclass(frozen=True)
class StoredResponse:
    """A response as it was returned, and the conversation a follow-up continues: the chat
    messages of its inputs (the ones it continued too) and of its own output, without its
    `instructions` (OpenAI's: a follow-up's own instructions replace them)."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """The newest stored responses by id (only the event loop's thread touches it)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        """Keep a response, forgetting the least recently used past the capacity."""
        self._entries[stored.body["id"]] = stored
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, now the newest (a conversation in use is the last to go)."""
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was there."""
        return self._entries.pop(response_id, None) is not None
