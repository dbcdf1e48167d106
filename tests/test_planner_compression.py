"""`kvserve memory --kv-compression`: a request's blocks as its compressed chunks keep them (ChunkPolicy, the
engine's own arithmetic), what fits with and without, and the engine's refusals."""

import json

import pytest

from kvserve.arith import round_up
from kvserve.cli import main
from kvserve.errors import InvalidRequestError
from kvserve.kv.compression.spec import DEFAULT_CHUNK
from kvserve.planner import describe, plan, resolve_model

KiB = 2**10


def custom(context: int = 4096):
    return resolve_model(None, layers=2, kv_heads=1, head_dim=8, params=1000, context=context)


@pytest.mark.parametrize("prompt,new_tokens", [(4096, 0), (4000, 96), (600, 0), (575, 0), (100, 28)])
@pytest.mark.parametrize("ratio", [2, 4])
def test_a_request_holds_its_kept_chunks_its_tail_and_its_output_whole(prompt, new_tokens, ratio):
    name, config, params = custom()
    context = prompt + new_tokens
    p = plan(name, config, params, context, kv_compression=f"knorm:{ratio}", max_new_tokens=new_tokens)
    budget = DEFAULT_CHUNK // ratio  # 512 / ratio is whole blocks of 16 here
    chunks = max(prompt - 64, 0) // DEFAULT_CHUNK  # the default window: 64 prompt tokens past a chunk
    assert p.compressed_chunks_per_request == chunks
    assert p.dropped_tokens_per_request == chunks * (DEFAULT_CHUNK - budget)
    held_whole = (chunks - 1) * budget + DEFAULT_CHUNK if chunks else 0  # the last chunk before its compaction
    slots = max(context - p.dropped_tokens_per_request, held_whole)
    assert p.kv_bytes_per_request_compressed == round_up(slots, 16) * p.bytes_per_token
    assert p.kv_bytes_total_compressed == p.kv_bytes_per_request_compressed
    assert p.kv_bytes_per_request == round_up(context, 16) * p.bytes_per_token  # the plain figure unchanged


@pytest.mark.parametrize("batch,new_tokens", [(1, 0), (2, 0), (1, 40)])
def test_the_largest_context_is_one_every_shorter_context_fits_at_too(batch, new_tokens):
    name, config, params = custom()
    kw = dict(batch=batch, memory_bytes=96 * KiB, kv_compression="knorm:4", max_new_tokens=new_tokens)
    p = plan(name, config, params, 1024, **kw)
    room = p.kv_room_bytes // batch
    longest = p.max_context_compressed
    assert longest > p.max_context_for_batch  # compression buys context
    sizes = [plan(name, config, params, c, **kw).kv_bytes_per_request_compressed
             for c in range(new_tokens + 1, longest + 2)]
    assert max(sizes[:-1]) <= room < sizes[-1]
    assert p.max_concurrent_requests_compressed == p.kv_room_bytes // p.kv_bytes_per_request_compressed
    assert p.max_concurrent_requests_compressed > p.max_concurrent_requests


def test_a_model_context_caps_the_compressed_context_as_the_plain_one():
    name, config, params = resolve_model("SmolLM2-135M")
    p = plan(name, config, params, 4096, memory_bytes=2**30, kv_compression="auto:2")
    assert p.kv_compression == "knorm:2"  # auto as the engine resolves it
    assert p.max_context_compressed == config.max_position_embeddings


@pytest.mark.parametrize("model,kv_dtype,reason", [
    ("gemma-3-270m", "float16", None),  # its full-attention layers compress; windowed ones keep their window
    ("Llama-3.1-8B", "int4", "encodes whole blocks"),
    ("Llama-3.1-8B", "float16", None),
])
def test_refused_where_the_engine_refuses_it(model, kv_dtype, reason):
    name, config, params = resolve_model(model)
    if reason is None:
        p = plan(name, config, params, 2048, kv_dtype=kv_dtype, kv_compression="keydiff:2")
        assert p.kv_compression and p.kv_bytes_per_request_compressed < p.kv_bytes_per_request
        return
    with pytest.raises(InvalidRequestError, match=reason):
        plan(name, config, params, 2048, kv_dtype=kv_dtype, kv_compression="keydiff:2")


def test_bad_specs_and_generated_tokens_are_refused():
    name, config, params = custom()
    for text, match in (("knorm", "METHOD:RATIO"), ("expected_attention:2", "queries"), ("knorm:0.5", ">= 1")):
        with pytest.raises(InvalidRequestError, match=match):
            plan(name, config, params, 2048, kv_compression=text)
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        plan(name, config, params, 2048, kv_compression="knorm:2", max_new_tokens=2048)
    assert not plan(name, config, params, 2048, kv_compression="none").kv_compression


def test_cli_prints_both_and_jsons_the_compressed_figures(capsys):
    assert main(["memory", "SmolLM2-135M", "--context", "4096", "--memory", "500MiB", "--batch", "2",
                 "--kv-compression", "knorm:2", "--max-tokens", "100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_compression"] == "knorm:2" and data["max_new_tokens"] == 100
    assert data["kv_bytes_per_request_compressed"] < data["kv_bytes_per_request"]
    name, config, params = resolve_model("SmolLM2-135M")
    text = describe(plan(name, config, params, 4096, batch=2, memory_bytes=500 * 2**20, kv_compression="knorm:2",
                         max_new_tokens=100))
    assert main(["memory", "SmolLM2-135M", "--context", "4096", "--memory", "500MiB", "--batch", "2",
                 "--kv-compression", "knorm:2", "--max-tokens", "100"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == text
    assert f"concurrent requests of 4,096 tokens: {data['max_concurrent_requests_compressed']:,} " \
           f"(without: {data['max_concurrent_requests']:,})" in out
    assert f"{data['max_context_compressed']:,} tokens (without: {data['max_context_for_batch']:,}" in out
