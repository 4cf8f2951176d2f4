"""Where a Spark stage's master comes from: a flag beats the environment, which beats
the spec, which beats local[*] (``millwheel backfill --help`` says the same)."""

from __future__ import annotations

import pytest

from millwheel.spark.session import DEFAULT_MASTER, MASTER_ENV, resolve_master


def test_flag_beats_environment_beats_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MASTER_ENV, raising=False)
    assert resolve_master(None) == DEFAULT_MASTER
    assert resolve_master("spark://spec:7077") == "spark://spec:7077"
    monkeypatch.setenv(MASTER_ENV, "spark://env:7077")
    assert resolve_master("spark://spec:7077") == "spark://env:7077"
    assert resolve_master("spark://spec:7077", explicit="local[2]") == "local[2]"
    assert resolve_master(None, explicit="local[2]") == "local[2]"
