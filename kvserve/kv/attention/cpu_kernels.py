"""The cpu backend's C++ kernels, compiled on first use with this machine's compiler, or None.

`paged_decode` reads each request's fp32, fp16 or bf16 K/V blocks where they lie in the
paged cache (csrc/paged_decode.cpp): the torch path gathers every block of
every layer with index_select and copies it again into SDPA's layout, which
at a 4096-token context was most of a decode step. Built with -march=native
for the CPU it runs on; the build is kept in the environment (the venv), one per
CPU feature set and torch version (an environment shared by machines with other
CPUs never loads a binary built for another),
and any failure (no compiler, no ninja) logs once and leaves the torch path.
`make install` builds it ahead of time; KVSERVE_NO_CPP_KERNELS=1 turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

from kvserve.cpu_features import cpu_flags

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def paged_decode_kernel() -> ModuleType | None:
    """The compiled module (its `paged_decode(...)`), or None where it cannot be built or is turned off."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def _build() -> ModuleType | None:
    if os.environ.get("KVSERVE_NO_CPP_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        # ninja may live next to this interpreter (a venv not on PATH).
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        import torch

        # One build per CPU feature set and torch version: a shared cache never loads a foreign binary.
        machine = hashlib.sha1(" ".join([torch.__version__, *sorted(cpu_flags())]).encode()).hexdigest()[:10]
        name = f"kvserve_paged_decode_{machine}"
        # Built inside the environment (the venv), not in a per-user cache shared by every checkout:
        # two checkouts alternating in one cache rebuild each other's binary (ninja sees another source path).
        build_directory = Path(sys.prefix) / "kvserve-kernels" / name
        build_directory.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        module = load(name=name, sources=[str(_SOURCE)], build_directory=str(build_directory),
                      extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"],
                      extra_ldflags=["-lmvec"], verbose=False)
        log.info("C++ paged-decode kernel ready in %.1fs (compiled once per CPU, then loaded from the cache)",
                 time.perf_counter() - started)
        return module
    except Exception as exc:  # any build or load failure: the torch path still works
        log.warning("C++ paged-decode kernel unavailable (%s: %s); decode attention uses the torch path",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
