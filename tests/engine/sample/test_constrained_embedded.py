"""Structured outputs on the embedded SmolLM2 (49,152 tokens, byte-level BPE) through the offline LLM API."""

import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from kvserve.structured.params import StructuredOutputsParams as Spec

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colour", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0},
                         "colour": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="64MiB")


def chat(llm, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_on_the_embedded_model(llm, temperature):
    params = SamplingParams(max_tokens=200, temperature=temperature, seed=0, structured_outputs=Spec(json=PERSON))
    outputs = llm.generate([chat(llm, "Describe a person as JSON."), chat(llm, "Who are you?")], params,
                           use_tqdm=False)
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), PERSON)


def test_regex_choice_and_json_object_on_the_embedded_model(llm):
    prompt = chat(llm, "Answer briefly.")
    regex, choice, anything = llm.generate([prompt] * 3, [
        SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=Spec(regex=r"\d{4}-\d{2}-\d{2}")),
        SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=Spec(choice=["Paris", "London"])),
        SamplingParams(max_tokens=150, temperature=0.0, structured_outputs=Spec(json_object=True)),
    ], use_tqdm=False)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", regex.outputs[0].text)
    assert choice.outputs[0].text in ("Paris", "London")
    if anything.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.outputs[0].text), dict)
    else:  # an object the model keeps extending: a valid prefix
        assert anything.outputs[0].text.startswith("{")


def test_trigger_then_tool_call_on_the_embedded_model(llm):
    schema = {"type": "object", "properties": {"name": {"enum": ["get_weather"]},
                                               "arguments": {"type": "object", "properties": {
                                                   "city": {"type": "string", "maxLength": 20}},
                                                   "required": ["city"], "additionalProperties": False}},
              "required": ["name", "arguments"], "additionalProperties": False}
    prompt = chat(llm, "Call the weather tool for Paris. Write <tool_call> then the call as JSON.") + "<tool_call>"
    (output,) = llm.generate(prompt, SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=Spec(
        json=schema, trigger="<tool_call>")), use_tqdm=False)
    text = output.outputs[0].text
    assert "<tool_call>" not in text or json.loads(text.split("<tool_call>", 1)[1])["name"] == "get_weather"
