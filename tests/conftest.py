"""Shared fixtures: fresh stores per test."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from millwheel.state.sqlite_store import SQLiteStore


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / "store.db")
    yield store
    store.close()
