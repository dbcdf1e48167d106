"""An excluded text (tool_choice "none": the call opener): the one token that would complete it is banned,
only where it would, and nothing is masked elsewhere."""

import pytest
import torch

from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.excluded import ExcludedText, ExcludedTextMatcher
from kvserve.structured.mask import allowed_tokens
from kvserve.structured.matcher import GrammarStateError, bitmask_words
from kvserve.structured.params import StructuredOutputsParams
from tests.server.inprocess import tiny_tokenizer

TOKENIZER = tiny_tokenizer()


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def _matcher_after(vocabulary, text: str) -> ExcludedTextMatcher:
    matcher = ExcludedTextMatcher(ExcludedText(vocabulary, "<tool_call>"))
    matcher.consume(_ids(text))
    return matcher


def test_only_the_token_that_completes_the_text_is_banned_and_only_after_the_rest(tiny_vocabulary):
    close = _ids(">")[0]
    for text in ["Hi", "Hi <tool_cal", "<tool_calls", "a <tool_<tool", "<tool"]:
        assert not _matcher_after(tiny_vocabulary, text).constrained, text  # nothing masked: plain sampling
    for text in ["Hi <tool_call", "<tool_<tool_call", "<tool_calls <tool_call"]:
        matcher = _matcher_after(tiny_vocabulary, text)
        assert matcher.constrained, text
        row = torch.zeros(bitmask_words(160), dtype=torch.int32)
        matcher.fill_bitmask(row)
        allowed = allowed_tokens(row, 160)
        assert not allowed[close] and int((~allowed).sum()) == 1, text
        with pytest.raises(GrammarStateError, match="excluded text"):
            matcher.consume([close])


def test_the_state_moves_on_after_a_near_miss(tiny_vocabulary):
    matcher = _matcher_after(tiny_vocabulary, "<tool_call")
    matcher.consume(_ids("s and <tool_call"))  # (a second opening after a first that did not close)
    assert matcher.constrained and matcher.take_forced(5) == [] and not matcher.is_stopped


def test_the_compiler_builds_and_caches_it_like_a_grammar(tiny_vocabulary):
    compiler = GrammarCompiler(tiny_vocabulary)
    spec = StructuredOutputsParams(excluded_text="<tool_call>")
    first = compiler.compile(spec)
    assert isinstance(first, ExcludedText) and compiler.compile(spec) is first and compiler.num_compiled == 1
