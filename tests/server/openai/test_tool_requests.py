"""Tool calls and structured output at the API's edges, on the tiny app: streamed `delta.tool_calls` as the
openai client's own stream state assembles them, and bad input as a 400 naming its field."""

import logging
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from kvserve.engine.output.types import RequestDelta, RequestMetrics
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.server.core.streaming import Job
from kvserve.server.core.tool_use import ToolUse
from kvserve.server.openai.chat import ChatFormat, tool_call_entries
from kvserve.structured.params import StructuredOutputsParams
from kvserve.tools.calls import FunctionTool, ToolCall, calls_text
from kvserve.tools.grammar import ToolChoice
from kvserve.tools.parsing import ArgumentsDelta, CallStarted

TOOLS = [FunctionTool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}}),
         FunctionTool("get_time")]
OUTPUT = "Let me look.\n" + calls_text([ToolCall("a", "get_weather", '{"city": "Paris"}'),
                                        ToolCall("b", "get_time", "{}")])
USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _delta(text: str, finished: bool) -> RequestDelta:
    return RequestDelta("r-0", None, [1], [2], text, "stop" if finished else None, finished, RequestMetrics())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, len(OUTPUT) - 1), max_size=12, unique=True))
def test_streamed_chunks_assemble_in_the_openai_client_to_content_and_calls(cuts):
    fmt = ChatFormat(SimpleNamespace(settings=SimpleNamespace(model_name="m")), tool_use=ToolUse(TOOLS))
    job = Job(0, 0, [1], SamplingParams())
    state = ChatCompletionStreamState()
    pieces = [OUTPUT[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(OUTPUT)])]
    chunks = fmt.opening_chunks([job]) + [fmt.chunk(job, _delta(p, i == len(pieces) - 1))
                                          for i, p in enumerate(pieces)]
    for chunk in chunks:
        if chunk is not None:
            indexes = [entry["index"] for entry in chunk["choices"][0]["delta"].get("tool_calls", [])]
            assert len(indexes) == len(set(indexes)), chunk  # one entry per call in a chunk
            state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls)


def test_a_chunk_carries_one_tool_calls_entry_per_call():
    """The id and name of a call and every argument fragment of the same chunk go in one entry (the openai
    SDK's stream helper, 1.x and 2.x, corrupts the arguments of two entries with one index)."""
    events = [ArgumentsDelta(0, '"}'), CallStarted(1, "call_b", "get_time"), ArgumentsDelta(1, '{"tz": '),
              ArgumentsDelta(1, '"UTC"'), CallStarted(2, "call_c", "get_weather")]
    assert tool_call_entries(events) == [
        {"index": 0, "function": {"arguments": '"}'}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"'}},
        {"index": 2, "id": "call_c", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]


def _chat(app, **body):
    return app.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body})


@pytest.mark.parametrize("body, param, fragment", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "more than once"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "call_x", "content": "42"}]}, "messages",
     "no earlier call"),
    ({"messages": [*USER, {"role": "tool", "content": "42"}]}, "messages", "tool_call_id"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{not json"}}},
     "response_format", "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs `json_schema`"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, "structured_outputs",
     "cannot both"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
])
def test_bad_tool_and_format_requests_are_400_naming_the_field(tiny_app, body, param, fragment):
    response = _chat(tiny_app, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"]


def test_other_apis_refuse_bad_tools_by_name(tiny_app):
    response = tiny_app.post("/v1/responses", json={"input": [
        {"type": "function_call_output", "call_id": "nope", "output": "x"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"
    response = tiny_app.post("/v1/messages", json={
        "model": "tiny", "max_tokens": 4, "messages": USER, "tools": [{"name": "f", "input_schema": {}}],
        "tool_choice": {"type": "tool", "name": "g"}})
    assert response.status_code == 400 and "'g', which is not among the tools" in response.json()["error"]["message"]
    response = tiny_app.post("/v1/completions", json={"prompt": "a", "structured_outputs": {"choice": []}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs"



BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": BAD_SCHEMA}}}, "response_format"),
    ("/v1/chat/completions", {"messages": USER, "structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                          "schema": BAD_SCHEMA}}}, "text.format"),
])
def test_a_schema_that_does_not_compile_is_blamed_on_the_field_that_sent_it(tiny_app, path, body, param):
    response = tiny_app.post(path, json={"max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: the schema does not compile: ")


def test_a_constraint_from_tools_is_blamed_on_the_tools():
    # (The tiny app's 256-token context cannot hold a tool block: the field is checked where it is chosen.)
    output = StructuredOutputsParams(json=BAD_SCHEMA)
    assert ToolUse(TOOLS, ToolChoice("required")).constraint_param == "tools"
    assert ToolUse(TOOLS, ToolChoice("none"), output=output, output_param="text.format").constraint_param == \
        "text.format"
    assert ToolUse(output=output).constraint_param == "response_format"


REF_LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
# (1,000 are enough to overflow llguidance's 2,000-item parser row, and fit the tiny app's body limit)
MANY_OPTIONAL = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": REF_LOOP}}}, "response_format"),
    ("/v1/chat/completions", {"messages": USER, "structured_outputs": {"json": MANY_OPTIONAL}}, "structured_outputs"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": REF_LOOP}}},
     "text.format"),
])
def test_a_grammar_that_fails_in_its_first_tokens_is_a_400_before_any_token(tiny_app, caplog, path, body, param,
                                                                              stream):
    """llguidance compiles these and fails only at a mask (a $ref loop allows nothing, 1,000 optional properties
    overflow a parser row): refused at validation, the engine's state in the log, not in the answer."""
    with caplog.at_level(logging.WARNING):
        response = tiny_app.post(path, json={"max_tokens": 4, "stream": stream, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: the schema does not compile: ")
    assert "<state>" not in error["message"]
    assert f"its {param} does not compile" in caplog.text  # the server's log says why
