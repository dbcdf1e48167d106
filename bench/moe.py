"""Qwen3-MoE on a CPU: a decode step reads the routed experts only, so it costs what a dense model of the
same *active* size costs, not what its total size would.

Writes two random-weight GGUF files with the gguf package (Q4_0 matrices, the router and norms F32, as
llama.cpp's quantizer leaves them): a `qwen3moe` model of E experts, k per token, and a dense `qwen3` model
whose MLP is k experts wide (intermediate = k x the expert's), so that both have the same active parameter
count per token. For each, kvserve (default weights: the files' own Q4_0 codes as int4) prints

- TPOT: one request, a 32-token prompt, greedy, `--tokens` output tokens; the decode steps' mean, best of
  `--rounds` rounds (a busy neighbour on a shared machine only ever slows a round down);
- bytes read per decode step: every linear layer a one-token step calls, its held tensors' bytes (each
  layer's whole weight is read per call), and the parameters those layers hold: the active parameters;
- the total parameters, for scale.

llama.cpp's `llama-bench` runs on the same files when bench/llama_tools.py finds it built (tg = `--tokens`);
skipped with a message otherwise.

    .venv/bin/python bench/moe.py [--experts 32] [--top-k 4] [--layers 8] [--hidden 1024] [--tokens 64]
                                  [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.cpu_features import describe_cpu
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.model.layers import Linear
from kvserve.model.loader import LoadedModel, load_model
from llama_tools import find_llama_tool, missing_message

VOCAB, HEADS, KV_HEADS, HEAD_DIM, PROMPT_LEN = 8192, 16, 4, 128, 32


def write_qwen3_gguf(path: Path, args: argparse.Namespace, moe: bool) -> None:
    """A random Qwen3 (dense) or Qwen3-MoE GGUF, laid out as llama.cpp's converter writes one."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    hidden, expert_size = args.hidden, args.expert_size
    writer = gguf.GGUFWriter(str(path), "qwen3moe" if moe else "qwen3")
    writer.add_block_count(args.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(args.top_k * expert_size)  # the dense model's MLP: k experts wide
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_string("tokenizer.ggml.model", "none")  # token ids only
    if moe:
        writer.add_expert_count(args.experts)
        writer.add_expert_used_count(args.top_k)
        writer.add_expert_feed_forward_length(expert_size)

    def matrix(name: str, *shape: int) -> None:
        weights = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
        writer.add_tensor(name, quantize(weights, gguf.GGMLQuantizationType.Q4_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q4_0)

    def vector(name: str, *shape: int, scale: float = 0.0) -> None:
        writer.add_tensor(name, (1 + scale * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32))

    matrix("token_embd.weight", VOCAB, hidden)
    vector("output_norm.weight", hidden)
    matrix("output.weight", VOCAB, hidden)
    for i in range(args.layers):
        block = f"blk.{i}"
        vector(f"{block}.attn_norm.weight", hidden)
        vector(f"{block}.ffn_norm.weight", hidden)
        vector(f"{block}.attn_q_norm.weight", HEAD_DIM)
        vector(f"{block}.attn_k_norm.weight", HEAD_DIM)
        matrix(f"{block}.attn_q.weight", HEADS * HEAD_DIM, hidden)
        matrix(f"{block}.attn_k.weight", KV_HEADS * HEAD_DIM, hidden)
        matrix(f"{block}.attn_v.weight", KV_HEADS * HEAD_DIM, hidden)
        matrix(f"{block}.attn_output.weight", hidden, HEADS * HEAD_DIM)
        if moe:
            router = rng.standard_normal((args.experts, hidden), dtype=np.float32) * 0.5
            writer.add_tensor(f"{block}.ffn_gate_inp.weight", router.astype(np.float32))
            matrix(f"{block}.ffn_gate_exps.weight", args.experts, expert_size, hidden)
            matrix(f"{block}.ffn_up_exps.weight", args.experts, expert_size, hidden)
            matrix(f"{block}.ffn_down_exps.weight", args.experts, hidden, expert_size)
        else:
            matrix(f"{block}.ffn_gate.weight", args.top_k * expert_size, hidden)
            matrix(f"{block}.ffn_up.weight", args.top_k * expert_size, hidden)
            matrix(f"{block}.ffn_down.weight", hidden, args.top_k * expert_size)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def decode_step_reads(loaded: LoadedModel) -> tuple[int, int]:
    """(bytes, parameters) of the linear layers one decode step (one token) calls, each counted per call."""
    read = {"bytes": 0, "params": 0}

    def count(module: Linear, args, output) -> None:
        read["bytes"] += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        read["params"] += module.input_size * module.output_size

    hooks = [m.register_forward_hook(count) for m in loaded.model.modules() if isinstance(m, Linear)]
    try:
        loaded.model(torch.tensor([7]), torch.tensor([0]))  # one token: which layers it calls, not its context
    finally:
        for hook in hooks:
            hook.remove()
    return read["bytes"], read["params"]


def kvserve_tpot(loaded: LoadedModel, tokens: int, rounds: int) -> float:
    """Seconds per output token after the first, best of `rounds`."""
    engine = Engine(EngineConfig(kv_cache_memory="256MiB", speculative="off", enable_prefix_caching=False),
                    loaded=loaded)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompt = np.random.default_rng(1).integers(0, VOCAB, PROMPT_LEN).tolist()
    best = float("inf")
    for _ in range(rounds + 1):  # the first round warms up
        engine.add_request(prompt, params)
        engine.step()  # the prefill and the first token
        started = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        best = min(best, (time.perf_counter() - started) / (tokens - 1))
    return best


def llama_bench_tpot(binary: Path, path: Path, tokens: int) -> str:
    result = subprocess.run([str(binary), "-m", str(path), "-p", "0", "-n", str(tokens), "-t",
                             str(torch.get_num_threads()), "-o", "json"], capture_output=True, text=True)
    if result.returncode != 0:
        return f"failed: {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.returncode}"
    tokens_per_s = json.loads(result.stdout)[0]["avg_ts"]
    return f"{1000 / tokens_per_s:.2f} ms ({tokens_per_s:.1f} tok/s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-size", type=int, default=512, help="each expert's intermediate size")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch / kernel threads (default: torch's); on a machine whose cores are busy, 1 "
                             "keeps each kernel call from waiting for a descheduled second thread")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {describe_cpu()}; torch threads {torch.get_num_threads()}", flush=True)
    print(f"shape: {args.layers} layers, hidden {args.hidden}, {HEADS} heads / {KV_HEADS} KV heads of {HEAD_DIM}, "
          f"vocab {VOCAB}; MoE: {args.experts} experts of {args.expert_size}, {args.top_k} per token; dense: "
          f"an MLP of {args.top_k * args.expert_size}", flush=True)
    llama_bench = find_llama_tool("llama-bench")
    with tempfile.TemporaryDirectory(prefix="kvserve-moe-") as directory:
        for name, moe in (("qwen3moe", True), ("qwen3 (dense)", False)):
            path = Path(directory) / f"{'moe' if moe else 'dense'}.gguf"
            write_qwen3_gguf(path, args, moe)
            loaded = load_model(path, weights_dtype="auto")
            read_bytes, active = decode_step_reads(loaded)
            tpot = kvserve_tpot(loaded, args.tokens, args.rounds)
            print(f"{name}: file {path.stat().st_size / 2**20:.1f} MiB, {loaded.model.num_parameters() / 1e6:.1f}M "
                  f"parameters, linear layers {loaded.linear_dtype}", flush=True)
            print(f"  decode step reads {read_bytes / 2**20:.2f} MiB of linear weights: {active / 1e6:.2f}M active "
                  f"parameters ({8 * read_bytes / active:.2f} bits each)", flush=True)
            print(f"  kvserve TPOT {1000 * tpot:.2f} ms ({1 / tpot:.1f} tok/s)", flush=True)
            if llama_bench is None:
                print("  " + missing_message("llama-bench"), flush=True)
            else:
                print(f"  llama-bench ({llama_bench}): TPOT {llama_bench_tpot(llama_bench, path, args.tokens)}",
                      flush=True)
            del loaded


if __name__ == "__main__":
    main()
