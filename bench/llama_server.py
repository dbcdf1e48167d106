"""llama.cpp's own `llama-server` on the same GGUF file, for the benches that compare against it (optional).

The binary is found by bench/llama_tools.py's one lookup (which also says how to build it); without it
`find_llama_server()` says so and the bench skips llama.cpp. Requests go to its native `/completion`
endpoint with the prompt as token ids, so both engines see exactly the same tokens (no second chat
template in the way), greedy, and its own timings come back (prompt_ms, predicted_per_token_ms, cache_n,
draft_n, draft_n_accepted).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from llama_tools import find_llama_tool, missing_message, vm_safe_flags


def find_llama_server() -> Path | None:
    """The llama-server binary, or None with a message saying where it was looked for."""
    found = find_llama_tool("llama-server")
    if found is None:
        print(missing_message("llama-server"))
    return found


@dataclass
class Completion:
    token_ids: list[int]
    prompt_ms: float  # prompt processing (what was not cached)
    ttft_s: float  # wall time to the first token, seen by the client
    tpot_ms: float  # its own mean time per generated token
    cached_tokens: int
    draft_tokens: int
    accepted_tokens: int


class LlamaServer:
    """One llama-server process on 127.0.0.1, started and stopped by the bench."""

    def __init__(self, binary: Path, model: Path, *extra: str, ctx: int = 8192, threads: int | None = None,
                 slots: int = 1) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        threads = threads or os.cpu_count() or 1
        command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                   "-c", str(ctx), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                   "--no-warmup", *vm_safe_flags(), *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._wait_healthy()

    def _wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.process.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not become healthy in time")

    def complete(self, prompt: list[int], max_tokens: int, cache_prompt: bool = True) -> Completion:
        """Greedy, up to `max_tokens` tokens (it stops at EOS like kvserve's server does)."""
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": cache_prompt,
                "return_tokens": True, "stream": True}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        ttft, tokens, final = None, [], {}
        with urllib.request.urlopen(request, timeout=600) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: "):])
                if ttft is None and (event.get("tokens") or event.get("content")):
                    ttft = time.perf_counter() - started
                tokens.extend(event.get("tokens") or [])
                if event.get("stop"):
                    final = event
        timings = final.get("timings", {})
        return Completion(tokens, timings.get("prompt_ms", 0.0), ttft or 0.0, timings.get("predicted_per_token_ms", 0.0),
                          timings.get("cache_n", 0), timings.get("draft_n", 0), timings.get("draft_n_accepted", 0))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
