"""The draft policy: k from measured acceptance against the verify's cost at this batch size."""

from kvserve.engine.spec_decode import policy as policy_module
from kvserve.engine.spec_decode.policy import PROBE_INTERVAL, DraftPolicy, best_k, draft_token_cost, expected_yield


def test_expected_yield_is_the_geometric_sum():
    assert expected_yield(0.5, 0) == 1.0
    assert expected_yield(0.5, 3) == 1.0 + 0.5 + 0.25 + 0.125


def test_k_grows_with_acceptance_and_shrinks_with_cost():
    assert best_k(0.9, 0.05, 8) == 8
    assert best_k(0.9, 0.5, 8) < best_k(0.9, 0.05, 8)
    assert best_k(0.1, 0.5, 8) == 0  # not worth verifying
    assert best_k(0.1, 0.5, 8, min_k=1) == 1  # an explicit method still drafts


def test_batched_verifies_cost_more_per_token():
    assert draft_token_cost(1) <= draft_token_cost(8) < draft_token_cost(16) < draft_token_cost(32)
    assert draft_token_cost(32) == draft_token_cost(512)


def test_a_request_whose_drafts_are_rejected_stops_drafting_and_probes_now_and_then():
    policy = DraftPolicy(8, auto_off=True)
    assert policy.num_tokens("r", 1) > 0  # hopeful at first
    for _ in range(8):
        policy.record("r", 4, 0)
    assert policy.acceptance("r") < 0.1
    ks = [policy.num_tokens("r", 1) for _ in range(PROBE_INTERVAL)]
    assert ks[:-1] == [0] * (PROBE_INTERVAL - 1) and ks[-1] == 1
    for _ in range(6):
        policy.record("r", 4, 4)
    assert policy.num_tokens("r", 1) == 8  # the text turned repetitive: back to full drafts
    policy.forget("r")
    assert policy.acceptance("r") is None


def test_an_explicit_method_never_stops_drafting():
    policy = DraftPolicy(8, auto_off=False)
    for _ in range(6):
        policy.record("r", 4, 0)
    assert policy.num_tokens("r", 64) == 1


def test_no_probe_where_even_perfect_drafts_would_not_pay(monkeypatch):
    monkeypatch.setattr(policy_module, "DRAFT_TOKEN_COST", ((1, 0.1), (16, 1.5)))  # a CPU where batches pay full
    policy = DraftPolicy(8, auto_off=True)
    assert [policy.num_tokens("r", 32) for _ in range(3 * PROBE_INTERVAL)] == [0] * (3 * PROBE_INTERVAL)
