"""deploy/Dockerfile builds a working image: its own COPY and RUN steps, replayed into a
temporary directory (no Docker daemon here; tests/support/dockerfile.py), install
millwheel into a fresh virtualenv standing for the image's Python, and the command the
image runs (its ENTRYPOINT) answers ``--help`` and runs the demo.

A file the build needs but the Dockerfile does not copy fails the replay as it fails
``docker build``; a wheel built without ``setup.py`` lacks the core package, which the
demo then cannot import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.dockerfile import ImageBuild, instructions

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MILLWHEEL_"))}


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[ImageBuild, list[str]]:
    """The replayed build and the image's command (ENTRYPOINT without tini) as argv."""
    tmp = tmp_path_factory.mktemp("image")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=_env())
    build = ImageBuild(ROOT, DOCKERFILE, tmp / "rootfs", venv)
    build.run()
    entry = next(i.args for i in instructions(DOCKERFILE) if i.name == "ENTRYPOINT")
    assert entry[:2] == ["tini", "--"]
    return build, [str(venv / "bin" / entry[2]), *entry[3:]]


def test_the_build_copies_what_it_needs_and_cleans_up(image: tuple[ImageBuild, list[str]]) -> None:
    build, _ = image
    assert any(line.startswith("RUN pip install") for line in build.log), build.log
    assert not (build.rootfs / "src").exists(), "the build removes its sources"
    site = next((build.venv / "lib").glob("python3*/site-packages"))
    assert (site / "millwheel" / "__init__.py").exists() and (site / "millwheel_service" / "cli").is_dir()
    assert (site / "millwheel_service" / "generated" / "millwheel_pb2_grpc.py").exists()
    assert (site / "millwheel_service" / "ui" / "static").is_dir(), "the console's files"
    assert (site / "pyspark").is_dir(), "workers run Spark stages: the image has the spark extra"


def test_the_image_command_answers_help_and_runs_the_demo(image: tuple[ImageBuild, list[str]],
                                                         tmp_path: Path) -> None:
    _, command = image
    helped = subprocess.run([*command, "--help"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                            timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert "controller" in helped.stdout and "worker" in helped.stdout
    demo = subprocess.run([*command, "demo", "zeitgeist", "--records", "5000", "--keys", "3", "--json"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stderr
    report = json.loads(demo.stdout)
    assert report["planted"] and report["recall"] == 1.0  # 3 keys: busy enough to plant in
