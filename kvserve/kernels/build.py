"""kvserve's C++ CPU kernels (csrc/), compiled for this machine on first use, or None.

One extension: paged decode attention, the group-quantized matmul and the
fused per-layer ops. Built with -march=native and OpenMP (torch's
`at::parallel_for` is serial in an extension compiled without it: the decode
kernel had run on one thread) and kept in the environment (the venv), one
build per CPU feature set and torch version, so an environment shared by
machines with other CPUs never loads a binary built for another. Any failure
(no compiler, no ninja) logs once and leaves the torch paths.
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

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("bindings.cpp", "paged_decode.cpp", "paged_decode_quant.cpp", "quant_matmul.cpp",
                         "fused_ops.cpp")]
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None where it cannot be built or is turned off (built or loaded once; later
    calls, a few hundred per decode step, read it without the lock)."""
    if "module" in _state:
        return _state["module"]
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

        # One build per CPU feature set, torch version and source checkout: a shared cache never loads a
        # foreign binary, and two checkouts (git worktrees) sharing one venv do not rebuild each other's
        # binary in turn (ninja sees another source path).
        key = " ".join([torch.__version__, str(_SOURCES[0].parent.resolve()), *sorted(cpu_flags())])
        name = f"kvserve_cpu_kernels_{hashlib.sha1(key.encode()).hexdigest()[:10]}"
        # Built inside the environment (the venv), not in a per-user cache shared by every environment.
        build_directory = Path(sys.prefix) / "kvserve-kernels" / name
        build_directory.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        module = load(name=name, sources=[str(s) for s in _SOURCES], build_directory=str(build_directory),
                      extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                      extra_ldflags=["-lmvec", "-fopenmp"], verbose=False)
        log.info("C++ CPU kernels ready in %.1fs (compiled once per CPU, then loaded from the cache); "
                 "quantized matmuls on %s", time.perf_counter() - started, module.quant_matmul_isa())
        return module
    except Exception as exc:  # any build or load failure: the torch paths still work
        log.warning("C++ CPU kernels unavailable (%s: %s); decode attention, quantized weights and the fused "
                    "layer ops use torch", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
