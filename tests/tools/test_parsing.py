"""Tool calls out of outputs: whole and streamed in any fragments, the same result."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.tools.calls import ToolCall, calls_text
from kvserve.tools.parsing import ArgumentsDelta, CallStarted, ContentDelta, ToolCallParser, parse_output

CALLS = [ToolCall("x", "get_weather", '{"city": "Paris", "days": [1, 2]}'), ToolCall("y", "now", "{}")]
OUTPUT = "Checking.\n" + calls_text(CALLS)


def test_a_whole_output_gives_content_and_calls_with_fresh_ids():
    parsed = parse_output(OUTPUT)
    assert parsed.content == "Checking.\n"
    assert [(c.name, c.arguments) for c in parsed.calls] == [(c.name, c.arguments) for c in CALLS]
    assert all(c.id.startswith("call_") for c in parsed.calls) and parsed.calls[0].id != parsed.calls[1].id
    assert parse_output(calls_text(CALLS[:1]), "toolu_").calls[0].id.startswith("toolu_")


def test_rendering_a_parsed_call_back_gives_the_generated_text():
    parsed = parse_output(OUTPUT)
    assert parsed.content + calls_text(parsed.calls) == OUTPUT


def test_text_that_is_not_a_call_stays_text():
    for text in ["no calls here", "a <tool_call without closing", "<tool_call>not json</tool_call>", "1 < 2"]:
        parsed = parse_output(text)
        assert parsed.calls == [] and parsed.content == text


def test_an_unfinished_call_keeps_its_arguments_so_far():
    parsed = parse_output(calls_text(CALLS[:1])[:-20])
    assert parsed.calls[0].name == "get_weather" and parsed.calls[0].arguments.startswith('{"city": "Paris"')


def test_a_further_call_cut_off_before_its_name_is_dropped():
    parsed = parse_output(calls_text(CALLS[:1]) + '\n<tool_call>\n{"na')
    assert parsed.content == "" and [c.name for c in parsed.calls] == ["get_weather"]


def _stream(text: str, cuts: list[int]) -> list:
    parser, events, last = ToolCallParser(), [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    return events + parser.finish()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(OUTPUT)), max_size=30))
def test_streamed_in_any_fragments_the_events_assemble_to_the_whole_parse(cuts):
    events = _stream(OUTPUT, cuts)
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    starts = [e for e in events if isinstance(e, CallStarted)]
    arguments = ["".join(e.fragment for e in events if isinstance(e, ArgumentsDelta) and e.index == i)
                 for i in range(len(starts))]
    assert content == "Checking.\n"
    assert [(s.index, s.name) for s in starts] == [(0, "get_weather"), (1, "now")]
    assert arguments == [c.arguments for c in CALLS]
    assert json.loads(arguments[0]) == {"city": "Paris", "days": [1, 2]}
    # a call is announced before any of its arguments
    first_fragment = next(i for i, e in enumerate(events) if isinstance(e, ArgumentsDelta))
    assert events.index(starts[0]) < first_fragment


def test_the_start_of_a_tag_is_held_back_until_it_is_known():
    parser = ToolCallParser()
    assert parser.feed("Hi <tool_") == [ContentDelta("Hi ")]
    assert parser.feed("box>") == [ContentDelta("<tool_box>")]


# --- a call cut by max_tokens ---------------------------------------------------------------------------

CUT = ToolCall("z", "get_weather", '{"city": "Paris", "when": {"day": 1}}')


def _cut_parses(text: str, calls_only: bool):
    """Every prefix of `text`, parsed whole and streamed a character at a time: the two must agree."""
    for end in range(len(text) + 1):
        prefix = text[:end]
        whole = parse_output(prefix, calls_only=calls_only)
        parser = ToolCallParser(calls_only=calls_only)
        events = [e for char in prefix for e in parser.feed(char)] + parser.finish()
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == whole.content
        assert [(c.name, c.arguments) for c in parser.calls] == [(c.name, c.arguments) for c in whole.calls]
        yield prefix, whole


def test_a_required_call_cut_anywhere_is_a_call_or_nothing_never_text():
    text = calls_text([CUT])
    head_end = text.index(CUT.arguments) - len(', "arguments": ')  # where the name's closing quote ends
    for prefix, parsed in _cut_parses(text, calls_only=True):
        assert parsed.content == ""
        if len(prefix) < head_end:
            assert parsed.calls == [], prefix
            continue
        (call,) = parsed.calls
        assert call.name == "get_weather"
        # exactly the argument text generated so far: no piece of the wrapper's tail (`}\n</tool_call`)
        generated = prefix[head_end:].removeprefix(', "arguments": '[:len(prefix) - head_end])
        assert call.arguments == generated[:len(CUT.arguments)], prefix
        assert CUT.arguments.startswith(call.arguments)


def test_an_auto_call_cut_after_its_trigger_is_no_text():
    text = "Let me see.\n" + calls_text([CUT])
    for prefix, parsed in _cut_parses(text, calls_only=False):
        if "<tool_call>" in prefix:  # from the trigger on the output is the grammar's: calls only
            assert parsed.content == "Let me see.\n", prefix
        else:  # free text until the trigger is whole
            assert parsed.content == prefix and parsed.calls == []
        assert all(CUT.arguments.startswith(call.arguments) for call in parsed.calls)


def test_a_further_call_cut_anywhere_leaves_the_first_whole_and_no_text():
    first = calls_text([CALLS[0]])
    text = calls_text([CALLS[0], CUT])
    for prefix, parsed in _cut_parses(text, calls_only=True):
        if len(prefix) < len(first):
            continue
        assert parsed.content == "" and parsed.calls[0].arguments == CALLS[0].arguments, prefix
        assert all(CUT.arguments.startswith(call.arguments) for call in parsed.calls[1:])


def test_arguments_end_with_their_json_not_at_the_first_suffix_like_text():
    tricky = ToolCall("t", "say", '{"text": "}\\n</tool_call> is how a call ends", "n": [1, {"a": "]"}]}')
    parsed = parse_output(calls_text([tricky]) + "\n", calls_only=True)
    assert parsed.content == "" and parsed.calls[0].arguments == tricky.arguments
