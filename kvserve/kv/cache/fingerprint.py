"""What produced a block's K/V, as one digest: a lower tier reads only blocks with its own.

K/V depend on the weights (and the precision the linear layers hold them in),
the model's shape and RoPE settings, the KV dtype, the block size and the
attention backend's layout. A restart with the same of each must hit; any
difference must miss, because a block read under the wrong one is silently
wrong output.

The weights are identified by their tensors: name, shape, dtype and a strided
sample of each tensor's bytes (about 4,096 elements per tensor). That tells
two fine-tunes of one architecture apart (training moves every tensor) and
costs milliseconds, where hashing a multi-gigabyte file would cost seconds at
every start.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Mapping

import torch

# 2: int4 keys per channel over a block (kv/cache/quant.py): older int4 blocks hold per-token groups in the same bytes.
FINGERPRINT_VERSION = b"kvserve-kv-fingerprint-2"
_SAMPLES_PER_TENSOR = 4096


def tensor_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """BLAKE2b-128 of every tensor's name, shape, dtype and a strided sample of its bytes."""
    digest = hashlib.blake2b(digest_size=16, person=b"kvserve-weights")
    for name, tensor in named_tensors:
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
        sample = flat[::step].contiguous()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|{flat.numel()}\n".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return digest.digest()


def cache_fingerprint(weights_digest: bytes, parts: Mapping[str, object]) -> bytes:
    """The digest a tier files blocks under: the weights' digest and every setting in `parts`
    (model config, KV dtype, block size, layout), each by its repr."""
    digest = hashlib.blake2b(FINGERPRINT_VERSION, digest_size=16, person=b"kvserve-kv-fp")
    digest.update(weights_digest)
    for name in sorted(parts):
        digest.update(f"{name}={parts[name]!r}\n".encode())
    return digest.digest()
