"""Issue 31's five rows of the bench's targets table: their names, figures, bounds and
met/unmet from a run's results; no figure (None) for what did not run or cannot be
measured here; a figure measured off the target's conditions shown but not judged."""

from __future__ import annotations

from typing import Any

from bench.report.targets import ratios_and_targets

NAMES = ("service >= 1.0x local (CLI, 2 cores)", "CPU per record <= 1.5x local",
         "8 workers >= 5x 1 worker and >= 3x local (16 cores)", "soak 60 min at 70%: flat",
         "subscribe >= 100k rows/s")


def _empty() -> dict[str, Any]:
    return {k: [] for k in ("throughput", "limits", "peer", "latency", "recovery", "ha", "service", "long",
                            "soak", "cli", "scale", "subscribe")}


def _rows(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["target"]: t for t in ratios_and_targets(res)[1] if t["target"] in NAMES}


def _cli(records: int, cpus: int, ok: bool = True) -> dict[str, Any]:
    return {"figure": "cli_vs_local", "result": {
        "records": records, "rounds": 3, "workers": 2, "cpus": cpus, "runs": [],
        "local_records_per_s": 40_000, "service_records_per_s": 44_000, "rate_ratio": 1.1,
        "local_cpu_us_per_record": 30.0, "service_cpu_us_per_record": 60.0, "cpu_ratio": 2.0,
        "correct": {"ok": ok, "detail": "exact" if ok else "round 1 service: 3 windows differ"}}}


def _scale(cpus: int, one: float, eight: float, local: float) -> list[dict[str, Any]]:
    def run(figure: str, rate: float, **meta: Any) -> dict[str, Any]:
        return {"figure": figure, "cpus": cpus, **meta, "result": {"records_per_s": rate, "correct": {"ok": True}}}

    return [run("local", local), run("service", one, workers=1), run("service", eight, workers=8)]


def _soak(minutes: float, load_pct: float, met: tuple[bool, ...]) -> dict[str, Any]:
    targets = [{"target": f"soak: row {i}", "value": 1.0, "bound": 2.0, "unit": "%", "met": m}
               for i, m in enumerate(met)]
    return {"figure": "soak", "result": {"minutes": minutes, "plan": {"rate": None, "load_pct": load_pct},
                                         "rate": 7_000.0, "capacity_records_per_s": 10_000.0,
                                         "targets": targets, "interrupted": False}}


def _subscribe(rows: int, rate: int, exact: bool = True) -> dict[str, Any]:
    return {"figure": "subscribe", "result": {"rows": rows, "after_cli_rows_s": rate, "after_exact": exact,
                                              "rounds": [{"label": "after", "cli_rows_s": rate}]}}


def test_not_run_rows_are_there_without_a_figure() -> None:
    rows = _rows(_empty())
    assert set(rows) == set(NAMES)
    for row in rows.values():
        assert row["value"] is None and row["met"] is None and row["note"]
    assert "not run" in rows["soak 60 min at 70%: flat"]["note"]


def test_full_run_rows_are_judged() -> None:
    res = _empty()
    res["cli"] = [_cli(200_000, 2)]
    res["scale"] = _scale(16, 10_000.0, 55_000.0, 15_000.0)
    res["soak"] = [_soak(60, 70, (True, True, False, True))]
    res["subscribe"] = [_subscribe(1_000_000, 120_000)]
    got = {n: (r["value"], r["bound"], r["met"]) for n, r in _rows(res).items()}
    assert got == {
        "service >= 1.0x local (CLI, 2 cores)": (1.1, 1.0, True),
        "CPU per record <= 1.5x local": (2.0, 1.5, False),
        "8 workers >= 5x 1 worker and >= 3x local (16 cores)": (5.5, 5.0, True),
        "soak 60 min at 70%: flat": (1, 0, False),
        "subscribe >= 100k rows/s": (120_000, 100_000, True),
    }
    # both conditions of the scale-out row: 5.5x 1 worker but only 2.75x local mode
    res["scale"] = _scale(16, 10_000.0, 55_000.0, 20_000.0)
    assert _rows(res)["8 workers >= 5x 1 worker and >= 3x local (16 cores)"]["met"] is False


def test_off_conditions_are_shown_not_judged_and_nothing_invented() -> None:
    res = _empty()
    res["cli"] = [_cli(20_000, 2)]  # a quick run's size
    res["scale"] = _scale(2, 10_000.0, 11_000.0, 30_000.0)  # a 2-core machine
    res["soak"] = [_soak(30, 50, (True, True, True, True))]  # the default soak
    res["subscribe"] = [_subscribe(100_000, 150_000)]  # a quick run's log
    rows = _rows(res)
    assert rows["service >= 1.0x local (CLI, 2 cores)"]["value"] == 1.1
    assert rows["service >= 1.0x local (CLI, 2 cores)"]["met"] is None
    assert rows["CPU per record <= 1.5x local"]["met"] is None
    scale = rows["8 workers >= 5x 1 worker and >= 3x local (16 cores)"]
    assert scale["value"] is None and scale["note"] == "not measured: 2 cores here"
    soak = rows["soak 60 min at 70%: flat"]
    assert soak["value"] is None and "30 min at 50%" in soak["note"]
    sub = rows["subscribe >= 100k rows/s"]
    assert sub["value"] == 150_000 and sub["met"] is None
    # a not exact comparison gives no figure
    res["cli"] = [_cli(200_000, 2, ok=False)]
    res["subscribe"] = [_subscribe(1_000_000, 150_000, exact=False)]
    rows = _rows(res)
    assert rows["service >= 1.0x local (CLI, 2 cores)"]["value"] is None
    assert "not exact" in rows["service >= 1.0x local (CLI, 2 cores)"]["note"]
    assert rows["subscribe >= 100k rows/s"]["value"] is None


def test_a_soak_run_alone_fills_the_soak_row_and_says_so(tmp_path: Any) -> None:
    """``python -m bench --soak-from STEM.json``: the hour's soak, run alone by
    ``python -m bench.cases.soak``, judged in another run's table, its file named."""
    import json

    import pytest

    from bench.__main__ import main
    from bench.cases.soak import entry_from

    alone = _soak(60, 70, (True, True, True, True))["result"]
    path = tmp_path / "2026-11-28-abc1234-soak-sqlite-60min.json"
    path.write_text(json.dumps({**alone, "store": "sqlite", "correct": {"ok": True}}))
    res = _empty()
    res["soak"] = [entry_from(path)]
    soak = _rows(res)["soak 60 min at 70%: flat"]
    assert (soak["value"], soak["met"]) == (0, True)
    assert "run alone: 2026-11-28-abc1234-soak-sqlite-60min.json" in soak["note"]
    lacking = tmp_path / "other.json"
    lacking.write_text(json.dumps({"rate": 1.0}))
    with pytest.raises(ValueError, match="no plan, minutes, targets, correct, store"):
        entry_from(lacking)
    for bad in (lacking, tmp_path / "missing.json"):  # refused before any section runs
        with pytest.raises(SystemExit) as exit_:
            main(["--only", "subscribe", "--soak-from", str(bad), "--out", str(tmp_path / "out")])
        assert exit_.value.code == 2
    assert not (tmp_path / "out").exists()
