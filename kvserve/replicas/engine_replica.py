"""One replica: a kvserve engine behind the single server's own app, driven over ASGI by the ingress.

The replica runs `kvserve.server.app.create_app` unchanged, so the API, auth,
tenants, error shapes and streaming are the single server's by construction;
the ingress hands it each HTTP request whole (method, path, headers, body)
and streams back what the app sends. What the router needs is reported
through Ray Serve's `record_routing_stats`: load (waiting, running, free
blocks) and the block hashes the pool holds, kept from the pool's own cache
events (kv/events/events.py) as vLLM's external hashes (kv/events/wire.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, AsyncIterator

from kvserve.kv.events.wire import external_block_hash
from kvserve.kv.events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


class HeldBlocks:
    """The external hashes of the blocks the pool caches (group 0), kept from its events (engine thread)
    and copied out for the router's reports (another thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()

    def on_event(self, event: KVCacheEvent) -> None:
        with self._lock:
            if isinstance(event, BlockStored) and event.group == 0:
                self._held.add(external_block_hash(event.block_hash))
            elif isinstance(event, BlockRemoved) and event.group == 0:
                self._held.discard(external_block_hash(event.block_hash))
            elif isinstance(event, AllBlocksCleared):
                self._held.clear()

    def snapshot(self) -> list[int]:
        with self._lock:
            return list(self._held)


class EngineReplica:
    """The Ray Serve deployment class of one replica (wrapped by `serve.deployment` in replicas/app.py)."""

    def __init__(self, engine_config: dict[str, Any], settings: dict[str, Any]) -> None:
        from kvserve.config import EngineConfig
        from kvserve.engine.engine import Engine
        from kvserve.platform import run_on_compute_thread
        from kvserve.server.app import create_app
        from kvserve.server.core.serving import ServerSettings

        config = EngineConfig(**engine_config)
        engine = run_on_compute_thread(Engine, config)  # the thread every step will run on, as in `kvserve serve`
        self.engine = engine
        self.held = HeldBlocks()
        engine.kv_manager.pool.subscribe(self.held.on_event)  # before the first step
        self.app = create_app(engine, ServerSettings(**settings))
        self._lifespan: contextlib.AbstractAsyncContextManager | None = None
        self.replica_id = _serve_replica_id()
        self._starting = asyncio.Lock()

    async def _started(self) -> None:
        """The app's lifespan (the step loop) starts with the first request: a constructor cannot await."""
        async with self._starting:
            if self._lifespan is None:
                lifespan = self.app.router.lifespan_context(self.app)
                await lifespan.__aenter__()
                self._lifespan = lifespan

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router scores this replica by (Ray Serve polls it)."""
        stats = self.engine.stats()
        return {"waiting": len(stats.waiting), "running": len(stats.running), "free_blocks": stats.num_free_blocks,
                "num_blocks": stats.num_blocks, "held": self.held.snapshot()}

    async def handle_http(self, request: dict[str, Any], routing_hashes: list[int] | None = None
                          ) -> AsyncIterator[dict[str, Any] | bytes]:
        """Run one HTTP request through the app: yields {"status", "headers"} first, then body chunks, then
        {"answers": [...]} if the app remembered answers meanwhile (for the ingress's routing keys, never
        sent on). `routing_hashes` is for the router only (it reads the call's arguments)."""
        await self._started()
        sent: asyncio.Queue = asyncio.Queue()
        body_given = False

        async def receive() -> dict[str, Any]:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": request["body"], "more_body": False}
            await asyncio.Event().wait()  # the client never goes away on its own here: a cancel ends it
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await sent.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request["method"],
                 "scheme": "http", "path": request["path"], "raw_path": request["path"].encode(),
                 "query_string": request["query"].encode(), "root_path": "",
                 "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request["headers"]],
                 "client": tuple(request.get("client") or ("127.0.0.1", 0)), "server": ("kvserve-replica", 80)}
        task = asyncio.create_task(self.app(scope, receive, send))
        try:
            while True:
                getter = asyncio.create_task(sent.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    task.result()  # the app ended without finishing the response: raise what it raised
                    return
                message = getter.result()
                if message["type"] == "http.response.start":
                    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]
                    yield {"status": message["status"], "headers": headers + [("x-kvserve-replica", self.replica_id)]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        answers = self.app.state.answers.take_new()
                        if answers:
                            yield {"answers": answers}
                        return
        finally:
            if not task.done():
                task.cancel()  # the ingress's client went away: the app aborts the request


def _serve_replica_id() -> str:
    """Which replica answered (the `x-kvserve-replica` header: per-replica load in bench/replicas.py, logs)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a Serve replica (a test driving the class directly)
        return "local"
