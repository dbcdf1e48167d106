"""SamplingParams (vLLM's names and meanings) and the sampler that applies them to logits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvserve.errors import InvalidRequestError
from kvserve.structured.params import StructuredOutputsParams

# Temperatures below this are treated as greedy (as vLLM does): dividing by a
# tiny temperature only amplifies float noise.
GREEDY_TEMPERATURE = 1e-5
# Most alternatives a request may ask for per position (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# Bounds that keep the sampler's float32 arithmetic finite. Logits are divided by the
# temperature and by (or multiplied by) the repetition penalty: a penalty of 1e-40 turns
# every positive logit into inf (then NaN probabilities), and any temperature above the
# float32 range becomes inf. Past these bounds the distribution is already flat (high
# temperature) or the penalty already absolute, so nothing useful is refused.
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# What torch.Generator.manual_seed accepts (negative seeds wrap modulo 2**64).
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop. Invalid values raise InvalidRequestError."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated text
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    skip_reading_prefix_cache: bool = False  # compute the whole prompt even if it is cached
    # Log-probabilities (of the raw model distribution): for each generated
    # token (`logprobs`) / each prompt token after the first (`prompt_logprobs`),
    # the chosen token's plus the top-k alternatives; 0 = the chosen one only.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Constrain the output to a JSON schema / regex / choice / grammar (kvserve/structured); the logprobs
    # above stay the raw model's, before the grammar's mask (as vLLM's default).
    structured_outputs: StructuredOutputsParams | None = None
    # KV compression for this request (issue 43): "METHOD:RATIO" or "none", over the engine's --kv-compression.
    kv_compression: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        if self.prompt_logprobs is not None:
            # A cached prefix is not computed, so it would have no logits to report.
            self.skip_reading_prefix_cache = True

    def _validate(self) -> None:
        def fail(message: str, param: str) -> None:
            raise InvalidRequestError(message, param=param)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.kv_compression is not None and not isinstance(self.kv_compression, str):
            fail(f"kv_compression must be a string (METHOD:RATIO or none), got {self.kv_compression!r}",
                 "kv_compression")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            fail(f"temperature must be >= 0 and <= {MAX_TEMPERATURE:g}, got {self.temperature!r}", "temperature")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or self.top_k < -1:
            fail(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}", "top_k")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        low, high = REPETITION_PENALTY_RANGE
        if not _is_number(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            fail(f"repetition_penalty must be in [{low:g}, {high:g}] (1 = off), got {self.repetition_penalty!r}",
                 "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                fail(f"{name} must be in [-2, 2], got {value!r}", name)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                fail(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", name)
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            fail(f"seed must be an integer in [-2**63, 2**64 - 1] (the range torch.Generator accepts), "
                 f"got {self.seed!r}", "seed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                fail(f"stop strings must be non-empty strings, got {s!r}", "stop")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                fail(f"stop_token_ids must be non-negative integers, got {t!r}", "stop_token_ids")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs must be a StructuredOutputsParams", "structured_outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalizes_output(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    # Finite only: NaN fails every comparison, and inf would overflow the sampler's arithmetic.
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool)  # (math.isfinite overflows on huge ints)


def make_generator(seed: int | None) -> torch.Generator:
    """A private RNG per request: same seed -> same tokens, whatever else runs."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty over tokens already in the prompt or output (`seen` is a bool mask)."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def penalized_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
                     output_counts: torch.Tensor | None = None) -> torch.Tensor:
    """`logits` after the repetition penalty, then the presence/frequency penalties (`output_counts`:
    occurrences of each token in the output so far)."""
    if params.repetition_penalty != 1.0 and seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.penalizes_output and output_counts is not None:
        logits = logits - params.frequency_penalty * output_counts - params.presence_penalty * (output_counts > 0)
    return logits


def target_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from, given penalized logits: temperature, top-k,
    top-p, then min-p. Not normalized after min-p (multinomial does not need it; divide by the sum where
    the probabilities themselves matter)."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token once the tokens ranked above it already cover top_p.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        # The most likely token always stays: a top_p too small for float32
        # (1e-300 rounds to 0) would otherwise drop every token.
        drop_sorted[0] = False
        drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = _probabilities(logits)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


def greedy_tokens(rows: torch.Tensor) -> list[int]:
    """The argmax of each row of `rows` `[N, vocab]`: the first index of the row's largest value (of its first
    NaN, if any), as torch.argmax. Through numpy for fp32 rows on the CPU: torch's argmax over one 49,152-token
    row took ~45 us of a ~5 ms decode step, numpy's ~4 (it vectorizes the search)."""
    if rows.device.type == "cpu" and rows.dtype is torch.float32:
        return rows.detach().numpy().argmax(axis=-1).tolist()
    return rows.argmax(dim=-1).tolist()


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    seen: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
) -> int:
    """Pick one token id from `logits` `[vocab]` (fp32).

    Order: repetition penalty, presence/frequency penalties, then greedy or
    temperature, top-k, top-p, min-p. A sampled token takes exactly one uniform
    from the request's generator and is its inverse-CDF token: so a verified
    draft, which is accepted exactly when it is the token this would pick
    (engine/spec_decode/verify.py), leaves a seeded request's tokens what they
    are without drafting.
    """
    logits = penalized_logits(logits, params, seen, output_counts)
    if params.greedy:
        return greedy_tokens(logits.reshape(1, -1))[0]
    u = torch.rand((), generator=generator, dtype=torch.float64, device=generator.device)
    return inverse_cdf(target_probabilities(logits, params), float(u))


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token whose share of the cumulative mass of `probs` (unnormalized) holds `u` in [0, 1): token i
    with probability probs[i] / sum(probs); a token of probability 0 is never picked."""
    cumulative = probs.double().cumsum(-1)
    index = int(torch.searchsorted(cumulative, cumulative[-1] * u, right=True))
    if index >= len(probs):  # u * total rounded up to the total: the last token with mass
        index = int(torch.nonzero(probs)[-1])
    return index


def _probabilities(logits: torch.Tensor) -> torch.Tensor:
    """softmax(logits), or — when penalties or temperature pushed logits to inf/NaN, where softmax
    gives NaN — all the mass on the largest logit, which is what those settings tend to anyway."""
    probs = logits.softmax(-1)
    if bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0:
        return probs
    best = torch.nan_to_num(logits, nan=float("-inf")).argmax()
    return torch.zeros_like(probs).index_fill_(0, best.view(1), 1.0)
