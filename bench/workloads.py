"""DESIGN §5 standard workloads: random token prompts (default_rng(0), ids in [1000, 40000)), greedy, EOS ignored."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from kvserve import huge_pages
from kvserve.engine.engine import Engine
from kvserve.engine.output.types import RequestOutput, RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.platform import freeze_startup_heap

RESULTS = Path(__file__).parent / "results"


def probe_buffer(elements: int = 2**28) -> torch.Tensor:
    """fp32 ones on 2 MiB pages, as the engine's weights and KV pool lie (kvserve/huge_pages.py): what a read
    probe sums. On 4 KiB pages the same sum read 45 GB/s where this one read 62, and 33 where it read 36 (the
    host's fast and slow states, bench/kquant_stream.py): a 4 KiB probe reads too little, and the floor it
    gives is too high."""
    return huge_pages.empty((elements,), torch.float32, torch.device("cpu")).fill_(1.0)


def read_rate(data: torch.Tensor, repeats: int = 1) -> float:
    """Bytes a second summing `data` on torch's threads, best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * data.element_size() / best


def read_bandwidth(repeats: int = 3) -> float:
    """Bytes a second this process reads from memory: a 1 GiB sum of `probe_buffer`, best of `repeats`."""
    return read_rate(probe_buffer(), repeats)


def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 40000, length).tolist() for _ in range(count)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[RequestOutput], dict]:
    """Add every prompt, step to completion; returns outputs in order and step statistics."""
    started = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    finished: dict[str, RequestOutput] = {}
    assembler = RequestOutputAssembler()
    peak_blocks = steps = 0
    while engine.has_unfinished():
        for delta in engine.step():
            final = assembler.add(delta)
            if final is not None:
                finished[final.request_id] = final
        steps += 1
        peak_blocks = max(peak_blocks, engine.stats().num_used_blocks)
    return [finished[i] for i in ids], {
        "wall_s": time.perf_counter() - started, "steps": steps, "peak_blocks": peak_blocks,
        "preemptions": engine.stats().num_preemptions,
    }


def freeze_setup() -> None:
    """What a running server does once it has started (kvserve.platform.freeze_startup_heap): the loaded
    engines stay out of full garbage collections, whose 80-160 ms pauses would otherwise land in whichever
    engine's timing they hit."""
    freeze_startup_heap()


def commit_pool(engine: Engine) -> float:
    """Zero (and so commit) the engine's whole KV pool, as a server does while it idles before its requests
    (AsyncEngine: kv/cache/zeroing.py), and as llama.cpp clears its cache when it makes a context: the steps
    timed after it fault no fresh page in. Returns the seconds it took."""
    started = time.perf_counter()
    while engine.zero_pool_ahead():
        pass
    return time.perf_counter() - started


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"machine": platform.machine(), "python": platform.python_version(), **payload}
    path.write_text(json.dumps(payload, indent=2))
    return path
