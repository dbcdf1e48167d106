"""kvserve as a user installs it: the wheel and the sdist are built once per session (`python -m build`,
the wheel from the sdist, as a package index gets them), each carries every file of the package, and
each, installed outside the checkout into a fresh target, compiles its C++ kernels from its own files and
serves a request. The checkout must not be importable there: a missing package-data file (csrc/kernels.h
once) then fails here instead of leaving installed users on the torch paths."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Run from the installed copy: the kernels, the engine, the server and the lab's pages. Prints one JSON line.
_SERVE_ONE_REQUEST = """
import json, sys
import kvserve
from fastapi.testclient import TestClient
from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.kernels import ops
from kvserve.server.app import create_app
from kvserve.server.core.serving import ServerSettings

engine = Engine(EngineConfig(kv_cache_memory="64MiB", speculative="off"))
with TestClient(create_app(engine, ServerSettings(model_name="m"))) as client:
    reply = client.post("/v1/completions", json={"model": "m", "prompt": "The capital of France is",
                                                 "max_tokens": 4, "temperature": 0})
    lab = client.get("/lab")
print(json.dumps({"file": kvserve.__file__, "kernels": ops.available(), "isa": ops.quant_matmul_isa(),
                  "linear_dtype": engine.loaded.linear_dtype, "status": reply.status_code,
                  "completion_tokens": reply.json().get("usage", {}).get("completion_tokens"),
                  "lab": lab.status_code}))
"""


def _package_files() -> set[str]:
    """Every file of the package in the source tree (kvserve/...), caches aside."""
    return {path.relative_to(REPO).as_posix() for path in (REPO / "kvserve").rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}


@pytest.fixture(scope="session")
def dists(tmp_path_factory) -> dict[str, Path]:
    """{"wheel": ..., "sdist": ...}, built once from a copy of the source (the build leaves nothing in the
    work tree), with this environment's setuptools (no download)."""
    root = tmp_path_factory.mktemp("package")
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "kvserve", source / "kvserve", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(root / "dist"),
                           str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"wheel": next((root / "dist").glob("kvserve-*.whl")),
            "sdist": next((root / "dist").glob("kvserve-*.tar.gz"))}


def test_the_wheel_carries_every_file_of_the_package(dists):
    names = set(zipfile.ZipFile(dists["wheel"]).namelist())
    expected = _package_files()
    assert {"kvserve/kernels/csrc/kernels.h", "kvserve/server/lab/static/lab.css"} <= expected
    assert expected <= names, sorted(expected - names)


def test_the_sdist_carries_every_file_of_the_package(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        # kvserve-0.1.0/kvserve/... -> kvserve/...
        names = {name.partition("/")[2] for name in sdist.getnames()}
    expected = _package_files() | {"pyproject.toml", "README.md"}
    assert expected <= names, sorted(expected - names)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installed_outside_the_checkout_it_builds_its_kernels_and_serves(dists, kind, tmp_path):
    target, kernels_dir, elsewhere = tmp_path / "target", tmp_path / "kernels", tmp_path / "elsewhere"
    elsewhere.mkdir()
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              "--target", str(target), str(dists[kind])], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    # The installed copy first on the path, run from a folder where the checkout is not importable; the
    # kernels build in a folder of their own, so they compile from the installed csrc/, not from a cache.
    env = {key: value for key, value in os.environ.items() if key != "KVSERVE_NO_CPP_KERNELS"}
    env.update(PYTHONPATH=str(target), KVSERVE_KERNELS_DIR=str(kernels_dir))
    done = subprocess.run([sys.executable, "-c", _SERVE_ONE_REQUEST], cwd=elsewhere, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).is_relative_to(target), result
    assert result["kernels"], done.stderr[-4000:]  # the build's warning says why not
    assert any(kernels_dir.iterdir())  # compiled here, from the installed files
    assert result["linear_dtype"] in ("int4", "int8"), result  # the kernels' weights, not the torch fallback
    assert (result["status"], result["completion_tokens"], result["lab"]) == (200, 4, 200), result
    # The installed `kvserve doctor` says the same (and exits 0): the kernels built here, this copy runs.
    doctor = subprocess.run([sys.executable, "-m", "kvserve.cli", "doctor"], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=600)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr[-3000:]
    assert f"built in {kernels_dir}" in doctor.stdout and f"({target}" in doctor.stdout, doctor.stdout
