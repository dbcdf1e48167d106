"""Stored responses (the Responses API's `store`): bounded, least recently used first, per tenant.

In memory, and, when the server is given a directory (`--responses-store-path`),
also written through to JSON files there, so a restart keeps them: a follow-up
after a restart continues the same token ids (with a disk KV tier, its prefix
comes back from the tier too). The ids are the model's own tokens: give each
model its own directory. Plain JSON, no pickle; files owner-only; a bad file
is skipped and removed; a disk error is logged once and the store goes on in
memory. Without a directory, a restart forgets every stored response (a
follow-up then gets "not found").
Each entry keeps the response object as returned, its input
items, and the exact token ids of its conversation (server/prompt/segments.py),
so a follow-up continues from those ids. Bounded by count and by an estimate
of bytes (token ids counted at 8 bytes, text at its UTF-8 size); past either
bound the least recently used responses go. Entries belong to the tenant
(a digest of its API key, never the key) that created them: for anyone else
they do not exist. The same store keeps conversations (responses/conversations.py's
StoredConversation, `conv_*.json`): a store holds one kind of entry.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar
from pathlib import Path

log = logging.getLogger(__name__)
_ID = re.compile(r"resp_[0-9a-f]{32}")  # the ids this server hands out: safe as file names

_BYTES_PER_TOKEN = 8  # a Python int in a tuple: one pointer (small ints are shared)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    PREFIX: ClassVar[str] = "resp_"  # of its id, and of its file's name

    response_id: str
    tenant: str
    body: dict  # the response object as returned
    input_items: tuple[dict, ...]  # this response's own input items, with ids
    instructions: str | None
    instruction_ids: tuple[int, ...]
    turns: tuple[tuple[int, ...], ...]  # per turn: its messages' tokens + generation prompt + output tokens
    summary: str | None = None  # a compacted history's summary (in instruction_ids; a follow-up keeps it)

    @property
    def key(self) -> str:
        return self.response_id

    @property
    def token_ids(self) -> list[int]:
        """The whole conversation as the model saw and produced it."""
        return [t for segment in (self.instruction_ids, *self.turns) for t in segment]

    @property
    def num_bytes(self) -> int:
        tokens = len(self.instruction_ids) + sum(len(turn) for turn in self.turns)
        text = len(json.dumps(self.body, ensure_ascii=False)) + len(json.dumps(self.input_items, ensure_ascii=False)) \
            + len(self.summary or "")
        return tokens * _BYTES_PER_TOKEN + text

    def to_json(self) -> dict:
        return {"version": 1, "response_id": self.response_id, "tenant": self.tenant, "body": self.body,
                "input_items": list(self.input_items), "instructions": self.instructions,
                "instruction_ids": list(self.instruction_ids), "turns": [list(turn) for turn in self.turns],
                "summary": self.summary}

    @classmethod
    def from_json(cls, data: dict) -> "StoredResponse":
        """Raises ValueError (or KeyError/TypeError) for anything but what to_json wrote."""
        if data.get("version") != 1 or not _ID.fullmatch(str(data["response_id"])):
            raise ValueError("not a stored response of this version")
        ids = tuple(int(t) for t in data["instruction_ids"])
        turns = tuple(tuple(int(t) for t in turn) for turn in data["turns"])
        if not isinstance(data["body"], dict) or not all(isinstance(i, dict) for i in data["input_items"]):
            raise ValueError("malformed body or input items")
        summary = data.get("summary")
        if summary is not None and not isinstance(summary, str):
            raise ValueError("malformed summary")
        return cls(data["response_id"], str(data["tenant"]), data["body"], tuple(data["input_items"]),
                   data["instructions"], ids, turns, summary)


class ResponsesStore:
    """Thread-safe (handlers run on the event loop, rendering on workers)."""

    def __init__(self, max_responses: int = 10_000, max_bytes: int = 256 * 2**20,
                 directory: Path | None = None, kind: type = StoredResponse) -> None:
        # `kind`: what it keeps (StoredResponse; responses/conversations.py's StoredConversation), any class
        # with PREFIX, key, tenant, num_bytes, to_json and from_json
        self.kind = kind
        self._id = re.compile(re.escape(kind.PREFIX) + r"[0-9a-f]{32}")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}  # num_bytes of each entry, computed once
        self._bytes = 0
        self._lock = threading.Lock()
        self.directory = directory
        if directory is not None:
            try:
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._load_all()
            except OSError as exc:
                self._give_up_disk(exc)

    @property
    def persistent(self) -> bool:
        return self.directory is not None

    def _load_all(self) -> None:
        """Read back what an earlier process stored, oldest first (file times keep the LRU order)."""
        paths = sorted(self.directory.glob(f"{self.kind.PREFIX}*.json"), key=lambda path: path.stat().st_mtime)
        for path in paths:
            try:
                entry = self.kind.from_json(json.loads(path.read_text()))
                if path.stem != entry.key:
                    raise ValueError("file name and id differ")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("stored responses: removing unreadable %s (%s)", path, exc)
                self._unlink(path.stem)
                continue
            self._remember(entry)
        if paths:
            log.info("stored responses: %d read back from %s", len(self._entries), self.directory)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def _write(self, entry: StoredResponse) -> None:
        if self.directory is None or not self._id.fullmatch(entry.key):
            return
        path = self._path(entry.key)
        temporary = path.with_name(path.name + f".tmp-{os.getpid()}")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as file:
                json.dump(entry.to_json(), file, ensure_ascii=False)
            os.replace(temporary, path)
        except OSError as exc:
            self._give_up_disk(exc)

    def _unlink(self, key: str) -> None:
        if self.directory is not None:
            try:
                self._path(key).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._give_up_disk(exc)

    def _give_up_disk(self, exc: OSError) -> None:
        log.error("stored responses: cannot use %s (%s); keeping them in memory only", self.directory, exc)
        self.directory = None

    def _remember(self, entry: StoredResponse) -> list[str]:
        """Under the lock (or before the store is shared): add an entry, evict past the bounds; the evicted ids."""
        size = entry.num_bytes
        if self._entries.pop(entry.key, None) is not None:
            self._bytes -= self._sizes.pop(entry.key)
        self._entries[entry.key] = entry
        self._sizes[entry.key] = size
        self._bytes += size
        evicted = []
        while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
            key, _ = self._entries.popitem(last=False)
            self._bytes -= self._sizes.pop(key)
            evicted.append(key)
        for key in evicted:
            self._unlink(key)
        return evicted

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, entry: StoredResponse) -> None:
        with self._lock:
            if entry.num_bytes > self.max_bytes:
                return  # larger than the whole store: keeping it would evict everything else
            self._remember(entry)
            self._write(entry)

    def get(self, key: str, tenant: str) -> Any:
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            entry = self._read_back(key)
        with self._lock:
            if entry is None or entry.tenant != tenant:
                return None
            if key in self._entries:
                self._entries.move_to_end(key)
        if self.directory is not None:
            try:
                os.utime(self._path(key))  # LRU order that survives a restart
            except OSError:
                pass
        return entry

    def _read_back(self, key: str) -> Any:
        """A response that another process sharing the directory stored (kvserve replicas on one host)."""
        if self.directory is None or not self._id.fullmatch(key):
            return None
        try:
            entry = self.kind.from_json(json.loads(self._path(key).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if entry.key != key:
            return None
        with self._lock:
            self._remember(entry)
        return entry

    def delete(self, key: str, tenant: str) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.tenant != tenant:
                return False
            del self._entries[key]
            self._bytes -= self._sizes.pop(key)
            self._unlink(key)
            return True
