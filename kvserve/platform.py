"""The platform: the device kvserve runs on, what it can do there, and the process tuning it depends on.

`Platform(EngineConfig.device)` is the one place that knows the device: weights, the KV pool and every
step's tensors are created on `platform.device`. What the hardware can do (the C++ kernels, fast bf16
GEMMs) is read here, from kvserve/cpu_features.py and kvserve/kernels/ops.py, so a caller asks the
platform instead of the CPU. The process tuning below (malloc, the heap freeze, the one compute thread)
is measured on the CPU, and `Platform.tune_process` applies what the device calls for.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvserve.cpu_features import describe_cpu, has_fast_bf16_matmul
from kvserve.errors import ConfigError
from kvserve.kernels import ops

log = logging.getLogger(__name__)
T = TypeVar("T")

# Device types kvserve can place tensors on (a backend for each is the attention registry's business).
DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class Platform:
    """The device named by `device_name` ("cpu", "cuda", "cuda:1") and what runs fast there."""

    device_name: str = "cpu"
    device: torch.device = field(init=False, compare=False)

    def __post_init__(self) -> None:
        try:
            device = torch.device(self.device_name)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device {self.device_name!r} is not a device name (e.g. cpu, cuda, cuda:0)") from exc
        if device.type not in DEVICE_TYPES:
            raise ConfigError(f"device {self.device_name!r} is not supported; supported: {', '.join(DEVICE_TYPES)}")
        object.__setattr__(self, "device", device)

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"

    @property
    def has_cpp_kernels(self) -> bool:
        """kvserve's C++ kernels run here: a CPU where they could be built (kvserve/kernels)."""
        return self.is_cpu and ops.available()

    @property
    def has_fast_bf16(self) -> bool:
        """bf16 GEMMs run natively: AVX512-BF16 / AMX on a CPU, a GPU that has bf16 units."""
        if self.is_cpu:
            return has_fast_bf16_matmul()
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def describe(self) -> str:
        """One line for logs: the device and its matmul-relevant features."""
        if self.is_cpu:
            kernels = "C++ kernels" if self.has_cpp_kernels else "torch kernels only"
            return f"cpu: {describe_cpu()}, {torch.get_num_threads()} threads, {kernels}"
        name = torch.cuda.get_device_name(self.device) if torch.cuda.is_available() else "not available"
        return f"{self.device}: {name}"

    def tune_process(self) -> None:
        """The process-level tuning this device's hot loop depends on (the CPU's malloc thresholds)."""
        if self.is_cpu:
            keep_freed_memory()


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30
_tuned = False


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
