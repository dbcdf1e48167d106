"""Token ids -> text, incrementally: what an output stream shows as tokens arrive.

It lives beside its one user, the output processor (engine/output/processor.py):
the model package knows how to encode and decode, not how a stream is cut.
"""

from __future__ import annotations

from kvserve.model.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, as vLLM does.

    Each delta is the text that decoding gained from the newest tokens, held
    back while it ends in an incomplete UTF-8 sequence (U+FFFD), so a byte-level
    character split over several tokens is never emitted broken. The deltas
    joined equal `decode(all output ids)`, once `flush()` has run at the end.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = 0  # tokens before this have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]
