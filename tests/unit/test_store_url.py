"""A SQLite store URL says which file it is: ``sqlite:///x`` is relative to the
working directory, ``sqlite:////x`` absolute, and start-up lines show the resolved file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from millwheel.state import open_store
from millwheel.state.url_display import describe_store


def test_relative_and_absolute_sqlite_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tmp").mkdir()
    store = open_store("sqlite:///tmp/x.db")
    store.close()
    assert (tmp_path / "tmp" / "x.db").exists()  # relative to the working directory
    assert describe_store("sqlite:///tmp/x.db") == f"sqlite:///tmp/x.db (file {tmp_path}/tmp/x.db)"
    absolute = tmp_path / "abs.db"
    store = open_store(f"sqlite:///{absolute}")  # four slashes: /{absolute} starts with /
    store.close()
    assert absolute.exists()
    assert describe_store(f"sqlite:///{absolute}?synchronous=FULL").endswith(f"(file {absolute})")
    assert describe_store("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert os.getcwd() == str(tmp_path)


def test_passwords_never_shown() -> None:
    from millwheel.state.url_display import redact

    assert redact("redis://user:s3cret@10.0.0.5:6379/0") == "redis://user:***@10.0.0.5:6379/0"
    assert redact("rediss://:s3cret@h:6380/1?cluster=yes") == "rediss://:***@h:6380/1?cluster=yes"
    assert "s3cret" not in describe_store("redis://:s3cret@h:6379/0")
    assert redact("redis://h:6379/0") == "redis://h:6379/0"
