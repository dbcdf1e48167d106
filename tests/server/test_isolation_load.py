"""Issue 11's load test: 256 concurrent streams, a quarter disconnecting, while a second tenant sends
hostile requests. Every well-formed request completes with the output it gets alone; nothing leaks."""

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

GOOD, EVIL = "good-key", "evil-key"
JSON = {"Content-Type": "application/json"}
PROMPTS = [f"Request family {i}: list facts about the number {i * 7}." for i in range(8)]
OUTPUT_TOKENS = 8
HOSTILE_BODIES = [
    {"prompt": "hi", "max_tokens": 2, "top_p": 1e-300, "temperature": 1},
    {"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e-40, "temperature": 1},
    {"prompt": "hi", "max_tokens": 2, "seed": 2**64},
    {"prompt": "hi", "max_tokens": 2, "seed": -(2**70)},
    {"prompt": "\ud800", "max_tokens": 2},
    {"prompt": "hi", "max_tokens": 2, "n": 100000},
    {"prompt": "hi", "max_tokens": -1},
    {"prompt": "hi", "max_tokens": 2, "logprobs": 1000},
    {"prompt": [10**9], "max_tokens": 2},
    {"prompt": "hi", "max_tokens": 2, "temperature": 1e-300, "top_k": 1},
    {"prompt": "hi", "max_tokens": 2, "stop": ["\udfff"]},
]


@pytest.fixture(scope="module")
def two_tenant_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("isolation-server"), "--api-key", GOOD, "--api-key", EVIL,
                       "--max-waiting-requests", "1024", api_key=GOOD)
    yield srv
    stop_server(srv)


def body(prompt: str, max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


async def stream_text(http: httpx.AsyncClient, url: str, payload: dict, leave_after: int | None):
    text, finish, chunks = "", None, 0
    async with http.stream("POST", url, json={**payload, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return "left", None
    return text, finish


def test_256_streams_with_leavers_and_a_hostile_tenant(two_tenant_server):
    server = two_tenant_server
    url = server.api_url + "/completions"
    good = {"Authorization": f"Bearer {GOOD}"}
    alone = []
    for prompt in PROMPTS:
        response = httpx.post(url, json=body(prompt, OUTPUT_TOKENS), headers=good, timeout=60)
        assert response.status_code == 200, response.text
        alone.append(response.json()["choices"][0]["text"])

    async def hostile(http: httpx.AsyncClient) -> list[int]:
        statuses = []
        for _ in range(3):
            for payload in HOSTILE_BODIES:  # json.dumps escapes a lone surrogate as \\ud800, as clients do
                response = await http.post(url, content=json.dumps(payload), headers=JSON)
                statuses.append(response.status_code)
            response = await http.post(url, content=b'{"prompt": "unterminated', headers=JSON)
            statuses.append(response.status_code)
            await asyncio.sleep(0.5)
        return statuses

    async def run():
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(timeout=600, limits=limits, headers=good) as http, \
                httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {EVIL}"}) as evil:
            streams = [
                stream_text(http, url, body(PROMPTS[i % 8], 2000 if i % 4 == 0 else OUTPUT_TOKENS),
                            leave_after=3 if i % 4 == 0 else None)
                for i in range(256)
            ]
            return await asyncio.gather(hostile(evil), *streams)

    statuses, *results = asyncio.run(run())
    assert all(status < 500 for status in statuses), statuses
    assert 200 in statuses and 400 in statuses
    for i, (text, finish) in enumerate(results):
        if i % 4 == 0:
            assert text == "left"
        else:
            assert (text, finish) == (alone[i % 8], "length"), f"stream {i}"
    assert httpx.get(server.base_url + "/health").status_code == 200
    report = server.wait_idle(timeout=120)
    assert report["num_used_blocks"] == 0 and report["integrity"] == "ok"
    assert "Traceback" not in server.log()
