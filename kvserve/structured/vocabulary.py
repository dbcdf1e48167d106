"""kvserve's tokenizer as llguidance sees it: every token's bytes and the end-of-generation tokens.

llguidance reads the tokenizer's own HF `tokenizers` JSON (byte-level BPE, SentencePiece byte fallback,
added and special tokens), so the bytes it matches are exactly the bytes kvserve decodes. Building it walks
the whole vocabulary (~0.4 s at 49,152 tokens): once per engine.
"""

from __future__ import annotations

import llguidance

from kvserve.errors import TokenizerUnavailableError
from kvserve.model.tokenizer import Tokenizer


def build_grammar_vocabulary(tokenizer: Tokenizer | None, vocab_size: int) -> llguidance.LLTokenizer:
    """An llguidance tokenizer over the model's `vocab_size` logits (ids past the tokenizer's own vocabulary
    have no bytes, so a grammar never allows them); every stop token of the model counts as EOS."""
    if tokenizer is None:
        raise TokenizerUnavailableError("structured outputs need a tokenizer; this model was loaded without one")
    eos = sorted(tokenizer.stop_token_ids)
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos or None)
