"""Attention over the KV cache: the one place where queries meet cached keys and values.

base.py        the seam: AttentionBackend (cache layout, batch order, step
               metadata, kernels) and AttentionContext (what the model sees)
cpu.py         the `cpu` backend (cpu_metadata.py, cpu_decode.py; its C++ decode kernel is
               kvserve/kernels/csrc/paged_decode.cpp) and `cpu-torch` (torch kernels only)
contiguous.py  one whole sequence over its own K/V, nothing stored (no cache)
reference.py   per-sequence SDPA with a bottom-right causal mask
registry.py    name -> backend
"""

from kvserve.kv.attention.base import AttentionBackend, AttentionContext, SequenceSlice
from kvserve.kv.attention.contiguous import ContiguousContext
from kvserve.kv.attention.cpu import CpuAttentionBackend, PagedKVContext
from kvserve.kv.attention.cpu_metadata import AttentionMetadata, build_attention_metadata
from kvserve.kv.attention.reference import attend, attention_mask
from kvserve.kv.attention.registry import attention_backend_names, get_attention_backend

__all__ = [
    "AttentionBackend", "AttentionContext", "AttentionMetadata", "ContiguousContext", "CpuAttentionBackend",
    "PagedKVContext", "SequenceSlice", "attend", "attention_backend_names", "attention_mask",
    "build_attention_metadata", "get_attention_backend",
]
