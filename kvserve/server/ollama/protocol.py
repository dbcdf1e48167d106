"""Ollama's request shapes and how they map onto kvserve's: `options` onto sampling, `format` onto structured
output, messages and tools onto the prompt builder's conversation.

Sampling defaults are Ollama's documented ones (temperature 0.8, top_k 40, top_p 0.9), since its clients
send nothing else and expect them; `num_predict` -1 (or none) runs to the end of the context,
-2 fills it. `num_ctx` cannot grow the server's context: a larger value is capped (and logged).
Unknown options are ignored, as Ollama ignores them.

Ollama's tool calls carry no ids. Each call here gets one made from its name and arguments, so an answer
the model generated and the same call sent back in the history have the same id: the prompt builder can
splice the generated ids back (server/prompt/answers.py), and results are matched to calls in order.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.server.core.fields import sampling_params
from kvserve.server.core.reasoning_use import ReasoningUse
from kvserve.server.core.tool_use import ToolUse
from kvserve.server.prompt.builder import Conversation
from kvserve.structured.params import StructuredOutputsParams
from kvserve.tools.calls import FunctionTool, ToolCall, dumps
from kvserve.tools.grammar import ToolChoice
from kvserve.tools.reasoning import reasoning_for_template
from kvserve.tools.rendering import Turn

log = logging.getLogger(__name__)

OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
# option name -> SamplingParams name
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}


def call_id(name: str, arguments: str) -> str:
    """The id of an Ollama call: the same for the same call, generated or sent back."""
    return "ollama_" + hashlib.sha256(f"{name}\0{arguments}".encode()).hexdigest()[:24]


class OllamaFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class OllamaToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    function: OllamaFunction

    def call(self) -> ToolCall:
        arguments = self.function.arguments
        text = arguments if isinstance(arguments, str) else dumps(arguments)
        return ToolCall(call_id(self.function.name, text), self.function.name, text)


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    thinking: str | None = None
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None


class OllamaToolFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class OllamaTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = "function"
    function: OllamaToolFunction


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    stream: StrictBool | None = True
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    think: StrictBool | Literal["low", "medium", "high"] | None = None

    def sampling(self, max_tokens: int, constraint: StructuredOutputsParams | None) -> SamplingParams:
        options = self.options or {}
        values: dict[str, Any] = {**OLLAMA_DEFAULTS, "max_tokens": max_tokens}
        for name, target in _OPTIONS.items():
            if options.get(name) is not None:
                values[target] = options[name]
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        constraint = constraint or self.format_constraint()
        if constraint is not None:
            values["structured_outputs"] = constraint
        return sampling_params(values, {v: f"options.{k}" for k, v in _OPTIONS.items()})

    def format_constraint(self) -> StructuredOutputsParams | None:
        if self.format == "json":
            return StructuredOutputsParams(json_object=True)
        if isinstance(self.format, dict):
            return StructuredOutputsParams(json=self.format)
        return None

    def requested_max_tokens(self, context_room: int) -> int | None:
        """`num_predict`: None for "to the end of the context" (-1, or not given), the room for -2."""
        predict = (self.options or {}).get("num_predict")
        if predict is None or predict == -1:
            return None
        if predict == -2:
            return context_room
        if not isinstance(predict, int) or predict < 1:
            raise InvalidRequestError(f"options.num_predict must be a positive integer, -1 or -2, got {predict!r}",
                                      param="options.num_predict")
        return predict

    def note_num_ctx(self, context: int) -> None:
        num_ctx = (self.options or {}).get("num_ctx")
        if isinstance(num_ctx, int) and num_ctx > context:
            log.info("options.num_ctx %d is more than the server's context of %d tokens: capped", num_ctx, context)


class ChatRequest(GenerationRequest):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[OllamaTool] | None = None

    def check(self) -> None:
        if any(m.images for m in self.messages):
            raise InvalidRequestError("images are not supported: this model reads text only", param="images")

    def tool_use(self) -> ToolUse:
        tools = [FunctionTool(t.function.name, t.function.description,
                              t.function.parameters or {"type": "object", "properties": {}}) for t in self.tools or []]
        # Ollama has no tool_choice: the model may call or answer
        use = ToolUse(tools, ToolChoice("auto" if tools else "none"), call_id_prefix="ollama_")
        use.check()
        return use

    def to_conversation(self, tool_use: ToolUse, tenant: str | None, variables: dict[str, Any]) -> Conversation:
        turns: list[Turn] = []
        unanswered: list[ToolCall] = []
        for message in self.messages:
            if message.role == "tool":
                # the first unanswered call of that name (or of any name): Ollama matches results in order
                match = next((c for c in unanswered if message.tool_name in (None, c.name)), None)
                if match is None:
                    raise InvalidRequestError("a tool message answers no earlier tool call", param="messages")
                unanswered.remove(match)
                turns.append(Turn("tool", message.content or "", tool_call_id=match.id, name=match.name))
                continue
            calls = [c.call() for c in message.tool_calls or []] if message.role == "assistant" else []
            unanswered += calls
            turns.append(Turn(message.role, message.content or "", calls))
        if not turns:
            raise InvalidRequestError("messages must not be empty", param="messages")
        return Conversation(turns, tool_use.tools, tenant=tenant, variables=variables)


class GenerateRequest(GenerationRequest):
    prompt: str | None = ""
    system: str | None = None
    template: str | None = None
    raw: StrictBool | None = False
    suffix: str | None = None
    context: list[int] | None = None
    images: list[Any] | None = None

    def check(self) -> None:
        for name, given in (("images", bool(self.images)), ("suffix", bool(self.suffix)),
                            ("template", bool(self.template)), ("context", bool(self.context))):
            if given:
                raise InvalidRequestError(
                    f"{name} is not supported by kvserve (it serves text prompts through the model's own template, "
                    "and the prefix cache in place of `context`)", param=name)


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    name: str | None = None  # older clients

    @property
    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise InvalidRequestError("model is required", param="model")
        return name


def thinking_use(think: Any, template: str | None, model: str) -> ReasoningUse:
    """`think` (a switch, or gpt-oss's depth "low" / "medium" / "high") on the model whose chat template is
    `template`; a model without thinking refuses it, as Ollama does. The thinking is kept apart only where `think`
    turned it on (`ReasoningUse.enabled`), as Ollama does."""
    if think is None:
        return ReasoningUse()
    if reasoning_for_template(template) is None:
        if think is False:
            return ReasoningUse()
        raise InvalidRequestError(f"\"{model}\" does not support thinking", param="think")
    effort = think if isinstance(think, str) else None
    return ReasoningUse.of(template, think is not False, effort, param="think")


def as_json_arguments(text: str) -> dict[str, Any] | None:
    """A generated call's arguments as Ollama returns them (an object); None for a call cut short by
    `num_predict`, which Ollama's shape cannot carry (`done_reason: "length"` says it was cut)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
