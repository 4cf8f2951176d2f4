"""``millwheel run --print STREAM`` writes the log a page at a time: every record once, in
log order, across page boundaries, as the JSON line a user reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from millwheel.record import Record
from millwheel.state.sqlite_store import SQLiteStore
from services.cli.local import print_log


@pytest.mark.parametrize("page", [1, 3, 7, 10_000])
def test_every_record_once_in_log_order_whatever_the_page(tmp_path: Path, page: int,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    try:
        records = [Record(f"k{i % 4}", f"v{i}".encode(), 1_000 * i, f"id{i}") for i in range(20)]
        store.append_log("out", records[:11])
        store.append_log("out", records[11:])
        print_log(store, "out", page=page)
    finally:
        store.close()
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == [
        {"key": r.key, "value": r.value.decode(), "timestamp": r.timestamp, "id": r.record_id} for r in records]


def test_an_empty_log_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    try:
        print_log(store, "nothing", page=5)
    finally:
        store.close()
    assert capsys.readouterr().out == ""
