"""Grafana dashboards and Prometheus alert rules never drift from the code.

Every PromQL expression in deploy/grafana/dashboards/*.json (panel targets and
template variables) and deploy/prometheus/*.yml rule files is parsed for the metric
names it uses; each must be exported at /metrics by a running controller or worker
(real processes, after records, a dead letter and worker heartbeats went through).
The files themselves must be what Grafana and Prometheus load: provisioning that
points at the dashboards, one datasource uid, rules with severity and summary.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from millwheel.record import Record
from tests.integration.ui_cluster import T0, Console, clicks, start_console
from tests.support.service_cluster import ROOT, wait_for

pytestmark = pytest.mark.timeout(240)
DEPLOY = ROOT / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
RULE_FILES = [DEPLOY / "prometheus" / f for f in
              yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text()).get("rule_files", [])]
NOT_METRICS = {  # PromQL keywords and aggregation words that are not followed by "("
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (not functions, labels or variables)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors ([5m], [$__rate_interval])
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", e):
        if m.group(2) is None and m.group(1).lower() not in NOT_METRICS:
            names.add(m.group(1))
    return names


def expressions() -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every dashboard target, template query and alert rule."""
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                yield f"{path.name}: panel {panel['title']!r} {target['refId']}", target["expr"]
        for var in board.get("templating", {}).get("list", []):
            if var.get("type") == "query":
                query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
                inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
                yield f"{path.name}: variable {var['name']}", inner.group(1) if inner else query
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                yield f"{path.name}: {rule['alert']}", rule["expr"]


def exported(text: str) -> set[str]:
    """Every sample name /metrics text can carry, including labelled families that
    have no child yet (counters as NAME_total, histograms as _bucket/_sum/_count)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            base = name.removesuffix("_total")  # client versions differ in naming the family
            names |= {"counter": {base + "_total", base + "_created"},
                      "histogram": {name + s for s in ("_bucket", "_sum", "_count", "_created")},
                      }.get(kind, {name})
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, set[str]]]:
    con: Console = start_console(tmp_path_factory.mktemp("dash"), workers=1, ui=False)  # no console needed
    try:
        con.inject(clicks(60))
        con.inject([Record("poison", b"not json", T0 + 30_000_000, "poison")])
        con.cluster.wait_watermark("counts", T0 + 29_500_000)
        wait_for(lambda: con.cluster.client.describe("by_user").dead_lettered, 30,
                 "the dead letter to be counted")
        port = re.search(r"metrics port (\d+)", con.cluster.log("controller")).group(1)  # type: ignore[union-attr]
        worker = con.cluster.client.status().workers[0].metrics_address

        def scrape(address: str) -> str:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
                return str(resp.read().decode())

        # computed when scraped, from the store
        assert 'millwheel_error_records{computation="by_user",outcome="dead_lettered"} 1.0' \
            in scrape(f"127.0.0.1:{port}")
        assert re.search(r'millwheel_worker_up\{worker="[^"]+"\} 1\.0', scrape(f"127.0.0.1:{port}"))
        yield {"controller": exported(scrape(f"127.0.0.1:{port}")), "worker": exported(scrape(worker))}
    finally:
        con.cluster.stop()


def test_the_extractor_finds_metrics_and_skips_the_rest() -> None:
    assert metric_names('histogram_quantile(0.99, sum by (le, computation) '
                        '(rate(millwheel_checkpoint_seconds_bucket{computation="$c"}[$__rate_interval])))') \
        == {"millwheel_checkpoint_seconds_bucket"}
    assert metric_names("count(a_metric == 0) or vector(0)") == {"a_metric"}
    assert metric_names('changes(x[15m]) == 0 and y{node="a b"} > 0') == {"x", "y"}


def test_every_expression_uses_only_exported_metrics(metrics: dict[str, set[str]]) -> None:
    found = list(expressions())
    assert len(found) >= 25 and {w.split(":")[0] for w, _ in found} >= {
        "millwheel-overview.json", "millwheel-computation.json", "alerts.yml"}
    everything = metrics["controller"] | metrics["worker"]
    for where, expr in found:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        missing = names - everything
        assert not missing, f"{where}: {sorted(missing)} not exported by the controller or a worker"


def test_the_overview_covers_what_operators_watch() -> None:
    board = json.loads((DEPLOY / "grafana" / "dashboards" / "millwheel-overview.json").read_text())
    used = {n for p in board["panels"] for t in p["targets"] for n in metric_names(t["expr"])}
    assert {"millwheel_records_in_total", "millwheel_watermark_lag_seconds",
            "millwheel_checkpoint_seconds_bucket", "millwheel_backpressure_seconds_total",
            "millwheel_error_records", "millwheel_worker_up"} <= used


def test_the_drill_down_is_filtered_by_its_variable() -> None:
    board = json.loads((DEPLOY / "grafana" / "dashboards" / "millwheel-computation.json").read_text())
    assert [v["name"] for v in board["templating"]["list"]] == ["computation"]
    for panel in board["panels"]:
        for target in panel["targets"]:
            assert "$computation" in target["expr"], (panel["title"], target["expr"])


def test_provisioning_loads_the_dashboards_from_one_datasource() -> None:
    prov = DEPLOY / "grafana" / "provisioning"
    sources = yaml.safe_load((prov / "datasources" / "millwheel.yaml").read_text())["datasources"]
    uids = {s["uid"] for s in sources if s["type"] == "prometheus"}
    providers = yaml.safe_load((prov / "dashboards" / "millwheel.yaml").read_text())["providers"]
    assert [p["type"] for p in providers] == ["file"] and providers[0]["options"]["path"]
    boards = [json.loads(p.read_text()) for p in DASHBOARDS]
    assert len({b["uid"] for b in boards}) == len(boards) == 2
    for b in boards:
        ids = [p["id"] for p in b["panels"]]
        assert len(set(ids)) == len(ids), b["uid"]
        for p in b["panels"]:
            refs: list[Any] = [p["datasource"], *(t["datasource"] for t in p["targets"])]
            assert {r["uid"] for r in refs} <= uids, (b["uid"], p["title"])


def test_alert_rules_are_complete() -> None:
    assert [p.name for p in RULE_FILES] == ["alerts.yml"] and all(p.is_file() for p in RULE_FILES)
    rules = [r for p in RULE_FILES for g in yaml.safe_load(p.read_text())["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert {"MillwheelWatermarkLagHigh", "MillwheelDeadLettersRising", "MillwheelWorkerDown"} <= names
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"], r
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
