"""Real `kvserve serve` processes on 127.0.0.1 (a free port each) with the embedded model."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 120


@dataclass
class Server:
    base_url: str  # http://127.0.0.1:PORT
    log_path: Path
    process: subprocess.Popen

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` (optionally filtered by labels) from /metrics."""
        text = httpx.get(self.base_url + "/metrics").text
        total, found = 0.0, False
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        assert found, f"{name} {labels} not in /metrics"
        return total

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Poll /v1/kv_cache until no request runs or waits; returns the last report."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        deadline = time.monotonic() + timeout
        while True:
            report = httpx.get(self.api_url + "/kv_cache", headers=headers).json()
            if report["num_requests_running"] == 0 and report["num_requests_waiting"] == 0:
                return report
            assert time.monotonic() < deadline, f"server still busy: {report}"
            time.sleep(0.2)

    api_key: str | None = None


def start_server(tmp_path: Path, *args: str, api_key: str | None = None) -> Server:
    """`kvserve serve` on the embedded model. fp32 weights unless `args` say otherwise: the tests compare
    texts across batch compositions, which only fp32's kernels keep identical (quantized weights switch
    kernels with the batch's row count)."""
    if "--weights-dtype" not in args:
        args = ("--weights-dtype", "float32", *args)
    log_path = tmp_path / "server.log"
    log_file = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--port", "0", "--kv-cache-memory", "256MiB", *args],
        stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        match = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log_path.read_text())
        if match:
            break
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"server did not start:\n{log_path.read_text()}")
        time.sleep(0.2)
    server = Server(match.group(1), log_path, process, api_key=api_key)
    while True:  # the port is bound before the log line; wait for the app itself
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)


def stop_server(server: Server) -> None:
    server.process.send_signal(signal.SIGINT)
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An open server (no API key) on the embedded model."""
    srv = start_server(tmp_path_factory.mktemp("server"))
    yield srv
    stop_server(srv)
    assert srv.process.returncode == 0, srv.log()


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    """Two tenants (keys alice-key, bob-key), one batch slot and two waiting places (to reach 429)."""
    srv = start_server(tmp_path_factory.mktemp("tenant-server"), "--api-key", "alice-key", "--api-key", "bob-key",
                       "--max-num-seqs", "1", "--max-waiting-requests", "2", api_key="alice-key")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def tiny_app(tiny_models):
    """The app in process on the tiny random model with a character tokenizer: 8 waiting places,
    a 64 KiB body limit."""
    from tests.server.inprocess import serve_in_process, with_tiny_tokenizer

    # Prompt lookup only: a request's drafts, and so its forward shapes and logprob rounding, are the same
    # each time it is sent (the suffix index would draft a repeat from the first answer).
    with serve_in_process(with_tiny_tokenizer(tiny_models("llama-gqa")), max_waiting_requests=8,
                          max_request_bytes=64 * 1024, engine_options={"speculative": "ngram"}) as client:
        yield client


@pytest.fixture(scope="session")
def tiny_long_model(tmp_path_factory):
    """The llama-gqa tiny random model with a 1,024-token context and the character tokenizer: room for a
    history, a compaction pass and its summary (the character tokenizer spends a token a character)."""
    import transformers

    from kvserve.model.loader import load_model
    from tests.helpers import TINY_VOCAB
    from tests.server.inprocess import with_tiny_tokenizer

    config = transformers.LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=1024, rms_norm_eps=1e-6)
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("llama-long")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(directory)
    return with_tiny_tokenizer(load_model(directory))
