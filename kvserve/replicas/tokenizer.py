"""The ingress's tokenizer: the model's own, without its weights where the format allows."""

from __future__ import annotations

from pathlib import Path

from kvserve.model.loader import embedded_model_path, load_model
from kvserve.model.tokenizer import Tokenizer


def ingress_tokenizer(model: str | None) -> Tokenizer | None:
    """A Hugging Face directory (the embedded model is one) gives its tokenizer alone; a GGUF file keeps its
    vocabulary among the weights, so that model is loaded once here (the ingress then holds it too)."""
    path = embedded_model_path() if model is None else Path(model)
    if path.is_dir():
        return Tokenizer.from_directory(path)
    return load_model(path).tokenizer
