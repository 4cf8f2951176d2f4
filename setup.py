"""Build hook: the gRPC stubs are generated from proto/ whenever the package is built.

``pip install .``, ``pip install -e .``, ``python -m build`` (sdist and wheel) all run
this file; it generates ``services/generated`` first (scripts/gen_proto.py, with
grpcio-tools from the build requirements), so an installed millwheel never needs a
script and the stubs are never committed. The repository's ``services/`` folder
installs as the package ``millwheel_service`` (pyproject.toml ``package-dir``): no
top-level ``services`` lands in site-packages.
"""

from __future__ import annotations

import runpy
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
runpy.run_path(str(ROOT / "scripts" / "gen_proto.py"))["generate"](ROOT)


def packages() -> list[str]:
    core = find_packages(where=str(ROOT), include=["millwheel", "millwheel.*"])
    service = [f"millwheel_service.{p}" for p in find_packages(where=str(ROOT / "services"))]
    # ui/static holds the console's files and no Python: a data-only package, listed so
    # that setuptools neither skips it nor prints a page of warnings about it.
    data = ["millwheel_service.ui.static"]
    return sorted({*core, "millwheel_service", "millwheel_service.generated", *service, *data})


setup(packages=packages())
