"""``millwheel state`` names a built-in operator's state fields (issue 33: state showed
as bare arrays), as the console does; user code's state is shown as stored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.service_cluster import ROOT, Cluster, wait_for

SPEC = """\
injectors: [{name: clicks, stream: clicks}]
computations:
  - name: counts
    inputs: [clicks]
    outputs: [counts]
    code: {name: window_aggregate, params: {size_us: 10000000, aggregation: count}}
"""
T0 = 1_700_000_000_000_000


def cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args, "--controller", cluster.address],
                          capture_output=True, text=True, cwd=cluster.tmp, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_state_of_a_window_aggregate_key_is_shown_with_its_fields(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        cluster.start_controller()
        cluster.start_worker()
        (tmp_path / "spec.yaml").write_text(SPEC)
        assert cli(cluster, "register", "spec.yaml").returncode == 0
        (tmp_path / "in.jsonl").write_text("".join(
            json.dumps({"key": "ann", "value": i, "timestamp": T0 + i * 1_000_000}) + "\n" for i in range(3)))
        done = cli(cluster, "inject", "in.jsonl", "--injector", "clicks")  # no watermark: the window stays open
        assert done.returncode == 0, done.stderr

        def counted() -> dict[str, object] | None:
            out = cli(cluster, "state", "counts", "ann", "--json")
            data = json.loads(out.stdout) if out.returncode == 0 else {}
            return data if data.get("exists") else None

        data = wait_for(counted, 30, "the key's state")
        labelled = data["state_labelled"]
        assert labelled["operator"] == "window_aggregate"
        [entry] = labelled["entries"]
        assert entry["fields"] == {"count": 3, "fired": False}
        assert entry["label"].startswith("window 2023-11-14 22:13:20.000")
        text = cli(cluster, "state", "counts", "ann").stdout
        assert "as window_aggregate state:" in text and "count=3, fired=False" in text, text
    finally:
        cluster.stop()
