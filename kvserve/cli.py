"""The `kvserve` command line: `generate` (stream answers to prompts in the terminal), `serve` (the HTTP
server, or `--replicas N` behind Ray Serve), `memory` (what a KV budget holds for a model) and `doctor`
(what this installation runs on)."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Sequence

from kvserve.memory_sizes import parse_memory
from kvserve.doctor import package_version
from kvserve.engine_args import add_engine_args, engine_config_from_args
from kvserve.errors import ConfigError, KVServeError
from kvserve.generate_args import add_output_args, tool_use_from_args
from kvserve.memory_args import MEMORY_DESCRIPTION, MEMORY_HELP, add_memory_args, model_name_of, run_memory
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
    parser.add_argument("--version", action="version", version=f"kvserve {package_version()}")
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
    add_output_args(gen)
    add_engine_args(gen)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_serve_args(serve)
    add_engine_args(serve)

    doctor = commands.add_parser("doctor", help="what this installation runs on: version, torch, CPU features, "
                                 "the C++ kernels' state (built if needed) and where the model comes from")
    doctor.add_argument("--model", default=None, help="check this GGUF file or Hugging Face directory instead of "
                        "the embedded model")

    add_memory_args(commands.add_parser(
        "memory", help=MEMORY_HELP, description=MEMORY_DESCRIPTION))
    return parser


def _prompts(args: argparse.Namespace, engine, tools: list) -> list[str | list[int]]:
    if args.token_ids is not None:
        if args.prompt:
            raise KVServeError("give either prompts or --token-ids, not both")
        try:
            return [[int(t) for t in args.token_ids.split(",") if t.strip()]]
        except ValueError:
            raise KVServeError(f"--token-ids must be comma-separated integers, got {args.token_ids!r}") from None
    if not args.prompt:
        raise KVServeError("a prompt is required (or --token-ids)")
    if not args.chat and not tools:
        return list(args.prompt)
    from kvserve.server.prompt.builder import Conversation, PromptBuilder  # the server's one prompt builder
    from kvserve.tools.rendering import Turn

    builder = PromptBuilder(engine.loaded.require_tokenizer())
    system = [Turn("system", args.system)] if args.system else []
    return [builder.build(Conversation(system + [Turn("user", text)], tools=tools)).token_ids for text in args.prompt]


def _generate(args: argparse.Namespace) -> int:
    from kvserve.engine.engine import Engine
    from kvserve.engine.sample.sampling import SamplingParams

    # Validate cheap things before the model load.
    config = engine_config_from_args(args)
    use = tool_use_from_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
        stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos, structured_outputs=use.constraint(),
    )
    engine = Engine(config)
    try:
        _generate_each(args, engine, params, use)
    finally:
        engine.close()  # the disk tier writes what it queued
    return 0


def _generate_each(args: argparse.Namespace, engine, params, use) -> None:
    from kvserve.tools.parsing import parse_output

    for prompt in _prompts(args, engine, use.tools):
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
        if use.parses_calls:
            calls = parse_output(final.outputs[0].text).calls
            for call in calls:
                print(f"tool call {call.name} {call.arguments}", file=sys.stderr)
            if not calls:
                print("no tool call", file=sys.stderr)
        if args.explain_cache and final.prefix_cache is not None:
            print(final.prefix_cache.describe(), file=sys.stderr)


def _stream_one(engine, prompt, params, cache_salt):
    """Run one request to completion, writing its text (or token ids) to stdout as it comes."""
    from kvserve.engine.output.types import RequestOutputAssembler

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
    name = args.served_model_name or model_name_of(engine.loaded.source)
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

    settings.model_name = args.served_model_name or model_name_of(str(config.model or embedded_model_path()))
    serve_until_stopped(config, settings, ReplicaOptions(args.replicas, args.router, args.replica_cpus),
                        args.host, args.port, args.ray_address)
    return 0


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
            return run_memory(args)
        if args.command == "doctor":
            from kvserve.doctor import main as doctor

            return doctor(args.model)
    except KVServeError as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
