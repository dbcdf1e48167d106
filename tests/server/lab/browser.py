"""A real headless Chromium driven over the DevTools protocol (a websocket), with nothing downloaded:
Debian's `chromium` package and the `websocket-client` wheel.

Tests that use it are marked `browser` and skip, naming the package, where Chromium is absent.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
SKIP_REASON = "needs a headless browser: Debian's `chromium` package (apt-get install chromium)"


def chromium_path() -> str | None:
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


requires_chromium = pytest.mark.skipif(chromium_path() is None, reason=SKIP_REASON)


class Browser:
    """One page of a headless Chromium. `evaluate` runs JavaScript in it; `wait_for` polls an expression."""

    def __init__(self, profile_dir: Path, width: int = 1400, height: int = 1000) -> None:
        import websocket  # websocket-client

        self.process = subprocess.Popen(
            [chromium_path(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--hide-scrollbars", "--remote-debugging-port=0", "--remote-allow-origins=*",
             f"--user-data-dir={profile_dir}", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile_dir / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json", timeout=10).json()
        page = next(t for t in targets if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self._ids = itertools.count(1)
        self.call("Page.enable")
        self.call("Runtime.enable")

    def call(self, method: str, **params) -> dict:
        message_id = next(self._ids)
        self.ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:  # events arrive in between; only our answer matters
            message = json.loads(self.ws.recv())
            if message.get("id") == message_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def goto(self, url: str) -> None:
        """Load `url` (again, if it is the current one) and wait until the new document has loaded."""
        self.evaluate("window.__leaving = true")  # gone once the new document replaces this one
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && !window.__leaving")

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {expression!r}")
            time.sleep(0.05)

    def text(self, element_id: str) -> str:
        return self.evaluate(f"document.getElementById({element_id!r}).textContent")

    def set_input(self, element_id: str, value) -> None:
        """What dragging a slider or choosing an option does: a new value, then an 'input' event."""
        self.evaluate(f"(() => {{ const e = document.getElementById({element_id!r});"
                      f" e.value = {json.dumps(str(value))};"
                      f" e.dispatchEvent(new Event('input', {{bubbles: true}})); }})()")

    def mouse_move(self, x: float, y: float) -> None:
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """The whole page, or (full_page=False) only what the window shows, as a person sees it."""
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=full_page)["data"]
        path.write_bytes(base64.b64decode(data))
        extra = os.environ.get("KVSERVE_LAB_SCREENSHOTS")  # a folder to also copy them to (the README's)
        if extra:
            shutil.copy(path, Path(extra) / path.name)
        return path

    def close(self) -> None:
        try:
            if hasattr(self, "ws"):
                self.ws.close()
        finally:
            self.process.kill()
            self.process.wait(timeout=10)


@contextlib.contextmanager
def serve_on_port(engine, model_name: str):
    """The app on `engine` behind a real port on 127.0.0.1 (uvicorn on a thread of this process: `kvserve serve`
    loads only real checkpoints), for a browser to load; yields its base URL."""
    import threading

    import torch
    import uvicorn

    from kvserve.platform import run_on_compute_thread
    from kvserve.server.app import create_app
    from kvserve.server.core.serving import ServerSettings

    app = create_app(engine, ServerSettings(model_name=model_name))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threads = run_on_compute_thread(torch.get_num_threads)
    run_on_compute_thread(torch.set_num_threads, 1)  # as serve_in_process: a tiny model gains nothing from two
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), name=f"{model_name}-server",
                              daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, f"the {model_name} server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        # As `kvserve serve` stops: the drain first, which also ends an open lab page's feed (else uvicorn
        # waits on that stream for as long as the page stays open), then the listener.
        if thread.is_alive() and server.started:
            asyncio.run_coroutine_threadsafe(app.state.async_engine.drain(0), loop).result(timeout=30)
        server.should_exit = True
        thread.join(timeout=30)
        run_on_compute_thread(torch.set_num_threads, threads)
        stopped = not thread.is_alive()
        if stopped:
            loop.close()
    assert stopped, f"the {model_name} server did not stop"  # (only when the body itself did not fail)
