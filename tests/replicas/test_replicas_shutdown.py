"""`kvserve serve --replicas N` on SIGTERM stops everything it started: the application (replicas drained),
Serve, and its own Ray instance (not a cluster it joined). Ray is faked: this checks the driver's stop path."""

import os
import signal
import sys
import threading
import types

import pytest

from kvserve.replicas import app


@pytest.fixture
def fake_ray(monkeypatch):
    calls = []
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: True
    ray.shutdown = lambda: calls.append("ray.shutdown")
    serve = types.ModuleType("ray.serve")
    serve.delete = lambda name: calls.append(f"serve.delete {name}")
    serve.shutdown = lambda: calls.append("serve.shutdown")
    ray.serve = serve
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.serve", serve)
    monkeypatch.setattr(app, "start", lambda *args: calls.append("start"))
    return calls


@pytest.mark.parametrize("ray_address, stops_ray", [(None, True), ("head:6379", False)])
def test_sigterm_drains_the_replicas_and_stops_serve_and_its_own_ray(fake_ray, ray_address, stops_ray):
    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    app.serve_until_stopped(None, types.SimpleNamespace(model_name="m"), app.ReplicaOptions(1), "127.0.0.1", 0,
                            ray_address)
    timer.join()
    expected = ["start", f"serve.delete {app.APP_NAME}", "serve.shutdown"] + (["ray.shutdown"] if stops_ray else [])
    assert fake_ray == expected
    assert signal.getsignal(signal.SIGTERM) == before  # the process's own handling is back
