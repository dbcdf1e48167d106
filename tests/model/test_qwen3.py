"""Qwen3 and Qwen3-MoE against transformers: tiny random models from an HF directory and from a GGUF."""

import json

import pytest
import torch

from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.kernels import ops
from kvserve.model.checkpoint import read_config
from kvserve.model.gguf import load_gguf
from kvserve.model.loader import load_model
from kvserve.model.moe import SparseMoE
from kvserve.model.qwen3 import Qwen3ForCausalLM
from tests.helpers import (QWEN3_VARIANTS, TINY_VOCAB, build_hf_model, paged_logits, reference_greedy,
                           reference_logits, save_hf_model, write_gguf)

SEQUENCE_LEN = 32
TOKENS = torch.randint(0, TINY_VOCAB, (SEQUENCE_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
CHUNKINGS = {"prefill then decode": [12], "chunked prefill": [5, 3, 4, 7], "all decode": [1]}
TOLERANCE = 1e-4


def assert_matches(model, expected: torch.Tensor) -> None:
    for name, chunks in CHUNKINGS.items():
        diff = (paged_logits(model, TOKENS, chunks) - expected).abs().max().item()
        assert diff <= TOLERANCE, f"{name}: max |logit diff| {diff:.2e}"
    recomputed = model(torch.tensor(TOKENS), torch.arange(SEQUENCE_LEN))  # no cache: the contiguous context
    assert (recomputed - expected).abs().max().item() <= TOLERANCE


def greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """kvserve's greedy continuation, recomputing the whole sequence each step (no cache)."""
    out = list(ids)
    for _ in range(num_tokens):
        logits = model(torch.tensor(out), torch.arange(len(out)), logits_indices=torch.tensor([len(out) - 1]))
        out.append(int(logits[0].argmax()))
    return out[len(ids):]


@pytest.mark.parametrize("variant", sorted(QWEN3_VARIANTS))
def test_hf_directory_matches_transformers(variant, tmp_path):
    hf_model = build_hf_model(variant)
    hf = hf_model.config
    loaded = load_model(save_hf_model(hf_model, tmp_path))
    assert isinstance(loaded.model, Qwen3ForCausalLM) and loaded.config.architecture == hf.architectures[0]
    assert loaded.config.head_dim == hf.head_dim  # decoupled from hidden / heads in all but one variant
    moe = [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, SparseMoE)]
    if "moe" in variant:
        assert len(moe) == hf.num_hidden_layers and loaded.config.num_experts == hf.num_experts
        assert loaded.config.norm_topk_prob == hf.norm_topk_prob
    else:
        assert not moe
    assert loaded.model.num_parameters() == sum(p.numel() for p in hf_model.parameters())
    assert_matches(loaded.model, reference_logits(hf_model, TOKENS))
    assert greedy(loaded.model, TOKENS[:8], 12) == reference_greedy(hf_model, TOKENS[:8], 12)


def test_qk_norm_and_routing_change_the_logits(tmp_path):
    # The parity above would prove little if the q/k norms or the router made no difference here.
    hf_model = build_hf_model("qwen3-moe")
    model = load_model(save_hf_model(hf_model, tmp_path)).model
    expected = reference_logits(hf_model, TOKENS)
    attention = model.layers[0].self_attn
    saved = attention.q_norm.weight.clone()
    attention.q_norm.weight.fill_(1.0)
    assert (paged_logits(model, TOKENS, [12]) - expected).abs().max() > 100 * TOLERANCE
    attention.q_norm.weight.copy_(saved)
    moe = model.layers[1].mlp
    moe.norm_topk_prob = False
    assert (paged_logits(model, TOKENS, [12]) - expected).abs().max() > 100 * TOLERANCE
    moe.norm_topk_prob = True
    moe.top_k = 1
    assert (paged_logits(model, TOKENS, [12]) - expected).abs().max() > 100 * TOLERANCE


def write_config(directory, variant="qwen3-moe", **changes):
    hf_model = build_hf_model(variant)
    save_hf_model(hf_model, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    return directory


@pytest.mark.parametrize("changes, message", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
])
def test_unsupported_configs_are_named(tmp_path, changes, message):
    with pytest.raises(UnsupportedModelError, match=message):
        read_config(write_config(tmp_path, **changes))


def test_hub_style_expert_count(tmp_path):
    # The Hub's Qwen3-MoE config.json files say num_experts; transformers 5 writes num_local_experts.
    directory = write_config(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    (directory / "config.json").write_text(json.dumps(config))
    assert read_config(directory).num_experts == 8


# --- GGUF ----------------------------------------------------------------------------------------------

GGUF_MIXES = {
    "f32": {},
    "f16": {"proj": "F16"},
    "q8_0": {"proj": "Q8_0", "embed": "Q8_0"},
    "q4_0-mixed": {"proj": "Q4_0", "embed": "Q8_0", "lm_head": "Q8_0"},
}
GGUF_CASES = [("qwen3", mix) for mix in GGUF_MIXES] + [("qwen3-moe", mix) for mix in GGUF_MIXES] \
    + [("qwen3-tied-mqa", "q8_0")]


@pytest.mark.parametrize("variant, mix", GGUF_CASES)
def test_gguf_matches_dequantized_reference(variant, mix, tmp_path):
    hf_model = build_hf_model(variant)
    path = tmp_path / "tiny.gguf"
    hf_model.load_state_dict(write_gguf(hf_model, path, GGUF_MIXES[mix]), strict=False)
    loaded = load_model(path)
    hf = hf_model.config
    assert isinstance(loaded.model, Qwen3ForCausalLM)
    assert loaded.config.architecture == {"qwen3": "qwen3", "qwen3_moe": "qwen3moe"}[hf.model_type]
    assert loaded.config.head_dim == hf.head_dim and loaded.config.tie_word_embeddings == hf.tie_word_embeddings
    if hf.model_type == "qwen3_moe":
        assert (loaded.config.num_experts, loaded.config.num_experts_per_tok, loaded.config.moe_intermediate_size,
                loaded.config.norm_topk_prob) == (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, True)
    assert_matches(loaded.model, reference_logits(hf_model, TOKENS))
    assert greedy(loaded.model, TOKENS[:8], 12) == reference_greedy(hf_model, TOKENS[:8], 12)


def test_gguf_expert_codes_are_each_experts_own(tmp_path):
    # A Q4_0 file's stacked experts: each expert's slice comes out as its own codes (held exactly as int4).
    hf_model = build_hf_model("qwen3-moe")
    path = tmp_path / "tiny.gguf"
    reference = write_gguf(hf_model, path, {"proj": "Q4_0"})
    gguf_model = load_gguf(path)
    assert gguf_model.linear_types == {"Q4_0"}
    intermediate = hf_model.config.moe_intermediate_size
    for expert in (0, 5, 7):
        gate = gguf_model.group_codes(f"model.layers.1.mlp.experts.{expert}.gate_proj.weight")
        up = gguf_model.group_codes(f"model.layers.1.mlp.experts.{expert}.up_proj.weight")
        down = gguf_model.group_codes(f"model.layers.1.mlp.experts.{expert}.down_proj.weight")
        gate_up = reference["model.layers.1.mlp.experts.gate_up_proj"][expert]
        assert torch.equal(gate.dequantize(), gate_up[:intermediate])
        assert torch.equal(up.dequantize(), gate_up[intermediate:])
        assert torch.equal(down.dequantize(), reference["model.layers.1.mlp.experts.down_proj"][expert])
    assert gguf_model.group_codes("model.layers.1.mlp.gate.weight") is None  # the router stays F32


def test_gguf_experts_must_be_stacked():
    from kvserve.model.gguf import tensor_parts
    from kvserve.model.gguf_file import GGUFTensorInfo
    from kvserve.model.registry import GGUF, find_architecture

    arch = find_architecture("qwen3moe", GGUF)
    stacked = tensor_parts(GGUFTensorInfo("blk.2.ffn_down_exps.weight", (4, 64, 32), 0, 0), arch)
    assert [(p.hf_name, p.expert) for p in stacked] == [
        (f"model.layers.2.mlp.experts.{e}.down_proj.weight", e) for e in range(4)]
    with pytest.raises(ModelLoadError, match="stacked experts are 3-D"):
        tensor_parts(GGUFTensorInfo("blk.0.ffn_gate_exps.weight", (32, 64), 0, 0), arch)


# --- on the default weights: experts as group codes, row-invariant --------------------------------------

needs_kernels = pytest.mark.skipif(not ops.available(), reason="the C++ kernels are not built")


@pytest.fixture(scope="module")
def moe_int4(tmp_path_factory):
    directory = save_hf_model(build_hf_model("qwen3-moe"), tmp_path_factory.mktemp("qwen3-moe"))
    return load_model(directory, weights_dtype="int4")


@needs_kernels
def test_experts_hold_their_own_codes_and_only_the_routed_run(moe_int4):
    moe = moe_int4.model.layers[0].mlp
    assert all(expert.gate_up_proj.weight is None and expert.gate_up_proj.packed is not None
               for expert in moe.experts)
    assert moe.gate.method.bits == 8  # the router keeps 8 bits beside 4-bit experts
    ran: list[int] = []
    hooks = [expert.register_forward_hook(lambda module, args, out, e=e: ran.append(e))
             for e, expert in enumerate(moe.experts)]
    try:
        x = torch.randn(1, moe_int4.config.hidden_size, generator=torch.Generator().manual_seed(3))
        _, routed = moe.route(x)
        moe(x)
        assert sorted(ran) == sorted(routed[0].tolist()) and len(ran) == moe.top_k  # one token: its k experts
        ran.clear()
        x = torch.randn(16, moe_int4.config.hidden_size, generator=torch.Generator().manual_seed(4))
        _, routed = moe.route(x)
        moe(x)
        assert sorted(ran) == sorted(set(routed.flatten().tolist()))  # each routed expert once, on its rows
    finally:
        for hook in hooks:
            hook.remove()


@needs_kernels
def test_a_tokens_moe_output_does_not_depend_on_its_batch(moe_int4):
    moe = moe_int4.model.layers[1].mlp
    x = torch.randn(24, moe_int4.config.hidden_size, generator=torch.Generator().manual_seed(5))
    batched = moe(x)
    for row in range(x.shape[0]):
        assert torch.equal(moe(x[row : row + 1])[0], batched[row])
    assert torch.equal(moe(x[7:19]), batched[7:19])


@pytest.mark.slow
@needs_kernels
def test_engine_tokens_are_the_same_cold_cached_chunked_and_drafted(moe_int4):
    from kvserve.engine.sample.sampling import SamplingParams
    from tests.engine.test_batch_invariance import Oracle, run

    assert moe_int4.linear_dtype == "int4"
    rng = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=rng).tolist() for n in (37, 9, 22)]
    params = [SamplingParams(max_tokens=10, temperature=t, seed=s, ignore_eos=True, logprobs=0)
              for t, s in ((0.0, None), (0.9, 1), (0.0, None))]
    alone = [run(moe_int4, [p], [sp], enable_prefix_caching=False)[0] for p, sp in zip(prompts, params)]
    assert run(moe_int4, prompts, params, max_num_batched_tokens=5) == alone  # batched, chunked prefill
    assert run(moe_int4, prompts, params, warm=[prompts[0][:30]]) == alone  # a cached prefix
    oracle = Oracle({tuple(p): out[0] for p, out in zip(prompts, alone)}, TINY_VOCAB)
    assert run(moe_int4, prompts, params, proposer=oracle, k=3) == alone  # drafts verified
    assert oracle.accepted > 0


