"""The `kvserve` command line: `generate` (stream answers to prompts in the terminal), `serve` (the HTTP
server, or `--replicas N` behind Ray Serve) and `memory` (what a KV budget holds for a model)."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Sequence

from kvserve.config import parse_memory
from kvserve.engine_args import add_engine_args, engine_config_from_args
from kvserve.errors import ConfigError, KVServeError
from kvserve.serve_args import add_serve_args, server_settings_from_args


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    group.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--seed", type=int, default=None, help="same seed, same output")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable; not printed)")
    group.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


# Integer flags outside EngineConfig that must be >= 1, by command (EngineConfig checks the engine flags itself,
# when engine_config_from_args builds it before the model loads).
_POSITIVE_INT_FLAGS = {"serve": ("max_waiting_requests", "default_max_tokens"),
                       "memory": ("context", "batch", "block_size")}


def check_args(args: argparse.Namespace) -> None:
    """Range checks of the flags that are not EngineConfig's, before anything heavy is imported or loaded."""
    for name in _POSITIVE_INT_FLAGS.get(args.command, ()):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.command == "memory" and args.memory is not None:
        try:
            parse_memory(args.memory)
        except ValueError as exc:
            raise ConfigError(f"--memory: {exc}") from None
    port = getattr(args, "port", None)
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"--port must be in 0..65535 (0 = any free port), got {port}")
    timeout = getattr(args, "shutdown_timeout", None)
    if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
        raise ConfigError(f"--shutdown-timeout must be a number of seconds >= 0, got {timeout}")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="KV-cache-centric LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text from a prompt, streaming it as it is produced")
    gen.add_argument("prompt", nargs="*", help="prompt text; several prompts run one after another "
                     "(later ones can reuse the cached prefixes of earlier ones)")
    gen.add_argument("--token-ids", help="comma-separated prompt token ids instead of text")
    gen.add_argument("--chat", action="store_true", help="render the prompt as a user turn with the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--quiet", action="store_true", help="do not print the model summary")
    gen.add_argument("--explain-cache", action="store_true",
                     help="after each prompt, say how much of it was cached and where it diverged from the closest cached prompt")
    gen.add_argument("--cache-salt", default=None, help="prefix-cache salt: prompts only share blocks with the same salt")
    _add_sampling_args(gen)
    add_engine_args(gen)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_serve_args(serve)
    add_engine_args(serve)

    memory = commands.add_parser(
        "memory", help="plan memory: KV bytes per token, per request, per batch; weights; what fits",
        description="Size the KV cache before serving: the engine's own bytes-per-token formula, "
                    "weights and overhead, and (with --memory) how many requests or how much context fit.")
    memory.add_argument("model", nargs="?", default=None,
                        help="a known model name (see --list), a .gguf file or a Hugging Face directory; "
                             "or describe one with --layers/--kv-heads/--head-dim")
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
    memory.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return parser


def _prompts(args: argparse.Namespace, engine) -> list[str | list[int]]:
    if args.token_ids is not None:
        if args.prompt:
            raise KVServeError("give either prompts or --token-ids, not both")
        try:
            return [[int(t) for t in args.token_ids.split(",") if t.strip()]]
        except ValueError:
            raise KVServeError(f"--token-ids must be comma-separated integers, got {args.token_ids!r}") from None
    if not args.prompt:
        raise KVServeError("a prompt is required (or --token-ids)")
    if not args.chat:
        return list(args.prompt)
    from kvserve.server.prompt.builder import Conversation, PromptBuilder  # the server's one prompt builder
    from kvserve.tools.rendering import Turn

    builder = PromptBuilder(engine.loaded.require_tokenizer())
    system = [Turn("system", args.system)] if args.system else []
    return [builder.build(Conversation(system + [Turn("user", text)])).token_ids for text in args.prompt]


def _generate(args: argparse.Namespace) -> int:
    from kvserve.engine.engine import Engine
    from kvserve.engine.sampling import SamplingParams

    # Validate cheap things before the model load.
    config = engine_config_from_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
        stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos,
    )
    engine = Engine(config)
    try:
        _generate_each(args, engine, params)
    finally:
        engine.close()  # the disk tier writes what it queued
    return 0


def _generate_each(args: argparse.Namespace, engine, params) -> None:
    for prompt in _prompts(args, engine):
        final = _stream_one(engine, prompt, params, args.cache_salt)
        m = final.metrics
        elapsed = (m.last_token_time or m.arrival_time) - m.arrival_time
        tpot = f"{m.tpot * 1000:.1f} ms" if m.tpot is not None else "n/a"
        held = "" if args.enable_kv_cache else " (no KV cache: recomputed every step)"
        print(
            f"[prompt {m.num_prompt_tokens} tokens ({final.num_cached_tokens} cached) | output {m.num_output_tokens} "
            f"tokens ({final.outputs[0].finish_reason}) | TTFT {m.ttft * 1000:.0f} ms | TPOT {tpot} | "
            f"{m.num_output_tokens / elapsed:.1f} tok/s | KV cache held {final.kv_cache_bytes / 2**20:.2f} MiB{held}]",
            file=sys.stderr,
        )
        if args.explain_cache and final.prefix_cache is not None:
            print(final.prefix_cache.describe(), file=sys.stderr)


