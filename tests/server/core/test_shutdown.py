"""Graceful shutdown of a real `kvserve serve`: SIGTERM never cuts a response short.

Requests in flight finish within --shutdown-timeout; past it each one ends with
finish_reason "abort" (streams: a last chunk, then `data: [DONE]`); new
requests are refused; the process exits 0 with no traceback in its log.
"""

import json
import signal
import threading
import time

import httpx
import pytest

from kvserve.server.app import create_app
from kvserve.server.core.serving import ServerSettings
from tests.engine.test_engine import make_engine
from tests.server.conftest import start_server

SHUTDOWN_WAIT_S = 120


class Call(threading.Thread):
    """One completion request on its own thread; `started` is set once it has produced a token."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.started = threading.Event()
        self.status: int | None = None
        self.events: list[str] = []  # SSE data payloads, in order
        self.json: dict | None = None  # the non-streaming body
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if self.body.get("stream"):
                with httpx.stream("POST", self.url, json=self.body, timeout=SHUTDOWN_WAIT_S) as response:
                    self.status = response.status_code
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            self.events.append(line[len("data: "):])
                            if self.events[-1] != "[DONE]" and any(c["text"] for c in json.loads(line[6:])["choices"]):
                                self.started.set()
            else:
                response = httpx.post(self.url, json=self.body, timeout=SHUTDOWN_WAIT_S)
                self.status, self.json = response.status_code, response.json()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.started.set()

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for chunk in self.chunks() for c in chunk["choices"] if c["finish_reason"]]


def completion(max_tokens: int, stream: bool) -> dict:
    body = {"prompt": "Once upon a time, in a quiet village,", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def start_calls(server, bodies: list[dict]) -> list[Call]:
    """Start every call and wait until the engine holds all of them and every stream has a token."""
    calls = [Call(server.api_url + "/completions", body) for body in bodies]
    for call in calls:
        call.start()
    for call in calls:
        if call.body["stream"]:
            assert call.started.wait(SHUTDOWN_WAIT_S), "a stream produced no token"
            assert call.error is None, call.error
    deadline = time.monotonic() + SHUTDOWN_WAIT_S
    while True:  # non-streaming calls show only in the engine's counts
        report = httpx.get(server.api_url + "/kv_cache", timeout=SHUTDOWN_WAIT_S).json()
        if report["num_requests_running"] + report["num_requests_waiting"] == len(calls):
            return calls
        assert time.monotonic() < deadline, report
        time.sleep(0.1)


def assert_clean_exit(server) -> str:
    server.process.wait(timeout=SHUTDOWN_WAIT_S)
    log = server.log()
    assert server.process.returncode == 0, log
    assert "Traceback" not in log and "CancelledError" not in log, log
    return log


def sigterm_during(server, bodies: list[dict], while_draining=None) -> tuple[list[Call], str]:
    """Start the calls, SIGTERM the server (then run `while_draining`), wait for all; the calls and the log."""
    try:
        calls = start_calls(server, bodies)
        server.process.send_signal(signal.SIGTERM)
        if while_draining is not None:
            while_draining()
        for call in calls:
            call.join(SHUTDOWN_WAIT_S)
        return calls, assert_clean_exit(server)
    finally:
        if server.process.poll() is None:
            server.process.kill()


@pytest.mark.slow
def test_sigterm_past_the_timeout_ends_every_response_with_abort(tmp_path):
    server = start_server(tmp_path, "--shutdown-timeout", "1", "--max-num-seqs", "16")

    def late_request() -> None:
        time.sleep(0.5)  # uvicorn closes the listener on its next tick (0.1 s)
        try:
            late = httpx.post(server.api_url + "/completions", json=completion(4, stream=False), timeout=10)
        except httpx.TransportError:
            return  # refused: the listener is closed
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]

    calls, log = sigterm_during(server, [completion(2000, stream=True)] * 8 + [completion(2000, stream=False)],
                                late_request)

    for call in calls:
        assert call.error is None and call.status == 200, (call.error, call.status)
    streams, (plain,) = calls[:8], calls[8:]
    for call in streams:
        assert call.events[-1] == "[DONE]"
        assert call.finish_reasons() == ["abort"]
        usage = call.chunks()[-1]["usage"]
        assert 1 <= usage["completion_tokens"] < 2000
    choice = plain.json["choices"][0]
    assert choice["finish_reason"] == "abort" and plain.json["usage"]["completion_tokens"] < 2000
    assert "SIGTERM: shutting down; 9 request(s) in flight may finish within 1s" in log
    assert "9 request(s) still running after 1s ended with finish_reason 'abort'" in log


@pytest.mark.slow
def test_sigterm_lets_requests_that_finish_within_the_timeout_complete(tmp_path):
    # The timeout is only an upper bound: the server exits as soon as the requests are done.
    server = start_server(tmp_path, "--shutdown-timeout", "300")
    calls, log = sigterm_during(server, [completion(24, stream=True)] * 4 + [completion(24, stream=False)])

    for call in calls:
        assert call.error is None and call.status == 200, (call.error, call.status)
    for call in calls[:4]:
        assert call.events[-1] == "[DONE]"
        assert call.finish_reasons() == ["length"]
        assert call.chunks()[-1]["usage"]["completion_tokens"] == 24
    assert calls[4].json["choices"][0]["finish_reason"] == "length"
    assert calls[4].json["usage"]["completion_tokens"] == 24
    assert "ended with finish_reason 'abort'" not in log


def test_while_draining_new_requests_get_503_and_health_says_so(tiny_models):
    from fastapi.testclient import TestClient

    engine = make_engine(tiny_models())
    app = create_app(engine, ServerSettings(model_name="tiny"))
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        app.state.async_engine.draining = True
        refused = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert "shutting down" in refused.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "shutting down"}
        assert client.get("/v1/models").status_code == 200  # reads still answer
    assert not engine.has_unfinished()
