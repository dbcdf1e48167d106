"""One build of the kernels at a time in a build directory, and never a wait on a build that is gone.

torch's `load` guards a build directory with a `lock` file created on start and removed on finish; a
process killed mid-build leaves it behind and every later `load` waits on it forever, silently. So kvserve
takes its own lock first, an OS file lock (`flock`) on `kvserve.lock` beside torch's: the kernel drops it
when its holder dies, however it dies. Holding it, kvserve knows whether torch's `lock` is stale: no
kvserve build is running, and (Linux) no process has the file open (torch keeps it open while building,
and a build by some other program is waited for). A stale one is removed and the start says so.

A wait says what it waits for after a few seconds and every half minute after, and gives up at a limit
(the caller then runs on the torch paths, with one warning).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

NOTICE_AFTER_S = 3.0  # a wait longer than this says what it waits for
NOTICE_EVERY_S = 30.0
POLL_S = 0.2


class BuildLockTimeout(Exception):
    """The build directory stayed locked past the wait limit."""


def torch_lock_holders(lock_path: Path) -> list[int]:
    """Ids of the processes (of those this user may inspect) that have `lock_path` open: torch's build
    holds its lock file open while it builds. Empty where /proc is missing."""
    target = str(lock_path.resolve())
    holders: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return holders
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if any(os.readlink(fd) == target for fd in (entry / "fd").iterdir()):
                holders.append(int(entry.name))
        except OSError:  # another user's process, or one that ended meanwhile
            continue
    return holders


class BuildLock:
    """Exclusive use of a kernels build directory (a context manager); see the module doc."""

    def __init__(self, build_directory: Path, say: Callable[[str], None], wait_limit_s: float) -> None:
        self.directory = build_directory
        self.path = build_directory / "kvserve.lock"
        self.torch_lock = build_directory / "lock"
        self.say = say
        self.wait_limit_s = wait_limit_s
        self._fd: int | None = None

    def __enter__(self) -> BuildLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the directory, waiting (and saying so) for a live build; raises BuildLockTimeout past the limit."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        started = time.monotonic()
        next_notice = NOTICE_AFTER_S
        try:
            while True:
                waited = time.monotonic() - started
                if self._try_lock(fd) and not (holders := torch_lock_holders(self.torch_lock)
                                               if self.torch_lock.exists() else []):
                    break
                if waited >= self.wait_limit_s:
                    raise BuildLockTimeout(f"another build held {self.directory} for {waited:.0f}s "
                                           f"(KVSERVE_KERNELS_WAIT_S={self.wait_limit_s:g})")
                if waited >= next_notice:
                    self.say(f"waiting {waited:.0f}s for {self._holder_description(fd)} building kvserve's CPU "
                             f"kernels in {self.directory} (gives up at {self.wait_limit_s:.0f}s)")
                    next_notice += NOTICE_EVERY_S
                time.sleep(POLL_S)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        if self.torch_lock.exists():
            self.torch_lock.unlink(missing_ok=True)
            self.say(f"took over a stale kernels build lock (its holder is gone, a build was stopped): "
                     f"removed {self.torch_lock}")

    def _try_lock(self, fd: int) -> bool:
        """Whether this process now holds the flock (it may already: a torch lock kept it waiting)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _holder_description(self, fd: int) -> str:
        if self.torch_lock.exists() and (holders := torch_lock_holders(self.torch_lock)):
            return f"process {holders[0]}"
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return f"process {pid}" if pid.isdigit() else "another process"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
