"""KV events on ZMQ, decoded with vLLM's documented schema (msgspec structs, as in vLLM's
examples/online_serving/kv_events_subscriber.py), rebuild the pool's cached blocks exactly."""

import itertools
import time

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
pytest.importorskip("msgpack")

from kvserve.engine.observe.kv_publisher import END_SEQ, KVEventPublisher  # noqa: E402
from kvserve.kv.events.wire import external_block_hash  # noqa: E402
from kvserve.kv.prefix.hashing import block_hashes  # noqa: E402
from kvserve.kv.manager import KVCacheManager  # noqa: E402
from kvserve.kv.tiers.block_file import header_bytes_needed  # noqa: E402
from kvserve.kv.tiers.connector import BlockKey  # noqa: E402
from kvserve.kv.tiers.disk import DiskTier  # noqa: E402

BS = 4
_names = itertools.count()


# vLLM's schema as its documentation gives it (tagged, array-like structs).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


class Mirror:
    """What a router knows from the events: medium -> {hash: (parent, tokens)}."""

    def __init__(self):
        self.blocks: dict[str, dict[int, tuple[int | None, tuple[int, ...]]]] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, BlockStored):
                assert event.block_size == BS and len(event.token_ids) == BS * len(event.block_hashes)
                held = self.blocks.setdefault(event.medium, {})
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    held[block_hash] = (parent, tuple(event.token_ids[i * BS : (i + 1) * BS]))
                    parent = block_hash
            else:
                for block_hash in event.block_hashes:
                    del self.blocks[event.medium][block_hash]


def expected(pool) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """The pool's cached blocks in the events' terms (a first block, whose parent is a root, has none)."""
    hashes = {block.block_hash for block in pool.cached.values()}
    roots = {block.parent_hash for block in pool.cached.values()} - hashes
    out = {}
    for block in pool.cached.values():
        parent = None if block.parent_hash in roots else external_block_hash(block.parent_hash)
        out[external_block_hash(block.block_hash)] = (parent, block.token_ids)
    return out


def replay(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(endpoint)
    socket.send_multipart((b"", start.to_bytes(8, "big")))
    batches = []
    try:
        while True:
            if not socket.poll(5000):
                raise AssertionError("the replay never ended")
            _, seq, payload = socket.recv_multipart()
            if seq == END_SEQ:
                return batches
            batches.append((int.from_bytes(seq, "big"), payload))
    finally:
        socket.close(linger=0)


def compute(kv, request_id, tokens, salt=None):
    chain = block_hashes(tokens, BS, salt)
    assert kv.allocate_slots(request_id, len(tokens), prefix=kv.find_cached_prefix(tokens, chain))
    kv.cache_full_blocks(request_id, tokens, chain, len(tokens))
    return chain


@pytest.fixture
def published():
    name = f"inproc://kv-events-{next(_names)}"
    kv = KVCacheManager(8, BS, watermark=0.0, enable_caching=True)
    publisher = KVEventPublisher(kv.pool, BS, name, name + "-replay")
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.connect(name)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.2)  # a PUB drops what it sends before the subscription arrives (the slow joiner)
    yield kv, publisher, subscriber, name + "-replay"
    subscriber.close(linger=0)
    publisher.close()


