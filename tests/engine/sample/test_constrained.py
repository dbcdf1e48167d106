"""Structured outputs through the engine on a tiny random model (sampling at temperature 1, so the mask,
not the model, keeps the output valid): validity, forced tokens, finishes and the KV accounting."""

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.structured.params import StructuredOutputsParams as Spec
from tests.helpers import run_to_finals
from tests.server.inprocess import with_tiny_tokenizer

LONG_KEYS = {"type": "object", "additionalProperties": False,
             "properties": {f"a_rather_long_constant_property_name_{i}": {"type": "integer", "minimum": 0, "maximum": 9}
                            for i in range(3)}}
LONG_KEYS["required"] = list(LONG_KEYS["properties"])


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return with_tiny_tokenizer(tiny_models("llama-gqa"))


def make_engine(loaded, **config) -> Engine:
    config.setdefault("kv_cache_memory", 512 * 4 * 3 * 2 * 2 * 16 * 4)
    config.setdefault("block_size", 4)
    return Engine(EngineConfig(**config), loaded=loaded)


def generate(engine, prompt="Some JSON: ", **params):
    request_id = engine.add_request(prompt, SamplingParams(**params))
    return run_to_finals(engine)[request_id].outputs[0]


def leaf_schemas():
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5)),
        st.just({"type": "boolean"}),
        st.builds(lambda values: {"enum": values}, st.lists(st.text("abcxyz_", min_size=1, max_size=8),
                                                            min_size=1, max_size=4, unique=True)),
    )


def object_schemas(children):
    keys = st.text("abcdefghij_", min_size=1, max_size=10)
    return st.dictionaries(keys, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}))


def longest_output(schema: dict) -> int:
    """Characters of the longest JSON the schema allows (numbers' fractions aside): every string character
    may be a 6-character escape."""
    if "enum" in schema:
        return max(len(json.dumps(value)) for value in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return 2 + 6 * schema["maxLength"]
    if kind in ("integer", "number"):
        return 24
    if kind == "boolean":
        return 5
    if kind == "array":
        return 2 + schema["maxItems"] * (longest_output(schema["items"]) + 2)
    return 2 + sum(len(key) + 6 + longest_output(child) for key, child in schema["properties"].items())


SCHEMAS = st.recursive(
    leaf_schemas(),
    lambda children: st.one_of(
        object_schemas(children),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3))),
    max_leaves=6,
).filter(lambda schema: schema.get("type") in ("object", "array") and longest_output(schema) <= 200)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**32))
def test_sampled_json_always_validates_against_its_schema(loaded, schema, seed):
    engine = make_engine(loaded)
    out = generate(engine, "{", max_tokens=250, temperature=1.0, seed=seed, structured_outputs=Spec(json=schema))
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


@pytest.mark.parametrize("seed", range(4))
def test_regex_and_choice(loaded, seed):
    engine = make_engine(loaded)
    regex = generate(engine, max_tokens=50, temperature=1.0, seed=seed,
                     structured_outputs=Spec(regex=r"[a-c]{2,4}-[0-9]{3}"))
    assert regex.finish_reason == "stop"
    assert __import__("re").fullmatch(r"[a-c]{2,4}-[0-9]{3}", regex.text)
    choice = generate(engine, max_tokens=50, temperature=1.0, seed=seed,
                      structured_outputs=Spec(choice=["alpha", "beta", "gamma delta"]))
    assert choice.finish_reason == "stop" and choice.text in ("alpha", "beta", "gamma delta")


def test_grammar_in_lark_with_json_inside(loaded):
    engine = make_engine(loaded)
    grammar = 'start: "call " %json{"type": "object", "properties": {"x": {"type": "integer", "maximum": 9, ' \
              '"minimum": 0}}, "required": ["x"], "additionalProperties": false}'
    out = generate(engine, max_tokens=60, temperature=1.0, seed=3, structured_outputs=Spec(grammar=grammar))
    assert out.text.startswith("call ")
    assert set(json.loads(out.text[len("call "):])) == {"x"}


def test_trigger_mode_is_free_text_then_constrained(loaded):
    engine = make_engine(loaded)
    # A prompt the tiny model continues with "ab" often; an always-present trigger: the prompt's own text is
    # not output, so the trigger must be generated. Find a seed whose free text reaches it.
    spec = Spec(choice=["[done]"], trigger="e")
    for seed in range(20):
        out = generate(engine, max_tokens=80, temperature=1.0, seed=seed, structured_outputs=spec)
        if "e" in out.text:
            free, _, rest = out.text.partition("e")
            assert rest == "[done]" and out.finish_reason == "stop"
            assert "[done]" not in free
            return
    pytest.fail("no sample reached the trigger")


def steps_and_tokens(engine) -> tuple[int, list[int]]:
    """Step one request to its end: (steps, its output tokens), the block accounting checked each step."""
    engine.add_request("x", SamplingParams(max_tokens=240, temperature=1.0, seed=7,
                                           structured_outputs=Spec(json=LONG_KEYS)))
    steps, tokens = 0, []
    while engine.has_unfinished():
        steps += 1
        for delta in engine.step():
            tokens.extend(delta.new_token_ids)
        engine.check_integrity()
    return steps, tokens


