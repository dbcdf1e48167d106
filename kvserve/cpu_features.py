"""What this CPU can do fast: kernel choices dispatch on it, never on the machine we developed on."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of /proc/cpuinfo's first processor (empty where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def has_fast_bf16_matmul() -> bool:
    """bf16 GEMMs run natively (AVX512-BF16 or AMX-BF16) on this CPU and torch dispatches to them.

    Without them oneDNN emulates bf16: measured on an AVX2-only AMD EPYC, a
    bf16 matmul ran at 0.3 GFLOP/s, hundreds of times slower than fp32.
    """
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"):
        return False
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def describe_cpu() -> str:
    """One line for logs and benchmark reports: the model name and the matmul-relevant features."""
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    features = sorted({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"} & cpu_flags())
    return f"{name} ({torch.backends.cpu.get_cpu_capability()}; {', '.join(features) or 'no SIMD flags read'})"
