"""A decode batch's group-code matmul reading its tiles one at a time against several side by side, in one process.

A decode step of one request multiplies one activation row by each weight matrix, reading every byte of it
once from memory; the group-code kernel (`csrc/quant_matmul.cpp`) takes such a row's tiles four at a time
(two to four rows' two at a time), spread over each thread's range, so that runs of bytes stream side by
side (its AVX2 path one at a time unless asked: `--isa avx2` measures it there, per matmul; what decided it
was the engine's step). This measures what that buys on this machine: the same calls with `runs` 1, 2 and 4 (4 is taken as 2
for more than one row), alternating call by call (the host's state moves absolute figures by half between
minutes; the ratios of neighbouring calls hold), on the shapes of the
embedded SmolLM2-135M (Q4_1 layers, Q8_0 head) and of W11's 1B-class body (Q4_0), each over enough matrices
(~200 MB) that every call reads from memory, not from the caches.

    .venv/bin/python bench/matmul_runs.py [--rows 1] [--pairs 30] [--threads 2] [--isa best]

Prints per shape the median GB/s of each setting and the median, over the rounds, of each setting's GB/s
over `runs 1`'s in the same round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.kernels import ops

# name, bits, inputs, outputs
SHAPES = [
    ("SmolLM2 qkv", 4, 576, 960),
    ("SmolLM2 gate_up", 4, 576, 3072),
    ("SmolLM2 down", 4, 1536, 576),
    ("SmolLM2 head (8-bit)", 8, 576, 49152),
    ("1B gate_up", 4, 2048, 16384),
    ("1B down", 4, 8192, 2048),
]
RUNS = (1, 2, 4)
STREAMED_BYTES = 200e6  # past any L3 here (32 MB)


def block_bytes(bits: int) -> int:
    return bits * 16 * 32 // 8 + 2 * 16 * 2  # a tile's codes for one 32-input group, then a[16] and b[16] fp16


def random_matrices(bits: int, inputs: int, outputs: int) -> list[torch.Tensor]:
    """Packed matrices with random codes and scales of 1.0 (the figures do not depend on the values)."""
    shape = (outputs // 16, inputs // 32, block_bytes(bits))
    count = max(2, int(STREAMED_BYTES // (shape[0] * shape[1] * shape[2])))
    mats = []
    for _ in range(count):
        m = torch.randint(0, 256, shape, dtype=torch.uint8)
        m[:, :, bits * 64:] = torch.tensor([0x00, 0x3C], dtype=torch.uint8).repeat(32)  # fp16 1.0
        mats.append(m)
    return mats


ISAS = {"best": -1, "avx2": 1, "avx512_vnni": 2}  # ops.quant_matmul's isa numbers


def gb_per_s(x: torch.Tensor, mats: list[torch.Tensor], bits: int, outputs: int, runs: int, isa: int) -> float:
    start = time.perf_counter()
    for m in mats:
        ops.quant_matmul(x, m, bits, outputs, isa=isa, runs=runs)
    return sum(m.numel() for m in mats) / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=30, help="rounds of one call per setting, alternating")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1, choices=[1, 2, 3, 4], help="activation rows (decode batch)")
    parser.add_argument("--isa", default="best", choices=list(ISAS),
                        help="the instruction set's path (avx2 on an AVX-512 machine: its code, this memory)")
    args = parser.parse_args()
    if not ops.available():
        raise SystemExit("the C++ kernels could not be built here: nothing to measure")
    torch.set_num_threads(args.threads)
    isa = ops.quant_matmul_isa() if args.isa == "best" else args.isa
    print(f"quant_matmul on {isa}, {args.rows} row(s), {args.threads} threads, {args.pairs} rounds per shape "
          f"(runs > 1 applies on the AVX512-VNNI and AVX2 paths)")
    print("| shape | " + " | ".join(f"runs {r} GB/s" for r in RUNS) + " | "
          + " | ".join(f"runs {r} / runs 1" for r in RUNS[1:]) + " |")
    print("|---" * (2 * len(RUNS)) + "|")
    for name, bits, inputs, outputs in SHAPES:
        mats = random_matrices(bits, inputs, outputs)
        x = torch.randn(args.rows, inputs)
        for runs in RUNS:  # warm the code paths
            gb_per_s(x, mats[:1], bits, outputs, runs, ISAS[args.isa])
        rates: dict[int, list[float]] = {r: [] for r in RUNS}
        for _ in range(args.pairs):
            for runs in RUNS:
                rates[runs].append(gb_per_s(x, mats, bits, outputs, runs, ISAS[args.isa]))
        ratios = {r: statistics.median(a / b for a, b in zip(rates[r], rates[1])) for r in RUNS[1:]}
        print(f"| {name} ({inputs} -> {outputs}) | "
              + " | ".join(f"{statistics.median(rates[r]):.1f}" for r in RUNS) + " | "
              + " | ".join(f"{ratios[r]:.3f}" for r in RUNS[1:]) + " |")


if __name__ == "__main__":
    main()
