"""A hybrid model end to end: a random-weight Qwen3.5-0.8B-shaped GGUF (24 layers, 18 Gated DeltaNet + 6 full
attention, hidden 1,024, tied 248,320-token embedding), written as llama.cpp's converter lays one out (Q4_0
matrices, as tests/qwen35_variants.py writes them), served by kvserve and run by transformers on the same
weights (the file's, dequantized, fp32). One sitting, printed side by side:

- TTFT (a `--prompt`-token prompt) and TPOT (`--tokens` greedy tokens), best of `--rounds`: kvserve on the
  file (default weights: the Q4_0 codes as int4) and transformers (fp32, its own cache; its Gated DeltaNet
  runs the torch fallbacks on a CPU: no flash-linear-attention kernels);
- a 4-turn chat (each turn the whole history plus a 64-token message, 32 tokens answered): TTFT of each turn
  with kvserve's prefix cache on and off (the same tokens: a hit changes the cost, never the answer);
- what the recurrent state takes: bytes per slot, and the snapshots the chat left per conversation.

llama.cpp's tools are not built on these machines: skipped, with this message.

    PYTHONPATH=. .venv/bin/python bench/hybrid.py [--prompt 512] [--tokens 32] [--rounds 2] [--layers 24]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.cpu_features import describe_cpu
from kvserve.engine.engine import Engine
from kvserve.engine.output.types import RequestOutputAssembler
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.model.loader import load_model
from tests.qwen35_variants import write_qwen35_gguf


def transformers_model(layers: int):
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        tie_word_embeddings=True, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(config).eval()


def timed_engine_run(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, float, list[int]]:
    """(TTFT, TPOT, tokens) of one greedy request alone."""
    request = engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    assembler, started, first, final = RequestOutputAssembler(), time.perf_counter(), None, None
    while engine.has_unfinished():
        for delta in engine.step():
            if first is None and delta.new_token_ids:
                first = time.perf_counter()
            final = assembler.add(delta) or final
    end = time.perf_counter()
    assert final is not None and final.request_id == request
    return first - started, (end - first) / max(tokens - 1, 1), list(final.outputs[0].token_ids)


@torch.inference_mode()
def timed_transformers_run(model, prompt: list[int], tokens: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    started = time.perf_counter()
    out = model(ids, use_cache=True)
    ttft = time.perf_counter() - started
    cache, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
    started = time.perf_counter()
    for _ in range(tokens - 1):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
    return ttft, (time.perf_counter() - started) / max(tokens - 1, 1)


def engine_for(path: Path, caching: bool) -> Engine:
    return Engine(EngineConfig(model=str(path), kv_cache_memory="3GiB", speculative="off",
                               enable_prefix_caching=caching))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24, help="24: Qwen3.5-0.8B (every 4th layer attends)")
    args = parser.parse_args()
    print(f"CPU: {describe_cpu()}, torch threads {torch.get_num_threads()}")
    workdir = Path(tempfile.mkdtemp(prefix="kvserve-hybrid-"))
    try:
        started = time.perf_counter()
        model = transformers_model(args.layers)
        path = workdir / "qwen35-0.8b-shaped-q4_0.gguf"
        reference = write_qwen35_gguf(model, path, {"proj": "Q4_0"})
        model.load_state_dict(reference, strict=False)  # the file's weights, dequantized
        print(f"wrote {path.name} ({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - started:.0f} s")
        rng = np.random.default_rng(0)
        prompt = rng.integers(100, 200000, args.prompt).tolist()

        engine = engine_for(path, caching=False)
        kv = [timed_engine_run(engine, prompt, args.tokens) for _ in range(args.rounds)]
        hf = [timed_transformers_run(model, prompt, args.tokens) for _ in range(args.rounds)]
        print(f"\n{args.prompt}-token prompt, {args.tokens} tokens, best of {args.rounds}:")
        print(f"  kvserve (int4 from Q4_0)   TTFT {min(r[0] for r in kv):7.2f} s   TPOT {min(r[1] for r in kv) * 1e3:7.1f} ms")
        print(f"  transformers (fp32)        TTFT {min(r[0] for r in hf):7.2f} s   TPOT {min(r[1] for r in hf) * 1e3:7.1f} ms")
        print("  llama.cpp: llama-bench not built here (skipped)" if shutil.which("llama-bench") is None else "")
        del engine

        print("\n4-turn chat (history + 64-token message, 32 tokens answered), kvserve TTFT per turn:")
        answers: dict[bool, list[list[int]]] = {True: [], False: []}
        cached_engine = engine_for(path, caching=True)
        opening = rng.integers(100, 200000, 200).tolist()
        for caching in (True, False):
            engine = cached_engine if caching else engine_for(path, caching=False)
            history, ttfts = opening, []
            turn_rng = np.random.default_rng(1)
            for _ in range(4):
                ttft, _, answer = timed_engine_run(engine, history, 32)
                ttfts.append(ttft)
                answers[caching].append(answer)
                history = history + answer + turn_rng.integers(100, 200000, 64).tolist()
            print(f"  prefix cache {'on ' if caching else 'off'}: " + "  ".join(f"{t:6.2f} s" for t in ttfts))
        print(f"  same tokens on and off: {answers[True] == answers[False]}")
        states = cached_engine.stats().states
        print(f"\nrecurrent state: {states.slot_bytes / 1e6:.1f} MB a slot; after the chat {states.num_snapshots} "
              f"snapshots held ({states.num_snapshots * states.slot_bytes / 1e6:.0f} MB) for one conversation of "
              f"4 turns; {states.num_slots} slots in the {cached_engine.config.state_cache_fraction:.0%} share")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