def test_the_events_decode_with_vllms_schema_and_rebuild_the_pool(published):
    kv, publisher, subscriber, replay_endpoint = published
    compute(kv, "a", list(range(1, 14)))  # 3 full blocks, one chain: one BlockStored of 3 hashes
    compute(kv, "b", list(range(1, 9)) + [50, 51, 52, 53], salt="tenant-b")  # another root: 3 more
    kv.free("a")
    kv.free("b")
    assert kv.allocate_slots("c", 5 * BS)  # evicts some cached blocks: BlockRemoved
    kv.free("c")
    compute(kv, "d", list(range(100, 109)))
    kv.free("d")
    assert publisher.flush(5)
    batches = replay(replay_endpoint)
    assert [seq for seq, _ in batches] == list(range(publisher.published))
    mirror = Mirror()
    for _, payload in batches:
        batch = DECODER.decode(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        mirror.apply(batch)
    assert set(mirror.blocks) == {"CPU"}
    assert mirror.blocks["CPU"] == expected(kv.pool) and len(expected(kv.pool)) >= 2
    first = DECODER.decode(batches[0][1]).events
    assert isinstance(first[0], AllBlocksCleared)  # a fresh engine says so first
    stored = [e for _, p in batches for e in DECODER.decode(p).events if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None and len(stored[0].block_hashes) == 3  # one chain, one event

    # The live stream carries the same batches under the same sequence numbers ([topic, seq, payload]).
    live = {}
    while subscriber.poll(200):
        topic, seq, payload = subscriber.recv_multipart()
        assert topic == b""
        live[int.from_bytes(seq, "big")] = payload
    assert live and all(dict(batches)[seq] == payload for seq, payload in live.items())
    assert replay(replay_endpoint, start=len(batches) - 1) == batches[-1:]


def test_a_reset_publishes_all_blocks_cleared_and_the_mirror_empties(published):
    kv, publisher, _, replay_endpoint = published
    compute(kv, "a", list(range(1, 10)))
    kv.free("a")
    assert kv.pool.reset_cache()
    assert publisher.flush(5)
    mirror = Mirror()
    for _, payload in replay(replay_endpoint):
        mirror.apply(DECODER.decode(payload))
    assert mirror.blocks == {} and expected(kv.pool) == {}


def test_the_disk_tier_is_published_as_the_disk_medium(tmp_path):
    name = f"inproc://kv-events-{next(_names)}"
    kv = KVCacheManager(8, BS, watermark=0.0, enable_caching=True)
    tier = DiskTier(tmp_path, 2 * (header_bytes_needed(BS) + 64), bytes(16), BS, 64)  # room for 2 block files
    publisher = KVEventPublisher(kv.pool, BS, name, name + "-replay", disk_tier=tier)
    try:
        chain = compute(kv, "a", list(range(1, 14)))
        tokens = list(range(1, 14))
        keys = [BlockKey(chain.hashes[i], chain.parent(i), tuple(tokens[i * BS : (i + 1) * BS])) for i in range(3)]
        tier.store([(key, bytes(64)) for key in keys])  # the third write evicts the first file
        tier.flush()
        assert publisher.flush(5)
        mirror = Mirror()
        for _, payload in replay(name + "-replay"):
            mirror.apply(DECODER.decode(payload))
        on_disk = {external_block_hash(k.block_hash) for k in keys if tier.contains(k.block_hash)}
        assert set(mirror.blocks["DISK"]) == on_disk and len(on_disk) == 2
        assert mirror.blocks["DISK"] == {h: mirror.blocks["CPU"][h] for h in on_disk}  # same parents and tokens
    finally:
        publisher.close()
        tier.close()


def test_a_bad_endpoint_is_a_config_error():
    from kvserve.errors import ConfigError

    kv = KVCacheManager(8, BS, watermark=0.0, enable_caching=True)
    with pytest.raises(ConfigError, match="cannot open"):
        KVEventPublisher(kv.pool, BS, "nonsense://here")
    assert not kv.pool._subscribers  # nothing left listening


def test_an_engine_publishes_its_pool_from_the_command_line_flags(tiny_models):
    import argparse

    from kvserve.engine.engine import Engine
    from kvserve.engine.sample.sampling import SamplingParams
    from kvserve.engine_args import add_engine_args, engine_config_from_args
    from kvserve.kv.cache.kv_spec import kv_spec

    loaded = tiny_models("llama-gqa")
    name = f"inproc://kv-events-{next(_names)}"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    memory = 64 * BS * kv_spec(loaded.config, "auto").bytes_per_token
    args = parser.parse_args(["--kv-events-endpoint", name, "--kv-events-replay-endpoint", name + "-replay",
                              "--block-size", str(BS), "--kv-cache-memory", str(memory)])
    engine = Engine(engine_config_from_args(args), loaded=loaded)
    try:
        for prompt in ([5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 20, 21, 22, 23, 24, 25]):
            engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
        assert engine.kv_events.flush(5)
        mirror = Mirror()
        for _, payload in replay(name + "-replay"):
            mirror.apply(DECODER.decode(payload))
        assert mirror.blocks["CPU"] == expected(engine.kv_manager.pool) and len(mirror.blocks["CPU"]) >= 3
    finally:
        engine.close()


def test_events_need_the_prefix_cache_and_a_replay_needs_an_endpoint():
    from kvserve.config import EngineConfig
    from kvserve.errors import ConfigError

    with pytest.raises(ConfigError, match="prefix caching"):
        EngineConfig(kv_events_endpoint="tcp://*:5557", enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="set that too"):
        EngineConfig(kv_events_replay_endpoint="tcp://*:5558")
