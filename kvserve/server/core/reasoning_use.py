"""A request's reasoning, API-neutral: the model's format (its chat template's: tools/reasoning.py), the request's
switch as template variables, the parser that keeps thinking apart from the answer, and where a constraint on
the answer starts. Each API maps its own switch: chat completions' `chat_template_kwargs` (vLLM's) and
`reasoning_effort`, Responses' `reasoning.effort`, Anthropic's `thinking.type`, Ollama's `think`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.model.tokenizer import Tokenizer
from kvserve.structured.params import StructuredOutputsParams
from kvserve.tools.reasoning import ReasoningFormat, ReasoningParser, reasoning_for_template

EFFORTS = ("minimal", "low", "medium", "high")
# Template variables the prompt builder sets itself (a client's chat_template_kwargs cannot replace them).
_SERVER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


@dataclass
class ReasoningUse:
    """`enabled` None: the template's default; `effort`: harmony's depth (the others read it as on / off)."""

    format: ReasoningFormat | None = None
    enabled: bool | None = None
    effort: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs, as the client gave them
    opened: bool = False  # the prompt opened the thinking (its template wrote the opening tag)
    closed: bool = False  # the prompt closed it (thinking switched off in the template)

    @classmethod
    def of(cls, template: str | None, enabled: bool | None = None, effort: str | None = None,
           template_kwargs: dict[str, Any] | None = None, param: str = "reasoning") -> "ReasoningUse":
        """The request's reasoning on the model whose chat template is `template`. Asking a model that does not
        reason to think is a 400 naming `param`; asking it not to is nothing to do."""
        reasoning = reasoning_for_template(template)
        if effort is not None and effort not in EFFORTS and effort != "none":
            raise InvalidRequestError(f"{param}: the effort must be one of {', '.join(EFFORTS)} or none, got "
                                      f"{effort!r}", param=param)
        if effort == "none":
            enabled, effort = False, None
        elif effort is not None and enabled is None:
            enabled = True
        if reasoning is None and enabled:
            raise InvalidRequestError("this model does not reason (its chat template knows no thinking), so "
                                      f"{param} cannot turn thinking on", param=param)
        kwargs = dict(template_kwargs or {})
        reserved = sorted(set(kwargs) & _SERVER_VARIABLES)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(reserved)}: the server sets "
                                      "them from the request", param="chat_template_kwargs")
        if enabled is None and isinstance(kwargs.get("enable_thinking"), bool):
            enabled = kwargs["enable_thinking"]
        return cls(reasoning, enabled, effort if reasoning is not None and reasoning.switch == "reasoning_effort"
                   else None, kwargs)

    @property
    def active(self) -> bool:
        """Whether the output is parsed for thinking (the model's template knows a format)."""
        return self.format is not None

    def variables(self) -> dict[str, Any]:
        """Template variables: the client's own (chat_template_kwargs), then the switch."""
        switch = self.format.variables(self.enabled, self.effort) if self.format is not None else {}
        return {**self.template_kwargs, **switch}

    def after_prompt(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> "ReasoningUse":
        """This reasoning once the prompt is known: whether its template opened or closed the thinking."""
        if self.format is None:
            return self
        tail = tokenizer.decode(prompt_ids[-12:], skip_special_tokens=False).rstrip()
        return replace(self, opened=self.format.opened_by(tail),
                       closed=tail.endswith(self.format.closer) and self.format.closer != "<|end|>")

    def parser(self) -> ReasoningParser | None:
        return self.format.parser(self.opened) if self.format is not None else None

    def gate(self, constraint: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """The constraint applied after the thinking (vLLM's way): nothing in the thinking is constrained, nor is a
        call written there a call. Unchanged where the prompt closed the thinking, or the model does not reason."""
        if constraint is None or self.format is None or self.closed:
            return constraint
        if constraint.excluded_text is not None:
            return constraint  # (a ban holds in the thinking too)
        # (where the prompt did not open the thinking, an output that does not open it is constrained from its start)
        return replace(_after_spacing(constraint), after=self.format.answer_start,
                       after_open=None if self.opened else self.format.opener)

    def markers(self) -> tuple[str, ...]:
        return (self.format.opener, self.format.closer) if self.format is not None else ()


def _after_spacing(constraint: StructuredOutputsParams) -> StructuredOutputsParams:
    """The constraint with the spacing a model writes after its thinking (`</think>\n\n`) allowed first, where the
    constraint starts at once (a trigger's wait skips spacing anyway): a grammar's or a schema's."""
    if constraint.trigger is not None:
        return constraint
    if constraint.grammar is not None:
        body = re.sub(r"^start:", "gated_start:", constraint.grammar, count=1, flags=re.MULTILINE)
        return replace(constraint, grammar=f"start: gated_start | GATED_SPACE gated_start\n{body}\n{_SPACE}")
    if constraint.json is not None or constraint.json_object:
        schema = constraint.json if constraint.json is not None else {"type": "object"}
        schema_text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        grammar = f"start: answer | GATED_SPACE answer\nanswer: %json {schema_text}\n{_SPACE}"
        return StructuredOutputsParams(grammar=grammar, trigger=constraint.trigger)
    return constraint


_SPACE = "GATED_SPACE: /[ \t\r\n]+/"


def reasoning_tokens(tokenizer: Tokenizer | None, thinking: str) -> int:
    """The output tokens the thinking took, as usage reports them (`reasoning_tokens`): its text tokenized."""
    if not thinking or tokenizer is None:
        return 0
    return len(tokenizer.encode(thinking, add_special_tokens=False))
