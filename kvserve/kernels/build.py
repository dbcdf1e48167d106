"""kvserve's C++ CPU kernels (csrc/), compiled for this machine on first use, or None.

One extension: paged decode attention, the group-quantized matmul, the
fused per-layer ops, the gated delta rule and the decoder stack. Built with -march=native and OpenMP (torch's
`at::parallel_for` is serial in an extension compiled without it: the decode
kernel had run on one thread) and kept in the environment (the venv), one
build per CPU feature set and torch version, so an environment shared by
machines with other CPUs never loads a binary built for another. Any failure
(no compiler, no ninja, another build holding the directory past KVSERVE_KERNELS_WAIT_S) logs once and
leaves the torch paths. A start never waits silently: a compile says so (and why) before it begins, a
wait on another build says what it waits for, and a build lock left by a killed build is taken over
(build_lock.py).
`make install` builds it ahead of time; KVSERVE_NO_CPP_KERNELS=1 turns it off; KVSERVE_KERNELS_DIR=DIR
builds (and looks for a build) under DIR instead of the environment's kvserve-kernels/.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from kvserve.cpu_features import cpu_flags
from kvserve.kernels.build_lock import BuildLock

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("bindings.cpp", "paged_decode.cpp", "paged_decode_quant.cpp", "quant_matmul.cpp",
                         "kquant_matmul.cpp", "kquant_repack.cpp", "fused_ops.cpp", "gated_delta.cpp",
                                     "decoder_stack.cpp")]
_lock = threading.Lock()
# How long a start waits for another process's build of the same directory before running without it.
DEFAULT_WAIT_LIMIT_S = 600.0
_state: dict[str, Any] = {}  # "module" (None: torch paths), and "directory" or "error" once tried

# What running without the kernels costs, in the words a user acts on (measured: W2 on the embedded model,
# TPOT 42.9 ms on the torch paths vs 7.2 ms with the kernels).
TORCH_PATHS_COST = ("int4/int8 weights are refused and --weights-dtype auto holds bfloat16 or float32 instead "
                    "(decode about 6x slower on the embedded model), decode attention gathers every block and "
                    "each layer's ops run as chains of torch ops")


@dataclass(frozen=True)
class KernelState:
    """Which kernels the engine runs on, and why: for the startup log and `kvserve doctor`."""

    available: bool
    detail: str  # where the build is, or why there is none
    failed: bool = False  # a build was tried and failed (a compiler error): a warning, not a choice

    def describe(self) -> str:
        if self.available:
            return f"C++ CPU kernels ({self.detail})"
        return f"torch paths only: {self.detail}; {TORCH_PATHS_COST}"


def kernel_state() -> KernelState:
    """The kernels' state here (building them first if no one has asked yet)."""
    module = cpu_kernels()
    if module is not None:
        return KernelState(True, f"quantized matmul on {module.quant_matmul_isa()}; built in "
                                 f"{_state.get('directory', 'an unknown directory')}")
    if os.environ.get("KVSERVE_NO_CPP_KERNELS"):
        return KernelState(False, "the C++ kernels are turned off (KVSERVE_NO_CPP_KERNELS)")
    if "error" in _state:
        return KernelState(False, f"the C++ kernels failed to build ({_state['error']})", failed=True)
    return KernelState(False, "the C++ kernels are not loaded")


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

        build_directory = kernels_build_directory(torch.__version__)
        name = build_directory.name
        build_directory.mkdir(parents=True, exist_ok=True)
        wait_limit_s = float(os.environ.get("KVSERVE_KERNELS_WAIT_S") or DEFAULT_WAIT_LIMIT_S)
        with BuildLock(build_directory, say, wait_limit_s):
            started = time.perf_counter()
            reason = rebuild_reason(build_directory, name)
            if reason is not None:
                say(f"compiling kvserve's CPU kernels for this CPU, once: about a minute ({reason}; "
                    f"in {build_directory})")
            module = load(name=name, sources=[str(s) for s in _SOURCES], build_directory=str(build_directory),
                          extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                          extra_ldflags=["-lmvec", "-fopenmp"], verbose=False)
        log.info("C++ CPU kernels %s in %.1fs (compiled once per CPU, then loaded from the cache); "
                 "quantized matmuls on %s", "compiled" if reason else "loaded", time.perf_counter() - started,
                 module.quant_matmul_isa())
        _state["directory"] = str(build_directory)
        return module
    except Exception as exc:  # any build or load failure: the torch paths still work, at a cost said loudly
        _state["error"] = f"{type(exc).__name__}: {_first_error_line(str(exc))}"
        log.warning("C++ CPU KERNELS UNAVAILABLE: %s. Running on the torch paths instead: %s. `kvserve doctor` "
                    "shows the kernels' state", _state["error"], TORCH_PATHS_COST)
        return None


def kernels_build_directory(torch_version: str) -> Path:
    """Where this checkout's kernels are built for this CPU and torch version."""
    # One build per CPU feature set, torch version and source checkout: a shared cache never loads a
    # foreign binary, and two checkouts (git worktrees) sharing one venv do not rebuild each other's
    # binary in turn (ninja sees another source path).
    key = " ".join([torch_version, str(_SOURCES[0].parent.resolve()), *sorted(cpu_flags())])
    name = f"kvserve_cpu_kernels_{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    # Built inside the environment (the venv), not in a per-user cache shared by every environment.
    return Path(os.environ.get("KVSERVE_KERNELS_DIR") or Path(sys.prefix) / "kvserve-kernels") / name


def say(line: str) -> None:
    """A line about the build on stderr, whatever logging is set up (`make install` and scripts set none):
    a start must never be silent while it compiles or waits."""
    print(f"kvserve: {line}", file=sys.stderr, flush=True)


def rebuild_reason(build_directory: Path, name: str) -> str | None:
    """Why `load` will compile here (None: it loads the finished build): no library yet, or a source newer
    than it (headers included)."""
    library = build_directory / f"{name}.so"
    if not library.exists():
        return "no finished build here yet: a first start on this CPU, or an earlier build was stopped"
    built = library.stat().st_mtime
    changed = sorted(source.name for source in _SOURCES[0].parent.iterdir() if source.stat().st_mtime > built)
    return f"sources changed since the last build: {', '.join(changed)}" if changed else None


def _first_error_line(message: str) -> str:
    """The compiler's first error (torch's message starts with ninja's command lines), else the first line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    line = next((line for line in lines if "error:" in line.lower()), lines[0] if lines else "no message")
    return line if len(line) <= 300 else line[:297] + "..."

