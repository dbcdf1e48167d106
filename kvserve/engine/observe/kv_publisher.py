"""The pool's and the disk tier's cache events on a ZMQ PUB socket, as vLLM publishes them.

Any KV-aware router written for vLLM (Dynamo, llm-d, Ray's) can follow what a
kvserve engine holds: multipart messages `[topic, sequence number (8 bytes,
big-endian), msgpack(batch)]`, the batch in vLLM's KVEventBatch schema
(kv/events/wire.py), an AllBlocksCleared first (a subscriber that saw an
earlier process drops what it knew), and a ROUTER socket that resends the
batches from a sequence number on (vLLM's replay protocol: a client sends
`[b"", seq]`, gets `[b"", seq, payload]` per batch, then `[b"", -1, b""]`).

Off the step's hot path: a pool callback only appends the event to a queue;
one thread drains it (every event waiting becomes one batch), encodes,
sends, keeps the last `buffer_batches` for replay and answers replays.
pyzmq and msgpack are the `kvserve[events]` extra, imported only here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from kvserve.errors import ConfigError
from kvserve.kv.events.wire import MEDIUM_CPU, MEDIUM_DISK, encode_batch, encode_events
from kvserve.kv.events.events import AllBlocksCleared, BlockStored, KVCacheEvent
from kvserve.kv.prefix.hashing import BlockHash

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # closes a replay, as in vLLM
_STOP = object()
_POLL_S = 0.05  # how long the thread waits for events before it looks at the replay socket again
_MAX_ROOTS = 1 << 16  # chain roots remembered to tell a disk block's missing parent (see _first)


class KVEventPublisher:
    """Publishes every cache event of `pool` (medium CPU) and, if given, `disk_tier` (medium DISK)."""

    def __init__(self, pool, block_size: int, endpoint: str, replay_endpoint: str | None = None,
                 disk_tier=None, topic: str = "", buffer_batches: int = 10_000, hwm: int = 100_000,
                 data_parallel_rank: int = 0) -> None:
        try:
            import msgpack
            import zmq
        except ImportError as exc:
            raise ConfigError(f"--kv-events-endpoint needs pyzmq and msgpack: pip install 'kvserve[events]' "
                              f"({exc})") from None
        self._zmq, self._packb = zmq, msgpack.packb
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._next_seq = 0
        # A disk block's event carries no `first` flag (the tier files keys, not chains): a parent that
        # was a first pool block's root is a root there too.
        self._roots: OrderedDict[BlockHash, None] = OrderedDict()
        context = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            _bind_or_connect(self._pub, endpoint)
            if replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"KV events: cannot open {endpoint}"
                              f"{' / ' + replay_endpoint if replay_endpoint else ''}: {exc}") from None
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._pool, self._disk_tier = pool, disk_tier
        self._events.put((MEDIUM_CPU, AllBlocksCleared()))  # a fresh engine: whatever was known is gone
        pool.subscribe(self._on_pool_event)
        if disk_tier is not None:
            disk_tier.subscribers.add(self._on_disk_event)
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()

    def _on_pool_event(self, event: KVCacheEvent) -> None:
        self._events.put((MEDIUM_CPU, event))

    def _on_disk_event(self, event: KVCacheEvent) -> None:
        self._events.put((MEDIUM_DISK, event))

    @property
    def published(self) -> int:
        """Batches sent so far."""
        return self._next_seq

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event queued before this call is sent; whether it was, within `timeout`."""
        done = threading.Event()
        self._events.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        """Stop listening, send what is queued, close the sockets."""
        self._pool.unsubscribe(self._on_pool_event)
        if self._disk_tier is not None:
            self._disk_tier.subscribers.remove(self._on_disk_event)
        self._events.put(_STOP)
        self._thread.join()
        self._close_sockets()

    # -- the publisher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            try:
                self._serve_replays()
                pending = self._drain()
                stopping = _STOP in pending
                events = [item for item in pending if isinstance(item, tuple)]
                if events:
                    self._send([(medium, self._first(medium, event)) for medium, event in events])
                for flushed in (item for item in pending if isinstance(item, threading.Event)):
                    flushed.set()
            except Exception:  # a router's trouble must never stop the engine: log and go on
                log.exception("KV events: a batch could not be published")

    def _drain(self) -> list[Any]:
        try:
            items = [self._events.get(timeout=_POLL_S)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._events.get_nowait())
            except queue.Empty:
                return items

    def _first(self, medium: str, event: KVCacheEvent) -> KVCacheEvent:
        if isinstance(event, BlockStored):
            if event.first:
                self._roots[event.parent_hash] = None
                if len(self._roots) > _MAX_ROOTS:
                    self._roots.popitem(last=False)
            elif medium == MEDIUM_DISK and event.parent_hash in self._roots:
                return BlockStored(event.block_id, event.block_hash, event.parent_hash, event.token_ids,
                                   event.group, first=True)
        return event

    def _send(self, events: list[tuple[str, KVCacheEvent]]) -> None:
        batch = encode_batch(time.time(), encode_events(events, self.block_size), self.data_parallel_rank)
        payload = self._packb(batch, use_bin_type=True)
        seq = self._next_seq
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self._next_seq = seq + 1

    def _serve_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: ignoring a malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)


def _bind_or_connect(socket, endpoint: str) -> None:
    """vLLM's rule: a wildcard host, ipc:// or inproc:// binds (a stable publisher); any other address
    connects to a collector that bound it."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


def open_kv_events(config, pool, tier=None) -> KVEventPublisher | None:
    """The publisher `config` (an EngineConfig) asks for, on `pool` and the disk tier if any; None if off."""
    if config.kv_events_endpoint is None:
        return None
    return KVEventPublisher(pool, config.block_size, config.kv_events_endpoint, config.kv_events_replay_endpoint,
                            disk_tier=tier)