# --- memory planning -----------------------------------------------------------------------------------


def test_memory_plan_counts_the_decoupled_head_dim_and_every_expert(tmp_path):
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import Engine
    from kvserve.model.quantized_linear import held_weight_bytes
    from kvserve.planner import plan, resolve_model

    directory = save_hf_model(build_hf_model("qwen3-moe"), tmp_path)
    name, config, params = resolve_model(str(directory))
    result = plan(name, config, params, context=37, kv_dtype="float32", block_size=16)
    assert result.bytes_per_token == 3 * 2 * 32 * 2 * 4  # layers x KV heads x head_dim 32 (not 64 / 4) x K, V
    loaded = load_model(directory)
    engine = Engine(EngineConfig(kv_cache_memory=result.kv_bytes_total, kv_cache_dtype="float32", block_size=16,
                                 max_num_seqs=1), loaded=loaded)
    assert engine.kv_spec.bytes_per_token == result.bytes_per_token
    assert engine.kv_cache.bytes_allocated == result.kv_bytes_total
    qk_norms = config.num_layers * 2 * config.head_dim  # the one thing the Llama-shaped count leaves out
    assert params == loaded.model.num_parameters() - qk_norms
    for dtype in ["float32"] + (["int8", "int4"] if ops.available() else []):
        held = load_model(directory, weights_dtype=dtype).weight_bytes
        assert held_weight_bytes(config, dtype) == sum(held.values()) - 4 * qk_norms, dtype


def test_catalog_qwen3_sizes():
    from kvserve.model.catalog import KNOWN_MODELS, num_parameters

    assert num_parameters(KNOWN_MODELS["Qwen3-30B-A3B"]) / 1e9 == pytest.approx(30.53, abs=0.01)
    assert num_parameters(KNOWN_MODELS["Qwen3-0.6B"]) / 1e9 == pytest.approx(0.596, abs=0.001)
