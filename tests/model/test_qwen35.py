"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention) against transformers, from an HF directory and a GGUF
twin; the delta rule's chunked form against its step; a sequence run in pieces through the paged KV cache and
the state cache (snapshots, resumes, batched requests) against the same sequence run whole."""

import json
from dataclasses import replace

import pytest
import torch

from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.kv.attention import CpuAttentionBackend, SequenceSlice
from kvserve.kv.cache.kv_spec import kv_spec
from kvserve.kv.state.context import StateSequence
from kvserve.kv.state.state_spec import state_spec
from kvserve.kv.state.storage import StateCache
from kvserve.model.checkpoint import read_config
from kvserve.model.gguf import read_gguf_config
from kvserve.model.loader import load_model
from kvserve.model.qwen35 import Qwen35ForCausalLM
from tests.helpers import (QWEN35_VARIANTS, TINY_VOCAB, build_hf_model, reference_greedy, reference_logits,
                           save_hf_model, write_qwen35_gguf)

SEQUENCE_LEN = 80  # past one 64-token chunk of the delta rule
TOKENS = torch.randint(0, TINY_VOCAB, (SEQUENCE_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
TOLERANCE = 1e-4  # against transformers
PIECES_TOLERANCE = 1e-5  # against ourselves, run whole


class HybridCache:
    """A paged KV cache (scrambled block tables, unwritten rows full of garbage) and a state cache, and one
    forward over any requests' pieces: what the engine's runner will do, driven by hand."""

    def __init__(self, model, num_requests: int = 2, num_slots: int = 4, block_size: int = 4) -> None:
        self.model = model
        self.backend = CpuAttentionBackend()
        spec = kv_spec(model.config)
        groups = spec.layout.num_groups
        blocks = -(-SEQUENCE_LEN * 2 // block_size)
        pool = num_requests * blocks * groups + 1
        self.kv = self.backend.allocate_kv_cache(spec, pool, block_size)
        scrambled = torch.randperm(pool, generator=torch.Generator().manual_seed(3)).tolist()
        self.tables = [[scrambled[(r * groups + g) * blocks : (r * groups + g + 1) * blocks] for g in range(groups)]
                       for r in range(num_requests)]
        self.kv.initialize_blocks_through(pool - 1)
        for tensor in self.kv.k + self.kv.v:
            tensor.fill_(1e4)
        self.states = StateCache(state_spec(model.config), num_slots)

    def forward(self, pieces: list[tuple[int, list[int], int, int, tuple]]) -> list[torch.Tensor]:
        """pieces: (request, its new tokens, their first position, its live slot, snapshots) -> each one's logits."""
        slices, sequences, ids, positions, row = [], [], [], [], 0
        for request, tokens, start, slot, snapshots in pieces:
            slices.append(SequenceSlice(self.tables[request], start, len(tokens)))
            sequences.append(StateSequence(row, len(tokens), start, slot, snapshots))
            ids += tokens
            positions += range(start, start + len(tokens))
            row += len(tokens)
        logits = self.model(torch.tensor(ids), torch.tensor(positions), self.backend.build_context(self.kv, slices),
                            states=self.states.context(sequences))
        return list(logits.split([len(tokens) for _, tokens, *_ in pieces]))

    def run(self, tokens: list[int], steps: list[int], request: int = 0, slot: int = 0,
            snapshots: dict[int, tuple] | None = None) -> torch.Tensor:
        """One request's tokens in steps of these sizes (then one at a time); step i takes snapshots[i]."""
        rows, done = [], 0
        sizes = list(steps) + [1] * (len(tokens) - sum(steps))
        for i, size in enumerate(sizes):
            piece = (request, tokens[done : done + size], done, slot, (snapshots or {}).get(i, ()))
            rows += self.forward([piece])
            done += size
        return torch.cat(rows)


def whole(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor(tokens), torch.arange(len(tokens)))


def cached_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """kvserve's greedy continuation: the prompt prefilled through the caches, then one token per step."""
    cache = HybridCache(model)
    out = list(ids)
    logits = cache.forward([(0, out, 0, 0, ())])[0]
    for _ in range(num_tokens):
        out.append(int(logits[-1].argmax()))
        if len(out) - len(ids) == num_tokens:
            break
        logits = cache.forward([(0, out[-1:], len(out) - 1, 0, ())])[0]
    return out[len(ids):]


