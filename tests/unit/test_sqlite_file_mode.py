"""Who can read a SQLite store (issue 21, item 8): the files hold every key's state,
every record in flight and the registry. A new store's file, its -wal and -shm files
and the service's writer lock are the owner's alone (0600; they were 0644 under the
usual umask 022: any local user could read all state). A file that exists keeps the
mode it has, and one that others can read is reported."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from millwheel.record import Record
from millwheel.state import open_store
from services.store_lock import open_service_store


@pytest.fixture(params=[0o022, 0o002, 0o077])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_store_is_readable_by_its_owner_alone(tmp_path: Path, umask: int) -> None:
    db = tmp_path / "data" / "service.db"
    store = open_service_store(f"sqlite:///{db}")  # what the controller and workers open
    try:
        store.append_log("s", [Record("k", b"secret state", 1, "r1")])  # a write: the WAL exists
        files = [db, Path(f"{db}-wal"), Path(f"{db}-shm"), Path(f"{db}.writers")]
        assert {f.name: mode(f) for f in files} == {f.name: 0o600 for f in files}
    finally:
        store.close()


def test_an_existing_store_keeps_its_mode_and_a_readable_one_is_reported(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "old.db"
    open_store(f"sqlite:///{db}").close()
    db.chmod(0o640)  # e.g. a backup group the operator chose
    with caplog.at_level(logging.WARNING, logger="millwheel.store"):
        open_store(f"sqlite:///{db}").close()
    assert mode(db) == 0o640
    [warning] = [r.getMessage() for r in caplog.records if r.name == "millwheel.store"]
    assert str(db) in warning and "0640" in warning and f"chmod 600 {db}" in warning

    db.chmod(0o600)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="millwheel.store"):
        open_store(f"sqlite:///{db}").close()
    assert not [r for r in caplog.records if r.name == "millwheel.store"]
