"""A conversation into prompt token ids: the one place where a chat template is rendered and tokenized.

Steps, for every API alike:
1. Tools: a template that renders tools itself gets them as its `tools` variable and calls as
   `tool_calls`; any other gets kvserve's default block (tools/rendering.py). With `instructions`
   (Responses) the definitions go into that leading system message, so they are the same bytes every
   turn whatever the input starts with.
2. Marks (Anthropic's cache_control breakpoints): a marker is written at each marked offset of a
   turn's text, the conversation is rendered, and each marker's place becomes a count of tokens: the
   tokens the text before it shares with the whole prompt (a token that straddles it is not before it).
3. Answers spliced back (answers.py): an assistant turn whose calls this tenant's model generated, and
   whose rendering still starts, right after the generation prompt that preceded it, with the text
   that was generated, is replaced by the ids that were generated. The rendering is tokenized piece by
   piece around it; a template's end-of-turn token that the answer already ended with is not doubled.
   Found by rendering the conversation up to that turn with the generation prompt, so it holds for any
   template that renders history as it renders the turn being generated (ChatML, Qwen3, Llama 3).
4. `split_instructions`: the instructions are tokenized apart from the rest, as a Responses
   conversation continued by previous_response_id tokenizes them (segments.py), so both hit the same
   blocks.

Template errors (a template that requires alternating roles, raises on a role it does not know) are a
400 naming the request's field, here for every API.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import jinja2

from kvserve.errors import InvalidRequestError
from kvserve.model.tokenizer import Tokenizer
from kvserve.server.prompt.answers import GeneratedAnswers
from kvserve.tools.calls import FunctionTool
from kvserve.tools.rendering import (Turn, render_conversation, system_with_tools, template_supports_tools,
                                     template_variables)

_MARK = "\x00kvserve-mark-{}\x00"
_MARK_PATTERN = re.compile("\x00kvserve-mark-(\\d+)\x00")
_RESERVED = "\x00kvserve-"


@dataclass
class Conversation:
    """A chat request, API-neutral."""

    turns: list[Turn]
    tools: list[FunctionTool] = field(default_factory=list)
    # Responses' instructions: a leading system message (none if empty and no tool block) that holds the
    # default tool block. None: the tools go into the conversation's own first system message.
    instructions: str | None = None
    add_generation_prompt: bool = True
    variables: dict[str, Any] = field(default_factory=dict)  # more template variables (`enable_thinking`)
    tenant: str | None = None  # whose generated answers are spliced back (None: none are)
    tools_mark: Any = None  # a mark (its tag) after the tool definitions, where they end a system message
    split_instructions: bool = False  # tokenize the instructions apart (Responses)
    param: str = "messages"  # the request field errors name


@dataclass
class Prompt:
    token_ids: list[int]
    marks: list[tuple[int, Any]] = field(default_factory=list)  # (tokens before the mark, its tag), in order
    num_instruction_tokens: int = 0  # with split_instructions: the leading segment's length


@dataclass(frozen=True)
class _Cut:
    """Characters [start, end) of the rendering replaced by `token_ids`."""

    start: int
    end: int
    token_ids: tuple[int, ...] = ()


class PromptBuilder:
    """Thread-safe (its only state is the answers store, which locks). `max_prompt_chars`: a text longer
    than this cannot fit the context whatever it tokenizes to, and is refused before any work."""

    def __init__(self, tokenizer: Tokenizer, answers: GeneratedAnswers | None = None,
                 max_prompt_chars: int | None = None, context_tokens: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.answers = answers
        self.max_prompt_chars = max_prompt_chars
        self.context_tokens = context_tokens  # only for the message of that refusal

    # --- text ------------------------------------------------------------------

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuse a text that can never fit (every token stands for at most `longest_token_chars` characters).
        Never refuses one that fits."""
        limit = self.max_prompt_chars
        if limit is not None and num_chars > limit:
            raise InvalidRequestError(
                f"{param} is {num_chars:,} characters: more than any prompt that fits the model's context of "
                f"{self.context_tokens} tokens ({self.tokenizer.longest_token_chars} characters per token at "
                f"most, so {limit:,} characters)", param=param)

    def encode_text(self, text: str, param: str = "prompt") -> list[int]:
        """A plain text prompt's ids (the tokenizer adds its BOS, as for completions)."""
        self.check_chars(len(text), param)
        return self.tokenizer.encode(text)

    def encode(self, text: str) -> list[int]:
        """A piece of a rendering: the template wrote any special tokens itself."""
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               variables: dict[str, Any] | None = None, param: str = "messages") -> str:
        """The model's chat template over `messages`; what it refuses is a 400 naming `param`."""
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **(variables or {}))
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the model's chat template refused these messages: {exc}",
                                      param=param) from None

    def messages(self, conversation: Conversation, turns: list[Turn] | None = None
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(template messages, template variables) of the conversation (`turns`: its turns, as marked)."""
        turns = conversation.turns if turns is None else turns
        template, tools = self.tokenizer.chat_template, conversation.tools
        if conversation.instructions is None:
            messages, variables = render_conversation(turns, tools, template)
        else:
            messages, _ = render_conversation(turns, [], template)
            messages, variables = self.instruction_messages(conversation) + messages, template_variables(tools, template)
        return messages, {**conversation.variables, **variables}

    def instruction_messages(self, conversation: Conversation) -> list[dict[str, Any]]:
        """The leading system message of a conversation with `instructions` (none if it would be empty)."""
        instructions, tools = conversation.instructions or "", conversation.tools
        if tools and not template_supports_tools(self.tokenizer.chat_template):
            instructions = system_with_tools(instructions, tools)
        return [{"role": "system", "content": instructions}] if instructions else []

    # --- the prompt --------------------------------------------------------------

    def build(self, conversation: Conversation) -> Prompt:
        tags: list[Any] = []
        if conversation.tools_mark is not None or any(turn.marks for turn in conversation.turns):
            if any(_RESERVED in turn.content for turn in conversation.turns):  # it would read as a marker
                raise InvalidRequestError("message text contains a reserved control sequence",
                                          param=conversation.param)
        turns = [self._marked(turn, tags) for turn in conversation.turns]
        messages, variables = self.messages(conversation, turns)
        if conversation.tools_mark is not None and messages and messages[0]["role"] == "system":
            # the definitions end the system message (kvserve's block)
            messages[0] = {**messages[0], "content": messages[0]["content"] + self._mark(conversation.tools_mark, tags)}
        self.check_chars(sum(len(m["content"] or "") for m in messages), conversation.param)

        def rendered(upto: int, generation_prompt: bool) -> str:
            text = self.render(messages[:upto], generation_prompt, variables, conversation.param)
            return _MARK_PATTERN.sub("", text) if tags else text

        full = self.render(messages, conversation.add_generation_prompt, variables, conversation.param)
        text, mark_offsets = _strip_marks(full) if tags else (full, [])
        cuts = self._answer_cuts(conversation, turns, messages, text, rendered)
        split = conversation.split_instructions and bool(self.instruction_messages(conversation))
        if split:
            try:
                head = rendered(1, False)
            except InvalidRequestError:  # a template that refuses a system message alone (Llama 3.1's with tools)
                head = None
            if head is not None and text.startswith(head):  # one that renders it alone differently: no split
                cuts.insert(0, _Cut(len(head), len(head)))
        token_ids, pieces = self._tokenize(text, cuts)
        marks = [(self._tokens_before(text, offset, pieces), tags[n]) for offset, n in mark_offsets]
        num_instruction_tokens = pieces[0].end_token if split and cuts and not cuts[0].token_ids else 0
        return Prompt(token_ids, marks, num_instruction_tokens)

    def _marked(self, turn: Turn, tags: list[Any]) -> Turn:
        """The turn with a marker at each of its marks."""
        if not turn.marks:
            return turn
        content, last = [], 0
        for offset, tag in sorted(turn.marks, key=lambda mark: mark[0]):
            content += [turn.content[last:offset], self._mark(tag, tags)]
            last = offset
        return replace(turn, content="".join(content) + turn.content[last:], marks=[])

    @staticmethod
    def _mark(tag: Any, tags: list[Any]) -> str:
        tags.append(tag)
        return _MARK.format(len(tags) - 1)

    def _answer_cuts(self, conversation: Conversation, turns: list[Turn], messages: list[dict[str, Any]],
                     text: str, rendered) -> list[_Cut]:
        """Where generated answers are spliced back (see the module doc, step 3)."""
        if self.answers is None or conversation.tenant is None:
            return []
        cuts: list[_Cut] = []
        positions = [j for j, message in enumerate(messages) if message["role"] == "assistant"]
        answered = [turn for turn in turns if turn.role == "assistant"]  # rendered one message each, in order
        for position, turn in zip(positions, answered):
            answer = self.answers.lookup(conversation.tenant, turn)
            if answer is None:
                continue
            head = rendered(position, True)
            start = len(head)
            if text.startswith(head) and text.startswith(answer.text, start) and \
                    (not cuts or cuts[-1].end <= start):
                cuts.append(_Cut(start, start + len(answer.text), answer.token_ids))
        return cuts

    def _tokenize(self, text: str, cuts: list[_Cut]) -> tuple[list[int], list[_Piece]]:
        """The ids of `text` with each cut replaced by its ids, and where each text piece lies."""
        ids: list[int] = []
        pieces: list[_Piece] = []
        position, previous = 0, ()
        for cut in [*cuts, _Cut(len(text), len(text))]:
            piece = self.encode(text[position:cut.start])
            # the template's end of turn that the answer before it already ended with is not doubled
            dropped = bool(previous and piece and piece[0] == previous[-1])
            pieces.append(_Piece(position, cut.start, len(ids), dropped))
            ids += piece[1:] if dropped else piece
            pieces[-1].end_token = len(ids)
            ids += cut.token_ids
            position, previous = cut.end, cut.token_ids
        return ids, pieces

    def _tokens_before(self, text: str, offset: int, pieces: list[_Piece]) -> int:
        """How many prompt tokens lie wholly before character `offset` of the rendering."""
        before = 0
        for piece in pieces:
            if offset < piece.start:  # inside an answer spliced in before this piece
                return before
            if offset <= piece.end:
                whole = self.encode(text[piece.start:piece.end])
                part = self.encode(text[piece.start:offset])
                common = 0
                while common < len(part) and common < len(whole) and part[common] == whole[common]:
                    common += 1
                return piece.first_token + max(common - piece.dropped, 0)
            before = piece.end_token
        return before


@dataclass
class _Piece:
    """Characters [start, end) of the rendering, tokenized alone from token `first_token` on."""

    start: int
    end: int
    first_token: int
    dropped: bool  # its first token was dropped (the end of turn of the answer before it)
    end_token: int = 0


def _strip_marks(text: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without markers, and (offset in it, mark number) for each, in order."""
    parts, offsets, removed, last = [], [], 0, 0
    for match in _MARK_PATTERN.finditer(text):
        parts.append(text[last:match.start()])
        offsets.append((match.start() - removed, int(match.group(1))))
        removed += match.end() - match.start()
        last = match.end()
    parts.append(text[last:])
    return "".join(parts), offsets
