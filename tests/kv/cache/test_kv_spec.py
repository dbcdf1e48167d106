import pytest
from kvserve.config import ModelConfig
from kvserve.errors import InvalidRequestError
from kvserve.kv.attention import CpuAttentionBackend
from kvserve.kv.cache.kv_spec import kv_bytes_per_token, kv_spec


def _config(**overrides) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=100, hidden_size=4096, intermediate_size=11008, num_layers=32,
                num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-5,
                rope_theta=10000.0)
    base.update(overrides)
    return ModelConfig(**base)


def test_formula_matches_known_figures():
    # Llama-3-8B-like: 32 layers x 8 KV heads x 128 head_dim in fp16 = 131,072 bytes per token.
    assert kv_bytes_per_token(_config(), "float16") == 131_072
    # 7B MHA (32 KV heads) in fp16: 0.5 MiB per token.
    assert kv_bytes_per_token(_config(num_kv_heads=32), "float16") == 512 * 1024
    # SmolLM2-135M in fp32 (auto).
    smol = _config(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576)
    assert kv_bytes_per_token(smol) == 2 * 30 * 3 * 64 * 4 == 46_080


def test_quantized_rows_count_their_parameters():
    smol = _config(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576)
    rows = 2 * 30 * 3
    assert kv_bytes_per_token(smol, "int8") == rows * (64 + 2)  # int8 elements + one fp16 scale
    assert kv_bytes_per_token(smol, "fp8_e4m3") == rows * (64 + 2)
    assert kv_bytes_per_token(smol, "int4") == rows * (32 + 4 * 2 * 2)  # packed nibbles + (scale, min) x 4 groups
    assert kv_bytes_per_token(smol, "int8/int4") == 30 * 3 * ((64 + 2) + (32 + 16))  # keys int8, values int4
    assert kv_spec(smol, "int8").formula() == "30 layers x 3 KV heads x 2 (K, V) x (64 x 1 B + 2 B scale) = 11,880 bytes/token"
    assert "(K (64 x 1 B + 2 B scale) + V (64 x 0.5 B + 16 B scales/mins))" in kv_spec(smol, "int8/int4").formula()


def test_auto_follows_what_the_linear_layers_hold():
    from kvserve.kv.cache.kv_spec import resolve_cache_dtype

    assert resolve_cache_dtype("auto") == "float32"  # exact float32 weights: an exact cache
    for linear_dtype in ("bfloat16", "int8", "int4"):
        assert resolve_cache_dtype("auto", linear_dtype) == "float16"
        assert resolve_cache_dtype("auto/int4", linear_dtype) == "float16/int4"
    assert resolve_cache_dtype("int8", "int4") == "int8"  # an explicit dtype is what it says


def test_unknown_dtype_is_rejected():
    with pytest.raises(InvalidRequestError, match="unsupported KV cache dtype 'int3'"):
        kv_spec(_config(), "int3")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "int4", "fp8_e4m3", "fp8_e5m2",
                                   "int8/int4", "float16/fp8_e5m2"])
def test_paged_pool_allocates_what_the_spec_says(dtype):
    config = _config(num_layers=2, num_kv_heads=2, head_dim=16, num_heads=4, hidden_size=64)
    spec = kv_spec(config, dtype)
    cache = CpuAttentionBackend().allocate_kv_cache(spec, num_blocks=5, block_size=4, max_num_seqs=2)
    # Pages, plus the float16 open blocks of two requests where keys are encoded per block (int4).
    assert cache.bytes_allocated == 5 * spec.page_bytes(4) + spec.open_blocks_bytes(2, 4)
    if not spec.has_open_blocks:  # every parameter per row: the bytes per token do not depend on the block size
        assert cache.bytes_allocated == 5 * 4 * kv_bytes_per_token(config, dtype)
    else:  # int4 keys: 2 x head_dim parameters per block and head, spread over its 4 rows
        assert spec.page_bytes(4) == 4 * 2 * 2 * ((8 + 8 * 2) + (8 + 2 * 2))
        assert spec.open_blocks_bytes(2, 4) == 2 * 2 * 2 * 2 * 4 * 16 * 2
