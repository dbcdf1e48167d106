"""Token-exact conversations (previous_response_id): the chat template rendered turn by turn, never the history
again.

A stored conversation is its exact token ids, kept as segments: the
instructions (a system message; may be empty) and then one segment per turn
(that turn's new messages as the template renders them after the history, the
generation prompt, and the model's output tokens as sampled). The next turn is
those ids + the closing of the last answer + the new messages' rendering — so
it starts with every block the previous turn computed (DESIGN §3, Pins and
sessions). Re-rendering the history as text and re-tokenizing it, as other
servers do, can differ at the turn boundary (the model's tokens are not always
how the tokenizer would split its text) and then misses the cache there.

Rendering only the new messages relies on the template being a concatenation
of per-message pieces, which holds for ChatML, Llama 3, Mistral and most
others: the new messages' text is render(context + new) minus render(context),
with a placeholder context, checked to be a true prefix. What the template
writes after an assistant's content (ChatML: `<|im_end|>\\n`) closes the
previous answer; its first token is dropped when the model already produced
it (an answer that ended on the end-of-turn token).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from kvserve.errors import InvalidRequestError
from kvserve.server.prompt.builder import PromptBuilder

# Placeholder content that no template transforms and no message contains.
_MARK = "\x00kvserve-answer\x00"
_CONTEXT = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


class TurnSegments:
    """A stored conversation's next segments (see the module doc). Thread-safe (no state but caches). The
    first turn of a conversation is the builder's (`Conversation.split_instructions`): it splits the
    instructions off as `instructions` here writes them."""

    def __init__(self, builder: PromptBuilder) -> None:
        self.builder = builder

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                variables: dict | None = None) -> str:
        return self.builder.render(messages, add_generation_prompt, variables, param="input")

    def _encode(self, text: str) -> list[int]:
        return self.builder.encode(text)

    def instructions(self, instructions: str | None, variables: dict | None = None) -> list[int]:
        """The tokens of the instructions as a leading system message (none without instructions).
        `variables`: more template variables (a template's own `tools`), here and below."""
        if not instructions:
            return []
        return self._encode(self._render([{"role": "system", "content": instructions}], False, variables))

    def next_turn(self, messages: list[dict[str, str]], variables: dict | None = None) -> list[int]:
        """The tokens of `messages` rendered after an assistant answer, up to the generation prompt."""
        context = self._render(_CONTEXT + [{"role": "assistant", "content": _MARK}], False, variables)
        full = self._render(_CONTEXT + [{"role": "assistant", "content": _MARK}] + messages, True, variables)
        if not full.startswith(context):
            raise self._not_incremental()
        return self._encode(full[len(context):])

    @functools.cached_property
    def _closing(self) -> list[int]:
        context = self._render(_CONTEXT + [{"role": "assistant", "content": _MARK}], False)
        if context.count(_MARK) != 1:
            raise self._not_incremental()
        return self._encode(context[context.index(_MARK) + len(_MARK):])

    def close_answer(self, output_ids: Sequence[int]) -> list[int]:
        """What follows an answer's tokens before the next message: the template's end of an assistant
        turn, less the end-of-turn token if the model already produced it."""
        closing = self._closing
        if closing and output_ids and output_ids[-1] == closing[0]:
            return closing[1:]
        return list(closing)

    @staticmethod
    def _not_incremental() -> InvalidRequestError:
        return InvalidRequestError("this model's chat template does not render a conversation message by message, "
                                   "so previous_response_id cannot continue it token-exactly; send the whole "
                                   "conversation as input instead", param="previous_response_id")
