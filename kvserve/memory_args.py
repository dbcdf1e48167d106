"""`kvserve memory`: its flags and its run (the planner, kvserve/planner.py, does the sizing), and the name a
model is served under, which `memory` accepts too."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvserve.memory_sizes import parse_memory
from kvserve.errors import KVServeError

MEMORY_HELP = ("plan memory: KV bytes per token (and a hybrid model's recurrent state per request), per request, "
               "per batch; weights; what fits")
MEMORY_DESCRIPTION = ("Size the KV cache before serving: the engine's own bytes-per-token formula, weights and "
                      "overhead, and (with --memory) how many requests or how much context fit.")


def add_memory_args(memory: argparse.ArgumentParser) -> None:
    memory.add_argument("model", nargs="?", default=None,
                        help="a known model name (see --list; a chat-tuned name such as SmolLM2-135M-Instruct "
                             "plans its base model's shape), a .gguf file or a Hugging Face directory; or describe "
                             "one with --layers/--kv-heads/--head-dim (default: the embedded model, which "
                             "`kvserve serve` runs without --model)")
    memory.add_argument("--list", action="store_true", help="list the known models and their shapes")
    memory.add_argument("--layers", type=int, help="custom shape: decoder layers")
    memory.add_argument("--kv-heads", type=int, help="custom shape: KV heads")
    memory.add_argument("--head-dim", type=int, help="custom shape: head dimension")
    memory.add_argument("--heads", type=int, help="custom shape: query heads (default: --kv-heads)")
    memory.add_argument("--params", type=float, help="parameter count, e.g. 7e9 (default: from the shape)")
    memory.add_argument("--context", type=int, default=None, help="tokens per request (default: the model's context)")
    memory.add_argument("--batch", type=int, default=1, help="concurrent requests (default 1)")
    memory.add_argument("--kv-dtype", default="float16",
                        help="KV cache dtype (default float16): float32, float16, bfloat16, int8, int4, fp8_e4m3, "
                             "fp8_e5m2, or K/V such as int8/int4")
    memory.add_argument("--weights-dtype", default="float16",
                        help="auto, float32, bfloat16, int8, int4: what kvserve holds with serve's --weights-dtype "
                             "(auto as on this CPU); float16, q8_0, q4_0, q4_k: bytes per weight of those formats "
                             "(default float16)")
    memory.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    memory.add_argument("--memory", default=None, help="device memory to plan for, e.g. 80GiB")
    memory.add_argument("--overhead", type=float, default=0.1,
                        help="activations and runtime, as a fraction of weights + KV (default 0.1)")
    memory.add_argument("--kv-compression", default=None, metavar="METHOD:RATIO",
                        help="also size requests whose prompts serve's --kv-compression compresses (e.g. knorm:2, "
                             "auto:4): the blocks they hold, and what fits, beside the figures without")
    memory.add_argument("--max-tokens", type=int, default=0,
                        help="with --kv-compression: tokens of --context that are generated, never compressed "
                             "(default 0: the whole context is prompt)")
    memory.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def run_memory(args: argparse.Namespace) -> int:
    """`kvserve memory`: print the plan (or the catalog)."""
    from kvserve.model.catalog import KNOWN_MODELS
    from kvserve.planner import describe, plan, resolve_model

    if args.list:
        from kvserve.kv.state.state_spec import state_spec

        print(f"{'model':<15} {'layers':>6} {'heads':>5} {'KV heads':>8} {'head_dim':>8} {'attention':>9} "
              f"{'context':>8}  recurrent layers (state bytes/request)")
        for name, c in KNOWN_MODELS.items():
            states = state_spec(c)
            recurrent = f"{states.num_layers} ({states.slot_bytes:,})" if states is not None else "-"
            print(f"{name:<15} {c.num_layers:>6} {c.num_heads:>5} {c.num_kv_heads:>8} {c.head_dim:>8} "
                  f"{c.attention_kind:>9} {c.max_position_embeddings:>8,}  {recurrent}")
        return 0
    model = args.model
    if model is None and (args.layers, args.kv_heads, args.head_dim) == (None, None, None):
        from kvserve.model.loader import embedded_model_path

        model = str(embedded_model_path())  # what serve runs without --model
    name, config, num_params = resolve_model(model, args.layers, args.kv_heads, args.head_dim, args.heads,
                                             args.params, args.context)
    if model is not None and args.model is None:
        name = model_name_of(model)  # the name serve reports
    context = args.context or config.max_position_embeddings
    if not context:
        raise KVServeError("--context is required for a custom shape")
    memory = parse_memory(args.memory) if args.memory is not None else None  # checked by check_args
    result = plan(name, config, num_params, context, args.batch, args.kv_dtype, args.block_size, args.weights_dtype,
                  memory, args.overhead, args.kv_compression, args.max_tokens)
    print(json.dumps(result.to_json()) if args.json else describe(result))
    return 0


def model_name_of(source: str) -> str:
    """'.../SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'; a directory -> its name."""
    return Path(source.rstrip("/")).name.split(".")[0] or source
