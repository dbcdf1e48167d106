import json

import pytest

from kvserve.errors import InvalidRequestError, TokenizerUnavailableError
from kvserve.structured.compiler import GrammarCompiler
from kvserve.structured.params import StructuredOutputsParams as Spec
from kvserve.structured.vocabulary import build_grammar_vocabulary


@pytest.mark.parametrize("spec", [
    Spec(grammar="start: undefined_rule"),
    Spec(grammar="this is not a grammar ::= ::="),
    Spec(regex="(unclosed"),
    Spec(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
    Spec(json={"type": "string", "format": "no-such-format", "unknownKeyword": 3}),
])
def test_specs_that_do_not_compile_are_invalid_requests(compiler, spec):
    with pytest.raises(InvalidRequestError) as caught:
        compiler.compile(spec)
    assert caught.value.param == "structured_outputs"
    assert "does not compile" in str(caught.value)


def test_gbnf_is_converted(compiler):
    compiled = compiler.compile(Spec(grammar='root ::= "yes" | "no"'))
    assert compiled.new_state().is_error() is False


def test_equal_specs_compile_once(compiler):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}}
    first = compiler.compile(Spec(json=schema))
    again = compiler.compile(Spec(json=json.dumps(schema), trigger="<tool_call>"))
    assert again is first and compiler.num_compiled == 1
    compiler.compile(Spec(json={"type": "object"}))
    assert compiler.num_compiled == 2


def test_cache_is_bounded_least_recently_used_first(tiny_vocabulary):
    compiler = GrammarCompiler(tiny_vocabulary, cache_size=2)
    a, b, c = (Spec(choice=[word]) for word in ("a", "b", "c"))
    compiler.compile(a), compiler.compile(b), compiler.compile(a), compiler.compile(c)  # b is the oldest
    assert compiler.num_compiled == 3
    compiler.compile(a)
    assert compiler.num_compiled == 3
    compiler.compile(b)
    assert compiler.num_compiled == 4


def test_compilation_past_the_time_limit_is_an_invalid_request(tiny_vocabulary):
    compiler = GrammarCompiler(tiny_vocabulary, timeout_s=1e-6)
    properties = {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{{i}}}[0-9]+"} for i in range(1, 200)}
    with pytest.raises(InvalidRequestError, match="grammar compilation took longer than"):
        compiler.compile(Spec(json={"type": "object", "properties": properties, "required": list(properties)}))


def test_a_model_without_tokenizer_cannot_be_constrained():
    with pytest.raises(TokenizerUnavailableError):
        build_grammar_vocabulary(None, 160)
