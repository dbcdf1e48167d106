"""`kvserve doctor`: what this installation runs on, in one screen: the version and where it is installed,
Python and torch, the CPU's features, the C++ kernels' state (building them if needed) and where the model
comes from. Exit status 1 when something the engine needs is missing (the kernels failed to build, the
model cannot be found), so a script can check an install with it."""

from __future__ import annotations

import platform as python_platform
from pathlib import Path


def package_version() -> str:
    """The installed distribution's version (a checkout that was never installed says so)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvserve")
    except PackageNotFoundError:
        return "unknown (not installed: run from a source tree)"


def report(model: str | None = None) -> tuple[list[str], bool]:
    """(lines to print, whether everything the engine needs is there)."""
    import torch

    import kvserve
    from kvserve.cpu_features import describe_cpu
    from kvserve.kernels.build import kernel_state

    kernels = kernel_state()
    model_line, model_ok = _model_line(model)
    lines = [
        f"kvserve {package_version()} ({Path(kvserve.__file__).parent})",
        f"python {python_platform.python_version()} ({python_platform.machine()}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)",
        f"cpu: {describe_cpu()}",
        f"kernels: {kernels.describe()}",
        f"model: {model_line}",
    ]
    return lines, model_ok and not kernels.failed


def _model_line(model: str | None) -> tuple[str, bool]:
    from kvserve.errors import KVServeError
    from kvserve.model.loader import EMBEDDED_MODEL_PACKAGE, embedded_model_path

    if model is not None:
        path = Path(model)
        kind = "Hugging Face directory" if path.is_dir() else "file" if path.is_file() else None
        return (f"{model} ({kind})", True) if kind else (f"{model}: not found", False)
    try:
        path = embedded_model_path()
    except KVServeError as exc:
        return f"embedded model unavailable: {exc}", False
    return f"embedded SmolLM2-135M-Instruct, {path} (package {EMBEDDED_MODEL_PACKAGE}); --model PATH for another", True


def main(model: str | None = None) -> int:
    lines, ok = report(model)
    print("\n".join(lines))
    return 0 if ok else 1
