"""Host memory on 2 MiB pages for what is streamed every step: the linear layers' weights, the KV pool.

A decode step reads each matrix (a few hundred KiB to a few MiB) and each K/V block once. On 4 KiB pages
every page is a TLB miss and a fresh start for the hardware prefetcher (which does not cross a page), so
short streams never reach the bandwidth a long one does. Linux backs a region with transparent huge pages
where it is asked to (`madvise`) or always; elsewhere, or where THP is `never`, nothing here applies and the
callers keep ordinary memory. Pages are still committed only as they are first written.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
from pathlib import Path

import torch

from kvserve.arith import round_up

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's madvise where transparent huge pages can be asked for, else None."""
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return None
    if "[never]" in mode:
        return None
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    madvise = ctypes.CDLL(libc_name, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """An uninitialized uint8 `[nbytes]` CPU tensor starting on a 2 MiB boundary whose pages Linux is asked
    to back with huge pages, or None where it cannot be."""
    madvise = _madvise()
    if madvise is None or nbytes <= 0:
        return None
    length = round_up(nbytes, HUGE_PAGE)
    raw = torch.empty(length + HUGE_PAGE, dtype=torch.uint8, device="cpu")
    start = -raw.data_ptr() % HUGE_PAGE
    if madvise(raw.data_ptr() + start, length, _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused (errno %d)", ctypes.get_errno())
        return None
    return raw[start : start + nbytes]


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty(shape, dtype, device), on huge pages where the tensor is on the CPU, spans at least one
    huge page and the OS gives them."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type == "cpu" and nbytes >= HUGE_PAGE:
        buffer = huge_page_buffer(nbytes)
        if buffer is not None:
            return buffer.view(dtype).view(shape)
    return torch.empty(shape, dtype=dtype, device=device)
