"""W2 (1 x 512 prompt, 128 output) and W4 (1 x 4096 prompt, 64 output): TTFT and TPOT.

kvserve, transformers `generate` and llama.cpp (optional: bench/llamacpp.py)
on the embedded SmolLM2-135M-Instruct, in one run. transformers' TTFT is a 1-token generate; its TPOT is the rest of a
full generate divided by the remaining tokens.

    .venv/bin/python bench/latency.py [--workloads W2 W4] [--skip-transformers] [--skip-llama-cpp]
                                      [--weights-dtype auto]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.config import EngineConfig
from kvserve.cpu_features import describe_cpu
from kvserve.engine.engine import Engine
from kvserve.model.loader import embedded_model_path, load_model
from llamacpp import llama_cpp_latency, load_llama_cpp
from workloads import freeze_setup, greedy, random_prompts, run_engine, save

WORKLOADS = {"W2": (512, 128), "W4": (4096, 64)}


def transformers_latency(model, prompt: list[int], output_len: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])

    def generate(n: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - started

    ttft = generate(1)
    total = generate(output_len)
    return ttft, (total - ttft) / (output_len - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--weights-dtype", default="auto", help="kvserve's linear weights (transformers: fp32)")
    parser.add_argument("--speculative", default="auto", help="kvserve's drafting: auto (default), ngram, suffix, off")
    args = parser.parse_args()
    print(f"CPU: {describe_cpu()}", flush=True)

    loaded = load_model(weights_dtype=args.weights_dtype)
    print(f"kvserve linear weights: {loaded.linear_dtype}", flush=True)
    engine = Engine(EngineConfig(kv_cache_memory="1GiB", max_num_batched_tokens=args.max_num_batched_tokens,
                                 speculative=args.speculative), loaded=loaded)
    run_engine(engine, random_prompts(1, 64, seed=1), greedy(4))  # warm-up
    reference = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        path = embedded_model_path()
        reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    llama = None if args.skip_llama_cpp else load_llama_cpp(
        embedded_model_path(), max(sum(WORKLOADS[name]) for name in args.workloads))
    freeze_setup()
    results = {}
    for name in args.workloads:
        prompt_len, output_len = WORKLOADS[name]
        # A seed per workload: with one seed, W4's prompt would begin with W2's and hit its cached prefix.
        prompt = random_prompts(1, prompt_len, seed=prompt_len)[0]
        (output,), _ = run_engine(engine, [prompt], greedy(output_len))
        row = {"kvserve_ttft_s": output.metrics.ttft, "kvserve_tpot_s": output.metrics.tpot}
        line = f"{name} ({prompt_len} prompt, {output_len} output): kvserve TTFT {row['kvserve_ttft_s']:.2f} s, TPOT {row['kvserve_tpot_s'] * 1e3:.1f} ms"
        if reference is not None:
            ttft, tpot = transformers_latency(reference, prompt, output_len)
            row.update(transformers_ttft_s=ttft, transformers_tpot_s=tpot)
            line += (f" | transformers TTFT {ttft:.2f} s, TPOT {tpot * 1e3:.1f} ms"
                     f" | ratio TTFT {ttft / row['kvserve_ttft_s']:.2f}x, TPOT {tpot / row['kvserve_tpot_s']:.2f}x")
        if llama is not None:
            ttft, tpot = llama_cpp_latency(llama, prompt, output_len)
            row.update(llama_cpp_ttft_s=ttft, llama_cpp_tpot_s=tpot)
            line += (f" | llama.cpp TTFT {ttft:.2f} s, TPOT {tpot * 1e3:.1f} ms"
                     f" | ratio TTFT {ttft / row['kvserve_ttft_s']:.2f}x, TPOT {tpot / row['kvserve_tpot_s']:.2f}x")
        print(line, flush=True)
        results[name] = row
    print(f"wrote {save('latency', {'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
