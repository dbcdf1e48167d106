"""Context shift (llama.cpp's): when a request reaches the context limit, drop a middle stretch of its
cached tokens and move the later ones earlier, instead of stopping it.

`shift_amount` says how much (llama.cpp's n_discard: keep the first
`keep_tokens`, drop half of the rest); `plan_shift` rewrites a full-attention
block table for it and returns the K/V rows the runner must copy (`ShiftPlan`):
the manager holds no tensors, and the runner re-rotates the moved keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.arith import cdiv
from kvserve.kv.pool.block_pool import BlockPool
from kvserve.kv.pool.free_queue import KVBlock


@dataclass(frozen=True, slots=True)
class TokenMoves:
    """Rows of the pool to copy, token by token: (block id, row) pairs, sources read before any is written.
    Opaque ints for the runner, which moves the K/V (and re-rotates moved keys)."""

    src_blocks: tuple[int, ...]
    src_rows: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    dst_rows: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ShiftPlan:
    """A context shift's K/V work: `copied` rows keep their position (a kept block that had to be copied),
    `moved` rows go `drop` positions earlier (their keys re-rotated by -drop)."""

    drop: int
    copied: TokenMoves
    moved: TokenMoves


def shift_amount(keep_tokens: int, num_tokens: int) -> tuple[int, int]:
    """(keep, drop) for a request of `num_tokens` tokens: keep the first `keep_tokens` (at most all but two),
    drop half of the rest, at least one (llama.cpp's n_discard)."""
    keep = min(keep_tokens, num_tokens - 2)
    return keep, max((num_tokens - 1 - keep) // 2, 1)


def plan_shift(pool: BlockPool, table: list[KVBlock], keep: int, drop: int,
               num_computed_tokens: int) -> ShiftPlan | None:
    """Drop tokens keep..keep+drop-1 of the `num_computed_tokens` cached in `table`, rewriting `table` in
    place; None (nothing changes) if the blocks it must copy do not fit in the free ones.

    Blocks wholly before `keep` stay as they are, still cached. Later blocks are rewritten: in place
    when the request holds them alone (they leave the prefix cache: their K/V no longer match a fresh
    computation of their tokens), else into fresh blocks (others keep reading the old ones). Blocks past
    the new length are freed; they are read by the moves first, which the runner does before the step's
    forward writes anything. The caller caches nothing from `keep // block_size` on again.
    """
    bs, new_length = pool.block_size, num_computed_tokens - drop
    if not 0 <= keep < new_length or drop <= 0 or len(table) * bs < num_computed_tokens:
        raise ValueError(f"cannot drop {drop} tokens after {keep} of {num_computed_tokens}")
    first, new_count = keep // bs, cdiv(new_length, bs)
    rewritten = range(first, new_count)
    shared = [index for index in rewritten if table[index].ref_cnt > 1]
    if len(shared) > pool.num_free_blocks:
        return None
    fresh = iter(pool.allocate(len(shared)))
    new_table = table[:first] + [next(fresh) if table[index].ref_cnt > 1 else table[index] for index in rewritten]
    for index in rewritten:
        if new_table[index] is table[index]:
            pool.uncache(table[index])
    copied: list[tuple[int, int, int, int]] = []
    moved: list[tuple[int, int, int, int]] = []
    for position in range(first * bs, new_length):
        source = position if position < keep else position + drop
        src, dst = table[source // bs], new_table[position // bs]
        if src is dst and source == position:
            continue  # a kept row of a block rewritten in place
        row = (src.block_id, source % bs, dst.block_id, position % bs)
        (copied if position < keep else moved).append(row)
    released = [table[index] for index in shared] + table[new_count:]
    table[:] = new_table
    pool.free(reversed(released))
    return ShiftPlan(drop, _token_moves(copied), _token_moves(moved))


def _token_moves(rows: list[tuple[int, int, int, int]]) -> TokenMoves:
    src_blocks, src_rows, dst_blocks, dst_rows = zip(*rows) if rows else ((), (), (), ())
    return TokenMoves(tuple(src_blocks), tuple(src_rows), tuple(dst_blocks), tuple(dst_rows))
