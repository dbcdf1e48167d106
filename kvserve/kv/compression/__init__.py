"""KV compression (issue 43): keep, per layer and KV head, the prompt tokens later queries will need.

spec.py       CompressionSpec ("keydiff:2", "auto:4"): method, ratio, always-kept sinks and window
scoring.py    question-agnostic scorers (StreamingLLM, Knorm, KeyDiff, Expected Attention) over PromptKV
select.py     scores -> kept indices (same count per head, deterministic) -> CompressedKV
attention.py  attention of new tokens over a compressed prefix (per-head masks); CompressedPrefixContext
capture.py    a prompt's per-layer K/V and last queries from a contiguous forward (tests, bench)
"""

from kvserve.kv.compression.attention import CompressedPrefixContext, attend_kept
from kvserve.kv.compression.capture import PromptCapture
from kvserve.kv.compression.scoring import SCORERS, PromptKV
from kvserve.kv.compression.select import CompressedKV, compress_layer, gather_kept, keep_indices
from kvserve.kv.compression.spec import AUTO_METHOD, METHODS, CompressionSpec, parse_compression

__all__ = [
    "AUTO_METHOD", "METHODS", "SCORERS", "CompressedKV", "CompressedPrefixContext", "CompressionSpec",
    "PromptCapture", "PromptKV", "attend_kept", "compress_layer", "gather_kept", "keep_indices",
    "parse_compression",
]
