"""The single-process server never imports Ray (an optional extra) nor pyzmq (only a publishing engine does)."""

import subprocess
import sys
from pathlib import Path


def test_the_server_and_the_cli_import_neither_ray_nor_zmq():
    check = ("import sys, kvserve.cli, kvserve.server.app, kvserve.engine.engine; "
             "loaded = [m for m in sys.modules if m.split('.')[0] in ('ray', 'zmq', 'msgpack')]; "
             "sys.exit(repr(loaded) if loaded else 0)")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])  # this checkout's kvserve
    assert done.returncode == 0, done.stderr[-2000:]
