"""Memory sizes: '2GiB' as bytes and back, and how much RAM a cache may take by default."""

from __future__ import annotations

import os
import re


_MEMORY_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
                 "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_memory(value: int | str) -> int:
    """'2GiB', '512MiB', '1.5GB' or a byte count -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        amount = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _MEMORY_UNITS:
            raise ValueError(f"cannot read {value!r} as a memory size (e.g. 2GiB, 512MiB, 1000000)")
        amount = int(float(match.group(1)) * _MEMORY_UNITS[unit])
    if amount <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return amount


def format_memory(num_bytes: float) -> str:
    """1536 -> '1.50 KiB': the largest binary unit (up to GiB) that keeps the number >= 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.2f} {unit}"
    return f"{num_bytes:,.0f} B"


def available_memory() -> int:
    """Bytes of RAM that can be used without swapping: MemAvailable, or free pages off Linux."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_kv_cache_memory() -> int:
    """A sensible share of free RAM: 30% of what is available, at most 4 GiB.

    The pool is allocated with torch.empty, so pages are committed only as
    blocks are first written.
    """
    return min(4 * 2**30, int(available_memory() * 0.3))
