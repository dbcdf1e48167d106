import pytest


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct, loaded once per test session."""
    from kvserve.model.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def embedded_tokenizer(embedded):
    return embedded.require_tokenizer()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random models by variant name, loaded once: {variant: LoadedModel}."""
    from kvserve.model.loader import load_model
    from tests.helpers import build_hf_model, save_hf_model

    cache = {}

    def get(variant: str = "llama-gqa"):
        if variant not in cache:
            directory = save_hf_model(build_hf_model(variant), tmp_path_factory.mktemp(variant))
            cache[variant] = load_model(directory)
        return cache[variant]

    return get
