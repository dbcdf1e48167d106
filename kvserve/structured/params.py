"""What a request asks its output to match (the engine compiles it into a token mask)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's names (SamplingParams.structured_outputs): exactly one of json / regex / choice / grammar / json_object."""
    json: dict | str | None = None     # a JSON schema (dict or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None         # llguidance Lark (with %json{...} for embedded JSON schemas)
    json_object: bool | None = None    # any JSON object
    trigger: str | None = None         # output is free text until it ends with this string; from then on the rest of
                                       # the output is constrained to the grammar (tool_choice "auto")
