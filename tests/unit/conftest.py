"""Fixtures several unit test modules share."""

from __future__ import annotations

from typing import Any

import pytest

import millwheel.spec
from millwheel.spec import computation_to_dict
from millwheel.topology import ComputationSpec


@pytest.fixture
def encoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the computations encoded to JSON, in order (``computation_to_dict``
    counted: what a registration or a heartbeat answer costs in encoding)."""
    names: list[str] = []

    def counting(spec: ComputationSpec) -> dict[str, Any]:
        names.append(spec.name)
        return computation_to_dict(spec)
    monkeypatch.setattr(millwheel.spec, "computation_to_dict", counting)
    return names
