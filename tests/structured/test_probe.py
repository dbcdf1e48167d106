"""Grammars that compile but fail once masks are computed are refused when compiled (a 400 before any
token), with llguidance's one-line reason; its engine state goes to the log only."""

import logging

import pytest

from kvserve.errors import InvalidRequestError
from kvserve.model.loader import load_tokenizer
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.params import StructuredOutputsParams
from kvserve.structured.vocabulary import build_grammar_vocabulary
from kvserve.tools.calls import FunctionTool
from kvserve.tools.grammar import ToolChoice, tool_call_constraint

REF_LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
MANY_OPTIONAL = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}}


@pytest.fixture(scope="module")
def vocabulary():
    """The embedded model's (a real BPE vocabulary: its long tokens reach a regex's blow-up in a few steps)."""
    return build_grammar_vocabulary(load_tokenizer(), 49152)


@pytest.fixture()
def compiler(vocabulary):
    return GrammarCompiler(vocabulary, timeout_s=60)


@pytest.mark.parametrize("spec, reason", [
    (StructuredOutputsParams(json=REF_LOOP), "allows no output at all"),
    (StructuredOutputsParams(json=MANY_OPTIONAL), "max is 2000"),
    (StructuredOutputsParams(regex="([a-z]{1,1000}){1,1000}"), "too many expressions"),
    # (a tool call: its head is forced, then the arguments overflow)
    (tool_call_constraint([FunctionTool("f", None, MANY_OPTIONAL)], ToolChoice("required")), "max is 2000"),
])
def test_a_grammar_that_fails_in_its_first_tokens_is_refused_when_compiled(compiler, caplog, spec, reason):
    with caplog.at_level(logging.WARNING), pytest.raises(InvalidRequestError) as info:
        compiler.compile(spec)
    message = str(info.value)
    assert info.value.param == "structured_outputs" and reason in message
    assert "<state>" not in message and "\n" not in message  # the engine's state is for the log
    assert "<state>" in caplog.text
    with pytest.raises(InvalidRequestError, match=reason.replace("$", r"\$")):  # refused again, from the cache
        compiler.compile(spec)
    assert (compiler.num_refused, compiler.num_cache_hits, compiler.num_compiled) == (1, 1, 0)


def test_a_good_grammar_keeps_its_first_mask(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    compiled = compiler.compile(StructuredOutputsParams(json=schema))
    assert compiled.first_mask is not None and int(compiled.first_mask.count_nonzero()) > 0
