"""A decode row's K-quant matmul read rate in each of the host's bandwidth states, beside the probe.

The host's read bandwidth here is bimodal (~30-35 GB/s or ~45-60 GB/s for tens of seconds at a time:
README, "why the floor moves"), so a kernel comparison taken in one state says nothing of the other.
Each pass probes the read rate (a 256 MiB fp32 sum on 2 MiB pages, as workloads.read_bandwidth, and the
same on 4 KiB pages) and then multiplies one row by ~250 MB of random Q4_K, Q5_K and Q6_K matrices on
2 MiB pages, as the engine holds its weights (the 1B body's gate/up shape: 2048 inputs, 8192 outputs;
more than the L3 holds, so every pass reads memory) with `ops.kquant_matmul`; the passes are grouped by
the probe's state and each kind's median rate printed per state, as GB/s and as a share of the probe's.

    .venv/bin/python bench/kquant_stream.py [--seconds 60] [--fast-above 45]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve import huge_pages
from kvserve.cpu_features import describe_cpu
from kvserve.kernels import ops
from kvserve.kernels.kquant_packing import KQUANT_KINDS, TYPE_BYTES
from workloads import probe_buffer, read_rate

INPUTS, OUTPUTS = 2048, 8192
SET_BYTES = 250e6


def random_matrices(kind: int, block_bytes: int, generator: torch.Generator) -> list[torch.Tensor]:
    """~SET_BYTES of packed matrices of random super-blocks, each block's fp16 scales made small and finite."""
    count = max(2, int(SET_BYTES // (OUTPUTS * INPUTS // 256 * block_bytes)))
    matrices = []
    for _ in range(count):
        blocks = torch.randint(0, 256, (OUTPUTS, INPUTS // 256, block_bytes), dtype=torch.uint8, generator=generator)
        # d (and dmin) as fp16 0x2000 (~0.008): Q4_K / Q5_K keep them first, Q6_K keeps d last.
        q6 = kind == KQUANT_KINDS["Q6_K"]
        blocks[:, :, slice(-2, None) if q6 else slice(0, 4)] = torch.tensor([0, 0x20] * (1 if q6 else 2),
                                                                            dtype=torch.uint8)
        packed = ops.kquant_repack(blocks, kind)
        matrices.append(huge_pages.empty(tuple(packed.shape), torch.uint8, packed.device).copy_(packed))
    return matrices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--fast-above", type=float, default=45.0, help="GB/s: probes above this are the fast state")
    args = parser.parse_args()
    if ops.kernels() is None:
        raise SystemExit("the C++ kernels are not built here")
    print(f"CPU: {describe_cpu()}, {torch.get_num_threads()} threads", flush=True)
    generator = torch.Generator().manual_seed(0)
    sets = {name: (KQUANT_KINDS[name], random_matrices(KQUANT_KINDS[name], size, generator))
            for name, size in TYPE_BYTES.items()}
    probe_data = probe_buffer(2**26)
    small_pages = torch.ones(2**26)
    x = torch.randn(1, INPUTS, generator=generator)
    passes: list[tuple[float, dict[str, float]]] = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        probe = read_rate(probe_data) / 1e9
        rates = {"4 KiB probe": read_rate(small_pages) / 1e9}
        for name, (kind, matrices) in sets.items():
            started = time.perf_counter()
            for matrix in matrices:
                ops.kquant_matmul(x, matrix, kind, OUTPUTS)
            rates[name] = sum(m.numel() for m in matrices) / (time.perf_counter() - started) / 1e9
        passes.append((probe, rates))
    for state, chosen in (("fast", [p for p in passes if p[0] > args.fast_above]),
                          ("slow", [p for p in passes if p[0] <= args.fast_above])):
        if not chosen:
            print(f"{state} state: no pass", flush=True)
            continue
        probe = statistics.median(p for p, _ in chosen)
        figures = ", ".join(f"{name} {statistics.median(r[name] for _, r in chosen):.1f} GB/s "
                            f"({statistics.median(r[name] / p for p, r in chosen):.2f}x)"
                            for name in ["4 KiB probe", *sets])
        print(f"{state} state ({len(chosen)} passes, probe median {probe:.1f} GB/s): {figures}", flush=True)


if __name__ == "__main__":
    main()
