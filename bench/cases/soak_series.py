"""The soak's series (one sample a minute) and what is concluded from them: growth over
the final window, the soak's target rows, the CSV and the PNG plot.

A sample is a flat dict: ``t_min`` and columns named ``FAMILY.SERIES`` (for example
``rss_mb.worker0``, ``store_mb.total``, ``rows.consumed_ids``, ``lag_s.mean``,
``rate.injected``). Families become the plot's panels.

Growth over a window is measured on a least-squares line through the window's samples,
``(line at the window's end - line at its start) / line at its start``, not from two
single samples: RSS and a SQLite WAL move up and down by a few percent from one minute
to the next (a checkpoint, a garbage collection), and one sample must not decide the
verdict. The window is the last 20 minutes, or the last 2/3 of a shorter run (the
first third is warm-up: the consumed-ID table and the Bloom filters fill until the
record-ID retention is reached, caches fill).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Sequence

TAIL_S = 20 * 60
GROWTH_BOUND_PCT = 10.0
LAG_MIN_RISE_S = 1.0  # lag is flat if its fitted rise is <= max(this, 10% of its mean)
FAMILIES = (  # (column prefix, panel title, y label)
    ("rss_mb.", "RSS per process", "MB"),
    ("store_mb.", "store size", "MB"),
    ("rows.consumed_ids", "consumed-ID rows", "rows"),
    ("rows.", "stream-log, state, timer, outbox rows", "rows"),
    ("lag_s.", "watermark lag (sink stage)", "s"),
    ("rate.", "records/s", "records/s"),
)


def window_s(duration_s: float, tail_s: float = TAIL_S) -> float:
    """The final window the targets are judged on: ``tail_s``, or 2/3 of a shorter run."""
    return min(tail_s, duration_s * 2 / 3)


def fit(ts: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares line ``y = a + b t`` as (a, b); None with fewer than 2 distinct times."""
    n = len(ts)
    if n < 2 or n != len(ys):
        return None
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return None
    b = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var
    return my - b * mt, b


def growth_pct(ts: Sequence[float], ys: Sequence[float]) -> float | None:
    """Growth of the fitted line from the first to the last time, in % of its start
    (None when there are fewer than 3 samples or the line starts at or below 0)."""
    if len(ts) < 3:
        return None
    line = fit(ts, ys)
    if line is None:
        return None
    a, b = line
    start, end = a + b * ts[0], a + b * ts[-1]
    if start <= 0:
        return None
    return 100.0 * (end - start) / start


def rise(ts: Sequence[float], ys: Sequence[float]) -> float | None:
    """The fitted line's change from the first to the last time (in the series' unit)."""
    if len(ts) < 3:
        return None
    line = fit(ts, ys)
    return None if line is None else line[1] * (ts[-1] - ts[0])


def columns(samples: Sequence[dict[str, Any]], prefix: str) -> list[str]:
    seen: dict[str, None] = {}
    for s in samples:
        for k in s:
            if k.startswith(prefix):
                seen[k] = None
    return list(seen)


def tail(samples: Sequence[dict[str, Any]], column: str, win_s: float) -> tuple[list[float], list[float]]:
    """(times in s, values) of ``column`` in the final ``win_s`` seconds (the window's
    first sample is the last one at or before its start, so a 20-minute window of
    minute samples has 21 points)."""
    points = [(float(s["t_min"]) * 60, float(s[column])) for s in samples
              if s.get(column) is not None and s.get("t_min") is not None]
    if not points:
        return [], []
    start = points[-1][0] - win_s
    first = max((i for i, (t, _) in enumerate(points) if t <= start + 1e-6), default=0)
    chosen = points[first:]
    return [t for t, _ in chosen], [y for _, y in chosen]


