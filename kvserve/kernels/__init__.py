"""kvserve's CPU kernels: one C++ extension built for this machine (build.py), reached only through ops.py
and, for the gated delta rule, gated_delta.py (every call checked for device and dtype, the torch fallback
chosen there), and the packed layout of group-quantized weights (packing.py). Below model/ and kv/;
imports only torch and kvserve.cpu_features.

csrc/kernels.h          the declarations of every kernel (bindings.cpp binds them)
csrc/paged_decode.cpp   decode attention over paged K/V blocks, read in place
csrc/quant_matmul.cpp   x @ W^T for 4-/8-bit group-quantized W (AVX512-VNNI, AVX2, portable)
csrc/fused_ops.cpp      RMSNorm (+ residual add), RoPE in place, gated activations, the K/V store
"""
