"""W11: a 1B-class model at real size. Writes a random-weight GGUF with Llama-3.2-1B's body (hidden 2048, 16
layers, 32 heads / 8 KV heads, FFN 8192, tied embeddings) on SmolLM2's 49,152-token vocabulary, in Q4_0 and
Q4_K_M, then runs W2 (1 x 512 prompt, 128 output; W4 with --workloads) with kvserve, drafting off, and
with llama.cpp's llama-bench on the same files in one sitting, and prints TTFT, TPOT, their ratio, the load
time, the bytes read per token and the bandwidth floor (those bytes / the measured read bandwidth).

The files are quantized as llama-quantize lays them out (Q4_K_M: Q4_K, with attn_v and ffn_down in Q6_K
on its "more bits" layers; both files keep the tied embedding in Q6_K) by kvserve's own simple
quantizer (kvserve/kernels/kquant_quantize.py) and the gguf package's Q4_0: the speed of a file depends on
its types and sizes, not on how well its scales were searched. llama-bench is looked for on PATH and
under /tmp/*/build/bin (--llama-bench PATH); without it that column is skipped with a message.

    .venv/bin/python bench/w11_1b.py [--dir /tmp/kvserve-w11] [--files Q4_0 Q4_K_M] [--workloads W2 W4]
                                     [--rounds 3] [--llama-bench PATH]

--no-write uses files already there (so a checkout without the quantizer, e.g. an older main, can be
measured on the same files).
"""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.cpu_features import describe_cpu
from kvserve.engine.engine import Engine
from kvserve.model.loader import embedded_model_path, load_model
from workloads import freeze_setup, greedy, random_prompts, run_engine

WORKLOADS = {"W2": (512, 128), "W4": (4096, 64)}
BODY = dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=49152)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v / ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _type_of(name: str, layer: int, mix: str) -> str:
    if name == "token_embd.weight":
        return "Q6_K"
    if mix == "Q4_0":
        return "Q4_0"
    return "Q6_K" if name in ("attn_v.weight", "ffn_down.weight") and _more_bits(layer, BODY["layers"]) else "Q4_K"


def _quantized(weight: torch.Tensor, type_name: str) -> np.ndarray:
    if type_name == "Q4_0":
        import gguf
        from gguf.quants import quantize

        return quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_0)
    from kvserve.kernels.kquant_quantize import quantize_kquant

    return quantize_kquant(weight, type_name).numpy()


