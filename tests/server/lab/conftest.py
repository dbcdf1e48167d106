"""The lab in process on the tiny random model (fast), with the settings each test module needs."""

from __future__ import annotations

import pytest

from tests.server.inprocess import serve_in_process, with_tiny_tokenizer
from tests.server.lab.browser import Browser


@pytest.fixture(scope="module")
def lab_app(tiny_models):
    """An open server (no keys), prompts not logged."""
    with serve_in_process(with_tiny_tokenizer(tiny_models("llama-gqa"))) as client:
        yield client


@pytest.fixture(scope="module")
def logging_lab_app(tiny_models):
    """An open server that logs prompts, so the explainer may show other requests' text."""
    with serve_in_process(with_tiny_tokenizer(tiny_models("llama-gqa")), log_prompts=True) as client:
        yield client


@pytest.fixture(scope="module")
def browser(request, tmp_path_factory):
    """One headless Chromium per test module; a module sets BROWSER_HEIGHT for a taller window."""
    page = Browser(tmp_path_factory.mktemp("chromium-profile"), height=getattr(request.module, "BROWSER_HEIGHT", 1000))
    yield page
    page.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    """Where a browser test module saves its screenshots."""
    return tmp_path_factory.mktemp("lab-screenshots")
