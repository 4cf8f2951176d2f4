"""Reading a sink's log as a user does: ``millwheel subscribe STREAM --json`` over a log
of ``rows`` records, to the end (no ``--follow``), rows/s and the CPU of each process.

A SQLite store is written once with a logged stream of ``rows`` count-like records
(``append_log``, no pipeline run: the case measures the reading), and a topology whose
computation writes that stream, logged, is registered. Each round starts a controller
(``millwheel controller``) on that store and runs the CLI against it, its output to a
file whose lines are counted and checked (every position once, in order): the figure
is only reported for a complete, exact read. The Python client's
:meth:`~services.client.ControllerClient.subscribe` is timed the same way in this
process.

``--root DIR`` also runs each round from another checkout (its controller and its CLI:
the same case before a change), interleaved with this one, round by round, so both
see the same machine; the table gives each round's figures and the ratio of medians.

    python -m bench.cases.subscribe [--rows 1000000] [--rounds 3] [--root DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import ROOT, free_port, log, process_cpu_s
from millwheel.record import Record
from millwheel.state.url import open_store
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options
from services.client import ControllerClient
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security

STREAM = "counts"
CHUNK = 10_000
TARGET_ROWS_S = 100_000  #: issue 31's target for `millwheel subscribe` of a 1M-row log


def prepare(tmp: Path, rows: int) -> str:
    """A SQLite store holding a ``rows``-record log of ``STREAM``; its URL."""
    url = f"sqlite:///{tmp}/subscribe.db"
    store = open_store(url)
    try:
        t0 = 1_700_000_000_000_000
        for start in range(0, rows, CHUNK):
            store.append_log(STREAM, [
                Record(f"user{i % 5000:05d}",
                       json.dumps({"window_start": t0 + (i // 5000) * 10_000_000, "count": i % 97 + 1}).encode(),
                       t0 + (i // 5000) * 10_000_000 + 9_999_999, f"counts/{i}")
                for i in range(start, min(rows, start + CHUNK))])
    finally:
        store.close()
    return url


def _topology() -> tuple[ComputationSpec, InjectorSpec]:
    return (ComputationSpec("counts", (InputSpec("events"),), (STREAM,),
                            CodeRef("window_aggregate", {"size_us": 10_000_000}), Options(key_ranges=2)),
            InjectorSpec("events", "events"))


def one_round(root: Path, url: str, rows: int, tmp: Path, label: str) -> dict[str, Any]:
    """A controller from ``root`` on ``url``; its CLI's subscribe timed, then (this
    checkout only) the Python client's."""
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")}, "PYTHONPATH": str(root)}
    with open(tmp / f"controller-{label}.log", "ab") as out:
        ctl = subprocess.Popen([sys.executable, "-m", "services.cli", "controller", "--store", url, "--port",
                                str(port), "--metrics-port", "-1", "--log-level", "WARNING"], cwd=root, env=env,
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    client = ControllerClient(address, timeout_s=60, security=Security())
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                client.status()
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline or ctl.poll() is not None:
                    raise RuntimeError(f"the controller ({label}) did not start: see {tmp}") from None
                time.sleep(0.2)
        comp, inj = _topology()
        client.register_topology([spec_to_proto(comp)], [inj], log_streams=[STREAM])
        result: dict[str, Any] = {"label": label}
        sink = tmp / f"subscribe-{label}.jsonl"
        ctl_cpu = process_cpu_s(ctl.pid)
        before = os.times()
        started = time.monotonic()
        with open(sink, "wb") as f:
            done = subprocess.run([sys.executable, "-m", "services.cli", "subscribe", STREAM, "--json",
                                   "--controller", address], cwd=root, env=env, stdout=f,
                                  stderr=subprocess.PIPE, timeout=1800)
        wall = time.monotonic() - started
        after = os.times()
        if done.returncode != 0:
            raise RuntimeError(f"subscribe ({label}) failed: {done.stderr.decode()[-2000:]}")
        seqs = [json.loads(line)["seq"] for line in sink.read_text().splitlines()]
        exact = len(seqs) == rows and seqs == sorted(set(seqs))
        result.update(cli_rows_s=round(rows / wall), cli_s=round(wall, 2), exact=exact,
                      cli_cpu_s=round(after.children_user + after.children_system
                                      - before.children_user - before.children_system, 2),
                      controller_cpu_s=round(process_cpu_s(ctl.pid) - ctl_cpu, 2))
        if root == ROOT:
            ctl_cpu = process_cpu_s(ctl.pid)
            started = time.monotonic()
            n = sum(1 for _ in client.subscribe(STREAM))
            wall = time.monotonic() - started
            result.update(client_rows_s=round(n / wall) if n == rows else None,
                          client_controller_cpu_s=round(process_cpu_s(ctl.pid) - ctl_cpu, 2))
        return result
    finally:
        client.close()
        ctl.terminate()
        try:
            ctl.wait(30)
        except subprocess.TimeoutExpired:
            ctl.kill()


def case(rows: int = 1_000_000, rounds: int = 3, root: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mw-bench-sub-") as tmpdir:
        tmp = Path(tmpdir)
        log(f"subscribe: writing a {rows:,}-record log")
        url = prepare(tmp, rows)
        runs: list[dict[str, Any]] = []
        for i in range(rounds):
            for label, where in ([("before", Path(root))] if root else []) + [("after", ROOT)]:
                r = one_round(where, url, rows, tmp, label)
                r["round"] = i + 1
                log(f"  round {i + 1} {label}: {r}")
                runs.append(r)
    out: dict[str, Any] = {"rows": rows, "rounds": runs, "root": root}
    for label in ("before", "after"):
        mine = [r for r in runs if r["label"] == label]
        if mine:
            out[f"{label}_cli_rows_s"] = statistics.median(r["cli_rows_s"] for r in mine)
            out[f"{label}_exact"] = all(r["exact"] for r in mine)
    if root:
        out["ratio"] = round(out["after_cli_rows_s"] / out["before_cli_rows_s"], 2)
    out["target"] = {"what": "millwheel subscribe of a 1M-row log", "bound": f">= {TARGET_ROWS_S:,} rows/s",
                     "figure": out["after_cli_rows_s"], "met": out["after_cli_rows_s"] >= TARGET_ROWS_S
                     and out["after_exact"] and rows >= 1_000_000}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cases.subscribe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="records in the log (default 1,000,000)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, interleaved with --root's (default 3)")
    ap.add_argument("--root", help="another checkout to run the same rounds from (the 'before' of a change)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    res = case(args.rows, args.rounds, args.root)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"millwheel subscribe --json of a {res['rows']:,}-record log (SQLite), each round:")
    print(f"{'round':>5}  {'run':<7} {'rows/s':>9} {'wall s':>7} {'CLI CPU s':>9} {'ctl CPU s':>9} "
          f"{'exact':>5} {'client rows/s':>13}")
    for r in res["rounds"]:
        print(f"{r['round']:>5}  {r['label']:<7} {r['cli_rows_s']:>9,} {r['cli_s']:>7} {r['cli_cpu_s']:>9} "
              f"{r['controller_cpu_s']:>9} {str(r['exact']):>5} {r.get('client_rows_s') or '':>13}")
    if res.get("ratio"):
        print(f"median rows/s: before {res['before_cli_rows_s']:,}, after {res['after_cli_rows_s']:,} "
              f"({res['ratio']}x)")
    t = res["target"]
    print(f"target: {t['what']} {t['bound']}: {t['figure']:,} rows/s, {'met' if t['met'] else 'unmet'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
