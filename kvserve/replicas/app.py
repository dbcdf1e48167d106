"""`kvserve serve --replicas N`: a Ray Serve application of N engine replicas behind one ingress.

Ray Serve runs the replicas (one actor each, restarted by Serve when one
dies), health-checks them, and routes the ingress's calls through
`KVServeRequestRouter` (replicas/request_router.py). `--ray-address` joins an
existing cluster (`ray start --head` on one machine, `ray start --address
HEAD:6379` on the others); without it a local Ray instance is started. The
replicas reserve no Ray CPUs (`num_cpus=0`): each engine sizes its own
threads, and Ray's CPU accounting would otherwise refuse more replicas than
a node has cores; `--replica-cpus` reserves some (Ray then spreads them).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import signal
import threading

from kvserve.config import EngineConfig
from kvserve.replicas.engine_replica import EngineReplica
from kvserve.replicas.ingress import Ingress
from kvserve.replicas.request_router import KVServeRequestRouter
from kvserve.server.core.serving import ServerSettings

log = logging.getLogger(__name__)

APP_NAME = "kvserve"
ROUTING_STATS_PERIOD_S = 0.5  # how often each replica reports its blocks and load to the router


@dataclasses.dataclass(frozen=True)
class ReplicaOptions:
    num_replicas: int = 2
    router: str = "cache_aware"
    replica_cpus: float = 0.0
    health_check_period_s: float = 2.0


def build_application(config: EngineConfig, settings: ServerSettings, options: ReplicaOptions):
    """The Ray Serve application (not yet running)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    router = RequestRouterConfig(request_router_class=KVServeRequestRouter,
                                 request_router_kwargs={"policy": options.router},
                                 request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
                                 request_routing_stats_timeout_s=5.0)
    replica = serve.deployment(EngineReplica, name="engine", num_replicas=options.num_replicas,
                               # Past its batch and queue a replica answers 429 itself (the server's rule).
                               max_ongoing_requests=settings.max_waiting_requests + config.max_num_seqs,
                               ray_actor_options={"num_cpus": options.replica_cpus},
                               request_router_config=router, health_check_period_s=options.health_check_period_s,
                               health_check_timeout_s=10.0 * options.health_check_period_s)
    ingress = serve.deployment(Ingress, name="ingress", num_replicas=1, max_ongoing_requests=10_000,
                               ray_actor_options={"num_cpus": 0})
    engine_fields = dataclasses.asdict(config)
    replica_settings = {**dataclasses.asdict(settings), "forward_answers": True}
    if settings.compaction_secret is None and settings.responses_store_path is None:
        # one secret for every replica, so a compaction item sealed by one opens on another
        replica_settings["compaction_secret"] = secrets.token_hex(32)
    return ingress.bind(replica.bind(engine_fields, replica_settings), config.model, config.block_size,
                        list(settings.api_keys))


def start(config: EngineConfig, settings: ServerSettings, options: ReplicaOptions, host: str, port: int,
          ray_address: str | None = None) -> None:
    """Start Ray (or join `ray_address`), Serve's HTTP proxy on host:port, and the application; returns
    once every replica is up."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        # "local": a fresh Ray of our own, never a stale cluster that an earlier `ray start` left recorded.
        ray.init(address=ray_address or "local", namespace="kvserve", log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_application(config, settings, options), name=APP_NAME, route_prefix="/", blocking=False)


def serve_until_stopped(config: EngineConfig, settings: ServerSettings, options: ReplicaOptions, host: str,
                        port: int, ray_address: str | None = None) -> None:
    """`kvserve serve --replicas N`: start, then run until Ctrl-C or SIGTERM, then stop it all: the application
    (Serve drains each replica's requests in flight), Serve's controller and proxy, and the Ray instance this
    process started (one joined with --ray-address stays up: it is not ours). SIGTERM's default action would
    end the driver alone and leave the replicas and Ray running."""
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        start(config, settings, options, host, port, ray_address)
        log.info("serving %s on http://%s:%d/v1 with %d replicas (router %s)", settings.model_name, host, port,
                 options.num_replicas, options.router)
        while not stop.wait(3600):
            pass
    finally:
        log.info("stopping: draining the replicas, then Serve%s", "" if ray_address else " and Ray")
        stop_everything(ray_address is None)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stop_everything(own_ray: bool) -> None:
    """Delete the application (its replicas drain), shut Serve down, and Ray if this process started it."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        if own_ray:
            ray.shutdown()
