"""Gemma 3 270M (the packaged Q4_K_M GGUF): W2 and W4 latency, kvserve beside transformers `generate` in one run.

The workloads and the measurements are bench/latency.py's (W2: 1 x 512 prompt, 128 output; W4: 1 x 4096
prompt, 64 output; random token prompts, greedy, EOS ignored); llama.cpp joins when llama-cpp-python is
installed. transformers loads the same GGUF itself (fp32). The engines take turns for `--rounds` rounds
and each reports its best round (a busy neighbour on a shared machine only ever slows a round down).
Skipped with a message when the model package is absent (`make install-dev` installs it).

    .venv/bin/python bench/gemma3.py [--workloads W2 W4] [--rounds 2] [--skip-transformers]
                                     [--skip-llama-cpp] [--weights-dtype auto]
"""

from __future__ import annotations

import argparse

import torch

from kvserve.config import EngineConfig
from kvserve.cpu_features import describe_cpu
from kvserve.engine.engine import Engine
from kvserve.errors import ModelLoadError
from kvserve.model.loader import gemma3_270m_path, load_model
from latency import WORKLOADS, transformers_latency
from llamacpp import llama_cpp_latency, load_llama_cpp
from workloads import freeze_setup, greedy, random_prompts, run_engine, save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; each engine's best is reported")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--weights-dtype", default="auto", help="kvserve's linear weights (transformers: fp32)")
    args = parser.parse_args()
    try:
        path = gemma3_270m_path()
    except ModelLoadError as exc:
        print(f"skipped: {exc}")
        return
    print(f"CPU: {describe_cpu()}", flush=True)

    loaded = load_model(path, weights_dtype=args.weights_dtype)
    print(f"kvserve: {loaded.source}, linear weights {loaded.linear_dtype}", flush=True)
    engine = Engine(EngineConfig(kv_cache_memory="1GiB", max_num_batched_tokens=args.max_num_batched_tokens),
                    loaded=loaded)
    run_engine(engine, random_prompts(1, 64, seed=1), greedy(4))  # warm-up
    reference = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32).eval()
    llama = None if args.skip_llama_cpp else load_llama_cpp(path, max(sum(WORKLOADS[name]) for name in args.workloads))
    freeze_setup()
    results = {}
    for workload_index, name in enumerate(args.workloads):
        prompt_len, output_len = WORKLOADS[name]
        best: dict[str, tuple[float, float]] = {}  # engine -> (TTFT, TPOT), each the best of the rounds
        for round_index in range(args.rounds):
            # A prompt no earlier one starts like (one seed, one stream: seed 0's 512 tokens begin its 4096),
            # else kvserve would serve a prefix from its cache.
            prompt = random_prompts(1, prompt_len, seed=2 + round_index + 100 * workload_index)[0]
            (output,), _ = run_engine(engine, [prompt], greedy(output_len))
            timings = {"kvserve": (output.metrics.ttft, output.metrics.tpot)}
            if reference is not None:
                timings["transformers"] = transformers_latency(reference, prompt, output_len)
            if llama is not None:
                timings["llama.cpp"] = llama_cpp_latency(llama, prompt, output_len)
            for engine_name, (ttft, tpot) in timings.items():
                previous = best.get(engine_name, (ttft, tpot))
                best[engine_name] = (min(previous[0], ttft), min(previous[1], tpot))
        ours_ttft, ours_tpot = best.pop("kvserve")
        row = {"kvserve_ttft_s": ours_ttft, "kvserve_tpot_s": ours_tpot}
        line = (f"{name} ({prompt_len} prompt, {output_len} output, best of {args.rounds}): "
                f"kvserve TTFT {ours_ttft:.2f} s, TPOT {ours_tpot * 1e3:.1f} ms")
        for engine_name, (ttft, tpot) in best.items():
            key = engine_name.replace(".", "_")
            row.update({f"{key}_ttft_s": ttft, f"{key}_tpot_s": tpot})
            line += (f" | {engine_name} TTFT {ttft:.2f} s, TPOT {tpot * 1e3:.1f} ms"
                     f" | ratio TTFT {ttft / ours_ttft:.2f}x, TPOT {tpot / ours_tpot:.2f}x")
        print(line, flush=True)
        results[name] = row
    print(f"wrote {save('gemma3', {'args': vars(args), 'linear_dtype': loaded.linear_dtype, 'results': results})}")


if __name__ == "__main__":
    main()