@pytest.fixture(scope="module", params=sorted(QWEN35_VARIANTS))
def hf_and_loaded(request, tmp_path_factory):
    hf_model = build_hf_model(request.param)
    return hf_model, load_model(save_hf_model(hf_model, tmp_path_factory.mktemp(request.param))).model


def test_hf_directory_matches_transformers(hf_and_loaded):
    hf_model, model = hf_and_loaded
    hf = hf_model.config
    assert isinstance(model, Qwen35ForCausalLM)
    kinds = ["recurrent" if kind == "linear_attention" else "attention" for kind in hf.layer_types]
    assert list(model.config.layer_kinds) == kinds and "attention" in kinds and "recurrent" in kinds
    assert model.num_parameters() == sum(p.numel() for p in hf_model.parameters())
    expected = reference_logits(hf_model, TOKENS)
    assert (whole(model, TOKENS) - expected).abs().max().item() <= TOLERANCE
    assert (HybridCache(model).run(TOKENS, [30, 5, 34]) - expected).abs().max().item() <= TOLERANCE
    assert cached_greedy(model, TOKENS[:8], 20) == reference_greedy(hf_model, TOKENS[:8], 20)


def test_pieces_and_snapshots_equal_the_whole_sequence(hf_and_loaded):
    _, model = hf_and_loaded
    expected = whole(model, TOKENS)
    for steps in ([SEQUENCE_LEN], [12, 1, 1, 40], [1, 63, 2], [33, 31]):
        got = HybridCache(model).run(TOKENS, steps)
        assert (got - expected).abs().max().item() <= PIECES_TOLERANCE, steps
    # A snapshot inside a prefill chunk (after 20 of its 40 rows) and one at a decode step's end; resumed from,
    # each continues exactly where the sequence was, though the live state has moved on since.
    cache = HybridCache(model)
    cache.run(TOKENS[:60], [10, 40], snapshots={1: ((20, 1),), 5: ((1, 2),)})
    # (The later one first: a resume overwrites the K/V of the positions it computes.)
    for slot, at in ((2, 54), (1, 30)):  # step 5 is position 53
        continuation = [5, 9, 13] + TOKENS[at + 3 : at + 20]
        resumed = cache.forward([(0, continuation, at, slot, ())])[0]
        reference = whole(model, TOKENS[:at] + continuation)[at:]
        assert (resumed - reference).abs().max().item() <= PIECES_TOLERANCE, slot


def test_batched_requests_equal_each_alone(hf_and_loaded):
    _, model = hf_and_loaded
    other = TOKENS[::-1]
    cache = HybridCache(model)
    first = cache.forward([(0, TOKENS[:20], 0, 0, ()), (1, other[:7], 0, 3, ())])
    second = cache.forward([(1, other[7:8], 7, 3, ()), (0, TOKENS[20:50], 20, 0, ())])
    assert (torch.cat((first[0], second[1])) - whole(model, TOKENS[:50])).abs().max() <= PIECES_TOLERANCE
    assert (torch.cat((first[1], second[0])) - whole(model, other[:8])).abs().max() <= PIECES_TOLERANCE


def test_a_read_state_is_never_changed_in_place(hf_and_loaded):
    _, model = hf_and_loaded
    cache = HybridCache(model)
    cache.run(TOKENS[:30], [20], snapshots={0: ((20, 1),)})
    snapshot = [[t[1].clone() for t in layer] for layer in cache.states.layers]
    cache.states.copy_slots([(1, 2)])
    cache.forward([(0, TOKENS[20:40], 20, 2, ())])  # reads slot 2, writes it back; slot 1 untouched
    cache.forward([(0, TOKENS[20:21], 20, 2, ())])
    assert all(torch.equal(tensor[1], kept) for layer, saved in zip(cache.states.layers, snapshot)
               for tensor, kept in zip(layer, saved))


# --- the delta rule (kvserve/kernels/csrc/gated_delta.cpp; its own tests: tests/kernels/test_gated_delta.py) ------


