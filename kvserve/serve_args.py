"""`kvserve serve`'s own flags (the server's, beside the engine's in engine_args.py) and the
ServerSettings they make."""

from __future__ import annotations

import argparse
import os

from kvserve.memory_sizes import parse_memory
from kvserve.errors import ConfigError


def _byte_size(value: str) -> int:
    try:
        return parse_memory(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _weights(value: str) -> list[float]:
    try:
        return [float(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {value!r}") from None


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    serve.add_argument("--api-key", action="append", default=[],
                       help="require this key as 'Authorization: Bearer KEY' (repeatable: one key per tenant; "
                            "tenants never share prefix-cache blocks). Also read from KVSERVE_API_KEY")
    serve.add_argument("--admin-key", default=None,
                       help="key that opens the lab (/lab: live block map, request table, prompt explanations) "
                            "and the whole /v1/kv_cache report; needed for the lab once --api-key is set, since it "
                            "shows every tenant's activity. Also read from KVSERVE_ADMIN_KEY")
    serve.add_argument("--metrics-key", default=None,
                       help="require this key (or the admin key) as 'Authorization: Bearer KEY' on /metrics "
                            "(default: /metrics is open, as Prometheus scrapers expect). Also read from "
                            "KVSERVE_METRICS_KEY")
    serve.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                       help="output cap of a request that sets no max_tokens (as llama.cpp's --n-predict; "
                            "default: none, such a request may run to the end of the context, as OpenAI's API)")
    serve.add_argument("--served-model-name", default=None, help="the model id clients send (default: from the file name)")
    serve.add_argument("--max-waiting-requests", type=int, default=256,
                       help="requests allowed to wait for a batch slot; beyond that new ones get 429 (default 256)")
    serve.add_argument("--tenant-weights", type=_weights, default=[], metavar="W1,W2,...",
                       help="each --api-key's weight, in --api-key order (missing ones 1), in the fair share of "
                            "each step's tokens, of the KV pool and of the waiting queue (default: equal shares)")
    serve.add_argument("--log-prompts", action="store_true", help="log prompt text (off by default)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds the requests in flight may take to finish before they are "
                            "ended with finish_reason 'abort' (default 30; new requests are refused at once)")
    serve.add_argument("--max-request-bytes", type=_byte_size, default="4MiB",
                       help="largest request body accepted, e.g. 8MiB; larger ones get 413 (default 4MiB)")
    serve.add_argument("--responses-store-path", default=None, metavar="DIR",
                       help="directory where stored responses (/v1/responses with store=true: each response, its "
                            "input items and the exact token ids of its conversation) persist as JSON files, so a "
                            "restart keeps them and previous_response_id goes on; one directory per model (default: "
                            "in memory only, forgotten at restart)")
    serve.add_argument("--compaction-secret", default=None, metavar="SECRET",
                       help="secret (16+ bytes) that seals compaction items (/v1/responses/compact, "
                            "context_management); or KVSERVE_COMPACTION_SECRET (default: one kept in "
                            "--responses-store-path, else a random one per process); replicas must share it")
    replicas = serve.add_argument_group("replicas (Ray Serve; needs kvserve[ray])")
    replicas.add_argument("--replicas", type=int, default=0, metavar="N",
                          help="run N engine replicas on Ray Serve behind one ingress with this same API "
                               "(default 0: one process, no Ray)")
    replicas.add_argument("--ray-address", default=None,
                          help="with --replicas: join this Ray cluster (e.g. HEAD:6379 after `ray start --head`) "
                               "instead of starting a local one")
    replicas.add_argument("--router", default="cache_aware", choices=("cache_aware", "round_robin", "pow2"),
                          help="with --replicas: cache_aware (default: the replica holding most of the prompt's "
                               "leading blocks, unless load is imbalanced), round_robin or pow2")
    replicas.add_argument("--replica-cpus", type=float, default=0.0,
                          help="with --replicas: Ray CPUs each replica reserves (default 0: engines size their "
                               "own threads; reserving makes Ray spread replicas over nodes)")


def server_settings_from_args(args: argparse.Namespace, model_name: str):
    """The server's settings from its flags and the KVSERVE_*_KEY environment variables; refuses an
    admin or metrics key that is also a tenant's key (a tenant must not see across tenants)."""
    from kvserve.server.core.serving import ServerSettings

    api_keys = list(args.api_key) + [k for k in os.environ.get("KVSERVE_API_KEY", "").split(",") if k]
    admin_key = args.admin_key or os.environ.get("KVSERVE_ADMIN_KEY") or None
    metrics_key = args.metrics_key or os.environ.get("KVSERVE_METRICS_KEY") or None
    if admin_key is not None and admin_key in api_keys:
        raise ConfigError("--admin-key must differ from every --api-key: a tenant must not open the lab")
    if metrics_key is not None and metrics_key in api_keys:
        raise ConfigError("--metrics-key must differ from every --api-key: /metrics counts every tenant's traffic")
    compaction_secret = args.compaction_secret or os.environ.get("KVSERVE_COMPACTION_SECRET") or None
    if compaction_secret is not None and len(compaction_secret.encode()) < 16:
        raise ConfigError("--compaction-secret must be at least 16 bytes")
    return ServerSettings(model_name=model_name, api_keys=api_keys, compaction_secret=compaction_secret, max_waiting_requests=args.max_waiting_requests,
                          log_prompts=args.log_prompts, max_request_bytes=args.max_request_bytes,
                          admin_key=admin_key, responses_store_path=args.responses_store_path,
                          default_max_tokens=args.default_max_tokens, metrics_key=metrics_key,
                          tenant_weights=list(getattr(args, "tenant_weights", [])))
