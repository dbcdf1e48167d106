"""What this installation is: its version (`kvserve --version`)."""

from __future__ import annotations


def package_version() -> str:
    """The installed distribution's version (a checkout that was never installed says so)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvserve")
    except PackageNotFoundError:
        return "unknown (not installed: run from a source tree)"
