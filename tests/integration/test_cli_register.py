"""``millwheel register`` reads a spec file exactly as ``millwheel run`` does: a field
either does not know is refused by both with the same message, and nothing is
registered (a typo must not register something other than what the user wrote)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.service_cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]
GOOD = """injectors:
  - {name: clicks, stream: clicks, file: clicks.jsonl}
computations:
  - name: keep
    inputs: [clicks]
    outputs: [kept]
    code: {name: filter, params: {expr: "True"}}
log_streams: [kept]
"""
TYPOS = {
    # an injector's `source:` where `file:` was meant
    "injector field": (GOOD.replace("file: clicks.jsonl", "source: clicks.jsonl"),
                       "injectors[0].source: must be a mapping with a 'type'"),
    # a top-level `sink:` where `sinks:` (a list of {stream, type, ...}) was meant
    "top-level field": (GOOD + "sink: [kept]\n", "topology: unknown fields ['sink']"),
    # a sink given as a bare stream name
    "sink entry": (GOOD + "sinks: [kept]\n", "sinks[0]: needs a 'stream'"),
    "computation field": (GOOD.replace("outputs: [kept]", "output: [kept]"),
                          "computation 'keep': unknown fields ['output']"),
    "option": (GOOD.replace("outputs: [kept]", "outputs: [kept]\n    options: {key_range: 2}"),
               "computation 'keep'.options: unknown options ['key_range']"),
}


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    cluster = Cluster(tmp_path_factory.mktemp("register"))
    cluster.start_controller()
    yield cluster  # type: ignore[misc]
    cluster.stop()


@pytest.mark.parametrize("case", sorted(TYPOS))
def test_register_refuses_what_run_refuses(case: str, controller: Cluster, tmp_path: Path) -> None:
    text, message = TYPOS[case]
    (tmp_path / "spec.yaml").write_text(text)
    (tmp_path / "clicks.jsonl").write_text('{"key": "a", "value": 1, "timestamp": 1}\n')
    run = cli("run", "spec.yaml", "--store", f"sqlite:///{tmp_path / 'run.db'}", "--quiet", cwd=tmp_path)
    reg = cli("register", "spec.yaml", "--controller", controller.address, cwd=tmp_path)
    for out in (run, reg):
        assert out.returncode == 2, (out.args, out.stdout, out.stderr)
        assert out.stderr.strip().splitlines()[-1].startswith(f"millwheel: error: {message}"), out.stderr
    listed = controller.client.computations()
    assert not listed.computations and not listed.injectors, "a refused spec registered something"


def test_the_same_spec_without_the_typo_registers(controller: Cluster, tmp_path: Path) -> None:
    # (without `file:` too: the service reads no client file, and register refuses it by
    # name: tests/integration/test_files_allow.py)
    (tmp_path / "spec.yaml").write_text(GOOD.replace(", file: clicks.jsonl", ""))
    reg = cli("register", "spec.yaml", "--controller", controller.address, cwd=tmp_path)
    assert reg.returncode == 0, reg.stderr
    listed = controller.client.computations()
    assert [c.spec.name for c in listed.computations] == ["keep"]
    assert [(i.name, i.stream) for i in listed.injectors] == [("clicks", "clicks")]
