import pytest

from kvserve.engine.sample.sampling import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.structured.params import StructuredOutputsParams


@pytest.mark.parametrize("kwargs", [
    {}, {"json": {"type": "object"}, "regex": "a+"}, {"json": "{not json"}, {"json": "[1]"},
    {"choice": []}, {"choice": ["a", ""]}, {"regex": ""}, {"grammar": "  "}, {"json_object": False},
    {"json_object": True, "trigger": ""}, {"trigger": "<tool_call>"},
])
def test_malformed_combinations_are_invalid_requests(kwargs):
    with pytest.raises(InvalidRequestError) as caught:
        StructuredOutputsParams(**kwargs)
    assert caught.value.param == "structured_outputs"


def test_each_kind_alone_is_accepted_and_named():
    assert StructuredOutputsParams(json={"type": "object"}).kind == "json"
    assert StructuredOutputsParams(json='{"type": "string"}').kind == "json"
    assert StructuredOutputsParams(regex="[a-z]+").kind == "regex"
    assert StructuredOutputsParams(choice=["yes", "no"]).kind == "choice"
    assert StructuredOutputsParams(grammar="start: \"x\"").kind == "grammar"
    assert StructuredOutputsParams(json_object=True, trigger="<tool_call>").kind == "json_object"


def test_cache_key_ignores_text_form_but_keeps_property_order():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}')
    assert a.cache_key() == b.cache_key()
    assert a.cache_key() != StructuredOutputsParams(json={"type": "object"}).cache_key()
    # The output writes keys in the schema's property order: reordered properties are another grammar.
    swapped = StructuredOutputsParams(json={"type": "object", "properties": {"y": {"type": "integer"}, "x": {"type": "integer"}}})
    assert swapped.cache_key() != a.cache_key()


def test_sampling_params_carries_structured_outputs():
    spec = StructuredOutputsParams(choice=["a", "b"])
    assert SamplingParams(structured_outputs=spec).structured_outputs is spec
    assert SamplingParams().structured_outputs is None
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_outputs={"json": {}})
