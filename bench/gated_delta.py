"""What the gated delta rule costs per token on a Qwen3.5-0.8B linear-attention layer, and against what.

kvserve runs the rule token by token for every token, prefill included (kernels/gated_delta.py, csrc/gated_delta.cpp):
the chunked form's results depend on where chunks start, and a token's bits must not depend on how its
prompt was chunked or cached. This prints, per token, on one layer's shape (16 key heads, 16 value heads,
dk = dv = 128, q and k l2-normalised in the rule):

- the C++ kernel: a prefill segment of --rows tokens, and batched decodes of 1 and 8 sequences over state slots,
  on 1 thread and on torch's thread count (a decode's few microseconds of work per head can wait longer than
  that for a second thread on a busy machine);
- the same math in torch, token by token (kvserve's path without the kernel, kernels/gated_delta_torch.py);
- transformers' torch_chunk_gated_delta_rule (chunk 64) and torch_recurrent_gated_delta_rule on the same input;
- for scale, that layer's input projections: x [rows, 1024] @ W^T, W [6144 + 2048 + 32, 1024] fp32
  (torch's GEMM), per token at --rows rows and at 1 row.

Each figure is the best of --repeats runs (the machine may be shared).

    PYTHONPATH=. .venv/bin/python bench/gated_delta.py [--rows 512] [--repeats 5] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from kvserve.cpu_features import describe_cpu
from kvserve.kernels import gated_delta, ops
from kvserve.kernels.gated_delta_torch import gated_delta_scan

HEADS, HEAD_DIM, HIDDEN, PROJECTED = 16, 128, 1024, 6144 + 2048 + 32


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def layer_inputs(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
    g = -F.softplus(torch.randn(rows, HEADS, generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(rows, HEADS, generator=gen))
    return q, k, v, g, beta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512, help="prefill segment length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads for every figure (0: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, repeats = args.rows, args.repeats
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = layer_inputs(rows, gen)
    print(f"CPU: {describe_cpu()}; {os.cpu_count()} CPUs; torch threads: {torch.get_num_threads()}; "
          f"gated delta kernel: {gated_delta.gated_delta_isa() or 'not built'}")
    print(f"layer: {HEADS} key / {HEADS} value heads, dk = dv = {HEAD_DIM}; prefill segment {rows} tokens")
    figures: list[tuple[str, float]] = []  # (what, microseconds per token)
    threads = torch.get_num_threads()
    for count in sorted({1, threads}) if ops.available() else ():
        torch.set_num_threads(count)
        seconds = best_seconds(lambda: gated_delta.gated_delta_rule(q, k, v, g, beta), repeats)
        figures.append((f"C++ kernel, prefill segment of {rows}, {count} thread(s)", seconds / rows))
        for batch in (1, 8):
            cache = torch.randn(2 * batch, HEADS, HEAD_DIM, HEAD_DIM, generator=gen) * 0.1
            step = layer_inputs(batch, gen)
            sequences = gated_delta.DeltaSequences.of([1] * batch, list(range(batch)), list(range(batch, 2 * batch)))
            seconds = best_seconds(lambda: gated_delta.gated_delta_rule_slots_(*step, cache, sequences), 20 * repeats)
            figures.append((f"C++ kernel, batched decode B={batch} (states read from / written to slots), "
                            f"{count} thread(s)", seconds / batch))
    torch.set_num_threads(threads)
    torch_rows = min(rows, 128)  # the torch loops cost ~ms a token: a shorter segment says the same per token
    part = (q[:torch_rows], k[:torch_rows], v[:torch_rows], g[:torch_rows], beta[:torch_rows])
    seconds = best_seconds(lambda: gated_delta_scan(*part, None, (), True, HEAD_DIM ** -0.5), max(1, repeats // 2))
    figures.append((f"torch token by token (kvserve's fallback), {torch_rows} tokens", seconds / torch_rows))
    batched = [x[None] for x in (q, k, v, g, beta)]
    seconds = best_seconds(lambda: torch_chunk_gated_delta_rule(*batched, chunk_size=64, output_final_state=True,
                                                                use_qk_l2norm_in_kernel=True), repeats)
    figures.append((f"transformers torch_chunk_gated_delta_rule (chunk 64), {rows} tokens", seconds / rows))
    short = [x[None] for x in part]
    seconds = best_seconds(lambda: torch_recurrent_gated_delta_rule(*short, output_final_state=True,
                                                                    use_qk_l2norm_in_kernel=True), max(1, repeats // 2))
    figures.append((f"transformers torch_recurrent_gated_delta_rule, {torch_rows} tokens", seconds / torch_rows))
    weight = torch.randn(PROJECTED, HIDDEN, generator=gen) * 0.02
    x = torch.randn(rows, HIDDEN, generator=gen)
    figures.append((f"for scale: input projections 1024 -> {PROJECTED:,} fp32, {rows} rows",
                    best_seconds(lambda: F.linear(x, weight), repeats) / rows))
    figures.append((f"for scale: input projections 1024 -> {PROJECTED:,} fp32, 1 row",
                    best_seconds(lambda: F.linear(x[:1], weight), 20 * repeats)))
    width = max(len(what) for what, _ in figures)
    for what, seconds in figures:
        print(f"  {what:<{width}}  {seconds * 1e6:10.1f} us/token")


if __name__ == "__main__":
    main()
