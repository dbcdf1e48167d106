"""kvserve's CPU kernels: one C++ extension built for this machine (build.py), what the model calls (ops.py),
and the packed layout of group-quantized weights (packing.py). Below model/ and kv/; imports only torch.

csrc/paged_decode.cpp   decode attention over paged K/V blocks, read in place
csrc/quant_matmul.cpp   x @ W^T for 4-/8-bit group-quantized W (AVX512-VNNI, AVX2, portable)
csrc/fused_ops.cpp      RMSNorm (+ residual add), RoPE in place, gated activations
"""

from kvserve.kernels.build import cpu_kernels

__all__ = ["cpu_kernels"]
