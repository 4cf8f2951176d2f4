"""Nexmark's queries as spec files ``millwheel run`` takes: ``q0.yaml`` ... ``q11.yaml``.

Each file is a query a user can read and adapt: its SQL (Flink Nexmark's) in the
comment on top, then the pipeline of built-in operators that computes it. As written,
a spec reads ``person.jsonl``, ``auction.jsonl`` and ``bid.jsonl`` beside it and is set
for the generator's default rate (10,000 events/s) and no disorder. :func:`render` sets
a spec for a generated directory: its files, the injectors' ``max_disorder_us`` (the
data's largest disorder) and the bounds that depend on the rate (q4's longest
auction); ``python -m millwheel.nexmark.generate --specs`` writes them beside the data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from millwheel.errors import InvalidSpecError
from millwheel.nexmark.meta import read_meta
from millwheel.spec import load_spec_file

HERE = Path(__file__).resolve().parent
#: The queries, in Nexmark's order (q6 is left out: Flink SQL cannot run it either).
QUERIES = ("q0", "q1", "q2", "q3", "q4", "q5", "q7", "q8", "q11")
#: Parameters set from the data: (computation, parameter) -> the ``nexmark.json`` field.
FROM_DATA = {("q4-join", "upper_us"): "max_auction_length_us"}


def spec_path(query: str) -> Path:
    if query not in QUERIES:
        raise InvalidSpecError(f"no Nexmark query {query!r}; there are {', '.join(QUERIES)}")
    return HERE / f"{query}.yaml"


def render(query: str, data: Path) -> dict[str, Any]:
    """The spec of ``query`` set for the generated directory ``data``: injector files
    as absolute paths into it, ``max_disorder_us`` and rate-dependent bounds from its
    ``nexmark.json``."""
    meta = read_meta(data)
    spec = load_spec_file(spec_path(query))
    for injector in spec.get("injectors", []):
        table = injector["stream"]
        injector["file"] = str((data / meta["files"][table]).resolve())
        injector["max_disorder_us"] = meta["max_disorder_us"]
    for computation in spec.get("computations", []):
        for (name, param), field in FROM_DATA.items():
            if computation["name"] == name:
                computation["code"]["params"][param] = meta[field]
    if meta.get("format", "jsonl") != "jsonl":
        raise InvalidSpecError(f"{data}: millwheel's injectors read JSON lines; generate with --format jsonl")
    return spec


def write_specs(data: Path, out: Path) -> list[Path]:
    """Write every query's spec, rendered for ``data``, into ``out`` as ``qN.yaml``."""
    written = []
    for query in QUERIES:
        path = out / f"{query}.yaml"
        header = "".join(line for line in spec_path(query).read_text().splitlines(keepends=True)
                         if line.startswith("#"))
        path.write_text(header + yaml.safe_dump(render(query, data), sort_keys=False, width=200))
        written.append(path)
    return written
