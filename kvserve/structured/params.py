"""What a request asks its output to match: vLLM's `structured_outputs` names, plus kvserve's trigger."""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass

from kvserve.errors import InvalidRequestError

PARAM = "structured_outputs"
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "excluded_text")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's names (SamplingParams.structured_outputs): exactly one of json / regex / choice / grammar / json_object,
    or kvserve's excluded_text."""

    json: dict | str | None = None  # a JSON schema (dict or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # llguidance Lark (with %json{...}); GBNF too if llguidance converts it
    json_object: bool | None = None  # any JSON object
    trigger: str | None = None  # kvserve: output is free text until it ends with this string; from then on the
    # rest of the output is constrained (tool_choice "auto": trigger "<tool_call>")
    after: str | None = None  # kvserve: output is free text until it contains this string (the end of a reasoning
    # model's thinking, as vLLM's reasoning parsers); the constraint, or the wait for its trigger, starts there
    after_open: str | None = None  # kvserve, with `after`: the text that opens what `after` closes (`<think>`); an
    # output that does not open with it is not awaited to close it (a model that skips its thinking)
    excluded_text: str | None = None  # kvserve: free text that never contains this string (tool_choice "none":
    # the call opener; structured/excluded.py)

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise InvalidRequestError(
                f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got {named}", param=PARAM)
        self._check_fields()

    def _check_fields(self) -> None:
        def fail(message: str) -> None:
            raise InvalidRequestError(message, param=PARAM)

        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json_module.loads(self.json)
                except ValueError as error:
                    fail(f"structured_outputs.json is not valid JSON: {error}")
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                fail(f"structured_outputs.json must be a JSON schema (an object), got {type(schema).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            fail("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            fail("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                fail("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            fail("structured_outputs.json_object must be a boolean")
        if self.trigger is not None and (not isinstance(self.trigger, str) or not self.trigger):
            fail("structured_outputs.trigger must be a non-empty string")
        if self.after is not None and (not isinstance(self.after, str) or not self.after):
            fail("structured_outputs.after must be a non-empty string")
        if self.excluded_text is not None and (not isinstance(self.excluded_text, str) or not self.excluded_text):
            fail("structured_outputs.excluded_text must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which of json / regex / choice / grammar / json_object this spec is."""
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> str:
        """A canonical text of the spec (the trigger and `after` aside: it does not change the grammar), so equal specs
        share one compiled grammar, given as a dict or as JSON text alike. Key order is kept: a schema's
        property order is the order the output writes its keys in, so two schemas that differ only there
        are two grammars."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json_module.loads(value)
        return self.kind + ":" + json_module.dumps(value, separators=(",", ":"))
