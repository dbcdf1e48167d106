"""/tokenize (vLLM's, chat form): the very prompt tokens a chat completion is computed on, tools included."""

from tests.server.openai.test_tool_requests import USER, WEATHER


def test_tokenize_counts_what_the_chat_completion_computes(tiny_app):
    tokens = tiny_app.post("/tokenize", json={"messages": USER}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == tiny_app.get("/v1/models").json()["data"][0]["max_model_len"]
    usage = tiny_app.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).json()["usage"]
    assert usage["prompt_tokens"] == tokens["count"]
    with_tools = tiny_app.post("/tokenize", json={"messages": USER, "tools": [WEATHER]}).json()
    assert with_tools["count"] > tokens["count"]  # the tool block is in the prompt


def test_tokenize_refuses_what_chat_refuses(tiny_app):
    response = tiny_app.post("/tokenize", json={"messages": [*USER, {"role": "tool", "tool_call_id": "call_x",
                                                                     "content": "42"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert tiny_app.post("/tokenize", json={"messages": USER, "model": "nope"}).status_code == 404
