"""Architecture name -> model class: the one list of what kvserve runs.

Names are spelt as their source spells them: a Hugging Face config.json's
`architectures[0]`, or a GGUF file's `general.architecture`. The checkpoint
and GGUF readers check support here, and the loader builds
`model_class(config.architecture)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from kvserve.errors import UnsupportedModelError
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.llama import LlamaForCausalLM

HF = "hf"
GGUF = "gguf"


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str
    source: str  # HF or GGUF
    model_class: type[nn.Module]
    # llama.cpp's converter permutes the rows of Q and K for architectures
    # whose ggml RoPE is the interleaved kind ("llama"); the loader undoes it.
    gguf_permuted_qk: bool = False
    # llama.cpp's converter adds this to every norm weight (Gemma's (1 + w) norms are stored as
    # 1 + w); the GGUF reader subtracts it so the model loads Hugging Face's w either way.
    gguf_norm_shift: float = 0.0


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("LlamaForCausalLM", HF, LlamaForCausalLM),
    Architecture("MistralForCausalLM", HF, LlamaForCausalLM),
    Architecture("Qwen2ForCausalLM", HF, LlamaForCausalLM),
    Architecture("Gemma3ForCausalLM", HF, Gemma3ForCausalLM),
    Architecture("llama", GGUF, LlamaForCausalLM, gguf_permuted_qk=True),
    Architecture("qwen2", GGUF, LlamaForCausalLM),  # NEOX RoPE: stored unpermuted
    Architecture("gemma3", GGUF, Gemma3ForCausalLM, gguf_norm_shift=1.0),  # NEOX RoPE too
)


def supported_architectures(source: str) -> list[str]:
    return [arch.name for arch in ARCHITECTURES if arch.source == source]


def find_architecture(name: str | None, source: str) -> Architecture:
    """The entry for `name` from `source`; UnsupportedModelError listing what is supported otherwise."""
    for arch in ARCHITECTURES:
        if arch.name == name and arch.source == source:
            return arch
    what = "GGUF architecture" if source == GGUF else "architecture"
    raise UnsupportedModelError(
        f"{what} {name!r} is not supported; supported: {', '.join(supported_architectures(source))}"
    )


def model_class(architecture: str) -> type[nn.Module]:
    """The class that runs a loaded config's `architecture` (names are unique across sources)."""
    for arch in ARCHITECTURES:
        if arch.name == architecture:
            return arch.model_class
    names = ", ".join(arch.name for arch in ARCHITECTURES)
    raise UnsupportedModelError(f"architecture {architecture!r} is not supported; supported: {names}")
