import pytest


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct, loaded once per test session."""
    from kvserve.model.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded):
    return embedded.require_tokenizer()
