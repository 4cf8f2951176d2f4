from __future__ import annotations

import pytest

from millwheel.errors import InvalidSpecError
from millwheel.spec import computation_from_dict, computation_to_dict, topology_from_dict

GOOD = {
    "name": "counts",
    "inputs": [{"stream": "queries", "key": "json:user"}],
    "outputs": ["counts"],
    "code": {"name": "window_aggregate", "params": {"size_us": 60_000_000}},
    "options": {"late_policy": "route", "late_stream": "late", "key_ranges": 8, "productions": "weak"},
}


def test_spec_round_trips() -> None:
    spec = computation_from_dict(GOOD)
    again = computation_from_dict(computation_to_dict(spec))
    assert again == spec
    assert spec.all_outputs() == ("counts", "late")


def test_error_options_round_trip_and_the_dead_letter_stream_is_written() -> None:
    spec = computation_from_dict({**GOOD, "options": {"on_error": "skip", "max_attempts": 5}})
    assert computation_from_dict(computation_to_dict(spec)) == spec
    assert spec.written_streams() == ("counts",)  # skip: no dead letters
    spec = computation_from_dict({**GOOD, "options": {"dead_letter_stream": "bad"}})
    assert spec.options.on_error.value == "dead_letter" and spec.options.max_attempts == 3
    assert spec.written_streams() == ("counts", "bad")
    assert computation_from_dict(GOOD).dead_letter_stream == "counts.dead_letters"


@pytest.mark.parametrize("change,message", [
    ({"name": ""}, "computation: name must be a non-empty string"),
    ({"inputs": "queries"}, "inputs: must be a list"),
    ({"inputs": [{"key": "key"}]}, r"inputs\[0\]: needs a 'stream'"),
    ({"inputs": [{"stream": "q", "key": "xml:a"}]}, "key extractor 'xml:a' not understood"),
    ({"code": {"params": {}}}, "code: needs a 'name'"),
    ({"options": {"late_policy": "ignore"}}, "'ignore' is not a valid LatePolicy"),
    ({"options": {"key_ranges": 0}}, r"options\.key_ranges: must be 1\.\.4096 \(the limit"),
    ({"options": {"key_ranges": "4"}}, "key_ranges: must be an integer"),
    ({"options": {"late_policy": "route"}}, "needs a late_stream"),
    ({"options": {"exactly_twice": True}}, r"unknown options \['exactly_twice'\]"),
    ({"options": {"on_error": "ignore"}}, "'ignore' is not a valid ErrorPolicy"),
    ({"options": {"max_attempts": 0}}, "max_attempts must be an integer 1..1000, got 0"),
    ({"options": {"max_attempts": "3"}}, "max_attempts: must be an integer"),
    ({"options": {"dead_letter_stream": ""}}, "dead_letter_stream must be a non-empty stream name"),
    ({"colour": "red"}, r"unknown fields \['colour'\]"),
    ({"options": {"max_batch_seconds": 0}}, "max_batch_seconds must be > 0"),
    # Durations within a century, so every time derived from one fits in an int64.
    ({"options": {"allowed_lateness_us": 2**63 - 1}},
     r"options\.allowed_lateness_us: must be an integer 0\.\.3153600000000000 \(microseconds"),
    ({"options": {"allowed_lateness_us": -1}}, r"options\.allowed_lateness_us: must be an integer 0\.\."),
    ({"options": {"record_id_retention_us": 10**30}},
     r"options\.record_id_retention_us: must be an integer 1\.\.3153600000000000"),
    ({"options": {"record_id_retention_us": 0}}, r"options\.record_id_retention_us: must be an integer 1\.\."),
    ({"options": {"state_ttl_us": 2**63 - 1}}, "state_ttl_us must be an integer 1000..3153600000000000"),
    ({"options": {"max_batch_seconds": "60"}}, "max_batch_seconds: must be a number of seconds"),
])
def test_malformed_specs_name_the_computation_and_field(change: dict[str, object], message: str) -> None:
    bad = {**GOOD, **change}
    if "options" in change:
        bad["options"] = change["options"]
    with pytest.raises(InvalidSpecError, match=message):
        computation_from_dict(bad)


def test_an_injector_disorder_bound_is_bounded_too() -> None:
    for bad in (10**30, -1, "5", True):
        with pytest.raises(InvalidSpecError, match=r"injectors\[0\]\.max_disorder_us: must be an integer "
                                                   r"0\.\.3153600000000000"):
            topology_from_dict({"computations": [GOOD], "injectors": [
                {"name": "queries", "stream": "queries", "max_disorder_us": bad}]})


def test_topology_errors() -> None:
    with pytest.raises(InvalidSpecError, match="input stream 'nowhere' is produced by no computation or injector"):
        topology_from_dict({"computations": [{**GOOD, "inputs": ["nowhere"]}]})
    cyc = [
        {"name": "a", "inputs": ["y"], "outputs": ["x"], "code": "map", },
        {"name": "b", "inputs": ["x"], "outputs": ["y"], "code": "map"},
    ]
    with pytest.raises(InvalidSpecError, match="cycle"):
        topology_from_dict({"computations": cyc})
    with pytest.raises(InvalidSpecError, match="defined twice"):
        topology_from_dict({"computations": [GOOD, GOOD], "injectors": [{"name": "q", "stream": "queries"}]})
