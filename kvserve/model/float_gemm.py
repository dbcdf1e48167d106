"""Float32 linear layers whose rows do not depend on the batch (README, Determinism).

torch's fp32 GEMM (MKL / oneDNN) multiplies a few rows on matrix-vector kernels whose sums run in another
order than its blocked GEMM's: a decode's row then differs in its last bits from the same row in a prefill
chunk, and a greedy answer can change with a cache hit. From some row count on, every row comes out the
same however many run (8 on AMD EPYC Zen 4, for every shape of the embedded model and its head). That count
depends on the CPU and the BLAS, so it is measured once per process on the first call, and fewer rows are
padded to it. Where no count up to 64 gives invariant rows, nothing is padded and the log says so.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CANDIDATE_ROWS = (8, 16, 32, 64)
# A layer shape of the embedded model (hidden 576 -> FFN 1536): its kernels are those of every shape tried.
_PROBE_SHAPE = (1536, 576)
_PROBE_BATCH = 160


@functools.cache
def invariant_rows() -> int:
    """The fewest rows from which this CPU's fp32 `F.linear` gives each row the same bits whatever the row
    count (0: none up to 64; then rows are not padded)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(*_PROBE_SHAPE, generator=gen)
    x = torch.randn(_PROBE_BATCH, _PROBE_SHAPE[1], generator=gen)
    full = F.linear(x, weight)
    for rows in CANDIDATE_ROWS:
        counts = [rows, rows + 1, 2 * rows + 3, _PROBE_BATCH - 1]
        if all(torch.equal(F.linear(x[:n], weight), full[:n]) for n in counts):
            return rows
    logger.warning("this CPU's float32 GEMM gives a row other bits in batches of other sizes: float32 weights are "
                   "not batch-invariant here (README, Determinism)")
    return 0


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` on fp32 `x [N, in]`, each row's result independent of how many rows run beside it: fewer
    than `invariant_rows()` rows are padded with zeros to that many."""
    minimum = invariant_rows() if x.dtype == torch.float32 else 0
    rows = x.shape[0]
    if x.dim() != 2 or rows >= minimum:
        return F.linear(x, weight, bias)
    padded = x.new_zeros(minimum, x.shape[1])
    padded[:rows] = x
    return F.linear(padded, weight, bias)[:rows]
