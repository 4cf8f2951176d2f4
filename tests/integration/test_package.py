"""What a new user gets from ``pip install``: a wheel built from this checkout (sdist
first, then the wheel from the sdist, as ``python -m build`` does), installed into a
fresh virtual environment, used only through its ``millwheel`` command.

The build generates the gRPC stubs itself (no script), and the service layer installs
as ``millwheel_service`` (no top-level ``services`` package in site-packages). The wheel
is installed without extras, so pyspark (the optional ``spark`` extra, ~500 MB) is not
there: everything but Spark stages works, and those say how to install it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
IGNORE = shutil.ignore_patterns(".venv", ".git", "__pycache__", "generated", "build", "dist", "*.egg-info",
                                ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", "bench",
                                "millwheel-data", "*.db*")

SPARK_PIPELINE = """
injectors:
  - {name: clicks, stream: clicks, file: clicks.jsonl}
log_streams: [clicks]
computations:
  - name: counts
    inputs: [{stream: clicks, key: "json:user"}]
    outputs: [counts]
    code: {name: spark_aggregate, params: {size_us: 10000000, aggregation: count}}
"""
SPARK_HINT = "pip install 'millwheel[spark]'"

PIPELINE = """
injectors:
  - {name: clicks, stream: clicks}
computations:
  - name: counts
    inputs: [{stream: clicks, key: "json:user"}]
    outputs: [counts]
    code: {name: window_aggregate, params: {size_us: 10000000, aggregation: count}}
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel built from a copy of this checkout; returns its bin/."""
    tmp = tmp_path_factory.mktemp("package")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    assert not (src / "services" / "generated").exists()  # the build must make the stubs
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"),
                            str(src)], check=True, capture_output=True, text=True, timeout=300)
    (tmp / "build.log").write_text(built.stdout + built.stderr)
    wheels = list((tmp / "dist").glob("millwheel-*.whl"))
    assert len(wheels) == 1 and list((tmp / "dist").glob("millwheel-*.tar.gz"))
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True, timeout=120, env=_env())
    subprocess.run([str(tmp / "venv" / "bin" / "pip"), "install", "-q", str(wheels[0])],
                   check=True, capture_output=True, timeout=600, env=_env(), cwd=tmp)
    return tmp / "venv" / "bin"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MILLWHEEL_"))}


def run(bin_dir: Path, *args: str, cwd: Path, stdin: str | None = None, timeout: float = 120
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir / "millwheel"), *args], cwd=cwd, env=_env(), input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def test_the_wheel_has_stubs_and_no_top_level_services(installed: Path) -> None:
    site = next((installed.parent / "lib").glob("python3*/site-packages"))
    assert (site / "millwheel_service" / "generated" / "millwheel_pb2_grpc.py").exists()
    assert not (site / "services").exists()


def test_the_build_prints_no_warning_wall(installed: Path) -> None:
    """setuptools printed a page-long warning about millwheel_service.ui.static (a folder
    of console files it could import but was not told to ship)."""
    log = (installed.parent.parent / "build.log").read_text()
    assert "Package would be ignored" not in log and "absent from the `packages`" not in log, log[-3000:]
    assert not [line for line in log.splitlines() if "*" * 20 in line], "a boxed setuptools warning"


def test_help_and_version(installed: Path, tmp_path: Path) -> None:
    out = run(installed, "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for command in ("up", "register", "inject", "subscribe", "demo"):
        assert command in out.stdout
    version = run(installed, "--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("millwheel ")


def test_demo_from_the_install(installed: Path, tmp_path: Path) -> None:
    out = run(installed, "demo", "zeitgeist", "--records", "5000", "--keys", "3", "--json", cwd=tmp_path,
              timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["planted"] and report["recall"] == 1.0  # 3 keys: busy enough to plant in


def test_a_plain_install_has_no_pyspark(installed: Path, tmp_path: Path) -> None:
    probe = subprocess.run([str(installed / "python"), "-c", "import pyspark"], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'pyspark'" in probe.stderr


def test_grpcio_tools_is_a_build_tool_not_a_runtime_dependency(installed: Path, tmp_path: Path) -> None:
    """The wheel ships generated stubs: a user's install has no protoc compiler (before,
    grpcio-tools, ~9 MB with its own protobuf pins, came with every install)."""
    probe = subprocess.run([str(installed / "python"), "-c", "import grpc_tools"], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'grpc_tools'" in probe.stderr


def test_spark_stages_say_how_to_install_pyspark(installed: Path, tmp_path: Path) -> None:
    (tmp_path / "spark.yaml").write_text(SPARK_PIPELINE)
    (tmp_path / "clicks.jsonl").write_text(
        "".join(json.dumps({"key": f"c{i}", "value": {"user": "ann"}, "timestamp": 1_700_000_000_000_000 + i})
                + "\n" for i in range(3)))
    store = f"sqlite:///{tmp_path / 'spark.db'}"
    for args in (("run", "spark.yaml", "--store", store, "--quiet"),
                 ("demo", "zeitgeist", "--spark", "--records", "1000"),
                 ("backfill", "counts", "--from", "0", "--to", "1800000000000000", "--spec", "spark.yaml",
                  "--store", store)):
        out = run(installed, *args, cwd=tmp_path, timeout=120)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr, out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("millwheel: error: ") and "pyspark" in last and SPARK_HINT in last, (args, last)


def test_service_round_trip_from_the_install(installed: Path, tmp_path: Path) -> None:
    port = free_port()
    controller = f"127.0.0.1:{port}"
    # As the README's quickstart: the default store and credentials in ./millwheel-data,
    # which the client commands started in the same directory find.
    up = subprocess.Popen([str(installed / "millwheel"), "up", "--workers", "2", "--port", str(port),
                           "--metrics-port", "-1"],
                          cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while run(installed, "status", "--controller", controller, cwd=tmp_path).returncode != 0:
            assert up.poll() is None and time.monotonic() < deadline, "millwheel up did not come up"
            time.sleep(0.5)
        (tmp_path / "pipeline.yaml").write_text(PIPELINE)
        reg = run(installed, "register", "pipeline.yaml", "--controller", controller, cwd=tmp_path)
        assert reg.returncode == 0, reg.stderr
        users = ["ann", "bob", "cy"]
        lines = [json.dumps({"key": f"c{i}", "value": {"user": users[i % 3] if i < 40 else "ann"},
                             "timestamp": 1_700_000_000_000_000 + i * 500_000}) for i in range(60)]
        inj = run(installed, "inject", "--injector", "clicks", "--done", "--controller", controller,
                  cwd=tmp_path, stdin="\n".join(lines) + "\n")
        assert inj.returncode == 0, inj.stderr
        expected: Counter[tuple[str, int]] = Counter()
        for i in range(60):
            ts = 1_700_000_000_000_000 + i * 500_000
            expected[(users[i % 3] if i < 40 else "ann", ts - ts % 10_000_000)] += 1
        got: dict[tuple[str, int], int] = {}
        deadline = time.monotonic() + 60
        while got != dict(expected) and time.monotonic() < deadline:
            sub = run(installed, "subscribe", "counts", "--json", "--controller", controller, cwd=tmp_path)
            assert sub.returncode == 0, sub.stderr
            rows = [json.loads(json.loads(line)["value"]) for line in sub.stdout.splitlines() if line]
            got = {(r["key"], r["start"]): r["value"] for r in rows}
            time.sleep(0.5)
        assert got == dict(expected)
        assert (tmp_path / "millwheel-data" / "client-token").exists()  # the calls above were authenticated
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
