"""Gemma 4 end to end (issue 39): a random-weight Gemma-4-E2B-shaped GGUF (35 layers, 4 sliding of one KV head of
256 then 1 full of one of 512, the last 20 reading earlier layers' caches, double-wide MLPs on those, per-layer
inputs of 256, hidden 1,536), written as llama.cpp's converter lays one out (tests/gemma4_variants.py), served by
kvserve and run by transformers on the same weights (the file's, dequantized, fp32). The vocabulary is SmolLM2's
49,152 rather than E2B's 262,144 (both embeddings: the main one and the per-layer inputs'), to keep the file and
the run small; every layer's shape is E2B's. One sitting, printed side by side:

- KV held per token and by one request at each of `--contexts` (kvserve's own accounting: kv_spec), with the
  savings (shared layers store nothing; the windows free blocks behind them) and without them, beside a naive
  cache (every layer its own K and V of the whole context); the same shape with K = V on the full layers (as
  Gemma 4 31B / 26B-A4B have it: they keep V alone); and the engine's real pool for a `--pool-context` request;
- TTFT (a `--prompt`-token prompt) and TPOT (`--tokens` greedy tokens), best of `--rounds`: kvserve on the file
  (`--weights`: every linear layer Q4_0 by default, the embeddings F32; kvserve runs the file's Q4_0 codes as
  int4) and transformers (fp32, its own cache, sdpa attention); llama.cpp where llama-cpp-python is installed
  (bench/llamacpp.py), else skipped with a message;
- the greedy tokens of both compared: equal expected on an F32 file (`--weights f32`, run as float32 with a
  float32 cache), and on a Q4_0 file with `--kvserve-weights float32`; as served (int4: activations quantized to
  int8 per group of 32, a float16 cache) they need not agree: random weights give flat logits, where that
  rounding changes greedy picks.

`--layers` shrinks the stack for a quick run: the 4:1 sliding/full pattern, 20/35 of the layers shared (rounded,
at least one full layer left storing its own). On a shared machine give `--threads` no more than the cores
left free: with a neighbour busy on one of 2 cores, 2 threads made kvserve ~30x and transformers 2-6x slower.

    PYTHONPATH=. .venv/bin/python bench/gemma4.py [--layers 35] [--prompt 512] [--tokens 16] [--rounds 2]
        [--weights q4_0|q8_0|f32] [--kvserve-weights auto] [--cache-dtype auto] [--threads 0]
        [--contexts 4096 32768] [--pool-context 4096] [--block-size 16]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from hybrid import timed_engine_run
from kvserve.config import EngineConfig, ModelConfig
from kvserve.cpu_features import describe_cpu
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.kv.cache.kv_spec import KVSpec, kv_spec
from kvserve.memory_sizes import format_memory
from kvserve.model.loader import LoadedModel, load_model
from llamacpp import llama_cpp_latency, load_llama_cpp
from tests.gemma4_variants import write_gemma4_gguf

VOCAB = 49_152  # SmolLM2's (E2B: 262,144)
E2B_LAYERS, E2B_SHARED = 35, 20
WEIGHTS = {"q4_0": "Q4_0", "q8_0": "Q8_0", "f32": "F32"}


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def layer_plan(layers: int) -> tuple[list[str], int]:
    """E2B's layer types (every 5th full) and KV-sharing count, for `layers` layers."""
    types = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)]
    types[-1] = "full_attention"  # transformers forces it
    shared = min(round(layers * E2B_SHARED / E2B_LAYERS), layers - 5)  # layers 0-4 store: one full among them
    return types, max(shared, 0)


def transformers_model(layers: int):
    """A random E2B-shaped Gemma4ForCausalLM. Its matrices are held in bfloat16 until the file's weights replace
    them (`load_file_weights`): at full size fp32 weights plus write_gemma4_gguf's fp32 reference would be ~19 GB."""
    import transformers

    types, shared = layer_plan(layers)
    config = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=1536, intermediate_size=6144,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
        attention_k_eq_v=False, sliding_window=512, layer_types=types, num_kv_shared_layers=shared,
        use_double_wide_mlp=True, hidden_size_per_layer_input=256, final_logit_softcapping=30.0,
        tie_word_embeddings=True, max_position_embeddings=131072, attn_implementation="sdpa",
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1_000_000.0}})
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(config).eval()
    for name, param in model.named_parameters():
        if param.dim() == 2:
            # The matrices at std 0.1 rather than transformers' 0.02 (as tests/model/test_gemma4.py), the
            # embeddings left at 0.02 and the main one at 0.005: else each token's own embedding (x sqrt(hidden))
            # swamps what the layers add, the tied head hands the last token back, and greedy tokens repeat it.
            scale = 0.25 if name.endswith("embed_tokens.weight") else 1.0 if "embed" in name else 5.0
            param.data = (param.data * scale).bfloat16()
    return model


