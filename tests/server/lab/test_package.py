"""The lab's static files are package data: a wheel built from the source tree ships every one of them."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from kvserve.server.lab.routes import STATIC_DIR

REPO = Path(__file__).resolve().parents[3]


def test_a_built_wheel_ships_the_lab(tmp_path):
    source = tmp_path / "src"  # a copy, so the build leaves nothing in the work tree
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "kvserve", source / "kvserve", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("kvserve-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"kvserve/server/lab/static/{path.name}" for path in STATIC_DIR.iterdir()}
    assert len(expected) >= 9 and expected <= names, sorted(expected - names)
    assert "kvserve/server/lab/routes.py" in names
