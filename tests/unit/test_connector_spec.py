"""The spec fields of connectors: an injector's ``source:`` and top-level ``sinks:``,
checked from their text alone, secrets never shown."""

from __future__ import annotations

from typing import Any

import pytest

from millwheel.errors import InvalidSpecError
from millwheel.spec import injector_to_dict, spec_parts, topology_from_dict, topology_parts_to_dict

PG = "postgresql://app:pa55word@db:5432/x"


def spec(source: Any = None, sinks: Any = None) -> dict[str, Any]:
    inj: dict[str, Any] = {"name": "ev", "stream": "ev"}
    if source is not None:
        inj["source"] = source
    data: dict[str, Any] = {"injectors": [inj], "computations": [
        {"name": "c", "inputs": ["ev"], "outputs": ["out"], "code": {"name": "filter", "params": {"expr": "True"}}}]}
    if sinks is not None:
        data["sinks"] = sinks
    return data


@pytest.mark.parametrize("source,message", [
    ({"type": "kafka", "url": "x"}, "injectors[0].source.type: must be one of ['files', 'nats-jetstream', "
                                    "'redis-stream'], got 'kafka'"),
    ({"type": "redis-stream", "url": "redis://h/0"}, "injectors[0].source: a redis-stream needs ['stream']"),
    ({"type": "redis-stream", "url": "http://u:pw@h", "stream": "s"},
     "injectors[0].source.url: a redis-stream URL starts with redis:// or rediss://, got 'http://u:***@h'"),
    ({"type": "redis-stream", "url": "redis://h/0", "stream": "s", "until": "later"},
     "injectors[0].source.until: 'end'"),
    ({"type": "redis-stream", "url": "redis://h/0", "stream": "s", "idle_timeout_us": -1},
     "injectors[0].source.idle_timeout_us: must be an integer"),
    ({"type": "redis-stream", "url": "redis://h/0", "stream": "s", "fields": {"nope": "x"}},
     "injectors[0].source.fields: maps"),
    ({"type": "redis-stream", "url": "redis://h/0", "stream": "x" * 5000}, "injectors[0].source.stream: must be"),
    ("events", "injectors[0].source: must be a mapping with a 'type'"),
])
def test_bad_sources_are_refused_naming_the_field(source: Any, message: str) -> None:
    with pytest.raises(InvalidSpecError) as err:
        spec_parts(spec(source))
    assert message in str(err.value)


@pytest.mark.parametrize("sinks,message", [
    ([{"stream": "out", "type": "postgres", "url": PG}], "sinks[0]: a postgres needs ['table']"),
    ([{"stream": "out", "type": "postgres", "url": "mysql://app:pa55word@db/x", "table": "t"}],
     "sinks[0].url: a postgres URL starts with postgresql:// or postgres://, got 'mysql://app:***@db/x'"),
    ([{"stream": "out", "type": "postgres", "url": PG, "table": "t", "upsert": True}],
     "sinks[0]: unknown fields ['upsert']"),
    ([{"stream": "out", "type": "postgres", "url": PG, "table": "t", "columns": {"colour": "c"}}],
     "sinks[0].columns: maps some of ['record_id'"),
    ([{"stream": "out", "type": "postgres", "url": PG, "table": "t", "columns": {"key": "k"}, "upsert_key": ["x"]}],
     "sinks[0].upsert_key: a list of columns named in 'columns'"),
    ([{"stream": "out", "type": "postgres", "url": PG, "table": "t", "upsert_key": ["key"]}],
     "sinks[0].upsert_key: a list of columns named in 'columns'"),
    ([{"stream": "out", "type": "postgres", "url": PG, "table": "t"}] * 2, "sink 'out.postgres' defined twice"),
    ([{"stream": "nowhere", "type": "postgres", "url": PG, "table": "t"}], "stream 'nowhere' is produced by no"),
    ([{"stream": "out", "type": "redis-stream", "url": "redis://h/0", "stream_": "o"}],
     "sinks[0]: a redis-stream needs ['redis_stream']"),
])
def test_bad_sinks_are_refused_naming_the_field(sinks: Any, message: str) -> None:
    with pytest.raises(InvalidSpecError) as err:
        topology_from_dict(spec(sinks=sinks))
    assert message in str(err.value)
    assert "pa55word" not in str(err.value)


def test_sources_and_sinks_round_trip_and_show_no_password() -> None:
    data = spec({"type": "redis-stream", "url": "redis://:pa55word@h/0", "stream": "s", "until": "end"},
                [{"stream": "out", "type": "postgres", "url": PG, "table": "t"}])
    topo = topology_from_dict(data)
    again = topology_from_dict({**data, **topology_parts_to_dict(topo)})
    assert again == topo  # what the registry stores and workers read back is the same
    inj = topo.injectors[0]
    assert inj.source is not None and inj.source.public()["url"] == "redis://:***@h/0"
    assert injector_to_dict(inj)["source"]["url"] == "redis://:pa55word@h/0"  # workers need it
    assert topo.sinks[0].connector.public()["url"] == "postgresql://app:***@db:5432/x"
    assert "ev.dead_letters" in topo.logged_streams() and "out" in topo.logged_streams()
