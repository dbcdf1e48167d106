"""W1 offline throughput: 32 requests x (256 prompt, 128 output), kvserve vs transformers `generate` and llama.cpp.

All run on the embedded SmolLM2-135M-Instruct (transformers with fp32 weights,
kvserve with --weights-dtype, default auto; llama.cpp, optional, on the GGUF
file itself: bench/llamacpp.py) in the same process, one after the other; the
ratios are what to compare across machines.
Also reports the KV memory the paged pool actually used against what a
contiguous per-request reservation would hold. kvserve's pool is committed
before the timed run (workloads.commit_pool: what a server does while idle,
and llama.cpp when it makes its context).

    .venv/bin/python bench/throughput.py [--requests 32 --prompt-len 256 --output-len 128]
                                         [--block-size 16] [--skip-transformers] [--skip-llama-cpp]
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
from llamacpp import llama_cpp_throughput, load_llama_cpp
from workloads import commit_pool, freeze_setup, greedy, random_prompts, run_engine, save


def run_transformers(prompts: list[list[int]], output_len: int) -> float:
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)  # equal lengths: left padding would be a no-op
    attention = torch.ones_like(ids)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=attention, max_new_tokens=output_len, min_new_tokens=output_len,
                             do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - started
    assert out.shape[1] == ids.shape[1] + output_len
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--weights-dtype", default="auto", help="kvserve's linear weights (transformers: fp32)")
    parser.add_argument("--speculative", default="auto", help="kvserve's drafting: auto (default), ngram, suffix, off")
    args = parser.parse_args()
    print(f"CPU: {describe_cpu()}", flush=True)

    prompts = random_prompts(args.requests, args.prompt_len)
    loaded = load_model(weights_dtype=args.weights_dtype)
    print(f"kvserve linear weights: {loaded.linear_dtype}", flush=True)
    engine = Engine(EngineConfig(kv_cache_memory="2GiB", block_size=args.block_size,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 speculative=args.speculative), loaded=loaded)
    run_engine(engine, random_prompts(2, 32, seed=1), greedy(4))  # warm-up
    print(f"kvserve KV pool committed in {commit_pool(engine):.1f} s (as a server does while idle)", flush=True)
    freeze_setup()
    outputs, stats = run_engine(engine, prompts, greedy(args.output_len))
    total_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    total_in = sum(len(p) for p in prompts)
    kv = {
        "kvserve_output_tok_s": total_out / stats["wall_s"],
        "kvserve_total_tok_s": (total_out + total_in) / stats["wall_s"],
        "kvserve_wall_s": stats["wall_s"],
        "steps": stats["steps"],
        "preemptions": stats["preemptions"],
    }
    bytes_per_token = engine.kv_spec.bytes_per_token
    memory = {
        "paged_peak_bytes": stats["peak_blocks"] * args.block_size * bytes_per_token,
        "contiguous_request_len_bytes": args.requests * (args.prompt_len + args.output_len) * bytes_per_token,
        "contiguous_max_model_len_bytes": args.requests * engine.max_model_len * bytes_per_token,
    }
    print(f"W1: {args.requests} x ({args.prompt_len} prompt, {args.output_len} output), block size {args.block_size}")
    print(f"kvserve       {kv['kvserve_output_tok_s']:7.1f} output tok/s  {kv['kvserve_total_tok_s']:7.1f} total tok/s  "
          f"({stats['wall_s']:.1f} s, {stats['steps']} steps)")
    result = {"workload": "W1", "args": vars(args), "kvserve": kv, "kv_memory": memory}
    if not args.skip_transformers:
        elapsed = run_transformers(prompts, args.output_len)
        hf = {"output_tok_s": total_out / elapsed, "total_tok_s": (total_out + total_in) / elapsed, "wall_s": elapsed}
        result["transformers"] = hf
        result["ratio_output_tok_s"] = kv["kvserve_output_tok_s"] / hf["output_tok_s"]
        print(f"transformers  {hf['output_tok_s']:7.1f} output tok/s  {hf['total_tok_s']:7.1f} total tok/s  ({elapsed:.1f} s)")
        print(f"ratio         {result['ratio_output_tok_s']:.2f}x output throughput")
    llama = None if args.skip_llama_cpp else load_llama_cpp(embedded_model_path(),
                                                             args.prompt_len + args.output_len)
    if llama is not None:
        elapsed = llama_cpp_throughput(llama, prompts, args.output_len)
        result["llama_cpp"] = {"output_tok_s": total_out / elapsed, "wall_s": elapsed}
        result["ratio_output_tok_s_vs_llama_cpp"] = kv["kvserve_output_tok_s"] / result["llama_cpp"]["output_tok_s"]
        print(f"llama.cpp     {total_out / elapsed:7.1f} output tok/s (one request at a time: the binding has no "
              f"batched generation; {elapsed:.1f} s)")
        print(f"ratio         {result['ratio_output_tok_s_vs_llama_cpp']:.2f}x output throughput vs llama.cpp")
    mib = 2**20
    print(f"KV memory: paged peak {memory['paged_peak_bytes'] / mib:.0f} MiB; contiguous reservation "
          f"{memory['contiguous_request_len_bytes'] / mib:.0f} MiB at prompt+output length, "
          f"{memory['contiguous_max_model_len_bytes'] / mib:.0f} MiB at the model's {engine.max_model_len}-token context")
    print(f"wrote {save('throughput', result)}")


if __name__ == "__main__":
    main()
