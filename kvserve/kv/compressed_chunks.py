"""Where a compressing request's prompt is compressed, in counts only (KV compression, issue 43).

Chunk k is prompt tokens [k * chunk, (k + 1) * chunk). It is compressed as soon as it is computed and before any
later token is, and only if the prompt goes on at least `window` tokens (at least one) past it: the recent tail
stays exact, and a compressed chunk is always followed by prompt tokens computed over it. Fixed boundaries make a
request's kept tokens the same however its prefill was scheduled, cold or cached.

A compressed chunk keeps `budget` slots (whole blocks) per layer and KV head, so `chunk - budget` tokens leave the
cache: a token at position p after c compressed chunks lives in slot p - c * (chunk - budget). RoPE uses positions;
block tables and attention metadata use slots. No tensors here: the runner moves the K/V (kv/compression/compact.py).

Only full-attention KV groups compress (a model's windowed groups hold their window and keep positional tables:
their offset is 0), and a hybrid model's recurrent state runs over every token: slots differ from positions only
in the full-attention groups' tables.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ChunkPolicy:
    """One compressing request's geometry: `chunk` and `budget` tokens (multiples of the block size), the
    `window` of prompt tokens that must follow a chunk for it to be compressed, and the prompt's length."""

    chunk: int
    budget: int
    window: int
    num_prompt_tokens: int

    @property
    def dropped_per_chunk(self) -> int:
        return self.chunk - self.budget

    @property
    def num_chunks(self) -> int:
        """Chunks of this prompt that are compressed (the prompt goes on >= max(window, 1) tokens past each)."""
        return max(self.num_prompt_tokens - max(self.window, 1), 0) // self.chunk

    def chunks_before(self, num_tokens: int) -> int:
        """Compressed chunks once `num_tokens` tokens are (being) computed: those wholly before the last token."""
        return min(max(num_tokens - 1, 0) // self.chunk, self.num_chunks)

    def dropped(self, num_tokens: int) -> int:
        """Tokens dropped from the cache once `num_tokens` tokens are (being) computed."""
        return self.chunks_before(num_tokens) * self.dropped_per_chunk

    def stop(self, start: int, count: int) -> int:
        """Tokens a step may compute from `start` (at most `count`): never past the end of a compressed chunk,
        so the runner compresses it before any later token is computed."""
        end = start + count
        boundary = (start // self.chunk + 1) * self.chunk
        if start // self.chunk < self.num_chunks and end > boundary:
            return boundary - start
        return count

    # The arithmetic of a compressing request's size, for everything that counts its blocks ahead (the planner,
    # `kvserve memory`, the lab's calculator, the engine's can-it-ever-fit check): one place, counts only.

    def slots(self, num_tokens: int) -> int:
        """Slots its tables hold with `num_tokens` tokens (prompt, then generated) computed."""
        return num_tokens - self.dropped(num_tokens)

    def peak_slots(self, num_tokens: int) -> int:
        """The most slots its tables hold at once while the request grows to `num_tokens` tokens: at the end, or
        at the end of its last compressed chunk, held whole until the next step compacts it (both whole blocks:
        chunk and budget are, so blocks = ceil(this / block size))."""
        last = min(self.num_chunks, num_tokens // self.chunk)
        return max(self.slots(num_tokens), self.slots(last * self.chunk))

    def worst_peak_slots(self, num_new_tokens: int) -> int:
        """The most slots any prompt of at most this one's length holds at once with `num_new_tokens` generated
        after it. A longer prompt can need fewer (one more token can compress one more chunk), so this is this
        prompt's peak or that of the longest prompt with one compressed chunk fewer, whose tail is the longest."""
        worst = self.peak_slots(self.num_prompt_tokens + num_new_tokens)
        if self.num_chunks:
            shorter = self.num_chunks * self.chunk + max(self.window, 1) - 1
            fewer = ChunkPolicy(self.chunk, self.budget, self.window, shorter)
            worst = max(worst, fewer.peak_slots(shorter + num_new_tokens))
        return worst


@dataclass(frozen=True, slots=True)
class Compaction:
    """One compressed chunk's K/V work for the runner (opaque ids and counts): the chunk's `src_blocks` (in token
    order, the chunk's positions from `first_position`), the first `num_kept_blocks` of which receive the kept
    tokens of every layer of KV `group` and KV head (in place: kept row i comes from a row >= i, all read before
    any written); the others went back to the pool. `chunk_index` 0 keeps its attention sinks."""

    chunk_index: int
    first_position: int
    src_blocks: tuple[int, ...]
    num_kept_blocks: int
    group: int = 0


class CompressedRequests:
    """The KV manager's record of compressing requests: each one's policy (kept across preemptions, dropped with
    `forget`), the chunks its tables already hold compressed and the compactions the runner has yet to do."""

    def __init__(self) -> None:
        self.policies: dict[str, ChunkPolicy] = {}
        self._done: dict[str, int] = {}
        self._pending: dict[str, list[Compaction]] = {}
        self.num_dropped_tokens = 0  # monotonic: tokens every compaction took out of the pool (stats)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.policies

    def dropped(self, request_id: str) -> int:
        """Tokens the request's tables no longer hold (slot = position - this)."""
        policy = self.policies.get(request_id)
        return self._done.get(request_id, 0) * policy.dropped_per_chunk if policy is not None else 0

    def compressed_end(self, request_id: str) -> int:
        """Tokens of the request's compressed chunks: a cut before this loses what they kept."""
        policy = self.policies.get(request_id)
        return self._done.get(request_id, 0) * policy.chunk if policy is not None else 0

    def due(self, request_id: str, num_tokens: int) -> list[int]:
        """Chunks to compress before the request's tables grow to `num_tokens` tokens (each computed: the
        scheduler never lets a step cross a compressed chunk's end)."""
        policy = self.policies.get(request_id)
        if policy is None:
            return []
        return list(range(self._done.get(request_id, 0), policy.chunks_before(num_tokens)))

    def claim(self, request_id: str, num_hit_tokens: int) -> None:
        """The request starts from a prefix hit of `num_hit_tokens` (0: none): the chunks wholly in it are
        compressed already (a hit on a compressed chunk is on all of its kept blocks)."""
        self.reset(request_id)
        if num_hit_tokens and request_id in self.policies:
            self._done[request_id] = self.policies[request_id].chunks_before(num_hit_tokens + 1)

    def final_slots(self, request_id: str, num_computed_tokens: int, block_size: int) -> int:
        """Blocks of the request's table whose K/V are final (what the prefix cache may register): the kept
        blocks of its compressed chunks, then, once no chunk waits to be compressed, its computed full blocks."""
        policy, done = self.policies[request_id], self._done.get(request_id, 0)
        kept = done * policy.budget // block_size
        if done < policy.num_chunks:
            return kept  # the chunk being computed is rewritten in place when it is compressed
        return kept + max(num_computed_tokens - done * policy.chunk, 0) // block_size

    def compacted(self, request_id: str, chunk_index: int, compactions: list[Compaction]) -> None:
        """Chunk `chunk_index` is compressed in every full-attention group (one compaction each)."""
        self._done[request_id] = chunk_index + 1
        self.num_dropped_tokens += self.policies[request_id].dropped_per_chunk
        self._pending.setdefault(request_id, []).extend(compactions)

    def take(self, request_id: str) -> tuple[Compaction, ...]:
        return tuple(self._pending.pop(request_id, ()))

    def reset(self, request_id: str) -> None:
        """Its blocks are gone (finished or preempted): it starts again uncompressed."""
        self._done.pop(request_id, None)
        self._pending.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self.reset(request_id)
        self.policies.pop(request_id, None)
