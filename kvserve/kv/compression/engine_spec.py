"""Which requests the engine compresses, and where it cannot: the flag's spec, a request's override, the refusals.

`--kv-compression METHOD:RATIO` sets the engine's default; a request's `kv_compression` field overrides it ("none":
off for that request). Both resolve to an engine spec (ENGINE_METHODS, auto -> ENGINE_AUTO_METHOD) whose chunk is a
multiple of the block size. What compression cannot follow yet is refused by name, at startup for the flag and per
request for the field (the engine turns the ValueError into a ConfigError or a 400). Compression applies to the
full-attention layers: a model's sliding-window layers (Gemma 3) keep their window by position and a hybrid's
recurrent layers (Qwen3.5, LFM2) their state over every token, beside compressed full-attention layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv.compressed_chunks import ChunkPolicy
from kvserve.kv.compression.spec import CompressionSpec, parse_compression

OFF = "none"


@dataclass(frozen=True, slots=True)
class EngineSupport:
    """What of the engine compression must reckon with (None: it can run; else why not)."""

    only_windows: bool  # every layer has a sliding window: no full-attention layer to compress
    shared_layers: bool  # layers that share or pack K/V (Gemma 4)
    blockwise_codec: bool
    context_shift: bool
    no_kv_cache: bool = False

    def refusal(self) -> str | None:
        reasons = [
            (self.only_windows, "every layer has a sliding window: compression applies to full-attention "
                                "layers (a model's windowed layers hold only their window anyway)"),
            (self.shared_layers, "layers that share or pack their K/V (Gemma 4) store rows that compaction "
                                 "cannot move per layer"),
            (self.blockwise_codec, "this cache dtype encodes whole blocks (int4 keys per channel): choose a "
                                   "per-row dtype (auto, float16, int8, fp8, int8/int4)"),
            (self.context_shift, "a context shift moves tokens by position, which a compressed table no longer "
                                 "holds"),
            (self.no_kv_cache, "without a KV cache there is nothing to compress"),
        ]
        found = [why for applies, why in reasons if applies]
        return f"KV compression cannot run here: {'; '.join(found)}" if found else None


def engine_spec(text: str | None, block_size: int) -> CompressionSpec | None:
    """A flag's or a request's "METHOD:RATIO" (or None / "none": off) -> the spec the engine runs; ValueError
    with what is wrong."""
    if text is None or text.strip().lower() == OFF:
        return None
    spec = parse_compression(text).for_engine()
    spec.chunk_budget(block_size)  # refuses a chunk that is not whole blocks
    return spec


def request_spec(override: str | None, default: CompressionSpec | None, block_size: int,
                 support: EngineSupport) -> CompressionSpec | None:
    """The spec a request runs with: its override ("none": off) or the engine's default; ValueError (a 400)
    where it asks for compression the engine cannot run."""
    spec = default if override is None else engine_spec(override, block_size)
    if spec is not None and override is not None and (why := support.refusal()) is not None:
        raise ValueError(why)
    return spec


def chunk_policy(spec: CompressionSpec, block_size: int, num_prompt_tokens: int) -> ChunkPolicy:
    """The KV manager's and scheduler's view of a compressing request (counts only)."""
    return ChunkPolicy(spec.chunk, spec.chunk_budget(block_size), spec.window, num_prompt_tokens)
