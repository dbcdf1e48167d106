"""Thinking split from the answer, whole and at every cut of a stream."""

import pytest

from kvserve.tools.reasoning import ThinkingSplitter, split_thinking, template_supports_thinking

CASES = [
    ("<think>\nPlan it.\n</think>\n\nThe answer.", False, ("Plan it.", "The answer.")),
    ("Plan it.\n</think>\n\nThe answer.", True, ("Plan it.", "The answer.")),  # the template opened it
    ("<think>\nStill thinking\n", False, ("Still thinking", "")),  # cut short
    ("<think>\n\n</think>\n\nNo thoughts.", False, ("", "No thoughts.")),
    ("\nNever thought.", False, ("", "\nNever thought.")),  # no tag: the answer as written
    ("<thi", False, ("", "<thi")),
]


@pytest.mark.parametrize("text, opened, expected", CASES)
def test_whole_and_streamed_in_every_cut_agree(text, opened, expected):
    assert split_thinking(text, opened) == expected
    for cut in range(len(text) + 1):
        splitter = ThinkingSplitter(opened)
        parts = [splitter.feed(text[:cut]), splitter.feed(text[cut:]), splitter.finish()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == expected, cut


def test_a_template_that_knows_thinking():
    assert template_supports_thinking("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}")
    assert not template_supports_thinking("<|im_start|>{{ m.content }}")
    assert not template_supports_thinking(None)
