"""MXFP4 experts as kvserve holds them (the file's 4-bit codes through a table of their 16 levels) against the
same weights as 8-bit codes (what re-quantizing them into int8 groups held before, in bytes): microseconds a
call and the bytes read a second, one activation row (a decode), side by side in one run. The shape is one
gpt-oss-20b expert's fused gate/up projection (5,760 x 2,880); `--matrices` distinct ones are cycled so that
none stays in cache, as the routed experts of a decode step do not.

    .venv/bin/python bench/mxfp4_matmul.py [--rows 1] [--matrices 24] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.cpu_features import describe_cpu
from kvserve.kernels import ops
from kvserve.kernels.packing import GroupCodes, pack
from kvserve.model.gguf_quants import MXFP4_LEVELS

OUTPUTS, INPUTS = 5760, 2880


def random_mxfp4(gen: torch.Generator) -> GroupCodes:
    """Random codes and power-of-two scales, as a GGUF MXFP4 matrix loads (kvserve.model.gguf_quants)."""
    exponents = torch.randint(112, 124, (OUTPUTS, INPUTS // 32), generator=gen)
    scales = torch.ldexp(torch.ones(exponents.shape), (exponents - 128).float()).half()
    codes = torch.randint(0, 16, (OUTPUTS, INPUTS), dtype=torch.uint8, generator=gen)
    return GroupCodes(codes, scales, (scales.float() * -12).half(), 4, MXFP4_LEVELS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--matrices", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not ops.available():
        print("the C++ kernels are not built here: nothing to measure")
        return
    print(f"CPU: {describe_cpu()}; {torch.get_num_threads()} threads; kernels {ops.quant_matmul_isa()}")
    gen = torch.Generator().manual_seed(0)
    weights = [random_mxfp4(gen) for _ in range(args.matrices)]
    held = {"4-bit codes + table": ([pack(w) for w in weights], 4, MXFP4_LEVELS),
            "8-bit codes": ([pack(w.untabled()) for w in weights], 8, None)}
    x = torch.randn(args.rows, INPUTS, generator=gen)
    for round_index in range(args.rounds):
        line = []
        for label, (packed, bits, table) in held.items():
            best = float("inf")
            for _ in range(5):
                started = time.perf_counter()
                for matrix in packed:
                    ops.quant_matmul(x, matrix, bits, OUTPUTS, table=table)
                best = min(best, time.perf_counter() - started)
            read = sum(m.numel() for m in packed)
            line.append(f"{label} {best / len(packed) * 1e6:.0f} us a call ({read / best / 1e9:.1f} GB/s)")
        print(f"round {round_index + 1}: " + " | ".join(line))


if __name__ == "__main__":
    main()