def test_the_layer_chunked_equals_the_layer_stepped(hf_and_loaded):
    # The model over 40 tokens: one segment, or 40 one-row steps: every token runs the recurrence itself and the
    # conv sums its taps in one order, so the bits are the same (README "Determinism").
    _, model = hf_and_loaded
    whole_run = HybridCache(model).run(TOKENS[:40], [40])
    stepped = HybridCache(model).run(TOKENS[:40], [])
    assert torch.equal(whole_run, stepped)


# --- GGUF ----------------------------------------------------------------------------------------------

GGUF_MIXES = {"f32": {}, "q8_0": {"mlp": "Q8_0", "in_proj": "Q8_0", "q_proj": "Q8_0", "embed": "Q8_0"}}


@pytest.mark.parametrize("variant, mix", [(v, m) for v in sorted(QWEN35_VARIANTS) for m in GGUF_MIXES])
def test_gguf_twin_matches_transformers(variant, mix, tmp_path):
    hf_model = build_hf_model(variant)
    path = tmp_path / "tiny.gguf"
    hf_model.load_state_dict(write_qwen35_gguf(hf_model, path, GGUF_MIXES[mix]), strict=False)
    loaded = load_model(path)
    hf = hf_model.config
    shape = loaded.config.gated_deltanet
    assert isinstance(loaded.model, Qwen35ForCausalLM)
    assert loaded.config.architecture == ("qwen35moe" if hf.model_type == "qwen3_5_moe_text" else "qwen35")
    assert shape.value_heads_tiled and loaded.config.tie_word_embeddings == hf.tie_word_embeddings
    assert (shape.num_key_heads, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim, shape.conv_kernel) \
        == (hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim,
            hf.linear_conv_kernel_dim)
    from_hf = read_config(save_hf_model(hf_model, tmp_path / "hf"))
    assert loaded.config.layer_kinds == from_hf.layer_kinds
    assert (loaded.config.num_experts, loaded.config.num_experts_per_tok, loaded.config.moe_intermediate_size,
            loaded.config.shared_expert_intermediate_size, loaded.config.norm_topk_prob) == \
        (from_hf.num_experts, from_hf.num_experts_per_tok, from_hf.moe_intermediate_size,
         from_hf.shared_expert_intermediate_size, from_hf.norm_topk_prob)
    expected = reference_logits(hf_model, TOKENS)
    assert (whole(loaded.model, TOKENS) - expected).abs().max().item() <= TOLERANCE
    assert cached_greedy(loaded.model, TOKENS[:8], 20) == reference_greedy(hf_model, TOKENS[:8], 20)


def test_gguf_prediction_blocks_are_read_past(tmp_path):
    # A converter that keeps the checkpoint's multi-token-prediction layer appends it as one more block (with its
    # nextn.* tensors) and says so in nextn_predict_layers: the decoder is the blocks before it.
    hf_model = build_hf_model("qwen35-moe")
    path = tmp_path / "tiny.gguf"
    hf_model.load_state_dict(write_qwen35_gguf(hf_model, path, prediction_blocks=1), strict=False)
    loaded = load_model(path)
    assert loaded.config.num_layers == hf_model.config.num_hidden_layers == len(loaded.model.layers)
    assert (whole(loaded.model, TOKENS) - reference_logits(hf_model, TOKENS)).abs().max().item() <= TOLERANCE


def test_the_value_head_order_matters(tmp_path):
    # The twin test would prove little if reading llama.cpp's tiled order as grouped changed nothing.
    hf_model = build_hf_model("qwen35")
    path = tmp_path / "tiny.gguf"
    hf_model.load_state_dict(write_qwen35_gguf(hf_model, path), strict=False)
    model = load_model(path).model
    expected = reference_logits(hf_model, TOKENS)
    assert (whole(model, TOKENS) - expected).abs().max().item() <= TOLERANCE
    for layer in model.layers:
        if not layer.attends:
            layer.linear_attn.shape = replace(layer.linear_attn.shape, value_heads_tiled=False)
    assert (whole(model, TOKENS) - expected).abs().max().item() > 100 * TOLERANCE


def test_gguf_without_the_ssm_shape_is_refused(tmp_path):
    import gguf

    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35")
    for add, value in ((writer.add_block_count, 4), (writer.add_context_length, 64), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, 128), (writer.add_head_count, 4),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_ssm_conv_kernel, 4)):
        add(value)
    writer.add_tensor("token_embd.weight", torch.zeros(TINY_VOCAB, 64).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="ssm"):
        read_gguf_config(path)


