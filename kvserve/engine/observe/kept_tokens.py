"""Which prompt tokens each layer and KV head kept of every chunk KV compression compacted (issue 43), for the lab.

The runner hands over each compaction's kept indices (kv/compression/compact.py: `kept_record`, positions within
the chunk as int16 `[layers, KVH, budget]`, a few KiB a chunk: 1/(2 x head_dim) of the kept K/V they describe).
Recording is off until a reader (the lab) turns it on; then it is bounded: a running request's chunks (replaced
when a preempted request compacts a chunk again, identically), and the last `keep_finished` finished requests.
Chunks a request found in the prefix cache were kept by the request that computed them; the record says which
chunks those are rather than copying them. Read on the engine's thread only (the lab asks through
AsyncEngine.call), so no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

KEEP_FINISHED = 16  # finished requests whose records stay for the lab


@dataclass(frozen=True, slots=True)
class ChunkKept:
    chunk_index: int
    first_position: int  # the chunk's first prompt position
    chunk: int  # tokens in the chunk
    kept: torch.Tensor  # int16 [layers, KVH, budget]: kept positions within the chunk, ascending per head
    layers: tuple[int, ...]  # the model layers of `kept`'s rows (the full-attention ones: windowed layers keep all)


@dataclass(slots=True)
class RequestKept:
    request_id: str
    num_prompt_tokens: int
    num_chunks: int  # chunks its prompt compresses (ChunkPolicy.num_chunks)
    chunks: dict[int, ChunkKept] = field(default_factory=dict)  # by chunk index: the ones it compacted itself
    finished: bool = False

    @property
    def cached_chunks(self) -> list[int]:
        """Compressed chunks it did not compact: they came compressed from the prefix cache (or not yet computed,
        while it runs)."""
        return [index for index in range(self.num_chunks) if index not in self.chunks]


class KeptTokens:
    def __init__(self, keep_finished: int = KEEP_FINISHED) -> None:
        self.enabled = False
        self.keep_finished = keep_finished
        self._running: dict[str, RequestKept] = {}
        self._finished: OrderedDict[str, RequestKept] = OrderedDict()

    def enable(self) -> None:
        """Start recording (the lab, once mounted). Compactions before this were not recorded."""
        self.enabled = True

    def start(self, request_id: str, num_prompt_tokens: int, num_chunks: int) -> None:
        """A compressing request was added."""
        if self.enabled:
            self._running[request_id] = RequestKept(request_id, num_prompt_tokens, num_chunks)

    def record(self, request_id: str, chunk_index: int, first_position: int, kept: torch.Tensor, chunk: int,
               layers: tuple[int, ...]) -> None:
        """One KV group's compaction of a chunk (`layers`: its model layers); a model with several full-attention
        groups sends one per group, joined here in layer order."""
        entry = self._running.get(request_id)
        if entry is None:
            return
        other = entry.chunks.get(chunk_index)
        if other is not None and not set(other.layers) & set(layers):
            order = sorted(range(len(other.layers) + len(layers)), key=(*other.layers, *layers).__getitem__)
            both = torch.cat([other.kept, kept])[torch.tensor(order)]
            kept, layers = both, tuple(sorted((*other.layers, *layers)))
        entry.chunks[chunk_index] = ChunkKept(chunk_index, first_position, chunk, kept, layers)

    def finish(self, request_id: str) -> None:
        entry = self._running.pop(request_id, None)
        if entry is None:
            return
        entry.finished = True
        self._finished[request_id] = entry
        while len(self._finished) > self.keep_finished:
            self._finished.popitem(last=False)

    def get(self, request_id: str) -> RequestKept | None:
        """A copy of the request's record as it is now, safe to read on another thread (the chunks' arrays
        are never written after they are recorded)."""
        entry = self._running.get(request_id) or self._finished.get(request_id)
        return None if entry is None else RequestKept(entry.request_id, entry.num_prompt_tokens, entry.num_chunks,
                                                      dict(entry.chunks), entry.finished)

    def requests(self) -> list[RequestKept]:
        """Copies of every record: running first (admission order), then finished, newest first."""
        return [self.get(r) for r in [*self._running, *reversed(self._finished)]]

    @property
    def num_bytes(self) -> int:
        """What the records hold (their bound, for the report)."""
        return sum(c.kept.numel() * c.kept.element_size() for r in self.requests() for c in r.chunks.values())
