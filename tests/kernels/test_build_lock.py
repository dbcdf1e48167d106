"""A start always comes up and says what it is doing: a build lock left by a killed build is taken over, a live
build is waited for (said after a few seconds) up to a limit, and a compile says so before it starts.

Every test builds under a temporary KVSERVE_KERNELS_DIR: the shared environment's kernels are never touched."""

import os
import signal
import subprocess
import sys
import time
import types

import pytest

from kvserve.kernels import build, build_lock
from kvserve.kernels.build_lock import BuildLock, BuildLockTimeout

# Holds kvserve's flock and opens torch's lock file (as a build does) until killed.
_HOLDER = """
import fcntl, os, sys, time
directory = sys.argv[1]
fd = os.open(os.path.join(directory, "kvserve.lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
torch_lock = os.open(os.path.join(directory, "lock"), os.O_CREAT | os.O_EXCL)
print("holding", flush=True)
time.sleep(600)
"""


@pytest.fixture
def kernels_dir(tmp_path, monkeypatch):
    """A fresh build state under a temporary kernels directory, with `load` faked (no compiler runs): it
    records the build directory it was given and fails if torch's lock is still there (torch would hang)."""
    import torch.utils.cpp_extension

    monkeypatch.setenv("KVSERVE_KERNELS_DIR", str(tmp_path))
    monkeypatch.delenv("KVSERVE_NO_CPP_KERNELS", raising=False)
    monkeypatch.setattr(build, "_state", {})
    calls = []

    def load(name, build_directory, **_):
        assert not os.path.exists(os.path.join(build_directory, "lock")), "torch would wait on this lock forever"
        calls.append(build_directory)
        return types.SimpleNamespace(quant_matmul_isa=lambda: "fake")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    import torch

    directory = build.kernels_build_directory(torch.__version__)
    directory.mkdir(parents=True)
    return directory, calls


def test_a_planted_stale_lock_is_taken_over_and_said(kernels_dir, capfd):
    directory, calls = kernels_dir
    (directory / "lock").touch()  # what a build killed mid-compile leaves: a lock with no holder
    assert build.cpu_kernels() is not None
    assert calls == [str(directory)]
    err = capfd.readouterr().err
    assert "took over a stale kernels build lock" in err
    assert "compiling kvserve's CPU kernels for this CPU, once: about a minute" in err
    assert not (directory / "lock").exists()


def test_a_finished_build_loads_without_the_compile_line_and_a_changed_source_says_why(kernels_dir, capfd):
    directory, _ = kernels_dir
    library = directory / f"{directory.name}.so"
    library.touch()
    newest = max(source.stat().st_mtime for source in build._SOURCES[0].parent.iterdir())
    os.utime(library, (newest + 10, newest + 10))
    assert build.cpu_kernels() is not None
    assert "compiling" not in capfd.readouterr().err
    os.utime(library, (newest - 10, newest - 10))
    assert "sources changed since the last build" in build.rebuild_reason(directory, directory.name)


def _start_holder(directory):
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_a_live_build_is_waited_for_said_and_given_up_on_at_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(build_lock, "NOTICE_AFTER_S", 0.3)
    holder = _start_holder(tmp_path)
    try:
        lines = []
        with pytest.raises(BuildLockTimeout, match="KVSERVE_KERNELS_WAIT_S"):
            BuildLock(tmp_path, lines.append, wait_limit_s=1.0).acquire()
        assert len(lines) == 1 and f"process {holder.pid}" in lines[0] and "gives up at" in lines[0]
        assert (tmp_path / "lock").exists()  # a live build's lock is never removed
    finally:
        holder.kill()
        holder.wait()


def test_a_build_killed_while_waited_for_is_taken_over(tmp_path):
    holder = _start_holder(tmp_path)
    lines = []
    lock = BuildLock(tmp_path, lines.append, wait_limit_s=30.0)
    started = time.monotonic()
    killer = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(0.5); os.kill({holder.pid}, 9)"])
    try:
        lock.acquire()
        assert time.monotonic() - started < 10
        assert any("took over a stale" in line for line in lines)
        assert not (tmp_path / "lock").exists()
        assert (tmp_path / "kvserve.lock").read_text().strip() == str(os.getpid())
    finally:
        lock.release()
        killer.wait()
        holder.wait()


def test_a_wait_past_the_limit_falls_back_to_the_torch_paths_with_one_warning(kernels_dir, monkeypatch, caplog):
    directory, calls = kernels_dir
    monkeypatch.setenv("KVSERVE_KERNELS_WAIT_S", "0.5")
    holder = _start_holder(directory)
    try:
        assert build.cpu_kernels() is None
    finally:
        holder.kill()
        holder.wait()
    assert calls == []
    warnings = [record for record in caplog.records if record.name == build.__name__ and record.levelname == "WARNING"]
    assert len(warnings) == 1 and "BuildLockTimeout" in warnings[0].getMessage()
    assert build.kernel_state().failed


@pytest.mark.slow
def test_a_start_killed_mid_compile_leaves_nothing_that_blocks_the_next(tmp_path):
    """The real compiler: kill a start while it compiles (its whole process group, as a Ctrl-C'd terminal or
    a killed container would), then start again: it comes up with the kernels, saying it took the lock over."""
    env = {**os.environ, "KVSERVE_KERNELS_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    env.pop("KVSERVE_NO_CPP_KERNELS", None)
    script = "from kvserve.kernels.build import cpu_kernels; print('kernels', cpu_kernels() is not None)"
    first = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True,
                             stderr=subprocess.PIPE, text=True)
    assert "compiling kvserve's CPU kernels" in first.stderr.readline()
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("*/lock")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(tmp_path.glob("*/lock")), "torch's build never took its lock"
    time.sleep(2)  # into the compile
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert list(tmp_path.glob("*/lock"))  # left behind: what used to hang every later start
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert "kernels True" in second.stdout, second.stderr
    assert "took over a stale kernels build lock" in second.stderr
    assert not list(tmp_path.glob("*/lock"))
