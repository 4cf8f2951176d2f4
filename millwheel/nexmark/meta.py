"""``nexmark.json``: what a generated directory holds, written by ``generate`` and read by
``queries`` (which sets a spec's files and bounds from it)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from millwheel.errors import InvalidSpecError
from millwheel.nexmark.generator import GeneratorConfig

META_FILE = "nexmark.json"


def describe(config: GeneratorConfig) -> dict[str, Any]:
    """The configuration and the bounds it implies, as ``nexmark.json`` holds them."""
    return {"config": dataclasses.asdict(config), "duration_us": config.duration_us,
            "max_disorder_us": config.max_disorder_us,
            "max_auction_length_us": config.max_auction_length_us}


def read_meta(out: Path) -> dict[str, Any]:
    """``nexmark.json`` of a generated directory."""
    path = out / META_FILE
    if not path.is_file():
        raise InvalidSpecError(f"{out}: no {META_FILE} (not written by millwheel.nexmark.generate)")
    data: dict[str, Any] = json.loads(path.read_text())
    return data