def _stream_one(engine, prompt, params, cache_salt):
    """Run one request to completion, writing its text (or token ids) to stdout as it comes."""
    from kvserve.engine.output import RequestOutputAssembler

    engine.add_request(prompt, params, cache_salt=cache_salt)
    show_ids = engine.tokenizer is None
    assembler, final = RequestOutputAssembler(), None
    while engine.has_unfinished():
        for delta in engine.step():
            sys.stdout.write("".join(f"{t} " for t in delta.new_token_ids) if show_ids else delta.new_text)
            sys.stdout.flush()
            final = assembler.add(delta) or final
    sys.stdout.write("\n")
    sys.stdout.flush()
    return final


def _serve(args: argparse.Namespace) -> int:
    import socket

    from kvserve.engine.engine import Engine
    from kvserve.platform import run_on_compute_thread
    from kvserve.server.app import create_app
    from kvserve.server.core.shutdown import serve

    config = engine_config_from_args(args)
    settings = server_settings_from_args(args, "")  # refuses conflicting keys before the model loads
    if args.replicas:
        return _serve_replicas(args, config, settings)
    # Bind before the model loads: a taken port fails in a second, not after the load.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        raise KVServeError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    try:
        engine = run_on_compute_thread(Engine, config)  # the thread every step will run on
    except BaseException:
        sock.close()
        raise
    name = args.served_model_name or _model_name(engine.loaded.source)
    settings.model_name = name
    app = create_app(engine, settings)
    host, port = sock.getsockname()[:2]
    log = logging.getLogger(__name__)
    api_keys, admin_key = settings.api_keys, settings.admin_key
    log.info("serving %s on http://%s:%d/v1 (API key %s)", name, host, port, "required" if api_keys else "not required")
    lab_access = "admin key required" if admin_key else "closed: set --admin-key" if api_keys else "open"
    log.info("lab on http://%s:%d/lab (%s)", host, port, lab_access)
    serve(app, sock, app.state.async_engine, args.shutdown_timeout)
    return 0


def _serve_replicas(args: argparse.Namespace, config, settings) -> int:
    """`serve --replicas N`: the same API from N engines on Ray Serve (kvserve/replicas/)."""
    if args.replicas < 0:
        raise KVServeError(f"--replicas must be >= 0, got {args.replicas}")
    try:
        from kvserve.replicas.app import ReplicaOptions, serve_until_stopped
    except ImportError as exc:
        raise KVServeError(f"--replicas needs Ray Serve: pip install 'kvserve[ray]' ({exc})") from None
    from kvserve.model.loader import embedded_model_path

    settings.model_name = args.served_model_name or _model_name(str(config.model or embedded_model_path()))
    serve_until_stopped(config, settings, ReplicaOptions(args.replicas, args.router, args.replica_cpus),
                        args.host, args.port, args.ray_address)
    return 0


def _memory(args: argparse.Namespace) -> int:
    import json

    from kvserve.model.catalog import KNOWN_MODELS
    from kvserve.planner import describe, plan, resolve_model

    if args.list:
        print(f"{'model':<15} {'layers':>6} {'heads':>5} {'KV heads':>8} {'head_dim':>8} {'attention':>9} {'context':>8}")
        for name, c in KNOWN_MODELS.items():
            print(f"{name:<15} {c.num_layers:>6} {c.num_heads:>5} {c.num_kv_heads:>8} {c.head_dim:>8} "
                  f"{c.attention_kind:>9} {c.max_position_embeddings:>8,}")
        return 0
    name, config, num_params = resolve_model(args.model, args.layers, args.kv_heads, args.head_dim, args.heads,
                                             args.params, args.context)
    context = args.context or config.max_position_embeddings
    if not context:
        raise KVServeError("--context is required for a custom shape")
    memory = parse_memory(args.memory) if args.memory is not None else None  # checked by check_args
    result = plan(name, config, num_params, context, args.batch, args.kv_dtype, args.block_size, args.weights_dtype,
                  memory, args.overhead)
    print(json.dumps(result.to_json()) if args.json else describe(result))
    return 0


def _model_name(source: str) -> str:
    """'.../SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'; a directory -> its name."""
    from pathlib import Path

    return Path(source.rstrip("/")).name.split(".")[0] or source


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if getattr(args, "quiet", False) else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
    )
    try:
        check_args(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "memory":
            return _memory(args)
    except KVServeError as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
