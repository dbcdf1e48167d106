"""EngineConfig.speculative -> the drafting the engine runs (or None)."""

from __future__ import annotations

from kvserve.config import EngineConfig
from kvserve.engine.spec_decode.drafting import Drafting, Proposer
from kvserve.engine.spec_decode.ngram import NgramProposer
from kvserve.engine.spec_decode.policy import DraftPolicy
from kvserve.engine.spec_decode.suffix import SuffixProposer


def build_drafting(config: EngineConfig, max_model_len: int, proposer: Proposer | None = None,
                   num_speculative_tokens: int | None = None) -> Drafting | None:
    """The configured method's drafting; a `proposer` given by the caller (tests, experiments) replaces
    the method's and drafts whenever it has something (no auto-off)."""
    max_k = num_speculative_tokens if num_speculative_tokens is not None else config.num_speculative_tokens
    if proposer is not None:
        return Drafting(proposer, max_k, max_model_len, DraftPolicy(max_k, auto_off=False))
    if config.speculative == "off" or not config.enable_kv_cache:  # without a KV cache nothing is rolled back
        return None
    method: Proposer = NgramProposer() if config.speculative == "ngram" else SuffixProposer()
    return Drafting(method, max_k, max_model_len, DraftPolicy(max_k, auto_off=config.speculative == "auto"))
