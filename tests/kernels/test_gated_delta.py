"""The gated delta rule (kernels/gated_delta.py: csrc/gated_delta.cpp on each instruction set, and its torch path)
against transformers' torch_recurrent_gated_delta_rule, and a token's bits however its sequence runs:
whole, split at any row and resumed from the state there, beside other sequences, as a batched decode."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

from kvserve.kernels import build, ops
from kvserve.kernels.gated_delta import DeltaSequences, gated_delta_isa, gated_delta_rule, gated_delta_rule_slots_

ISAS = {"portable": 0, "avx2": 1, "avx512": 2}
KERNEL_PATHS = list(ISAS)[: ISAS[gated_delta_isa()] + 1] if ops.available() else []
PATHS = [*KERNEL_PATHS, "torch"]


@pytest.fixture
def path_isa(request, monkeypatch):
    """The `isa` argument for the path under test; the torch path with the kernels taken away."""
    if request.param == "torch":
        monkeypatch.setitem(build._state, "module", None)
        return -1
    return ISAS[request.param]


def inputs(rows, key_heads=2, value_heads=4, key_dim=16, value_dim=16, seed=0):
    """Random q, k `[rows, Hk, dk]`, v `[rows, Hv, dv]`, g (log decay, <= 0) and beta `[rows, Hv]`, the
    ranges Qwen3.5 gives them (q and k unnormalised: the rule normalises them)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, key_heads, key_dim, generator=gen)
    k = torch.randn(rows, key_heads, key_dim, generator=gen)
    v = torch.randn(rows, value_heads, value_dim, generator=gen)
    g = -F.softplus(torch.randn(rows, value_heads, generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(rows, value_heads, generator=gen))
    return q, k, v, g, beta


@pytest.mark.parametrize("path_isa", PATHS, indirect=True)
@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_matches_transformers_recurrent_rule(path_isa, head_dim, rows):
    q, k, v, g, beta = inputs(rows, key_dim=head_dim, value_dim=head_dim, seed=rows)
    state = torch.randn(4, head_dim, head_dim, generator=torch.Generator().manual_seed(9)) if rows == 7 else None
    expected, expected_state = torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=None if state is None else state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, final, _ = gated_delta_rule(q, k, v, g, beta, state, isa=path_isa)
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, expected_state[0], rtol=1e-5, atol=1e-5)


def test_prenormalised_inputs_and_a_given_scale(monkeypatch):
    q, k, v, g, beta = inputs(9)
    qn, kn = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    expected, _ = torch_recurrent_gated_delta_rule(qn[None] * 2.0, kn[None], v[None], g[None], beta[None])
    out, _, _ = gated_delta_rule(qn, kn, v, g, beta, normalize_qk=False, scale=2.0 * 16 ** -0.5)
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path_isa", PATHS, indirect=True)
@pytest.mark.parametrize("head_dim", [16, 48])  # 48: a tile of 2 vectors and one of 1 (AVX-512)
def test_split_segments_and_snapshots_are_bit_identical_to_one_run(path_isa, head_dim):
    q, k, v, g, beta = inputs(40, key_dim=head_dim, value_dim=head_dim, seed=3)
    whole, final, snapshots = gated_delta_rule(q, k, v, g, beta, snapshot_rows=[0, 1, 13, 13, 39, 40],
                                                   isa=path_isa)
    for cuts in ([1, 13, 14, 39], [5], [2, 3, 4, 20, 21, 22], list(range(1, 40))):
        pieces, state, states = [], None, {0: torch.zeros_like(final)}
        for first, end in zip([0, *cuts], [*cuts, 40]):
            rows = slice(first, end)
            piece, state, _ = gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], state, isa=path_isa)
            pieces.append(piece)
            states[end] = state
        assert torch.equal(torch.cat(pieces), whole), cuts
        assert torch.equal(state, final), cuts
        for done, snapshot in zip([0, 1, 13, 13, 39, 40], snapshots):
            if done in states:
                assert torch.equal(snapshot, states[done]), (cuts, done)


@pytest.mark.parametrize("path_isa", PATHS, indirect=True)
def test_sequences_batched_over_state_slots_equal_each_alone(path_isa):
    """A prefill segment resumed from a slot beside fresh prompts and decodes, states read and written in
    place or slot to slot, snapshots into other slots: each sequence's bits are its own run's."""
    lengths, starts = [11, 1, 25, 1, 1, 4], [True, False, False, True, True, False]  # fresh: starts from zeros
    all_rows = inputs(sum(lengths), seed=5)
    cache = torch.randn(16, 4, 16, 16, generator=torch.Generator().manual_seed(6))
    before = cache.clone()
    reads = [-1 if fresh else slot for fresh, slot in zip(starts, [0, 1, 2, 3, 4, 5])]
    writes = [8, 1, 9, 3, 10, 5]  # slots 1 and 5: read and written in place
    snapshots = [(0, 4, 11), (2, 0, 12), (2, 20, 13), (5, 4, 14)]
    out = gated_delta_rule_slots_(*all_rows, cache, DeltaSequences.of(lengths, reads, writes, snapshots),
                                      isa=path_isa)
    first = 0
    for b, length in enumerate(lengths):
        rows = slice(first, first + length)
        mine = [(done, slot) for seq, done, slot in snapshots if seq == b]
        alone, final, states = gated_delta_rule(*(x[rows] for x in all_rows), None if starts[b] else before[b],
                                                    [done for done, _ in mine], isa=path_isa)
        assert torch.equal(out[rows], alone), b
        assert torch.equal(cache[writes[b]], final), b
        for (_, slot), state in zip(mine, states):
            assert torch.equal(cache[slot], state), (b, slot)
        first += length
    untouched = [6, 7, 15, 0, 2, 4]
    assert torch.equal(cache[untouched], before[untouched])


