"""The ingress's routing key is the block chain the replica will cache (tenant salt included), and a replica's
held set follows its pool's events. No Ray needed."""

import json

import pytest

from kvserve.kv.events.wire import external_block_hash
from kvserve.kv.prefix.hashing import block_hashes
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
    anthropic = json.dumps({"model": "m", "system": "Be brief.", "messages": messages[1:]}).encode()
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


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}


def _tool_loop_turn_two(app, path, headers):
    """Turn one forces one call (so the answer ends: only an answer that ended is remembered); turn two sends it back (content null / tool_use blocks / items) with its result.
    Returns turn two's body."""
    if path == "/v1/chat/completions":
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
        question = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}]
        first = app.post(path, headers=headers, json={"messages": question, "tools": tools, "tool_choice": "required",
                                                      "parallel_tool_calls": False, "max_tokens": 60, "temperature": 0}).json()
        call = first["choices"][0]["message"]["tool_calls"][0]
        return {"messages": question + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny"}],
                "tools": tools, "max_tokens": 4, "temperature": 0}
    if path == "/v1/messages":
        tools = [{"name": "get_weather", "input_schema": WEATHER}]
        question = [{"role": "user", "content": "Weather in Paris?"}]
        first = app.post(path, headers=headers, json={"model": "tiny", "system": "You help.", "messages": question,
                                                      "tools": tools,
                                                      "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                                                      "max_tokens": 60, "temperature": 0}).json()
        use = [block for block in first["content"] if block["type"] == "tool_use"][0]
        return {"model": "tiny", "system": "You help.", "tools": tools, "max_tokens": 4, "messages": question + [
            {"role": "assistant", "content": first["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "Sunny"}]}]}
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = app.post(path, headers=headers, json={"instructions": "You help.", "input": question, "tools": tools,
                                                  "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 60,
                                                  "temperature": 0, "store": False}).json()
    calls = [item for item in first["output"] if item["type"] == "function_call"]
    items = [{k: v for k, v in call.items() if k in ("type", "call_id", "name", "arguments")} for call in calls]
    return {"instructions": "You help.", "tools": tools, "max_output_tokens": 4, "temperature": 0, "store": False,
            "input": question + items + [{"type": "function_call_output", "call_id": calls[0]["call_id"],
                                          "output": "Sunny"}]}


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_a_tool_loops_routing_hashes_are_the_blocks_its_replica_caches(embedded, path):
    """Through the serving path itself (the embedded model: its tokenizer splits a generated call otherwise
    than the model wrote it): the hashes the ingress computes for turn two (tools, a call sent back as
    `content: null`, tool_use blocks or items) are blocks the replica holds once it has served turn two."""
    from tests.server.inprocess import serve_in_process

    with serve_in_process(embedded, kv_cache_memory="64MiB", api_keys=["key-a"], forward_answers=True) as app:
        engine = app.app.state.async_engine.engine
        held = HeldBlocks()
        engine.kv_manager.pool.subscribe(held.on_event)
        headers = {"authorization": "Bearer key-a", "x-api-key": "key-a"}
        turn_two = _tool_loop_turn_two(app, path, headers)
        keys = RoutingKeys(engine.tokenizer, engine.config.block_size, ["key-a"])
        keys.remember(app.app.state.answers.take_new())  # what a replica forwards after each response
        hashes = keys.hashes(path, headers, json.dumps(turn_two).encode())
        served = app.post(path, headers=headers, json=turn_two)
        assert served.status_code == 200, served.text
        usage = served.json()["usage"]
        prompt_tokens = usage.get("prompt_tokens") or usage.get("input_tokens")
        if path == "/v1/messages":
            prompt_tokens = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
        assert len(hashes) == prompt_tokens // engine.config.block_size > 2
        assert set(hashes) <= set(held.snapshot())