def load_file_weights(model, reference: dict[str, torch.Tensor]) -> None:
    """The file's weights (dequantized, fp32) into `model` one at a time, each freed from `reference` as it goes
    (the tied head follows the embedding: one Parameter)."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name in list(reference):
        tensors[name].data = reference.pop(name)
    assert all(param.dtype == torch.float32 for param in model.parameters())


# --- KV held ------------------------------------------------------------------------------------------------

def naive_bytes_per_token(config: ModelConfig, element_bytes: int) -> int:
    """Every layer its own K and V at its own shape, no sharing, no K = V."""
    return sum(2 * heads * dim * element_bytes for heads, dim in
               (config.kv_shape_of(layer) for layer in range(config.num_layers)))


def unwindowed(spec: KVSpec) -> KVSpec:
    """The same slots with every block kept (no window frees any)."""
    return replace(spec, layer_windows=())


def print_kv_held(config: ModelConfig, dtype: str, contexts: list[int], block_size: int) -> None:
    element_bytes = kv_spec(config, dtype).k_codec.bits // 8
    unshared = replace(config, kv_source_layers=None, layer_k_eq_v=None)
    k_eq_v = replace(config, layer_k_eq_v=tuple(window is None for window in config.layer_windows))
    variants = [  # (what, its spec), the savings first
        ("kvserve: shared layers store nothing, windows free", kv_spec(config, dtype)),
        ("  the same, no window freeing", unwindowed(kv_spec(config, dtype))),
        ("no sharing (every layer its own), windows free", kv_spec(unshared, dtype)),
        ("  the same, no window freeing", unwindowed(kv_spec(unshared, dtype))),
        ("K = V on the full layers (31B/26B-style), shared, windows free", kv_spec(k_eq_v, dtype)),
    ]
    naive_token = naive_bytes_per_token(config, element_bytes)
    spec = variants[0][1]
    print(f"\nKV held ({dtype} cache, blocks of {block_size}; {load()}):")
    print(f"  kvserve's slots: {spec.formula(block_size)}; padding {spec.padding_bytes_per_token(block_size)} "
          f"bytes/token; KV groups {spec.layout.describe()}")
    header = "".join(f"{f'{context:,} tokens':>22}" for context in contexts)
    print(f"  {'':64}{'bytes/token':>12}{header}")
    for name, variant in variants:
        cells = "".join(f"{format_memory(held):>12} ({naive_token * context / held:4.1f}x)" for context in contexts
                        for held in [variant.request_bytes(context, block_size)])
        print(f"  {name:64}{variant.bytes_per_token:>12,}{cells}")
    cells = "".join(f"{format_memory(naive_token * context):>12} ({1:4.1f}x)" for context in contexts)
    print(f"  {'naive: every layer its own K and V, whole context':64}{naive_token:>12,}{cells}")
    print("  (x: how many times less than the naive cache; bytes/token counts every slot, windows aside)")


def kvserve_weights(args: argparse.Namespace) -> str:
    """An F32 file as float32 (a float32 cache by "auto": transformers' greedy tokens expected), quantized
    matrices as kvserve runs them by default (Q4_0: its int4 codes, a float16 cache)."""
    return "float32" if args.kvserve_weights == "auto" and args.weights == "f32" else args.kvserve_weights


def engine_for(loaded: LoadedModel, args: argparse.Namespace, max_model_len: int, memory: str = "2GiB") -> Engine:
    """kvserve on the file, loaded once (an engine for each use shares it)."""
    return Engine(EngineConfig(kv_cache_memory=memory, speculative="off", enable_prefix_caching=False,
                               weights_dtype=loaded.linear_dtype, kv_cache_dtype=args.cache_dtype,
                               block_size=args.block_size, max_model_len=max_model_len), loaded=loaded)


def measure_pool(loaded: LoadedModel, args: argparse.Namespace) -> None:
    """The engine's own pool: the pages one request of `--pool-context` prompt tokens holds once computed."""
    tokens, block_size = args.pool_context, args.block_size
    engine = engine_for(loaded, args, tokens + 8, memory="3GiB")
    spec, page = engine.kv_spec, engine.kv_spec.page_bytes(block_size)
    prompt = np.random.default_rng(3).integers(100, VOCAB, tokens).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    started, last = time.perf_counter(), None
    while engine.has_unfinished():
        engine.step()
        running = engine.stats().running
        if running and running[0].num_computed_tokens >= tokens:
            last = last or running[0]
    assert last is not None
    held, expected = last.num_blocks * page, spec.request_bytes(last.num_computed_tokens, block_size)
    print(f"  engine's pool, one request at {last.num_computed_tokens:,} tokens computed: {last.num_blocks} pages "
          f"of {page:,} bytes = {format_memory(held)} ({'equal to' if held == expected else 'NOT'} kv_spec's "
          f"{format_memory(expected)}); {time.perf_counter() - started:.0f} s; {load()}")


# --- latency ------------------------------------------------------------------------------------------------

@torch.inference_mode()
def timed_transformers_run(model, prompt: list[int], tokens: int) -> tuple[float, float, list[int]]:
    """(TTFT, TPOT, greedy tokens), transformers' own cache."""
    started = time.perf_counter()
    out = model(torch.tensor([prompt]), use_cache=True)
    ttft = time.perf_counter() - started
    cache, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
    generated = [int(token)]
    started = time.perf_counter()
    for _ in range(tokens - 1):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
        generated.append(int(token))
    return ttft, (time.perf_counter() - started) / max(tokens - 1, 1), generated


def print_llama_cpp(path: Path, prompt: list[int], tokens: int, rounds: int) -> None:
    """llama.cpp on the same file where llama-cpp-python is installed (load_llama_cpp says so where it is not);
    a build that predates Gemma 4 fails to load the file: said, not raised."""
    print("  ", end="")
    try:
        llama = load_llama_cpp(path, len(prompt) + tokens + 8)
    except Exception as exc:  # noqa: BLE001 (any load failure is reported)
        print(f"llama.cpp: could not load the file ({exc})")
        return
    if llama is not None:
        runs = [llama_cpp_latency(llama, prompt, tokens) for _ in range(rounds)]
        print(f"llama.cpp                         {best(runs)}   ({load()})")


def best(runs: list[tuple]) -> str:
    return f"TTFT {min(r[0] for r in runs):7.2f} s   TPOT {min(r[1] for r in runs) * 1e3:8.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=E2B_LAYERS, help="35: E2B (every 5th layer full)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--weights", choices=list(WEIGHTS), default="q4_0", help="the file's attention/MLP matrices")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--pool-context", type=int, default=4096, help="0: skip the engine's pool check")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kvserve-weights", default="auto", help="kvserve's linear weights (auto: int4 from Q4_0 "
                        "codes, float32 from an F32 file)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); on a "
                        "shared machine, no more than the cores left free: an oversubscribed core slows every "
                        "OpenMP kernel many times over")
    parser.add_argument("--cache-dtype", default="auto", help="kvserve's KV cache (auto: by its linear weights)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {describe_cpu()}, torch threads {torch.get_num_threads()}; {load()}")
    workdir = Path(tempfile.mkdtemp(prefix="kvserve-gemma4-"))
    try:
        started = time.perf_counter()
        model = transformers_model(args.layers)
        types, shared = layer_plan(args.layers)
        path = workdir / f"gemma4-e2b-shaped-{args.weights}.gguf"
        qtype = WEIGHTS[args.weights]
        matrices = {} if qtype == "F32" else {"proj": qtype, "per_layer_input_gate": qtype}  # every linear layer
        reference = write_gemma4_gguf(model, path, matrices)
        load_file_weights(model, reference)
        del reference
        gc.collect()
        params = sum(p.numel() for p in model.parameters())
        print(f"wrote {path.name}: {args.layers} layers ({types.count('full_attention')} full, {shared} shared), "
              f"{params / 1e9:.2f} B parameters, vocab {VOCAB:,}; {path.stat().st_size / 2**20:,.0f} MiB in "
              f"{time.perf_counter() - started:.0f} s")

        loaded = load_model(path, weights_dtype=kvserve_weights(args))
        config, dtype = loaded.config, kv_spec(loaded.config, args.cache_dtype, loaded.linear_dtype).dtype
        print(f"kvserve: linear weights {loaded.linear_dtype}, KV cache {dtype}")
        print_kv_held(config, dtype, args.contexts, args.block_size)
        if args.pool_context:
            measure_pool(loaded, args)
            gc.collect()  # its pool
        # one engine at a time on the one loaded model: the pool's is gone before this one is made
        engine = engine_for(loaded, args, args.prompt + args.tokens + 16)
        prompt = np.random.default_rng(0).integers(100, VOCAB, args.prompt).tolist()
        kv = [timed_engine_run(engine, prompt, args.tokens) for _ in range(args.rounds)]
        print(f"\n{args.prompt}-token prompt, {args.tokens} greedy tokens, best of {args.rounds} ({load()}):")
        print(f"  kvserve ({loaded.linear_dtype} from {qtype}, {dtype} KV)  {best(kv)}")
        del engine, loaded
        gc.collect()
        hf = [timed_transformers_run(model, prompt, args.tokens) for _ in range(args.rounds)]
        print(f"  transformers (fp32, sdpa)         {best(hf)}   ({load()})")
        print_llama_cpp(path, prompt, args.tokens, args.rounds)
        ours, theirs = kv[0][2], hf[0][2]
        agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
        print(f"\ngreedy tokens: {'the same' if ours == theirs else f'first {agree} of {len(ours)} the same'}"
              f" ({'F32 file: expected equal' if qtype == 'F32' else f'{qtype} file: need not agree'})")
        print(f"  kvserve      {ours}\n  transformers {theirs}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
