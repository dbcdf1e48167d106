"""Draft verification leaves the output distribution the target's: many seeds, a small vocabulary, a
chi-square bound; and a seeded request samples the same tokens with or without a draft."""

import numpy as np
import torch

from kvserve.engine.sample.sampling import SamplingParams, make_generator, sample
from kvserve.engine.spec_decode.verify import verify_drafts

VOCAB = 6
LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -3.0],
                       [0.0, 2.0, 0.3, 1.2, 1.0, -1.0],
                       [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
PARAMS = SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.7, max_tokens=8)
# Chi-square critical value for 5 degrees of freedom at p = 1e-4: a correct sampler fails this once in 10,000.
CHI2_CRITICAL_5 = 25.74


def reference_probs(logits: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The target distribution, computed here from the definitions (not by the sampler's code)."""
    z = (logits - PARAMS.presence_penalty * (counts > 0)) / PARAMS.temperature
    z[np.argsort(z)[: VOCAB - PARAMS.top_k]] = -np.inf
    p = np.exp(z - z.max())
    return p / p.sum()


def chi_square(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    expected = expected_probs * observed.sum()
    keep = expected > 0
    assert observed[~keep].sum() == 0  # never a token the target gives no mass
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_verified_tokens_follow_the_target_distribution():
    drafts = [1, 3]  # d0 is the target's 2nd choice at row 0; d1 its 2nd at row 1 (after the penalty on d0)
    first, second = np.zeros(VOCAB), np.zeros(VOCAB)
    num_samples = 6000
    for seed in range(num_samples):
        counts = torch.zeros(VOCAB)
        tokens = verify_drafts(LOGITS, drafts, PARAMS, make_generator(seed), None, counts)
        assert counts.sum() == 0  # the request's own penalty state is left to the acceptor
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            second[tokens[1]] += 1
    p0 = reference_probs(LOGITS[0].numpy(), np.zeros(VOCAB))
    counts_after_d0 = np.zeros(VOCAB)
    counts_after_d0[drafts[0]] = 1
    p1 = reference_probs(LOGITS[1].numpy(), counts_after_d0)  # row 1 sees d0 as accepted
    assert chi_square(first, p0) < CHI2_CRITICAL_5
    assert chi_square(second, p1) < CHI2_CRITICAL_5
    assert abs(first[drafts[0]] / num_samples - p0[drafts[0]]) < 0.02  # accepted with probability p(d0)


def test_a_seeded_request_draws_the_same_tokens_with_or_without_drafts():
    for seed in range(200):
        generator = make_generator(seed)
        counts = torch.zeros(VOCAB)
        plain = []
        for row in LOGITS:
            plain.append(sample(row, PARAMS, generator, None, counts))
            counts[plain[-1]] += 1
        for drafts in ([plain[0], plain[1]], [plain[0], (plain[1] + 1) % VOCAB], [(plain[0] + 1) % VOCAB, 0]):
            tokens = verify_drafts(LOGITS, drafts, PARAMS, make_generator(seed), None, torch.zeros(VOCAB))
            assert tokens == plain[: len(tokens)]


def test_greedy_accepts_the_argmax_prefix():
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    # Row 2 is flat: the repetition penalty on the accepted drafts 0 and 1 makes 2 its argmax.
    assert verify_drafts(LOGITS, [0, 1], greedy, make_generator(0), seen, None) == [0, 1, 2]
    assert verify_drafts(LOGITS, [2, 1], greedy, make_generator(0), seen, None) == [0]
