"""The ingress's routing key is the block chain the replica will cache (tenant salt included), and a replica's
held set follows its pool's events. No Ray needed."""

import json

import pytest

from kvserve.kv.event_wire import external_block_hash
from kvserve.kv.hashing import block_hashes
from kvserve.kv.manager import KVCacheManager
from kvserve.replicas.engine_replica import HeldBlocks
from kvserve.replicas.routing_key import RoutingKeys
from kvserve.server.core.tenancy import Tenancy

BS = 4


@pytest.fixture(scope="module")
def keys(embedded_tokenizer):
    return RoutingKeys(embedded_tokenizer, BS, ["key-a", "key-b"])


def expected(tokens, key, client_salt=None):
    salt = Tenancy(["key-a", "key-b"]).cache_salt(key, client_salt)
    return [external_block_hash(h) for h in block_hashes(tokens, BS, salt).hashes]


def test_completions_and_chat_hash_as_the_replica_will(keys):
    tokens = list(range(100, 113))
    body = json.dumps({"prompt": tokens}).encode()
    assert keys.hashes("/v1/completions", {"authorization": "Bearer key-a"}, body) == expected(tokens, "key-a")
    salted = json.dumps({"prompt": tokens, "cache_salt": "s"}).encode()
    assert keys.hashes("/v1/completions", {"authorization": "Bearer key-a"}, salted) == expected(tokens, "key-a", "s")
    assert keys.hashes("/v1/completions", {"authorization": "Bearer key-b"}, body) != expected(tokens, "key-a")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    chat = json.dumps({"messages": messages}).encode()
    rendered = keys.tokenizer.encode_chat(messages, True)
    assert keys.hashes("/v1/chat/completions", {"authorization": "Bearer key-b"}, chat) == expected(rendered, "key-b")
    anthropic = json.dumps({"system": "Be brief.", "messages": messages[1:]}).encode()
    assert keys.hashes("/v1/messages", {"x-api-key": "key-b"}, anthropic) == expected(rendered, "key-b")


def test_what_cannot_be_read_routes_by_load_alone(keys):
    auth = {"authorization": "Bearer key-a"}
    assert keys.hashes("/v1/completions", {"authorization": "Bearer nope"}, b'{"prompt": [1, 2, 3, 4, 5]}') == []
    assert keys.hashes("/v1/completions", auth, b"not json") == []
    assert keys.hashes("/v1/chat/completions", auth, b'{"messages": [{"content": 3}]}') == []
    assert keys.hashes("/v1/models", auth, b"") == []


def test_a_replicas_held_blocks_follow_its_pools_events():
    kv = KVCacheManager(8, BS, watermark=0.0, enable_caching=True)
    held = HeldBlocks()
    kv.pool.subscribe(held.on_event)
    tokens = list(range(1, 10))
    chain = block_hashes(tokens, BS)
    assert kv.allocate_slots("a", len(tokens), prefix=kv.find_cached_prefix(tokens, chain))
    kv.cache_full_blocks("a", tokens, chain, len(tokens))
    assert sorted(held.snapshot()) == sorted(external_block_hash(h) for h in chain.hashes)
    kv.free("a")
    assert kv.allocate_slots("b", 8 * BS)  # evicts them all
    assert held.snapshot() == []
