"""Issue 11 item 3: the event loop never waits on CPU work. While the largest requests are being
refused (tokenized off the loop, refused by length before tokenizing, or refused by size before
reading), /health keeps answering. The bound is generous for an idle loop (a few ms) and far
below what a blocked loop shows (the tokenization alone takes ~0.2-1 s here)."""

import gc
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.inprocess import assert_idle_and_intact, serve_in_process

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
RESPONSIVE_S = 0.1


@pytest.fixture(scope="module")
def app(embedded):
    with serve_in_process(embedded, kv_cache_memory="64MiB") as client:  # 4 MiB body limit (the default)
        yield client


def health_latencies_while(client, request):
    """Run `request()` on another thread; meanwhile send /health back to back and time each. The process's
    garbage is collected first: in a full run it holds every earlier test's leftovers, and a full collection
    of them, which stops every thread, is the likely cause of the only failures seen (111 and 243 ms, in two
    full runs; never alone). That is not the loop waiting on the refusal's work, which this measures."""
    gc.collect()
    latencies = []
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(request)
        while not pending.done():
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
        return pending.result(), latencies


def test_health_answers_while_the_longest_tokenizable_prompt_is_refused(app):
    engine = app.app.state.async_engine.engine
    # Just under the length that is refused without tokenizing: this one must be tokenized.
    limit = engine.max_model_len * engine.tokenizer.longest_token_chars
    content = ("All work and no play makes Jack a dull boy. " * (limit // 44 + 1))[: limit - 100]
    response, latencies = health_latencies_while(
        app, lambda: app.post(CHAT, json={"messages": [{"role": "user", "content": content}], "max_tokens": 1}))
    assert response.status_code == 400 and "exceeds the model's context of 8192 tokens" in response.text
    assert len(latencies) >= 3, "the refusal was too quick to probe the loop"
    assert max(latencies) < RESPONSIVE_S, f"/health took {max(latencies) * 1000:.0f} ms"


def test_health_answers_while_bodies_at_and_over_the_limit_are_refused(app):
    just_under = '{"prompt": "' + "x" * (4 * 2**20 - 100) + '"}'  # refused by length, never tokenized
    response, latencies = health_latencies_while(
        app, lambda: app.post("/v1/completions", content=just_under, headers={"Content-Type": "application/json"}))
    assert response.status_code == 400 and "characters: more than any prompt that fits" in response.text
    assert max(latencies, default=0) < RESPONSIVE_S

    twenty_mb = b'{"messages": [{"role": "user", "content": "' + b"x" * 20_000_000 + b'"}]}'
    response, latencies = health_latencies_while(
        app, lambda: app.post(CHAT, content=twenty_mb, headers={"Content-Type": "application/json"}))
    assert response.status_code == 413 and "4,194,304 bytes" in response.text
    assert max(latencies, default=0) < RESPONSIVE_S
    assert_idle_and_intact(app)


def test_a_running_server_keeps_its_startup_heap_out_of_full_collections(embedded):
    # A full collection walks every tracked object (torch's import alone leaves ~165k: 80-160 ms a pass
    # here, the loop stopped meanwhile); a running server has them frozen, and gives them back at shutdown.
    with serve_in_process(embedded) as client:
        assert gc.get_freeze_count() > 100_000
        assert client.get("/health").status_code == 200
    assert gc.get_freeze_count() == 0
