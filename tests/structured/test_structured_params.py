"""StructuredOutputsParams: checked when built, plain data on the wire."""

import msgpack
import pytest

from metrale.messages.sampling_params import SamplingParams, SamplingParamsError
from metrale.messages.scheduler_output import NewRequestData, SchedulerOutput
from metrale.messages.structured_outputs import (MAX_SCHEMA_DEPTH, MAX_SPEC_BYTES, StructuredOutputsError,
                                                 StructuredOutputsParams as Spec)


@pytest.mark.parametrize("fields,match", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"json_object": False}, "exactly one"),
    ({"regex": ""}, "non-empty string"),
    ({"regex": 5}, "non-empty string"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 1]}, "non-empty list"),
    ({"grammar": "  "}, "non-empty string"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "must be a JSON object"),
    ({"json": 5}, "must be a JSON object"),
    ({"json": {"enum": ["x" * (MAX_SPEC_BYTES + 1)]}}, "bytes; at most"),
    ({"regex": "a" * (MAX_SPEC_BYTES + 1)}, "bytes; at most"),
    ({"regex": "\ud800"}, "lone surrogate"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "boolean"),
])
def test_bad_specs_are_refused_naming_the_field(fields, match):
    with pytest.raises(StructuredOutputsError, match=match) as e:
        Spec(**fields)
    assert e.value.param == "structured_outputs"


def test_depth_bound():
    schema = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"type": "array", "items": schema}
    with pytest.raises(StructuredOutputsError, match="nested more than"):
        Spec(json=schema)
    Spec(json=schema["items"]["items"])


def test_equal_specs_share_a_key():
    assert Spec(json={"b": 1, "a": [1, 2]}).cache_key() == Spec(json='{"a": [1,2], "b": 1}').cache_key()
    assert Spec(json={"type": "object"}).cache_key() != Spec(json={"type": "object"},
                                                            disable_any_whitespace=True).cache_key()
    assert Spec(regex="a+").cache_key() == Spec(regex="a+", disable_any_whitespace=True).cache_key()
    assert Spec(json_object=True).schema() == {"type": "object"}


def test_sampling_params_refuse_what_the_grammar_decides():
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(ignore_eos=True, structured_outputs=Spec(regex="a"))
    assert e.value.param == "ignore_eos"
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(min_tokens=2, structured_outputs=Spec(regex="a"))
    assert e.value.param == "min_tokens"


def test_round_trips_through_the_plan_as_msgpack():
    spec = Spec(json={"type": "object", "properties": {"x": {"enum": ["a", "ü"]}}}, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.5, structured_outputs=spec)
    plan = SchedulerOutput(new_requests=[NewRequestData("r", [1, 2], 2, params, 7, [0], 0)],
                           num_scheduled_tokens={"r": 2})
    wire = msgpack.unpackb(msgpack.packb(plan.to_wire(), use_bin_type=True), raw=False, strict_map_key=False)
    back = SchedulerOutput.from_wire(wire).new_requests[0].sampling_params
    assert back.structured_outputs == spec and back.structured_outputs.cache_key() == spec.cache_key()
    assert SamplingParams.from_dict(SamplingParams().to_dict()).structured_outputs is None
    with pytest.raises(StructuredOutputsError, match="unknown field"):
        Spec.of({"regex": "a", "bogus": 1})