def summary(samples: Sequence[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """Per column: first, last, min, max, and over the final window its growth (% of
    the fitted start) and fitted rise."""
    win = window_s(duration_s)
    out: dict[str, Any] = {"window_s": win, "columns": {}}
    for col in columns(samples, ""):
        if col == "t_min":
            continue
        vals = [float(s[col]) for s in samples if s.get(col) is not None]
        if not vals:
            continue
        ts, ys = tail(samples, col, win)
        out["columns"][col] = {"first": vals[0], "last": vals[-1], "min": min(vals), "max": max(vals),
                               "window_growth_pct": growth_pct(ts, ys), "window_rise": rise(ts, ys)}
    return out


def _target(name: str, value: float | None, bound: float, unit: str, detail: str,
            met: bool | None = None) -> dict[str, Any]:
    if met is None:
        met = None if value is None else value <= bound
    return {"target": name, "value": value, "bound": bound, "unit": unit, "met": met, "detail": detail}


def targets(samples: Sequence[dict[str, Any]], duration_s: float, correct: dict[str, Any] | None,
            restarts: int = 0) -> list[dict[str, Any]]:
    """The soak's rows for the bench's targets table (issue 24, item 4): RSS and store
    size growth <= 10% over the final window (the worst process, the worst store
    measure), watermark lag flat there, output exact at the end."""
    win = window_s(duration_s)
    where = f"over the last {win / 60:.0f} min of {duration_s / 60:.0f}"
    rows = []
    for prefix, what in (("rss_mb.", "RSS"), ("store_mb.", "store size")):
        growths = {}
        for col in columns(samples, prefix):
            if prefix == "store_mb." and col in ("store_mb.db", "store_mb.wal"):
                continue  # judged together as store_mb.total (a checkpoint moves bytes between them)
            ts, ys = tail(samples, col, win)
            growths[col[len(prefix):]] = growth_pct(ts, ys)
        known = {k: v for k, v in growths.items() if v is not None}
        worst = max(known, key=lambda k: known[k], default=None)
        detail = ", ".join(f"{k} {v:+.1f}%" for k, v in sorted(known.items()))
        if prefix == "rss_mb." and restarts:
            detail += f"; {restarts} worker restart(s) during the run"
        rows.append(_target(f"soak: {what} growth {where} <= {GROWTH_BOUND_PCT:.0f}% "
                            f"({'worst process' if prefix == 'rss_mb.' else 'worst measure'})",
                            None if worst is None or len(known) < len(growths) else known[worst],
                            GROWTH_BOUND_PCT, "%", detail or "too few samples"))
    ts, ys = tail(samples, "lag_s.mean", win)
    lag_rise = rise(ts, ys)
    mean = sum(ys) / len(ys) if ys else 0.0
    bound = max(LAG_MIN_RISE_S, 0.1 * mean)
    rows.append(_target(f"soak: watermark lag flat {where} (fitted rise <= max(1 s, 10% of its mean))",
                        lag_rise, bound, "s",
                        f"mean {mean:.2f} s, max {max(ys, default=0.0):.2f} s" if ys else "too few samples"))
    if correct is None:
        rows.append(_target("soak: output exact at the end (every window once)", None, 0, "windows wrong",
                            "not checked"))
    else:
        wrong = correct.get("windows_wrong")
        rows.append(_target("soak: output exact at the end (every window once)", wrong, 0, "windows wrong",
                            correct.get("detail", ""), met=bool(correct.get("ok"))))
    return rows


def write_csv(path: Path, samples: Sequence[dict[str, Any]]) -> None:
    cols = columns(samples, "")
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for s in samples:
            w.writerow({k: ("" if s.get(k) is None else s[k]) for k in cols})


def plot(path: Path, samples: Sequence[dict[str, Any]], duration_s: float, title: str) -> None:
    """One panel per series family, the final window shaded (what the targets judge)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, str, list[str]]] = []
    taken: set[str] = set()
    for prefix, name, unit in FAMILIES:
        cols = [c for c in columns(samples, prefix) if c not in taken]
        taken.update(cols)
        if cols:
            panels.append((name, unit, cols))
    n = len(panels)
    ncols = 2
    nrows = (n + 1) // 2
    fig, axes = plt.subplots(nrows, ncols, figsize=(14, 3.6 * nrows), sharex=True, squeeze=False)
    win_start = (samples[-1]["t_min"] - window_s(duration_s) / 60) if samples else 0
    for ax, (name, unit, cols) in zip(axes.flat, panels, strict=False):
        for col in cols:
            pts = [(s["t_min"], s[col]) for s in samples if s.get(col) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=col.split(".", 1)[1])
        ax.axvspan(win_start, samples[-1]["t_min"] if samples else 0, color="0.92", zorder=0)
        ax.set_title(name)
        ax.set_ylabel(unit)
        top = max((float(s[c]) for s in samples for c in cols if s.get(c) is not None), default=0.0)
        ax.set_ylim(0, top * 1.3 if top > 0 else 1)  # room above the lines for the legend
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", ncol=3)
        ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("minutes")
    fig.suptitle(f"{title}\n(shaded: the window the targets judge)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
