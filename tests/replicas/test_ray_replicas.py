"""Replicas on a two-node Ray cluster started on this machine: the single server's API through the ingress,
routing by cache, and a replica killed mid-request (its requests fail alone and clearly, nothing hangs,
Ray brings it back)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

KEYS = ["tenant-a", "tenant-b"]
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 12


# A test cluster on localhost: no usage reports, and no token auth (a token another local Ray left in
# ~/.ray would otherwise be required by some clients and not others).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ray_node(*args: str) -> subprocess.Popen:
    """`ray start ... --block`: the node lives as long as this process, which a SIGTERM ends with its children."""
    ray_cli = Path(sys.executable).with_name("ray")
    return subprocess.Popen([str(ray_cli), "start", "--block", "--disable-usage-stats", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, **RAY_ENV})


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def cluster():
    """A head node and a second node, as `ray start --head` / `ray start --address` on two machines would."""
    saved = {name: os.environ.get(name) for name in RAY_ENV}
    os.environ.update(RAY_ENV)  # this process's ray.init and `ray status` too
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = ray_node("--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false")
    nodes = [head]
    try:
        wait_for(lambda: subprocess.run([str(Path(sys.executable).with_name("ray")), "status", f"--address={address}"],
                                        capture_output=True).returncode == 0, 60, "the head node")
        nodes.append(ray_node(f"--address={address}", "--num-cpus=1"))
        ray.init(address=address, namespace="kvserve-test", log_to_driver=False)
        wait_for(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, 60, "two nodes")
        yield address
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        for node in reversed(nodes):
            os.killpg(node.pid, signal.SIGTERM)  # the node's own process group: only what it started
        grace_ends = time.monotonic() + 5
        for node in reversed(nodes):
            try:
                node.wait(timeout=max(0.0, grace_ends - time.monotonic()))
            except subprocess.TimeoutExpired:  # its raylet lingers ~30 s on SIGTERM here, though Serve and
                os.killpg(node.pid, signal.SIGKILL)  # the driver are shut down above: nothing left to lose
                node.wait(timeout=30)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def app(cluster):
    from kvserve.config import EngineConfig
    from kvserve.replicas.app import ReplicaOptions, start
    from kvserve.server.core.serving import ServerSettings

    port = free_port()
    start(EngineConfig(kv_cache_memory="48MiB", max_num_seqs=8, speculative="off"),
          ServerSettings(model_name="smol", api_keys=KEYS), ReplicaOptions(2, "cache_aware"), "127.0.0.1", port,
          cluster)
    return f"http://127.0.0.1:{port}"


def chat(base, question, key=KEYS[0], **extra):
    body = {"model": "smol", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], **extra}
    return httpx.post(f"{base}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json=body,
                      timeout=120)


def replica_pids() -> list[int]:
    """The live engine replicas' processes, from Ray's actor table (the state API needs the dashboard)."""
    from ray._private.state import actors

    return sorted(info["Pid"] for info in actors().values()
                  if info["State"] == "ALIVE" and info["ActorClassName"].endswith(":engine"))


def test_the_single_servers_api_auth_errors_and_streaming_through_the_ingress(app):
    assert chat(app, "hi", key="wrong").status_code == 401
    assert chat(app, "hi", max_tokens=-1).status_code == 400
    with httpx.stream("POST", f"{app}/v1/chat/completions", headers={"authorization": f"Bearer {KEYS[0]}"},
                      json={"model": "smol", "max_tokens": 3, "stream": True,
                            "messages": [{"role": "user", "content": "hello"}]}, timeout=60) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["object"] == "chat.completion.chunk"
    anthropic = httpx.post(f"{app}/v1/messages", headers={"x-api-key": KEYS[1], "anthropic-version": "2023-06-01"},
                           json={"model": "smol", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
                           timeout=60)
    assert anthropic.status_code == 200 and anthropic.json()["type"] == "message"


def test_a_shared_system_prompt_is_cached_where_it_was_routed_and_tenants_never_share(app):
    first = chat(app, "question 0")
    assert first.status_code == 200
    time.sleep(1.5)  # the replicas report their blocks every 0.5 s
    cached = [chat(app, f"question {i}").json()["usage"]["prompt_tokens_details"]["cached_tokens"]
              for i in range(1, 6)]
    assert all(tokens >= 100 for tokens in cached), cached  # every repeat went where the prefix is
    other = chat(app, "question 0", key=KEYS[1]).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert other == 0  # another tenant's salt: never the same blocks


def replica_pid(replica_id: str) -> int:
    """The process of the live engine replica whose Serve id is `replica_id` (the x-kvserve-replica header)."""
    from ray._private.state import actors

    found = [info["Pid"] for info in actors().values() if info["State"] == "ALIVE"
             and info["ActorClassName"].endswith(":engine") and str(info.get("Name", "")).endswith(replica_id)]
    assert len(found) == 1, (replica_id, found)
    return found[0]


def test_a_killed_replica_fails_its_own_requests_clearly_and_comes_back(app):
    pids = wait_for(lambda: (p := replica_pids()) and len(p) == 2 and p, 60, "two replicas")
    outcomes: dict[int, str] = {}
    served_by: dict[int, str] = {}
    streaming = [threading.Event() for _ in range(4)]

    def ask(index: int) -> None:
        try:
            with httpx.stream("POST", f"{app}/v1/chat/completions", headers={"authorization": f"Bearer {KEYS[0]}"},
                              # Each its own salt: no shared prefix; the router places them by load.
                              # Long enough to be mid-stream at the kill (~15 s of decoding on a replica's
                              # one CPU; the kill comes within a second or two of the last one's first token).
                              json={"model": "smol", "max_tokens": 1000, "stream": True, "ignore_eos": True,
                                    "cache_salt": f"request-{index}",
                                    "messages": [{"role": "user", "content": f"count to a thousand, {index}"}]},
                              timeout=300) as stream:
                served_by[index] = stream.headers.get("x-kvserve-replica", "")
                pieces = []
                for piece in stream.iter_text():
                    pieces.append(piece)
                    streaming[index].set()
                body = "".join(pieces)
            outcomes[index] = ("done" if "data: [DONE]" in body else
                               "replica_unavailable" if "replica_unavailable" in body else body[-200:])
        except Exception as exc:  # noqa: BLE001
            outcomes[index] = repr(exc)
        finally:
            streaming[index].set()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    # Kill, as soon as every request is streaming, the replica that serves the first one (the router may
    # have put any number of the four there: load alone decides).
    for event in streaming:
        event.wait(timeout=120)
    victim = served_by[0]
    victim_pid = replica_pid(victim)
    assert victim_pid in pids
    os.kill(victim_pid, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a request hung"
    # The killed replica's requests fail with a clear error; every other request completes untouched.
    assert outcomes == {i: "replica_unavailable" if served_by[i] == victim else "done" for i in range(4)}, \
        (outcomes, served_by)
    # Meanwhile and after, requests are answered by the live replica; Ray restarts the dead one.
    assert chat(app, "after the crash").status_code == 200
    wait_for(lambda: len(replica_pids()) == 2 and victim_pid not in replica_pids(), 120, "the replica's restart")
    assert all(chat(app, f"after the restart {i}").status_code == 200 for i in range(3))
