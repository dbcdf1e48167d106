"""Float linear layers (float32, bfloat16) whose rows do not depend on the batch (README, Determinism).

torch's fp32 GEMM (MKL / oneDNN) multiplies a few rows on matrix-vector kernels whose sums run in another
order than its blocked GEMM's: a decode's row then differs in its last bits from the same row in a prefill
chunk, and a greedy answer can change with a cache hit. From some row count on, every row comes out the
same however many run (16 on AMD EPYC Zen 4 for fp32; bf16 there is invariant from 1 row). That count
depends on the CPU, the BLAS and the dtype, so it is measured once per process and dtype on the first call,
and fewer rows are padded to it. Where no count up to 64 gives invariant rows, nothing is padded and the log
says so.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CANDIDATE_ROWS = (1, 8, 16, 32, 64)
# A layer shape of the embedded model (hidden 576 -> FFN 1536): its kernels are those of every shape tried.
_PROBE_SHAPE = (1536, 576)
_PROBE_BATCH = 160


@functools.cache
def invariant_rows(dtype: torch.dtype = torch.float32) -> int:
    """The fewest rows from which this CPU's `F.linear` in `dtype` gives each row the same bits whatever the
    row count (0: none up to 64; then rows are not padded)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(*_PROBE_SHAPE, generator=gen).to(dtype)
    x = torch.randn(_PROBE_BATCH, _PROBE_SHAPE[1], generator=gen).to(dtype)
    full = F.linear(x, weight)
    for rows in CANDIDATE_ROWS:
        counts = [rows, rows + 1, 2 * rows + 3, _PROBE_BATCH - 1]
        if all(torch.equal(F.linear(x[:n], weight), full[:n]) for n in counts):
            return rows
    logger.warning(f"this CPU's {dtype} GEMM gives a row other bits in batches of other sizes: those weights are "
                   f"not batch-invariant here (README, Determinism)")
    return 0


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` on `x [N, in]` (fp32 or bf16), each row's result independent of how many rows run beside
    it: fewer than `invariant_rows(x.dtype)` rows are padded with zeros to that many."""
    minimum = invariant_rows(x.dtype) if x.dtype in (torch.float32, torch.bfloat16) else 0
    rows = x.shape[0]
    if x.dim() != 2 or rows >= minimum:
        return F.linear(x, weight, bias)
    padded = x.new_zeros(minimum, x.shape[1])
    padded[:rows] = x
    return F.linear(padded, weight, bias)[:rows]
