"""Templates that render tools and calls themselves (Llama 3.1's, as published): the grammar forces the
layout the template writes history calls in, and a tool loop's turn two holds the whole of turn one, prompt and
answer, on the embedded model (whose tokenizer splits a generated call otherwise than the model wrote it)."""

import copy
import dataclasses
from pathlib import Path

import pytest

from tests.server.inprocess import serve_in_process

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).parent.parent.parent / "fixtures" / "templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}


# (Qwen3's template, a thinking model's: tests/server/test_family_templates.py, with the output scripted; the
# embedded model does not think, and the grammar waits for the end of a thinking its first token `<` may open.)
@pytest.mark.parametrize("template", ["llama3_1.jinja"])
def test_turn_two_of_a_tool_loop_holds_turn_one(embedded, template):
    tokenizer = copy.copy(embedded.tokenizer)
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    loaded = dataclasses.replace(embedded, tokenizer=tokenizer)
    with serve_in_process(loaded, kv_cache_memory="64MiB") as app:
        question = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Oslo?"}]
        kwargs = {"tools": [WEATHER], "temperature": 0}
        first = app.post("/v1/chat/completions", json={
            "messages": question, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60,
            **kwargs}).json()
        assert first["choices"][0]["finish_reason"] == "tool_calls", first
        call = first["choices"][0]["message"]["tool_calls"][0]
        history = question + [{"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": call["id"], "content": "Snow"}]
        second = app.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2, **kwargs}).json()
        turn_one = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
        assert second["usage"]["prompt_tokens"] > turn_one
        # every block of turn one (its last token, the call's end, was never computed)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= (turn_one - 1) // 16 * 16