def test_forced_tokens_ride_several_per_step(loaded):
    steps, tokens = steps_and_tokens(make_engine(loaded))
    jsonschema.validate(json.loads(loaded.tokenizer.decode(tokens)), LONG_KEYS)
    assert steps < len(tokens) / 4  # the keys (~130 characters) come as forced runs, not a step each

    unforced = make_engine(loaded)
    unforced.constrained.force = False
    unforced_steps, unforced_tokens = steps_and_tokens(unforced)
    jsonschema.validate(json.loads(loaded.tokenizer.decode(unforced_tokens)), LONG_KEYS)
    assert unforced_steps >= len(unforced_tokens)  # one token per step (the prompt's step included)


def test_max_tokens_mid_grammar_finishes_with_length_and_a_valid_prefix(loaded):
    engine = make_engine(loaded)
    out = generate(engine, max_tokens=20, temperature=1.0, seed=1, structured_outputs=Spec(json=LONG_KEYS))
    assert out.finish_reason == "length" and len(out.token_ids) == 20
    # Forced tokens stop short of max_tokens (room for a sampled one): the output is the forced key's start.
    assert '{"a_rather_long_constant_property_name_0": '.startswith(out.text) and len(out.text) >= 20


def test_unconstrained_requests_are_bit_identical_beside_constrained_ones(loaded):
    plain = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True, logprobs=2)]
    prompts = ["The capital", "is it"]

    def run(with_constrained: bool):
        engine = make_engine(loaded)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, plain)]
        if with_constrained:
            for seed in range(3):
                engine.add_request("{", SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                                                       structured_outputs=Spec(json=LONG_KEYS)))
        finals = run_to_finals(engine)
        return [(finals[i].outputs[0].token_ids, finals[i].outputs[0].logprobs) for i in ids]

    # Tokens are bit-identical; logprobs equal to float tolerance (a bigger batch changes the matmuls'
    # blocking, as without structured outputs: tests/engine/test_logprobs.py).
    beside, alone = run(True), run(False)
    for (tokens, logprobs), (tokens_alone, logprobs_alone) in zip(beside, alone):
        assert tokens == tokens_alone
        assert [e.logprob for e in logprobs or []] == pytest.approx([e.logprob for e in logprobs_alone or []],
                                                                    abs=1e-4)


def test_stop_strings_seeds_and_n_behave_as_unconstrained(loaded):
    engine = make_engine(loaded)
    spec = Spec(regex=r"[a-z]{10,30}")
    stopped = generate(engine, max_tokens=60, temperature=1.0, seed=11, structured_outputs=spec, stop=["e"])
    full = generate(engine, max_tokens=60, temperature=1.0, seed=11, structured_outputs=spec)
    assert full.text.startswith(stopped.text) and "e" not in stopped.text
    assert generate(engine, max_tokens=60, temperature=1.0, seed=11, structured_outputs=spec).text == full.text


def test_forced_tokens_get_the_raw_models_logprobs(loaded):
    engine = make_engine(loaded)
    out = generate(engine, max_tokens=240, temperature=1.0, seed=2, logprobs=1, structured_outputs=Spec(json=LONG_KEYS))
    assert len(out.logprobs) == len(out.token_ids)
    assert [entry.token_id for entry in out.logprobs] == out.token_ids
    assert all(entry.logprob <= 0 for entry in out.logprobs)


def test_preemption_and_abort_with_forced_tokens_pending(loaded):
    # 48 blocks of 4 tokens for 6 constrained requests of ~150 tokens: constant preemption, forced runs
    # spilling into new blocks.
    engine = make_engine(loaded, kv_cache_memory=48 * 4 * 3 * 2 * 2 * 16 * 4)
    ids = [engine.add_request("{", SamplingParams(max_tokens=180, temperature=1.0, seed=seed,
                                                  structured_outputs=Spec(json=LONG_KEYS))) for seed in range(6)]
    finals = run_to_finals(engine)
    assert engine.scheduler.num_preemptions > 0
    for request_id in ids:
        jsonschema.validate(json.loads(finals[request_id].outputs[0].text), LONG_KEYS)

    victim = engine.add_request("{", SamplingParams(max_tokens=180, temperature=1.0, seed=0,
                                                    structured_outputs=Spec(json=LONG_KEYS)))
    while not engine.scheduler.requests[victim].forced_token_ids:
        engine.step()
    engine.abort(victim)
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_a_spec_that_does_not_compile_is_refused_and_changes_nothing(loaded):
    engine = make_engine(loaded)
    params = SamplingParams(structured_outputs=Spec(grammar="start: nowhere"))
    with pytest.raises(InvalidRequestError):
        engine.validate_request([1, 2], params)
    with pytest.raises(InvalidRequestError):
        engine.add_request("x", params)
    assert not engine.has_unfinished()
    assert engine.constrained.compiler.num_compiled == 0
