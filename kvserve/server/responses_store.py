"""Stored responses (the Responses API's `store`): bounded, least recently used first, per tenant.

In memory: a restart forgets every stored response (a follow-up then gets
"not found"). Each entry keeps the response object as returned, its input
items, and the exact token ids of its conversation (server/conversation.py),
so a follow-up continues from those ids. Bounded by count and by an estimate
of bytes (token ids counted at 8 bytes, text at its UTF-8 size); past either
bound the least recently used responses go. Entries belong to the tenant
(a digest of its API key, never the key) that created them: for anyone else
they do not exist.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

_BYTES_PER_TOKEN = 8  # a Python int in a tuple: one pointer (small ints are shared)


def tenant_id(api_key: str) -> str:
    return hashlib.sha256(b"kvserve-responses\0" + api_key.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_id: str
    tenant: str
    body: dict  # the response object as returned
    input_items: tuple[dict, ...]  # this response's own input items, with ids
    instructions: str | None
    instruction_ids: tuple[int, ...]
    turns: tuple[tuple[int, ...], ...]  # per turn: its messages' tokens + generation prompt + output tokens

    @property
    def token_ids(self) -> list[int]:
        """The whole conversation as the model saw and produced it."""
        return [t for segment in (self.instruction_ids, *self.turns) for t in segment]

    @property
    def num_bytes(self) -> int:
        tokens = len(self.instruction_ids) + sum(len(turn) for turn in self.turns)
        text = len(json.dumps(self.body, ensure_ascii=False)) + len(json.dumps(self.input_items, ensure_ascii=False))
        return tokens * _BYTES_PER_TOKEN + text


class ResponsesStore:
    """Thread-safe (handlers run on the event loop, rendering on workers)."""

    def __init__(self, max_responses: int = 10_000, max_bytes: int = 256 * 2**20) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}  # num_bytes of each entry, computed once
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, entry: StoredResponse) -> None:
        size = entry.num_bytes
        with self._lock:
            if size > self.max_bytes:
                return  # larger than the whole store: keeping it would evict everything else
            if self._entries.pop(entry.response_id, None) is not None:
                self._bytes -= self._sizes.pop(entry.response_id)
            self._entries[entry.response_id] = entry
            self._sizes[entry.response_id] = size
            self._bytes += size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                evicted, _ = self._entries.popitem(last=False)
                self._bytes -= self._sizes.pop(evicted)

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.tenant != tenant:
                return None
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str, tenant: str) -> bool:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.tenant != tenant:
                return False
            del self._entries[response_id]
            self._bytes -= self._sizes.pop(response_id)
            return True
