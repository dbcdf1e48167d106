"""llama.cpp on the same GGUF file, for the latency and throughput benches (optional).

Install it into the venv from its sdist (it compiles llama.cpp for this CPU, several minutes on 2 cores):

    CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 .venv/bin/pip install llama-cpp-python

Without it the benches say so and skip llama.cpp. Its AMX path segfaults in this VM, so the model
loads with `use_extra_bufts = False` (no extra buffer types) whatever the CPU.
Greedy decoding through the low-level eval/sample loop: no stop at EOS, like the other engines here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch


def load_llama_cpp(path: Path, n_ctx: int) -> Any | None:
    """A `llama_cpp.Llama` on `path`, or None (with a message) when llama-cpp-python is not installed."""
    try:
        import llama_cpp
        import llama_cpp.llama_cpp as low_level
    except ImportError:
        print("llama.cpp: skipped (llama-cpp-python is not installed; see bench/llamacpp.py)")
        return None
    default_params = low_level.llama_model_default_params

    def params_without_extra_bufts():
        params = default_params()
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = params_without_extra_bufts
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=torch.get_num_threads(),
                               n_threads_batch=torch.get_num_threads(), verbose=False)
    finally:
        low_level.llama_model_default_params = default_params


def llama_cpp_latency(llm: Any, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds: prompt eval + first greedy token, then the mean of the rest."""
    llm.reset()
    started = time.perf_counter()
    llm.eval(prompt)
    token = llm.sample(top_k=1, temp=0.0)
    ttft = time.perf_counter() - started
    decode_started = time.perf_counter()
    for _ in range(output_len - 1):
        llm.eval([token])
        token = llm.sample(top_k=1, temp=0.0)
    return ttft, (time.perf_counter() - decode_started) / (output_len - 1)


def llama_cpp_throughput(llm: Any, prompts: list[list[int]], output_len: int) -> float:
    """Wall seconds for every prompt, one after another (the binding has no batched generation)."""
    started = time.perf_counter()
    for prompt in prompts:
        llama_cpp_latency(llm, prompt, output_len)
    return time.perf_counter() - started