def write_file(path: Path, mix: str) -> None:
    """The random-weight 1B-class file in `mix` ("Q4_0" or "Q4_K_M"), SmolLM2's tokenizer metadata."""
    import gguf

    b = BODY
    head_dim = b["hidden"] // b["heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(b["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(b["hidden"])
    writer.add_feed_forward_length(b["ffn"])
    writer.add_head_count(b["heads"])
    writer.add_head_count_kv(b["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(b["vocab"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if mix == "Q4_0" else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    reader = gguf.GGUFReader(str(embedded_model_path()))
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            value = field.contents()
            writer.add_key_value(field.name, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
    gen = torch.Generator().manual_seed(0)
    shapes = {"attn_q.weight": (b["hidden"], b["hidden"]), "attn_k.weight": (b["kv_heads"] * head_dim, b["hidden"]),
              "attn_v.weight": (b["kv_heads"] * head_dim, b["hidden"]), "attn_output.weight": (b["hidden"], b["hidden"]),
              "ffn_gate.weight": (b["ffn"], b["hidden"]), "ffn_up.weight": (b["ffn"], b["hidden"]),
              "ffn_down.weight": (b["hidden"], b["ffn"])}

    def add(name: str, shape: tuple[int, ...], layer: int = 0) -> None:
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
            return
        type_name = _type_of(name.split(".", 2)[-1] if name.startswith("blk.") else name, layer, mix)
        weight = torch.randn(shape, generator=gen) * 0.02
        writer.add_tensor(name, _quantized(weight, type_name), raw_dtype=gguf.GGMLQuantizationType[type_name])

    add("token_embd.weight", (b["vocab"], b["hidden"]))
    add("output_norm.weight", (b["hidden"],))
    for layer in range(b["layers"]):
        add(f"blk.{layer}.attn_norm.weight", (b["hidden"],))
        add(f"blk.{layer}.ffn_norm.weight", (b["hidden"],))
        for name, shape in shapes.items():
            add(f"blk.{layer}.{name}", shape, layer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_bandwidth() -> float:
    """Bytes a second this process reads from memory (a 1 GiB fp32 sum on torch's threads, best of 3)."""
    data = torch.ones(256 * 1024 * 1024)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


def bytes_per_token(model: torch.nn.Module) -> int:
    """What a decode step reads at least: every linear layer's held weights (the embedding lookup reads one
    row; the KV cache read is left out, ~1% here at 512 tokens)."""
    from kvserve.model.layers import Linear

    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, Linear)
               for p in m.parameters(recurse=False))


def llama_bench_binary(asked: str | None) -> str | None:
    if asked:
        return asked
    return shutil.which("llama-bench") or next(iter(sorted(glob.glob("/tmp/*/build/bin/llama-bench"))), None)


def run_llama_bench(binary: str, path: Path, prompt_len: int, output_len: int) -> tuple[float, float]:
    """(TTFT, TPOT) from llama-bench -t threads -p P -n N -d P: prompt time at its rate, 1 / token rate."""
    threads = str(torch.get_num_threads())
    out = subprocess.run([binary, "-m", str(path), "-t", threads, "-p", str(prompt_len), "-n", str(output_len),
                          "-d", str(prompt_len), "-o", "json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    prompt_rate = next(r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"])
    gen_rate = next(r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"])
    return prompt_len / prompt_rate, 1.0 / gen_rate


def measure_file(path: Path, args: argparse.Namespace, bandwidth: float, llama_bench: str | None) -> None:
    started = time.perf_counter()
    loaded = load_model(path, weights_dtype=args.weights_dtype)
    load_s = time.perf_counter() - started
    per_token = bytes_per_token(loaded.model)
    floor = per_token / bandwidth
    print(f"{path.name}: {path.stat().st_size / 1e6:.0f} MB, loaded in {load_s:.1f} s ({loaded.linear_dtype}), "
          f"{per_token / 1e6:.0f} MB read per token, floor {floor * 1e3:.1f} ms", flush=True)
    engine = Engine(EngineConfig(kv_cache_memory="1GiB", speculative="off"), loaded=loaded)
    run_engine(engine, random_prompts(1, 64, seed=1), greedy(4))  # warm-up
    freeze_setup()
    for name in args.workloads:
        prompt_len, output_len = WORKLOADS[name]
        best_ttft = best_tpot = float("inf")
        for round_index in range(args.rounds):
            prompt = random_prompts(1, prompt_len, seed=prompt_len + round_index)[0]  # no cached prefix
            (output,), _ = run_engine(engine, [prompt], greedy(output_len))
            best_ttft, best_tpot = min(best_ttft, output.metrics.ttft), min(best_tpot, output.metrics.tpot)
        line = (f"  {name}: kvserve TTFT {best_ttft:.2f} s, TPOT {best_tpot * 1e3:.1f} ms "
                f"({best_tpot / floor:.2f}x the floor)")
        if llama_bench:
            ttft, tpot = run_llama_bench(llama_bench, path, prompt_len, output_len)
            line += (f" | llama-bench TTFT {ttft:.2f} s, TPOT {tpot * 1e3:.1f} ms | kvserve / llama.cpp: "
                     f"TTFT {best_ttft / ttft:.2f}x, TPOT {best_tpot / tpot:.2f}x")
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/kvserve-w11")
    parser.add_argument("--files", nargs="+", default=["Q4_0", "Q4_K_M"], choices=["Q4_0", "Q4_K_M"])
    parser.add_argument("--workloads", nargs="+", default=["W2"], choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3, help="runs per workload; the best is reported")
    parser.add_argument("--weights-dtype", default="auto")
    parser.add_argument("--llama-bench", default=None, help="llama-bench binary (default: PATH, /tmp/*/build/bin)")
    parser.add_argument("--no-write", action="store_true", help="use the files in --dir as they are")
    args = parser.parse_args()
    print(f"CPU: {describe_cpu()}; {torch.get_num_threads()} threads", flush=True)
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    llama_bench = llama_bench_binary(args.llama_bench)
    if llama_bench is None:
        print("llama-bench: skipped (not on PATH nor under /tmp/*/build/bin; build llama.cpp or pass --llama-bench)")
    bandwidth = read_bandwidth()
    print(f"measured read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    for mix in args.files:
        path = directory / f"llama-1b-body-{mix}.gguf"
        if not path.exists():
            if args.no_write:
                raise SystemExit(f"{path} is not there (--no-write)")
            started = time.perf_counter()
            write_file(path, mix)
            print(f"wrote {path} in {time.perf_counter() - started:.0f} s", flush=True)
        measure_file(path, args, bandwidth, llama_bench)


if __name__ == "__main__":
    main()