@pytest.mark.parametrize("decodes", [1, 3, 8])
def test_a_batched_decode_equals_each_decode_alone(decodes):
    rows = inputs(decodes, key_heads=16, value_heads=16, key_dim=128, value_dim=128, seed=decodes)
    cache = torch.randn(2 * decodes, 16, 128, 128) * 0.1
    alone = [gated_delta_rule(*(x[b : b + 1] for x in rows), cache[b])[:2] for b in range(decodes)]
    sequences = DeltaSequences.of([1] * decodes, list(range(decodes)), list(range(decodes, 2 * decodes)))
    out = gated_delta_rule_slots_(*rows, cache, sequences)
    for b, (token, state) in enumerate(alone):
        assert torch.equal(out[b : b + 1], token) and torch.equal(cache[decodes + b], state), b


@pytest.mark.skipif(not ops.available(), reason="the C++ kernels could not be built here")
@pytest.mark.parametrize("head_dim", [16, 128])
def test_the_torch_path_agrees_with_the_kernel(monkeypatch, head_dim):
    q, k, v, g, beta = inputs(33, key_dim=head_dim, value_dim=head_dim, seed=11)
    state = torch.randn(4, head_dim, head_dim) * 0.3
    kernel = gated_delta_rule(q, k, v, g, beta, state, [3, 33])
    monkeypatch.setitem(build._state, "module", None)
    fallback = gated_delta_rule(q, k, v, g, beta, state, [3, 33])
    for a, b in zip([kernel[0], kernel[1], *kernel[2]], [fallback[0], fallback[1], *fallback[2]]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ops.available(), reason="the C++ kernels could not be built here")
def test_the_kernel_refuses_slots_that_would_race():
    rows = inputs(2)
    cache = torch.zeros(4, 4, 16, 16)
    with pytest.raises(RuntimeError, match="slot 2 written by two sequences"):
        gated_delta_rule_slots_(*rows, cache, DeltaSequences.of([1, 1], [0, 1], [2, 2]))
    with pytest.raises(RuntimeError, match="slot 1 is read by one sequence and written by another"):
        gated_delta_rule_slots_(*rows, cache, DeltaSequences.of([1, 1], [0, 1], [1, 3]))
    with pytest.raises(RuntimeError, match="write slot 4 out of range"):
        gated_delta_rule_slots_(*rows, cache, DeltaSequences.of([1, 1], [0, 1], [2, 3], [(1, 1, 4)]))
    with pytest.raises(RuntimeError, match="a snapshot after 2 rows of a sequence of 1"):
        gated_delta_rule_slots_(*rows, cache, DeltaSequences.of([1, 1], [0, 1], [2, 3], [(0, 2, 0)]))
    assert torch.equal(cache, torch.zeros_like(cache))  # refused before anything was written


@pytest.mark.skipif(not ops.available(), reason="the C++ kernels could not be built here")
def test_the_thread_count_changes_nothing():
    rows = inputs(37, key_heads=4, value_heads=8, key_dim=32, value_dim=64, seed=13)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gated_delta_rule(*rows, snapshot_rows=[20])
        torch.set_num_threads(max(2, threads))
        many = gated_delta_rule(*rows, snapshot_rows=[20])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip([one[0], one[1], *one[2]], [many[0], many[1], *many[2]]))


@pytest.mark.parametrize("path_isa", PATHS, indirect=True)
def test_mismatched_shapes_are_refused_by_name(path_isa):
    q, k, v, g, beta = inputs(3)
    with pytest.raises(ValueError, match="Hv a multiple of Hk"):
        gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3], isa=path_isa)
    with pytest.raises(ValueError, match="g, beta \\[N, Hv\\]"):
        gated_delta_rule(q, k, v, g[:2], beta, isa=path_isa)
    with pytest.raises(ValueError, match="states must be \\[slots, 4, 16, 16\\], got \\(2, 4, 16, 8\\)"):
        gated_delta_rule_slots_(q, k, v, g, beta, torch.zeros(2, 4, 16, 8), DeltaSequences.of([3], [-1], [0]))


@pytest.mark.parametrize("path_isa", PATHS, indirect=True)
@pytest.mark.parametrize("key_dim, value_dim", [(13, 20), (6, 24), (30, 40)])  # odd tails: rows % 4, columns % 8, % 16
def test_odd_head_dims(path_isa, key_dim, value_dim):
    q, k, v, g, beta = inputs(12, key_dim=key_dim, value_dim=value_dim, seed=key_dim)
    expected, expected_state = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, final, _ = gated_delta_rule(q, k, v, g, beta, isa=path_isa)
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, expected_state[0], rtol=1e-5, atol=1e-5)
    first, state, _ = gated_delta_rule(q[:5], k[:5], v[:5], g[:5], beta[:5], isa=path_isa)
    rest, state, _ = gated_delta_rule(q[5:], k[5:], v[5:], g[5:], beta[5:], state, isa=path_isa)
    assert torch.equal(torch.cat([first, rest]), out) and torch.equal(state, final)
