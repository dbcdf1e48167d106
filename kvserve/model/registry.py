"""Architecture name -> model family: the one list of what kvserve runs.

Each family file declares its architectures (kvserve.model.family: the names its sources use, its model
class, its config readers and GGUF tensor names); this module collects them. Adding a family is its
file plus its line in FAMILIES. Names are spelt as their source spells them: a Hugging Face
config.json's `architectures[0]`, or a GGUF file's `general.architecture`. The checkpoint and GGUF
readers look their architecture up here, and the loader builds `model_class(config.architecture)`.
"""

from __future__ import annotations

from kvserve.errors import UnsupportedModelError
from kvserve.model import gemma3, gpt_oss, granite, llama, ministral3, olmo2, phi3, qwen3, qwen35, smollm3
from kvserve.model import gemma4, lfm2
from kvserve.model.causal_lm import CausalLM
from kvserve.model.family import GGUF, HF, Architecture, ModelFamily

__all__ = ["ARCHITECTURES", "GGUF", "HF", "Architecture", "find_architecture", "model_class",
           "supported_architectures"]

FAMILIES: tuple[ModelFamily, ...] = (llama.FAMILY, gemma3.FAMILY, qwen3.FAMILY, smollm3.FAMILY, phi3.FAMILY,
                                     olmo2.FAMILY, granite.FAMILY, ministral3.FAMILY, gpt_oss.FAMILY,
                                     lfm2.FAMILY, qwen35.FAMILY, gemma4.FAMILY)
ARCHITECTURES: tuple[Architecture, ...] = tuple(arch for module in (llama, gemma3, qwen3, smollm3, phi3, olmo2, granite,
                                                                  ministral3, gpt_oss, lfm2, qwen35, gemma4)
                                                for arch in module.ARCHITECTURES)


def supported_architectures(source: str) -> list[str]:
    return [arch.name for arch in ARCHITECTURES if arch.source == source]


def find_architecture(name: str | None, source: str) -> Architecture:
    """The entry for `name` from `source`; UnsupportedModelError listing what is supported otherwise (or
    saying why, for a name a family recognizes but does not run)."""
    for arch in ARCHITECTURES:
        if arch.name == name and arch.source == source:
            return arch
    for family in FAMILIES:
        if name in family.refused:
            raise UnsupportedModelError(family.refused[name])
    what = "GGUF architecture" if source == GGUF else "architecture"
    raise UnsupportedModelError(
        f"{what} {name!r} is not supported; supported: {', '.join(supported_architectures(source))}"
    )


def model_class(architecture: str) -> type[CausalLM]:
    """The class that runs a loaded config's `architecture` (names are unique across sources)."""
    for arch in ARCHITECTURES:
        if arch.name == architecture:
            return arch.model_class
    names = ", ".join(arch.name for arch in ARCHITECTURES)
    raise UnsupportedModelError(f"architecture {architecture!r} is not supported; supported: {names}")
