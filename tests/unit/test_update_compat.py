"""Which updates of a windowed aggregation the controller refuses while windows are open
(services/controller/compat.py), checked against a real SQLite store holding the timers a
running range would have written: an incremental window's ``end:`` timer, a buffered
(holistic or Spark) window's ``fire:`` timer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from millwheel.record import Timer
from millwheel.state.protocol import Checkpoint, StateStore
from millwheel.state.url import open_store
from millwheel.topology import CodeRef, ComputationSpec, InputSpec, Options
from services.controller.compat import refuse_open_windows, window_change
from services.rpc.status import PreconditionError


def spec(name: str = "win", code: str = "window_aggregate", **params: Any) -> ComputationSpec:
    base = {"size_us": 2_000_000, "aggregation": "count"}
    return ComputationSpec(name, (InputSpec("events"),), ("out",), CodeRef(code, {**base, **params}),
                           Options(key_ranges=2))


def with_timer(tmp_path: Path, tag: str) -> StateStore:
    """A store whose range 1 of ``win`` holds one pending timer ``tag`` (an open window)."""
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    token = store.acquire("win", 1)
    store.checkpoint(Checkpoint("win", 1, token, 1, timer_sets=[Timer("k", tag, 1_999_999)]))
    return store


def test_a_changed_aggregation_is_a_change_of_the_open_windows() -> None:
    assert window_change(spec(), spec()) is None
    assert window_change(spec(), spec(allowed_lateness_us=5)) is None  # not the windows' state
    for changed in ({"aggregation": "sum", "field": "n"}, {"aggregation": "median", "field": "n"}):
        said = window_change(spec(), spec(**changed))
        assert said is not None and "aggregation" in said, changed
    said = window_change(spec(aggregation="percentile", field="n", p=50),
                         spec(aggregation="percentile", field="n", p=99))
    assert said is not None and said.startswith("code.params p ")
    said = window_change(spec(), spec(code="spark_aggregate"))
    assert said is not None and "other code" in said


def test_incremental_windows_open_refused_unless_drop_or_flush(tmp_path: Path) -> None:
    store = with_timer(tmp_path, "end:0")
    new = spec(aggregation="sum", field="n")
    with pytest.raises(PreconditionError, match="1 window"):
        refuse_open_windows(store, spec(), new, "refuse")
    assert refuse_open_windows(store, spec(), new, "flush") is not None  # to act on
    assert refuse_open_windows(store, spec(), new, "drop") is not None


@pytest.mark.parametrize("old", [spec(aggregation="median", field="n"),
                                 spec(aggregation="top_k", field="n", k=3),
                                 spec(code="spark_aggregate")], ids=["median", "top_k", "spark"])
def test_buffered_windows_open_refused_whatever_the_directive(tmp_path: Path, old: ComputationSpec) -> None:
    store = with_timer(tmp_path, "fire:0:0")
    new = ComputationSpec(old.name, old.inputs, old.outputs,
                          CodeRef(old.code.name, {**old.code.params, "size_us": 3_000_000}), old.options)
    with pytest.raises(PreconditionError, match="1 window"):
        refuse_open_windows(store, old, new, "refuse")
    for directive in ("drop", "flush"):
        with pytest.raises(PreconditionError, match=f"'{directive}' is not built for windows kept in buffers"):
            refuse_open_windows(store, old, new, directive)


def test_buffered_windows_all_closed_may_change(tmp_path: Path) -> None:
    store = with_timer(tmp_path, "gc:0")  # only a lateness timer left: fired, kept for corrections
    old = spec(aggregation="median", field="n")
    new = spec(aggregation="median", field="n", size_us=3_000_000)
    assert refuse_open_windows(store, old, new, "refuse") is None
