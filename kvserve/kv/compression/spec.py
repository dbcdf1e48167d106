"""What to compress a prompt's KV cache by: a method and a ratio ("keydiff:2"), as a flag or request field gives it.

`auto:R` names no method of its own: `resolve` replaces it with the method that bench/kv_compression.py measured
best (AUTO_METHOD), so that what enters the prefix cache's key is always a concrete method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# The question-agnostic methods (scoring.py has one scorer per name).
METHODS = ("streaming", "knorm", "keydiff", "expected_attention")
# What `auto` resolves to, by bench/kv_compression.py (2,048-token prefixes, 256 scored tokens): the lowest KL and
# highest top-1 agreement at 2x and 4x on SmolLM2-135M and Gemma 3 270M, the lowest perplexity change on both at 4x
# and on Gemma at 2x (SmolLM2 2x: +1.64% against StreamingLLM's +1.44%). Its known weakness: fitted to the last
# queries of the prompt, it drops a passkey those queries never looked at (0 of 5 retrieved at 2x on SmolLM2,
# where Knorm and KeyDiff kept 5 of 5).
AUTO_METHOD = "expected_attention"
# Methods the engine runs: they score a chunk from its cached keys alone, so the kept tokens are a function of the
# chunk's K/V and never of how the scheduler chunked the prefill. Expected Attention reads the chunk's last queries,
# which depend on that chunking (a cache hit would change the answer): the bench runs it, the engine refuses it.
ENGINE_METHODS = ("streaming", "knorm", "keydiff")
# What `auto` resolves to in the engine, by bench/kv_compression.py --engine (the engine's 512-token chunks, each
# scored alone; figures in its docstring): no key-only way beat Knorm everywhere. Per-chunk StreamingLLM (each
# chunk's newest half) has the lower perplexity change at 2x (SmolLM2 +1.65% against +2.33% with the prompt's
# last 64 tokens exact, +2.90% against +4.64% with every chunk compressed; Gemma 3 +0.25% against +2.80%) but the
# higher at 4x (+4.53% / +8.92% / +4.70% against +3.48% / +11.40% / +2.90%), and it drops whatever lies in a
# chunk's first half (passkey at 1k: 1 of 2, Knorm 2 of 2). Knorm with each chunk's newest 64 tokens kept did
# better with every chunk compressed (+3.47% / +8.14%) but worse with the prompt's tail exact (+2.89% / +4.77%)
# and lost the passkey at 4k that Knorm kept. KeyDiff was worse than Knorm in every setting.
ENGINE_AUTO_METHOD = "knorm"
# Tokens per canonical chunk (a multiple of the block size): chunk k is prompt tokens [k * chunk, (k + 1) * chunk),
# compressed as soon as it is computed, so a request's kept tokens are the same cold and cached.
DEFAULT_CHUNK = 512


@dataclass(frozen=True, slots=True)
class CompressionSpec:
    """Keep ceil(T / ratio) of a prompt's T tokens per layer and KV head.

    `sinks` first tokens and `window` last tokens are always kept (StreamingLLM's attention sinks, and the recent
    context every next token leans on); the method chooses the rest. Where the budget is smaller than
    sinks + window (short prompts, high ratios) the budget wins: the sinks first, then as much of the window as fits.
    """

    method: str
    ratio: float
    sinks: int = 4
    window: int = 64
    chunk: int = DEFAULT_CHUNK  # the engine's canonical chunk (the bench compresses a whole prompt and ignores it)

    def __post_init__(self) -> None:
        if self.method not in METHODS and self.method != "auto":
            raise ValueError(f"unknown KV compression method {self.method!r}; choose one of "
                             f"{', '.join(METHODS + ('auto',))}")
        if not (isinstance(self.ratio, (int, float)) and math.isfinite(self.ratio) and self.ratio >= 1):
            raise ValueError(f"KV compression ratio must be a finite number >= 1 (1 keeps every token), "
                             f"got {self.ratio!r}")
        if self.sinks < 0 or self.window < 0:
            raise ValueError("sinks and window are token counts (>= 0)")
        if self.chunk < 1:
            raise ValueError(f"KV compression chunk must be a positive token count, got {self.chunk!r}")

    def budget(self, num_tokens: int) -> int:
        """Tokens kept of `num_tokens`: ceil(T / ratio), the same for every layer and head."""
        return min(num_tokens, math.ceil(num_tokens / self.ratio))

    def resolve(self) -> CompressionSpec:
        """`auto` replaced by the measured method; a concrete spec as it is."""
        return replace(self, method=AUTO_METHOD) if self.method == "auto" else self

    def for_engine(self) -> CompressionSpec:
        """The spec the engine runs: `auto` resolved to ENGINE_AUTO_METHOD; a method that reads queries refused."""
        if self.method == "auto":
            return replace(self, method=ENGINE_AUTO_METHOD)
        if self.method not in ENGINE_METHODS:
            raise ValueError(f"KV compression method {self.method!r} scores tokens with the prompt's last queries, "
                             f"which depend on how the prefill was chunked, so a cache hit could change the answer; "
                             f"the engine runs {', '.join(ENGINE_METHODS)} (or auto = {ENGINE_AUTO_METHOD})")
        return self

    def chunk_budget(self, block_size: int) -> int:
        """Tokens the engine keeps of each compressed chunk, per layer and KV head: ceil(chunk / ratio) rounded
        up to whole blocks, so the kept tokens fill whole blocks."""
        if self.chunk % block_size:
            raise ValueError(f"KV compression chunk ({self.chunk} tokens) must be a multiple of the block size "
                             f"({block_size})")
        return min(self.chunk, -(-self.budget(self.chunk) // block_size) * block_size)

    def key(self) -> str:
        """What a prefix-cache key holds for this spec (a resolved one): every field the kept tokens depend on."""
        spec = self.resolve()
        return f"{spec.method}:{spec.ratio:g}:s{spec.sinks}:w{spec.window}:c{spec.chunk}"


def parse_compression(text: str) -> CompressionSpec:
    """"METHOD:RATIO" (e.g. "keydiff:2", "expected_attention:4", "auto:2") -> a spec with default sinks / window."""
    method, sep, ratio_text = text.strip().partition(":")
    if not sep or not method or not ratio_text:
        raise ValueError(f"KV compression must be METHOD:RATIO (e.g. keydiff:2), got {text!r}")
    try:
        ratio = float(ratio_text)
    except ValueError:
        raise ValueError(f"KV compression ratio must be a number, got {ratio_text!r} in {text!r}") from None
    return CompressionSpec(method.strip().lower(), ratio)
