"""How often to snapshot a hybrid model's recurrent state: prefix hits bought vs snapshot memory.

A recurrent layer's state is fixed-size per request, overwritten at every token, so a prefix hit needs a
snapshot of it exactly where the hit ends (kv/state/manager.py). kvserve keeps one at every
`state_snapshot_tokens` tokens of a sequence, in whole blocks (the grid), at the last block boundary of each step (a
request's tail: the next chat turn resumes there) and where a hit's attention blocks went past the last
snapshot (a fork). This runs two workloads through the real engine for several intervals and prints, per
interval: the prompt tokens served from the cache, the snapshots kept at the end, the most held at once,
and what those would take on Qwen3.5-0.8B (its state: 18 Gated DeltaNet layers x (conv 6,144 x 3 + 16 x
128 x 128) float32 = 20.2 MB a snapshot, vs 12 KiB of float16 K/V per token for its 6 attention layers).

- `system prompts`: 4 system prompts (150, 300, 700, 1,200 tokens), 6 users each asking a unique 40-token
  question (greedy, 16 tokens), users of different prompts interleaved;
- `chat`: 4 conversations of 4 turns, each turn the whole history plus a 30-token message.

The model is the tests' toy hybrid (tests/toy_hybrid.py: 2 recurrent and 2 attention layers); what hits
and what is kept depends only on the bookkeeping, which is the engine's own. Block size 16.

    PYTHONPATH=. .venv/bin/python bench/state_snapshots.py [--intervals 1 2 4 8 16 32] [--slots 4096]
"""

from __future__ import annotations

import argparse

import numpy as np

from kvserve.config import EngineConfig
from kvserve.cpu_features import describe_cpu
from kvserve.engine.engine import Engine
from kvserve.engine.output.types import RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.kv.cache.kv_spec import kv_spec
from kvserve.kv.state.state_spec import StateSpec, state_spec
from tests.toy_hybrid import toy_hybrid

BLOCK = 16
QWEN35_08B_STATE = StateSpec(18, ((6144, 3), (16, 128, 128)))
VOCAB = 160


def engine_for(loaded, interval: int, slots: int) -> Engine:
    per_state = state_spec(loaded.config).slot_bytes
    kv = 8192 * kv_spec(loaded.config).bytes_per_token
    memory = kv + slots * per_state
    return Engine(EngineConfig(block_size=BLOCK, kv_cache_memory=memory, weights_dtype="float32", speculative="off",
                               state_cache_fraction=slots * per_state / memory, state_snapshot_tokens=interval * BLOCK,
                               max_num_batched_tokens=512), loaded=loaded)


def run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Each prompt alone (a user at a time); the outputs and the most snapshots held at once."""
    outputs, peak, assembler = [], 0, RequestOutputAssembler()
    for prompt in prompts:
        request = engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            for delta in engine.step():
                final = assembler.add(delta)
                if final is not None and final.request_id == request:
                    outputs.append(list(final.outputs[0].token_ids))
            peak = max(peak, engine.stats().states.num_snapshots)
    return outputs, peak


def system_prompts(rng: np.random.Generator) -> list[list[int]]:
    systems = [rng.integers(1, VOCAB, n).tolist() for n in (150, 300, 700, 1200)]
    return [systems[user % 4] + rng.integers(1, VOCAB, 40).tolist() for user in range(24)]


def chat_turns(engine: Engine, rng: np.random.Generator) -> int:
    """The most snapshots held at once."""
    histories = [rng.integers(1, VOCAB, 60).tolist() for _ in range(4)]
    peak = 0
    for _ in range(4):
        for index, history in enumerate(histories):
            answer, peak_now = run(engine, [history])
            peak = max(peak, peak_now)
            histories[index] = history + answer[0] + rng.integers(1, VOCAB, 30).tolist()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--slots", type=int, default=4096, help="state slots (enough that none is evicted)")
    args = parser.parse_args()
    loaded = toy_hybrid(VOCAB)
    print(f"CPU: {describe_cpu()}; block size {BLOCK}; Qwen3.5-0.8B snapshot: "
          f"{QWEN35_08B_STATE.slot_bytes / 1e6:.1f} MB ({QWEN35_08B_STATE.formula()})")
    print(f"{'workload':<16}{'interval':>9}{'hit %':>8}{'snapshots kept':>16}{'most held':>11}"
          f"{'at 0.8B':>10}")
    for name in ("system prompts", "chat"):
        for interval in args.intervals:
            engine = engine_for(loaded, interval, args.slots)
            rng = np.random.default_rng(0)
            peak = run(engine, system_prompts(rng))[1] if name == "system prompts" else chat_turns(engine, rng)
            stats = engine.stats()
            hit = 100 * stats.prefix_cache_hits / stats.prefix_cache_queries
            print(f"{name:<16}{interval:>9}{hit:>7.1f}%{stats.states.num_snapshots:>16}{peak:>11}"
                  f"{peak * QWEN35_08B_STATE.slot_bytes / 1e9:>8.2f} GB")


if __name__ == "__main__":
    main()
