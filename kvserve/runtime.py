"""Process-level tuning that the hot loop depends on."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30
_tuned = False
T = TypeVar("T")


def keep_freed_memory() -> None:
    """Stop glibc from returning large freed blocks to the OS after every step.

    By default glibc serves allocations above a dynamic threshold with mmap and
    unmaps them on free, and trims the heap top; every step then page-faults
    its multi-MB temporaries (gathered K/V blocks, scores) back in. Measured:
    the split-KV decode attention alone at W1 shape, alternating with other
    work, 32 ms -> 2.8 ms per call; a whole W1 decode step about 5% faster
    (interleaved A/B runs, 204-217 ms vs 216-220 ms). Raising both thresholds
    keeps freed memory for reuse (the process holds its peak). A no-op off glibc.
    """
    global _tuned
    if _tuned or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES) and libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES)
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.debug("mallopt unavailable; large temporaries may be re-faulted every step")
    _tuned = True


def freeze_startup_heap() -> None:
    """Keep everything alive now out of every later cyclic garbage collection (`gc.freeze`), after one
    last collection.

    A full (generation-2) collection walks every tracked object, and importing torch alone leaves
    ~165,000 of them: measured here, each such collection took 80-160 ms, every request and the step
    loop stopped meanwhile (a server's /health answered after 134-404 ms while a large prompt was
    refused). What is alive at startup (modules, the model, the pool) lives as long as the process, so
    nothing is lost by not scanning it; objects created later are collected as before (vLLM and SGLang
    freeze after startup too). `unfreeze_heap` undoes it."""
    gc.collect()
    gc.freeze()


def unfreeze_heap() -> None:
    """Put the frozen objects back in reach of the collector (a server's shutdown: a process that goes on,
    such as a test session starting many servers, collects their engines again)."""
    gc.unfreeze()


_compute_executor: ThreadPoolExecutor | None = None


def compute_executor() -> ThreadPoolExecutor:
    """The one thread that runs torch work when the main thread must stay free (the server).

    Each thread that enters an OpenMP parallel region gets its own team of
    worker threads. Once two teams exist, libgomp sees more threads than cores
    and stops spin-waiting, and every parallel region pays a futex wake-up:
    measured on 2 cores, a batch-1 decode step went 34 ms -> 52 ms when steps
    ran on a worker thread after the model had loaded on the main thread (and
    stayed slow on either thread afterwards). So the server loads the model and
    runs every step on this same thread.
    """
    global _compute_executor
    if _compute_executor is None:
        _compute_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-compute")
    return _compute_executor


def run_on_compute_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call `fn` on the compute thread and wait for its result (or exception)."""
    return compute_executor().submit(fn, *args, **kwargs).result()