# --- config.json ----------------------------------------------------------------------------------------


def write_config(directory, **changes):
    save_hf_model(build_hf_model("qwen35"), directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    return directory


@pytest.mark.parametrize("changes, message", [
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
])
def test_unsupported_configs_are_named(tmp_path, changes, message):
    with pytest.raises(UnsupportedModelError, match=message):
        read_config(write_config(tmp_path, **changes))


def test_layer_kinds_from_the_interval_and_the_state_shape(tmp_path):
    config = read_config(write_config(tmp_path, layer_types=None, full_attention_interval=2))
    assert config.layer_kinds == ("recurrent", "attention", "recurrent", "attention")
    assert config.attention_layers == (1, 3) and config.recurrent_layers == (0, 2)
    # q and k of 2 heads x 16, v of 4 heads x 16 through a 4-tap convolution; 4 value heads' 16 x 16 matrices
    assert config.recurrent_state == ((128, 3), (4, 16, 16))
    assert config.rotary_dim == 8  # partial_rotary_factor 0.5 of head_dim 16


@pytest.mark.parametrize("tied", [False, True])
def test_the_hubs_conditional_generation_checkpoint_runs_its_language_model(tmp_path, tied):
    # The Hub's Qwen3.5 files are Qwen3_5ForConditionalGeneration: text_config, model.language_model.*, a vision
    # tower (model.visual.*, not loaded). On token ids alone it is the text model, positions 1-D.
    import transformers

    _, _, overrides = QWEN35_VARIANTS["qwen35"]
    text = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, max_position_embeddings=256, **overrides)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tied)
    torch.manual_seed(0)
    hf_model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    loaded = load_model(save_hf_model(hf_model, tmp_path))
    assert loaded.config.architecture == "Qwen3_5ForConditionalGeneration"
    assert loaded.config.tie_word_embeddings == tied
    text_parameters = sum(p.numel() for n, p in hf_model.named_parameters() if not n.startswith("model.visual."))
    assert loaded.model.num_parameters() == text_parameters
    expected = reference_logits(hf_model, TOKENS)
    assert (whole(loaded.model, TOKENS) - expected).abs().max().item() <= TOLERANCE


def test_the_shared_expert_and_its_gate_change_the_logits(tmp_path):
    # The MoE parity would prove little if the shared expert or its sigmoid gate made no difference here.
    hf_model = build_hf_model("qwen35-moe")
    model = load_model(save_hf_model(hf_model, tmp_path)).model
    expected = reference_logits(hf_model, TOKENS)
    assert (whole(model, TOKENS) - expected).abs().max().item() <= TOLERANCE
    moe = model.layers[0].mlp
    saved = moe.shared_expert_gate.weight.clone()
    moe.shared_expert_gate.weight.fill_(0.5)
    assert (whole(model, TOKENS) - expected).abs().max().item() > 100 * TOLERANCE
    moe.shared_expert_gate.weight.copy_(saved)
    moe.shared_expert.down_proj.weight.zero_()
    assert (whole(model, TOKENS) - expected).abs().max().item() > 100 * TOLERANCE


def test_a_decode_batch_gives_each_request_what_it_gets_alone(hf_and_loaded):
    # A decode step's sequences (one row each) run as one batched step: each row's numbers are its own, bit for
    # bit (README, Determinism), and equal the one-row step inside a sequence's pieces.
    _, model = hf_and_loaded
    prompts = [TOKENS[:9], TOKENS[20:45], TOKENS[50:51]]
    together, alone = HybridCache(model, num_requests=3), [HybridCache(model, num_requests=3) for _ in prompts]
    together.forward([(r, p, 0, r, ()) for r, p in enumerate(prompts)])
    for r, p in enumerate(prompts):
        alone[r].forward([(r, p, 0, r, ())])
    for step in range(3):
        pieces = [(r, [TOKENS[60 + 3 * r + step]], len(p) + step, r, ()) for r, p in enumerate(prompts)]
        batched = together.forward(pieces)
        for r, piece in enumerate(pieces):
            assert torch.equal(batched[r], alone[r].forward([piece])[0])
