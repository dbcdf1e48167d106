"""The Makefile's own `python -c` lines run against the package as it is: a rename inside kvserve
must not leave `make test` / `make serve` failing at install time on a fresh machine (CI's first step)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

MAKEFILE = Path(__file__).resolve().parent.parent / "Makefile"
SNIPPETS = re.findall(r'\$\(BIN\)/python -c "([^"]+)"', MAKEFILE.read_text())


def test_the_makefile_has_python_snippets_to_check():
    assert SNIPPETS, "the Makefile's install step lost its kernel build line"


@pytest.mark.parametrize("snippet", SNIPPETS)
def test_a_makefile_python_snippet_runs(snippet):
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
