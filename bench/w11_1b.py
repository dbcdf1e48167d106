"""W11: a 1B-class model at real size beside llama.cpp's own tools, in one sitting.

Writes a random-weight GGUF with Llama-3.2-1B's body (hidden 2048, 16 layers, 32 heads / 8 KV heads, FFN 8192,
tied embeddings) on SmolLM2's 49,152-token vocabulary, quantized to Q4_0 and Q4_K_M by llama.cpp's own
`llama-quantize` (from an F16 file written here), and measures kvserve (W2: 1 x 512 prompt, 128 output;
W4 with --workloads; drafting off, best of --runs per round) against `llama-bench -t T -p P -n N -d P` (its
prompt test runs after P tokens already in context, so its TTFT is of a slightly harder prompt; its token
test decodes at the same depths as kvserve's W2; best of its repetitions) on the same files, in --rounds
interleaved rounds (kvserve, then llama-bench, file after file), plus the embedded SmolLM2-135M Q4_1 file
(`--files SmolLM2`). Printed per file: the engine's start to ready (loading the file, building the engine,
the first request: the kernels' first call), the bytes a decode step reads, and per round each engine's
TTFT and TPOT beside the read bandwidth probed just before and just after its run (`workloads.read_bandwidth`:
a 1 GiB sum on 2 MiB pages, where the weights lie) and the floor that gives
(those bytes / the probes' mean), and the ratios, marked "one state" where all four probes agree within 15%
(the host's read bandwidth moves between ~30 and ~60 GB/s for tens of seconds at a time; the probes say
where it stood at each end of a run, not how the run went: an engine's step time moves by up to ~25% with
the probes alike), and 0.8x llama-bench's TPOT as a multiple of kvserve's floor (below 1, reaching it
would take reading faster than the probes did); then each figure's range, the ratios' over the rounds run
in one state, and the ratio of each engine's best over the sitting (the best time each reached in it).

llama-quantize, llama-bench: bench/llama_tools.py's lookup (it says how to build them). Without
llama-quantize the files are written by kvserve's own quantizer (kvserve/kernels/kquant_quantize.py, the
gguf package's Q4_0) in llama-quantize's type layout (Q4_K_M: Q4_K, attn_v and ffn_down in Q6_K on its
"more bits" layers, the tied embedding in Q6_K), under another name; without llama-bench that column is
skipped, each with a message.

    .venv/bin/python bench/w11_1b.py [--dir /tmp/kvserve-w11] [--files Q4_0 Q4_K_M SmolLM2]
                                     [--workloads W2 W4] [--rounds 2] [--runs 3] [--reps 3]

--no-write uses files already there (so a checkout without the quantizer, e.g. an older main, can be
measured on the same files).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from kvserve.config import EngineConfig
from kvserve.cpu_features import describe_cpu
from kvserve.engine.engine import Engine
from kvserve.model.loader import embedded_model_path, load_model
from kvserve.kernels import ops
from llama_tools import find_llama_tool, missing_message
from workloads import freeze_setup, greedy, random_prompts, read_bandwidth, run_engine

WORKLOADS = {"W2": (512, 128), "W4": (4096, 64)}
FILES = ("Q4_0", "Q4_K_M", "SmolLM2")  # SmolLM2: the embedded model's own file (Q4_1), not written here
# Probes this close (max / min) put two runs in one state of the host's bandwidth.
SAME_STATE_SPREAD = 1.15
BODY = dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=49152)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v / ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _type_of(name: str, layer: int, mix: str) -> str:
    if mix == "F16":  # llama-quantize's input
        return "F16"
    if name == "token_embd.weight":
        return "Q6_K"
    if mix == "Q4_0":
        return "Q4_0"
    return "Q6_K" if name in ("attn_v.weight", "ffn_down.weight") and _more_bits(layer, BODY["layers"]) else "Q4_K"


def _quantized(weight: torch.Tensor, type_name: str) -> np.ndarray:
    if type_name == "F16":
        return weight.numpy().astype(np.float16)
    if type_name == "Q4_0":
        import gguf
        from gguf.quants import quantize

        return quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_0)
    from kvserve.kernels.kquant_quantize import quantize_kquant

    return quantize_kquant(weight, type_name).numpy()


def write_file(path: Path, mix: str) -> None:
    """The random-weight 1B-class file in `mix` ("F16", or "Q4_0" / "Q4_K_M" by kvserve's quantizer), SmolLM2's
    tokenizer metadata."""
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
    writer.add_file_type({"F16": gguf.LlamaFileType.MOSTLY_F16, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                          "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M}[mix])
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
        raw_dtype = None if type_name == "F16" else gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, _quantized(weight, type_name), raw_dtype=raw_dtype)

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


def bytes_per_token(model: torch.nn.Module) -> int:
    """What a decode step reads at least: every linear layer's held weights (the embedding lookup reads one
    row; the KV cache read is left out, ~1% here at 512 tokens)."""
    from kvserve.model.layers import Linear

    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, Linear)
               for p in m.parameters(recurse=False))


def make_file(directory: Path, mix: str, quantizer: Path | None, no_write: bool) -> Path:
    """The 1B-class file in `mix`: llama-quantize's from the F16 file where it is built, else kvserve's
    quantizer's (its own name, so the two never mix); written once (under a temporary name, so a stopped
    run leaves no partial file to reuse), then reused."""
    path = directory / (f"llama-1b-body-{mix}.gguf" if quantizer else f"llama-1b-body-{mix}-kvserve-quantizer.gguf")
    if path.exists():
        return path
    if no_write:
        raise SystemExit(f"{path} is not there (--no-write)")
    started = time.perf_counter()
    partial = path.with_name(path.name + ".partial")
    if quantizer is None:
        write_file(partial, mix)
    else:
        source = directory / "llama-1b-body-F16.gguf"
        if not source.exists():
            write_file(source.with_name(source.name + ".partial"), "F16")
            source.with_name(source.name + ".partial").rename(source)
        threads = str(torch.get_num_threads())  # niced: quantizing is setup, not a figure
        subprocess.run(["nice", "-n", "19", str(quantizer), str(source), str(partial), mix, threads], check=True,
                       capture_output=True)
    partial.rename(path)
    print(f"wrote {path} in {time.perf_counter() - started:.0f} s", flush=True)
    return path


@dataclass
class Run:
    """One engine's figures in one round, with the read bandwidth probed just before and just after it (the
    host's moves between ~30 and ~60 GB/s for tens of seconds at a time: a ratio of two runs says most where
    both ran in one state)."""

    ttft: float
    tpot: float
    read: tuple[float, float]  # bytes a second, before and after

    def floor(self, per_token: int) -> float:
        """Seconds a step takes reading `per_token` bytes at this run's bandwidth (its two probes' mean)."""
        return per_token / (sum(self.read) / 2)

    def probes(self) -> str:
        return f"read {self.read[0] / 1e9:.0f}/{self.read[1] / 1e9:.0f} GB/s"


def probed(measure: Callable[[], tuple[float, float]]) -> Run:
    before = read_bandwidth()
    ttft, tpot = measure()
    return Run(ttft, tpot, (before, read_bandwidth()))


def one_state(*runs: Run, spread: float = SAME_STATE_SPREAD) -> bool:
    """Whether every probe of these runs read within `spread` of the others (the host stayed in one state)."""
    reads = [value for run in runs for value in run.read]
    return max(reads) <= spread * min(reads)


@dataclass
class Subject:
    """One file, loaded once, and its rounds: workload -> [Run, ...] per engine."""

    name: str
    path: Path
    engine: Engine
    bytes_per_token: int
    kvserve: dict[str, list[Run]] = field(default_factory=dict)
    llama: dict[str, list[Run]] = field(default_factory=dict)


def open_subject(name: str, path: Path, args: argparse.Namespace, bandwidth: float) -> Subject:
    """Load `path` and time the engine's start to ready: the file loaded, the engine built, the first
    request (its kernels' first call), the C++ kernels already built and imported."""
    started = time.perf_counter()
    loaded = load_model(path, weights_dtype=args.weights_dtype)
    loaded_at = time.perf_counter()
    engine = Engine(EngineConfig(kv_cache_memory="1GiB", speculative="off"), loaded=loaded)
    built_at = time.perf_counter()
    run_engine(engine, random_prompts(1, 64, seed=1), greedy(4))
    ready_at = time.perf_counter()
    per_token = bytes_per_token(loaded.model)
    floor = per_token / bandwidth
    print(f"{name}: {path.name}, {path.stat().st_size / 1e6:.0f} MB ({loaded.weight_format}); start to ready "
          f"{ready_at - started:.1f} s (load {loaded_at - started:.1f} s, engine {built_at - loaded_at:.1f} s, "
          f"first request {ready_at - built_at:.1f} s); linear layers {loaded.linear_dtype}, "
          f"{per_token / 1e6:.0f} MB read per token, floor {floor * 1e3:.1f} ms", flush=True)
    return Subject(name, path, engine, per_token)


def kvserve_round(subject: Subject, workload: str, runs: int, round_index: int) -> tuple[float, float]:
    """Best TTFT and best TPOT of `runs` requests, each on a fresh prompt (no cached prefix)."""
    prompt_len, output_len = WORKLOADS[workload]
    best_ttft = best_tpot = float("inf")
    for run in range(runs):
        prompt = random_prompts(1, prompt_len, seed=1000 * round_index + prompt_len + run)[0]
        (output,), _ = run_engine(subject.engine, [prompt], greedy(output_len))
        best_ttft, best_tpot = min(best_ttft, output.metrics.ttft), min(best_tpot, output.metrics.tpot)
    return best_ttft, best_tpot


def llama_bench_round(binary: Path, path: Path, workload: str, reps: int) -> tuple[float, float]:
    """(TTFT, TPOT) from `llama-bench -t T -p P -n N -d P -r reps`: the prompt test's best time, the token
    test's best time per token (its depth fill is not timed)."""
    prompt_len, output_len = WORKLOADS[workload]
    command = [str(binary), "-m", str(path), "-t", str(torch.get_num_threads()), "-p", str(prompt_len),
               "-n", str(output_len), "-d", str(prompt_len), "-r", str(reps), "-o", "json"]
    rows = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    prompt_ns = min(next(r["samples_ns"] for r in rows if r["n_prompt"] and not r["n_gen"]))
    gen_ns = min(next(r["samples_ns"] for r in rows if r["n_gen"] and not r["n_prompt"]))
    return prompt_ns / 1e9, gen_ns / 1e9 / output_len


def _span(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    low, high = min(values) * scale, max(values) * scale
    return f"{low:.{digits}f}" if f"{low:.{digits}f}" == f"{high:.{digits}f}" else f"{low:.{digits}f}-{high:.{digits}f}"


def round_line(subject: Subject, workload: str, ours: Run, theirs: Run | None) -> str:
    per_token = subject.bytes_per_token
    floor = ours.floor(per_token)
    line = (f"{subject.name} {workload}: kvserve ({ours.probes()}, floor {floor * 1e3:.1f} ms) "
            f"TTFT {ours.ttft:.2f} s, TPOT {ours.tpot * 1e3:.1f} ms ({ours.tpot / floor:.2f}x the floor)")
    if theirs is not None:
        line += (f" | llama-bench ({theirs.probes()}) TTFT {theirs.ttft:.2f} s, TPOT {theirs.tpot * 1e3:.1f} ms "
                 f"({theirs.tpot / theirs.floor(per_token):.2f}x the floor) | kvserve / llama.cpp: TTFT "
                 f"{ours.ttft / theirs.ttft:.2f}x, TPOT {ours.tpot / theirs.tpot:.2f}x "
                 f"({'one state' if one_state(ours, theirs) else 'the state moved'}); 0.8x llama-bench's TPOT "
                 f"is {0.8 * theirs.tpot / floor:.2f}x kvserve's floor")
    return line


def print_summary(subjects: list[Subject]) -> None:
    """Each figure's range over the rounds; the ratios are per round (kvserve / llama-bench of one round, each
    engine's TPOT over its own run's floor), then over only the rounds where both engines ran in one state,
    then each engine's best over the sitting."""
    print("summary (ranges over rounds):", flush=True)
    for subject in subjects:
        per_token = subject.bytes_per_token
        for workload, ours in subject.kvserve.items():
            over_floor = _span([r.tpot / r.floor(per_token) for r in ours])
            line = (f"  {subject.name} {workload}: kvserve TTFT {_span([r.ttft for r in ours])} s, TPOT "
                    f"{_span([r.tpot for r in ours], 1e3, 1)} ms ({over_floor}x the floor of "
                    f"{_span([r.floor(per_token) for r in ours], 1e3, 1)} ms)")
            theirs = subject.llama.get(workload)
            if theirs:
                pairs = list(zip(ours, theirs))
                steady = [(a, b) for a, b in pairs if one_state(a, b)]
                best_ttft = min(r.ttft for r in ours) / min(r.ttft for r in theirs)
                best_tpot = min(r.tpot for r in ours) / min(r.tpot for r in theirs)
                in_one_state = (f"{len(steady)} of {len(pairs)} rounds in one state (read "
                                f"{_span([v for a, b in steady for v in a.read + b.read], 1e-9, 0)} GB/s): "
                                f"TTFT {_span([a.ttft / b.ttft for a, b in steady])}x, "
                                f"TPOT {_span([a.tpot / b.tpot for a, b in steady])}x" if steady
                                else f"none of {len(pairs)} rounds in one state")
                line += (f" | llama-bench TTFT {_span([r.ttft for r in theirs])} s, TPOT "
                         f"{_span([r.tpot for r in theirs], 1e3, 1)} ms "
                         f"({_span([r.tpot / r.floor(per_token) for r in theirs])}x the floor) | "
                         f"kvserve / llama.cpp: TTFT {_span([a.ttft / b.ttft for a, b in pairs])}x, TPOT "
                         f"{_span([a.tpot / b.tpot for a, b in pairs])}x; {in_one_state}; best of each over "
                         f"the sitting: TTFT {best_ttft:.2f}x, TPOT {best_tpot:.2f}x")
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/kvserve-w11")
    parser.add_argument("--files", nargs="+", default=list(FILES), choices=FILES)
    parser.add_argument("--workloads", nargs="+", default=["W2"], choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (kvserve, llama-bench, per file)")
    parser.add_argument("--runs", type=int, default=3, help="kvserve requests per round; the best is kept")
    parser.add_argument("--reps", type=int, default=3, help="llama-bench repetitions per round; the best is kept")
    parser.add_argument("--weights-dtype", default="auto")
    parser.add_argument("--no-write", action="store_true", help="use the files in --dir as they are")
    args = parser.parse_args()
    print(f"CPU: {describe_cpu()}; {torch.get_num_threads()} threads; kernels {ops.quant_matmul_isa()}", flush=True)
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    quantizer, llama_bench = find_llama_tool("llama-quantize"), find_llama_tool("llama-bench")
    if quantizer is None:
        print(missing_message("llama-quantize") + ": kvserve's quantizer writes the files")
    if llama_bench is None:
        print(missing_message("llama-bench"))
    paths = {mix: make_file(directory, mix, quantizer, args.no_write) for mix in args.files if mix != "SmolLM2"}
    if "SmolLM2" in args.files:
        paths["SmolLM2"] = embedded_model_path()
    bandwidth = read_bandwidth()
    print(f"measured read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    subjects = [open_subject(name, path, args, bandwidth) for name, path in paths.items()]
    freeze_setup()
    for round_index in range(args.rounds):
        for subject in subjects:
            for workload in args.workloads:
                ours = probed(lambda: kvserve_round(subject, workload, args.runs, round_index))
                subject.kvserve.setdefault(workload, []).append(ours)
                theirs = None
                if llama_bench:
                    theirs = probed(lambda: llama_bench_round(llama_bench, subject.path, workload, args.reps))
                    subject.llama.setdefault(workload, []).append(theirs)
                print(f"round {round_index + 1} {round_line(subject, workload, ours, theirs)}", flush=True)
    print_summary(subjects)


if __name__ == "__main__":
    main()
