"""schemathesis against the app's own /openapi.json (the three APIs), in process on the tiny model:
data the schema allows is served, data it forbids is refused with a 4xx, and nothing is a 5xx.

Positive data may still meet a limit of the server's state, which no schema can state: prompt +
max_tokens over the context or the KV pool, more choices than the waiting queue holds; or ask for a
feature kvserve refuses by name ("... is not supported"). Those 400s say so in their message and
pass; any other 400 for schema-valid data is a disagreement between the schema and the checks
(issue 27), and fails. Generation is short (the tiny model's context is 128
tokens), so a few hundred cases run in well under a minute.
"""

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import negative_data_rejection

from kvserve.engine.sample.sampling import SEED_RANGE
from tests.server.inprocess import assert_idle_and_intact

OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
              ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses/compact"),
              ("POST", "/v1/conversations")]
EXAMPLES = 40  # per operation and mode
TINY_APP_MAX_REQUEST_BYTES = 64 * 1024  # tests/server/conftest.py's tiny_app
# What a schema-valid request may still be refused for: the server's state, not the request's shape
# (the context, the pool, the queue, the model's vocabulary, a stored response that does not exist);
# and a feature of the API kvserve does not implement (tools, logit_bias, images, ...), which the
# schema lists as the API has it and the server refuses by name, never ignores.
# A reference between fields no schema states is checked by the server alone: a tool_choice naming a
# function the tools do not define, a tool result for a call the conversation never made, two tools
# of one name; so is a regex, grammar or JSON schema the grammar engine cannot compile.
STATE_LIMITS = ("context", "KV pool", "the server queues at most", "vocabulary", "not found", "not supported",
                # a compaction item only this server can seal; a context_management edit's beta header
                "not one this server issued", "needs the beta header",
                "not among the tools", "no earlier call", "more than once", "does not compile",
                # tools under tool_choice auto beside a choice/regex/grammar output: the rule written as an if/then
                # over structured_outputs' $ref is a schema schemathesis cannot generate from
                "only a JSON structured output can be asked for",
                # a reasoning switch on a model whose template knows no thinking; a template variable the server
                # sets itself (the schema takes any chat_template_kwargs)
                "does not reason", "chat_template_kwargs cannot set",
                # a compaction input of reasoning or tool items alone: "at least one message" is a count over
                # an anyOf of item kinds, which the schema cannot state
                "nothing to compact",
                # KV compression on a server configured so it cannot run (a refusal in engine_spec.py), or with a method
                # the engine does not run (it scores with the prompt's queries)
                "KV compression cannot run here", "scores tokens with the prompt's last queries")


def _past_seed_range(body) -> bool:
    """The generator works with float bounds past 2**53, so a "positive" seed can land one past
    [-2**63, 2**64 - 1]: the schema forbids it, and so does the server."""
    seed = body.get("seed") if isinstance(body, dict) else None
    return isinstance(seed, int) and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]


@pytest.fixture(scope="module")
def schema(tiny_app):
    return schemathesis.openapi.from_dict(tiny_app.get("/openapi.json").json())


def encoded_body(case) -> bytes:
    """The case's body as JSON (a negative case's body may be raw bytes: sent as they are)."""
    return case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()


def send(app, case):
    headers = {"Content-Type": "application/json", **(case.headers or {})}
    return app.request(case.method, case.formatted_path, content=encoded_body(case), headers=headers,
                       params=case.query or None)


@pytest.mark.parametrize("method, path", OPERATIONS)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_the_schema_and_the_server_agree(tiny_app, schema, method, path, mode):
    strategy = schema[path][method].as_strategy(generation_mode=mode)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case):
        assume(not (mode is GenerationMode.POSITIVE and _past_seed_range(case.body)))
        response = send(tiny_app, case)
        if response.status_code == 413:
            # A body past --max-request-bytes is refused before its shape is read, whatever the schema says
            # of it (schemathesis lists 413 among no rejections): the body must really be over the limit.
            assert len(encoded_body(case)) > TINY_APP_MAX_REQUEST_BYTES, response.text
            assert "--max-request-bytes" in response.text, response.text
            return
        case.validate_response(response, checks=[not_a_server_error, negative_data_rejection])
        if mode is GenerationMode.POSITIVE and response.status_code >= 400:
            assert response.status_code in (400, 404, 429), response.text
            if response.status_code == 404:  # the schema cannot know which model (conversation) this server has
                assert "does not exist" in response.text or "Conversation with id" in response.text, response.text
            elif response.status_code == 400:
                assert any(limit in response.text for limit in STATE_LIMITS), (case.body, response.text)

    check()


def test_the_app_is_healthy_after_the_schemathesis_run(tiny_app):
    assert_idle_and_intact(tiny_app)
