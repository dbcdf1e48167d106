import pytest
import torch

from kvserve.structured.mask import allowed_tokens, apply_bitmask
from kvserve.structured.matcher import GrammarMatcher, GrammarStateError, bitmask_words
from kvserve.structured.params import StructuredOutputsParams as Spec
from tests.helpers import TINY_VOCAB
from tests.server.inprocess import tiny_tokenizer

TOKENIZER = tiny_tokenizer()


def matcher(compiler, spec, force=True):
    return GrammarMatcher(compiler.compile(spec), compiler.vocabulary, spec.trigger, force=force, after=spec.after,
                         after_open=spec.after_open)


def allowed(m) -> set[int]:
    row = torch.zeros(bitmask_words(TINY_VOCAB), dtype=torch.int32)
    m.fill_bitmask(row)
    return set(torch.nonzero(allowed_tokens(row, TINY_VOCAB)).flatten().tolist())


def test_mask_allows_exactly_the_grammar_tokens(compiler):
    m = matcher(compiler, Spec(choice=["ab", "ac"]))
    assert {TOKENIZER.decode([t]) for t in allowed(m)} == {"a"}
    m.consume(TOKENIZER.encode("a", add_special_tokens=False))
    assert {TOKENIZER.decode([t]) for t in allowed(m)} == {"b", "c"}


def test_apply_bitmask_puts_forbidden_tokens_at_minus_inf():
    bitmask = torch.zeros(bitmask_words(40), dtype=torch.int32)
    bitmask[1] = 1 << 3  # token 35 only
    logits = apply_bitmask(torch.randn(40), bitmask)
    assert torch.isfinite(logits).nonzero().flatten().tolist() == [35]


def test_forced_tokens_are_the_fixed_text_and_respect_the_limit(compiler):
    schema = {"type": "object", "properties": {"constant_key": {"type": "integer"}}, "required": ["constant_key"],
              "additionalProperties": False}
    m = matcher(compiler, Spec(json=schema))
    forced = m.take_forced(100)
    assert TOKENIZER.decode(forced) == '{"constant_key": '
    assert m.num_consumed == len(forced)
    limited = matcher(compiler, Spec(json=schema))
    assert limited.take_forced(3) == forced[:3]
    assert matcher(compiler, Spec(json=schema), force=False).take_forced(100) == []


def test_grammar_refuses_a_token_and_rolls_back(compiler):
    m = matcher(compiler, Spec(regex="[0-9]+x"))
    m.consume(TOKENIZER.encode("12", add_special_tokens=False))
    m.rollback(1)
    m.consume(TOKENIZER.encode("3x", add_special_tokens=False))
    assert m.is_stopped
    fresh = matcher(compiler, Spec(regex="[0-9]+x"))
    try:
        fresh.consume(TOKENIZER.encode("y", add_special_tokens=False))
    except GrammarStateError:
        pass
    else:
        raise AssertionError("the grammar took a token it refuses")


def test_trigger_mode_is_free_until_the_trigger_then_constrained(compiler):
    m = matcher(compiler, Spec(choice=["yes", "no"], trigger="<call>"))
    m.consume(TOKENIZER.encode("any text <ca", add_special_tokens=False))
    assert not m.constrained and m.take_forced(10) == []
    m.consume(TOKENIZER.encode("ll>", add_special_tokens=False))
    assert m.constrained
    assert {TOKENIZER.decode([t]) for t in allowed(m)} == {"y", "n"}


@pytest.mark.parametrize("trigger", [None, "<call>"])
def test_after_the_end_of_thinking_the_constraint_starts(compiler, trigger):
    """A reasoning model's thinking is free: the trigger inside it starts nothing, the grammar starts (or waits
    for its trigger) once the thinking is closed, in the same token or later."""
    m = matcher(compiler, Spec(choice=["yes", "no"], trigger=trigger, after="</t>"))
    m.consume(TOKENIZER.encode("<t>maybe <call> no</", add_special_tokens=False))
    assert not m.constrained
    m.consume(TOKENIZER.encode("t>" + ("\n<call>" if trigger else ""), add_special_tokens=False))
    assert m.constrained
    assert {TOKENIZER.decode([t]) for t in allowed(m)} == {"y", "n"}


@pytest.mark.parametrize("trigger", [None, "@call"])
def test_an_output_that_does_not_open_its_thinking_is_constrained_from_its_start(compiler, trigger):
    """Decided at the first token: the opening's first token (then the thinking's end is awaited), or the
    grammar's (then the constraint, or the wait for its trigger, starts at once)."""
    spec = Spec(choice=["yes", "no"], trigger=trigger, after="</t>", after_open="<t>")
    opened = matcher(compiler, spec)
    if trigger is None:  # the first token: the grammar's, or the opening
        assert {TOKENIZER.decode([t]) for t in allowed(opened)} == {"y", "n", "<"}
    opened.consume(TOKENIZER.encode("<t>maybe @call", add_special_tokens=False))
    assert not opened.constrained  # it opened its thinking: its end is awaited, a trigger inside starts nothing
    skipped = matcher(compiler, spec)
    skipped.consume(TOKENIZER.encode(trigger or "y", add_special_tokens=False))
    assert skipped.constrained
    assert {TOKENIZER.decode([t]) for t in allowed(skipped)} == ({"y", "n"} if trigger else {"e"})


def test_bytes_after_the_trigger_in_the_same_token_go_to_the_grammar(compiler):
    m = matcher(compiler, Spec(choice=["The end"], trigger="!"))
    m.consume(TOKENIZER.encode("hi!", add_special_tokens=False) + TOKENIZER.encode("The", add_special_tokens=False))
    assert TOKENIZER.decode(m.take_forced(10)) == " end"
