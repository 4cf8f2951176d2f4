"""The service against local mode through the public CLI only, as a user runs them
(issue 31, targets 1 and 2): records/s and CPU per record, interleaved rounds.

The same files serve both modes, written once into a temporary directory:

* ``events.jsonl``: the workload (``bench.workload.generate(N, late_fraction=0.0)``,
  keyed by source partition as every three-stage figure: ``bench.pipelines.injected``),
  one JSON line ``{"key", "value", "timestamp", "id"}`` a record, the value the
  record's JSON text as it is;
* ``pipeline.json``: the three-stage pipeline of bench/pipelines.py (parse -> 10 s
  tumbling count, late records dropped -> sink ``rows``; exactly-once, strong
  productions), 2 x workers key ranges per computation and for the injector ``events``,
  which reads ``events.jsonl`` in local mode (``file``, 2 s disorder bound) and is fed
  by ``millwheel inject`` in the service (where ``file`` is not used).

A **local round** times ``millwheel run pipeline.json --store sqlite:///...
--print rows --quiet`` on a fresh SQLite file, from starting the command to its exit:
the rows it prints are the output. CPU: the process's own (its rusage once reaped).

A **service round** starts ``millwheel up --workers W --store sqlite:///... --port P
--no-auth --allow-code bench.pipelines`` (bench/cases/service.py's ``Service``: the
workers import the pipeline's map functions), registers the spec (less the injector's ``file`` and ``max_disorder_us``,
which the service refuses) with ``millwheel
register``, waits until every key range has an owner (none of that is timed), then
times ``millwheel inject events.jsonl --injector events --max-disorder-us 2000000
--done`` followed by ``millwheel subscribe rows --json --follow``, from starting
``inject`` until ``subscribe`` has printed every expected row (it is then stopped, after
0.3 s more in which a duplicate row would show). ``inject`` writes records straight to
the workers owning the injector's ranges (parallel ingestion, its default). CPU: every
process of the service during the timed part (``millwheel up`` itself, the controller,
each worker, each worker's watchdog; /proc/PID/stat before and after) plus the
``inject`` and ``subscribe`` processes (their rusage once reaped).

Each round's rows are compared with the exact expected counts
(``bench.workload.check``: every window once, nothing else). Rounds alternate the
order (local then service, service then local, ...), so both modes see the same
machine drift. Reported: each round as a JSON line, then the medians of records/s and
CPU microseconds per record of each mode, and the ratios service / local of both:
issue 31 asks for records/s >= 1.0x local mode and CPU per record <= 1.5x local mode's
(2 cores, 200k records, SQLite).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

from bench import pipelines, workload
from bench.harness import ROOT, log, process_cpu_s
from bench.workload import DISORDER_US
from millwheel.spec import computation_to_dict

INJECTOR = "events"
SINK = "rows"
TARGET_RATE_RATIO = 1.0  #: issue 31 target 1: the service's records/s >= 1.0x local mode's
TARGET_CPU_RATIO = 1.5  #: issue 31 target 2: the service's CPU per record <= 1.5x local mode's


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def _env() -> dict[str, str]:
    """The CLI's environment: this checkout importable (the pipeline's map functions), no
    MILLWHEEL_* settings of the caller's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _children_cpu_s() -> float:
    t = os.times()
    return t.children_user + t.children_system


def write_inputs(tmp: Path, n: int, key_ranges: int) -> tuple[Path, workload.Workload]:
    """``events.jsonl`` and ``pipeline.json`` in ``tmp``; (the spec's path, the workload)."""
    w = workload.generate(n, late_fraction=0.0)
    with open(tmp / "events.jsonl", "w") as f:
        for r in pipelines.injected(w.records, "three"):
            f.write(json.dumps({"key": r.key, "value": r.value.decode(), "timestamp": r.timestamp,
                                "id": r.record_id}, separators=(",", ":")) + "\n")
    topo = pipelines.topology("three", productions="strong", key_ranges=key_ranges)
    spec = {
        "computations": [computation_to_dict(c) for c in topo.computations],
        "injectors": [{"name": INJECTOR, "stream": INJECTOR, "file": "events.jsonl",
                       "max_disorder_us": DISORDER_US, "key_ranges": key_ranges}],
    }
    path = tmp / "pipeline.json"
    path.write_text(json.dumps(spec, indent=1) + "\n")
    # The service reads no client file: `register` refuses an injector's `file` and
    # `max_disorder_us` by name (`inject` sends the file, with --max-disorder-us).
    for inj in spec["injectors"]:
        inj.pop("file"), inj.pop("max_disorder_us")
    (tmp / "pipeline-service.json").write_text(json.dumps(spec, indent=1) + "\n")
    return path, w


def _counts(lines: list[str]) -> tuple[Counter[tuple[str, int]], int]:
    """(key, window start) -> count from JSON lines of the sink's rows; and how many rows."""
    counts: Counter[tuple[str, int]] = Counter()
    rows = 0
    for line in lines:
        if not line.strip():
            continue
        obj = json.loads(line)
        start, count = obj["value"].split(",", 1)
        counts[(obj["key"], int(start))] += int(count)
        rows += 1
    return counts, rows


def _verdict(w: workload.Workload, lines: list[str], errors: list[str]) -> dict[str, Any]:
    counts, rows = _counts(lines)
    v = workload.check(w, counts).as_dict()
    v["rows"] = rows
    if errors:
        v["ok"] = False
        v["detail"] = "; ".join(errors) + ("" if v["detail"] == "exact" else "; " + str(v["detail"]))
    return v


def local_round(tmp: Path, spec: Path, w: workload.Workload, label: str, timeout_s: float) -> dict[str, Any]:
    """``millwheel run`` on a fresh SQLite file, timed from start to exit."""
    n = w.size
    url = f"sqlite:///{tmp}/local-{label}.db"
    out_path = tmp / f"local-{label}.jsonl"
    errors: list[str] = []
    cpu0 = _children_cpu_s()
    with open(out_path, "wb") as out:
        started = time.monotonic()
        done = subprocess.run(_cli("run", str(spec), "--store", url, "--quiet", "--print", SINK), cwd=tmp,
                              env=_env(), stdout=out, stderr=subprocess.PIPE, timeout=timeout_s)
        wall = time.monotonic() - started
    cpu = _children_cpu_s() - cpu0
    if done.returncode != 0:
        errors.append(f"millwheel run exited {done.returncode}: {done.stderr.decode(errors='replace')[-1500:]}")
    verdict = _verdict(w, out_path.read_text().splitlines(), errors)
    return {"mode": "local", "records": n, "wall_s": round(wall, 3),
            "records_per_s": round(n / wall) if verdict["ok"] else None,
            "cpu_s": {"run": round(cpu, 3)}, "cpu_s_total": round(cpu, 3),
            "cpu_us_per_record": round(cpu / n * 1e6, 1) if verdict["ok"] else None, "correct": verdict}


class _Lines:
    """The lines a subscribe process prints, read by a thread; waits for a count."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self._stream = stream
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for raw in self._stream:
            line = raw.decode(errors="replace").rstrip("\n")
            if not line.strip():
                continue
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait(self, count: int, timeout_s: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: len(self.lines) >= count or not self._thread.is_alive(),
                                         timeout_s) and len(self.lines) >= count

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """End the subscribe process it reads (SIGTERM, then SIGKILL after 30 s), let the
        reading thread see the end of its output, and close the pipe."""
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self.join(10)
        if proc.stdout is not None:
            proc.stdout.close()


#: ``--profile DIR``: py-spy samples each service process during the timed part.
PROFILE_DIR: Path | None = None


def _profile(pids: dict[str, int], out: Path) -> list[subprocess.Popen[bytes]]:
    """One ``py-spy record --gil`` per process (controller, workers, watchdogs), writing
    ``ROLE.txt`` in collapsed-stack form (``--nonblocking``: the processes run on at
    their own pace; ``--gil``: only samples of the thread holding the interpreter count,
    as on-CPU sampling reports threads blocked in ``Condition.wait`` or ``flock`` as busy)."""
    spy = Path(sys.executable).with_name("py-spy")
    out.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([str(spy), "record", "--pid", str(pid), "--rate", "200", "--nonblocking", "--gil",
                              "--format", "raw", "--output", str(out / f"{role}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for role, pid in pids.items() if role != "up"]


def service_round(tmp: Path, spec: Path, w: workload.Workload, workers: int, label: str,
                  batch: int | None, timeout_s: float) -> dict[str, Any]:
    """``millwheel up`` + ``register`` (untimed), then ``inject --done`` and ``subscribe``
    timed until every expected row was printed."""
    from bench.cases.service import Service

    n = w.size
    expected_rows = len(workload.expected_counts(w))
    errors: list[str] = []
    lines: list[str] = []
    env = _env()
    svc_dir = tmp / f"service-{label}"
    svc_dir.mkdir()
    svc: Service | None = None
    result: dict[str, Any] = {"mode": "service", "records": n, "workers": workers}
    try:
        svc = Service(f"sqlite:///{svc_dir}/service.db", workers, svc_dir)
        reg = subprocess.run(_cli("register", str(spec.with_name("pipeline-service.json")),
                                  "--controller", svc.address), cwd=tmp, env=env,
                             capture_output=True, timeout=120)
        if reg.returncode != 0:
            raise RuntimeError(f"millwheel register exited {reg.returncode}: "
                               f"{reg.stderr.decode(errors='replace')[-1500:]}")
        svc.wait_balanced(timeout_s=120)
        pids = {**svc.pids(), "up": svc.proc.pid}
        inject_cmd = _cli("inject", str(tmp / "events.jsonl"), "--injector", INJECTOR,
                          "--max-disorder-us", str(DISORDER_US), "--done", "--controller", svc.address,
                          *(["--batch", str(batch)] if batch else []))
        spies = _profile(pids, PROFILE_DIR / label) if PROFILE_DIR is not None else []
        if PROFILE_DIR is not None:  # the inject CLI sampled from its start, under py-spy
            inject_cmd = [str(Path(sys.executable).with_name("py-spy")), "record", "--rate", "200", "--gil",
                          "--format", "raw", "--output", str(PROFILE_DIR / label / "inject.txt"), "--",
                          *inject_cmd]
        svc_cpu0 = {role: process_cpu_s(pid) for role, pid in pids.items()}
        cli_cpu0 = _children_cpu_s()
        started = time.monotonic()
        inj = subprocess.run(inject_cmd, cwd=tmp, env=env, capture_output=True, timeout=timeout_s)
        injected_s = time.monotonic() - started
        inject_cpu = _children_cpu_s() - cli_cpu0
        if inj.returncode != 0:
            raise RuntimeError(f"millwheel inject exited {inj.returncode}: "
                               f"{inj.stderr.decode(errors='replace')[-1500:]}")
        cli_cpu1 = _children_cpu_s()
        with open(svc_dir / "subscribe.err", "w+b") as err:
            sub = subprocess.Popen(_cli("subscribe", SINK, "--json", "--follow", "--controller", svc.address),
                                   cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=err)
            assert sub.stdout is not None
            reader = _Lines(sub.stdout)
            complete = reader.wait(expected_rows, max(1.0, timeout_s - injected_s))
            elapsed = time.monotonic() - started
            svc_cpu = {role: round(process_cpu_s(pid) - svc_cpu0[role], 3) for role, pid in pids.items()}
            for spy in spies:  # py-spy writes its profile on SIGINT
                spy.send_signal(signal.SIGINT)
            time.sleep(0.3)  # a duplicate row would arrive after the last expected one
            reader.stop(sub)
            subscribe_cpu = _children_cpu_s() - cli_cpu1
            lines = list(reader.lines)
            if not complete:
                err.seek(0)
                errors.append(f"subscribe printed {len(lines)} of {expected_rows} rows in time: "
                              f"{err.read().decode(errors='replace')[-800:]}")
        cpu = {**svc_cpu, "inject": round(inject_cpu, 3), "subscribe": round(subscribe_cpu, 3)}
        total = sum(cpu.values())
        busiest = max(cpu, key=lambda k: cpu[k])
        result.update(wall_s=round(elapsed, 3), inject_s=round(injected_s, 3), complete=complete,
                      inject_records_per_s=round(n / injected_s), cpu_s=cpu, cpu_s_total=round(total, 3),
                      busiest={"process": busiest, "cpu_s": cpu[busiest],
                               "share": round(cpu[busiest] / total, 3) if total else None})
    except Exception as exc:  # noqa: BLE001 - the round fails, the run goes on
        errors.append(f"{exc.__class__.__name__}: {exc}")
    finally:
        if svc is not None:
            svc.stop()
    verdict = _verdict(w, lines, errors)
    ok = verdict["ok"]
    result.update(records_per_s=round(n / result["wall_s"]) if ok else None,
                  cpu_us_per_record=round(result["cpu_s_total"] / n * 1e6, 1) if ok else None, correct=verdict)
    if not ok and svc is not None and svc.log_path.exists():
        result["up_log_tail"] = svc.log_path.read_text(errors="replace")[-2000:]
    return result


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def case(records: int = 200_000, rounds: int = 3, workers: int = 2, batch: int | None = None,
         timeout_s: float = 600, emit: Any = None) -> dict[str, Any]:
    """Interleaved rounds of both modes; the summary (each run under ``runs``).
    ``emit(run)`` is called as each run ends (the command prints it)."""
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mw-bench-cli-") as tmpdir:
        tmp = Path(tmpdir)
        log(f"cli vs local: writing {records:,} records and the spec ...")
        spec, w = write_inputs(tmp, records, 2 * workers)
        for i in range(rounds):
            for mode in (("local", "service") if i % 2 == 0 else ("service", "local")):
                label = f"{i + 1}"
                t0 = time.monotonic()
                if mode == "local":
                    r = local_round(tmp, spec, w, label, timeout_s)
                else:
                    r = service_round(tmp, spec, w, workers, label, batch, timeout_s)
                r["round"] = i + 1
                runs.append(r)
                log(f"  round {i + 1} {mode}: {r.get('records_per_s') or 0:,.0f} records/s, "
                    f"{r.get('cpu_us_per_record') or 0:,.0f} CPU µs/record, {r['correct']['detail'][:300]}  "
                    f"[{time.monotonic() - t0:.1f}s]")
                if emit is not None:
                    emit(r)
    out: dict[str, Any] = {"records": records, "rounds": rounds, "workers": workers, "store": "sqlite",
                           "cpus": os.cpu_count(), "runs": runs}
    for mode in ("local", "service"):
        mine = [r for r in runs if r["mode"] == mode]
        out[f"{mode}_records_per_s"] = _median([r["records_per_s"] for r in mine if r.get("records_per_s")])
        out[f"{mode}_cpu_us_per_record"] = _median([r["cpu_us_per_record"] for r in mine
                                                    if r.get("cpu_us_per_record")])
    ok = all(r["correct"]["ok"] for r in runs)
    out["rate_ratio"] = _ratio(out["service_records_per_s"], out["local_records_per_s"]) if ok else None
    out["cpu_ratio"] = _ratio(out["service_cpu_us_per_record"], out["local_cpu_us_per_record"]) if ok else None
    out["correct"] = {"ok": ok, "detail": "exact" if ok else "; ".join(
        f"round {r['round']} {r['mode']}: {r['correct']['detail'][:300]}" for r in runs if not r["correct"]["ok"])}
    return out


def summary_lines(res: dict[str, Any]) -> list[str]:
    """A markdown table of the medians and the two ratios against their bounds."""
    def f(x: float | None, unit: str = "") -> str:
        return "-" if x is None else f"{x:,.0f}{unit}"

    def ratio(x: float | None, bound: float, lower: bool) -> str:
        if x is None:
            return "-"
        met = x <= bound if lower else x >= bound
        return f"{x:.2f} ({'<=' if lower else '>='} {bound:g}: {'met' if met else 'unmet'})"

    return [
        f"CLI only, {res['records']:,} records, SQLite, {res['rounds']} interleaved round(s), "
        f"`millwheel up --workers {res['workers']}` vs `millwheel run`, {res['cpus']} CPUs here; medians:", "",
        "| mode | records/s | CPU µs/record |", "|---|---|---|",
        f"| local (`millwheel run`) | {f(res['local_records_per_s'])} | {f(res['local_cpu_us_per_record'])} |",
        f"| service (inject + subscribe) | {f(res['service_records_per_s'])} | "
        f"{f(res['service_cpu_us_per_record'])} |",
        f"| service / local | {ratio(res['rate_ratio'], TARGET_RATE_RATIO, False)} | "
        f"{ratio(res['cpu_ratio'], TARGET_CPU_RATIO, True)} |",
    ]


def markdown(entries: list[dict[str, Any]]) -> list[str]:
    """The ``cli`` section of a bench run's markdown."""
    lines = ["", "## Service vs local mode through the CLI only (bench/cases/cli_vs_local.py)", ""]
    for e in entries:
        r = e.get("result")
        if r is None:
            lines.append(f"Failed: {e.get('error', '')}")
            continue
        lines += summary_lines(r)
        for run in r["runs"]:
            if run["mode"] == "service" and run.get("cpu_s"):
                cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(run["cpu_s"].items()))
                lines += ["", f"Round {run['round']} service CPU s: {cpu}."]
        if not r["correct"]["ok"]:
            lines += ["", f"**NOT EXACT**: {r['correct']['detail']}"]
    return lines


def section(records: int, rounds: int, out: list[dict[str, Any]], run_case: Any) -> None:
    """The ``cli`` section of ``python -m bench``: one case (all its rounds) in a fresh process."""
    run_case(out, f"cli vs local {records:,} records, {rounds} round(s)",
             {"figure": "cli_vs_local", "records": records, "rounds": rounds}, case, records, rounds,
             summary=lambda r: f"local {r['local_records_per_s'] or 0:,.0f} rec/s, service "
                               f"{r['service_records_per_s'] or 0:,.0f} rec/s ({r['rate_ratio']}x); CPU/record "
                               f"{r['cpu_ratio']}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.cases.cli_vs_local", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog="Prints one JSON line per run and a summary JSON line (stdout), progress on stderr, then a "
               "markdown table of the medians. Exits 1 if any run's output was not exact or a run failed.")
    ap.add_argument("--records", type=int, default=200_000, help="records per run (default 200000)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each one run of both modes (default 3)")
    ap.add_argument("--workers", type=int, default=2, help="workers of millwheel up (default 2)")
    ap.add_argument("--batch", type=int, help="millwheel inject --batch (default: inject's own)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a run may take (default 600)")
    ap.add_argument("--json-out", metavar="PATH", help="also write the whole result as JSON to PATH")
    ap.add_argument("--profile", metavar="DIR", type=Path,
                    help="py-spy record every service process during the timed part, one "
                         "collapsed-stack file per process under DIR/service-ROUND/ (CPU samples only)")
    args = ap.parse_args(argv)
    global PROFILE_DIR
    PROFILE_DIR = args.profile
    if args.records < 1 or args.rounds < 1 or args.workers < 1 or (args.batch is not None and args.batch < 1):
        ap.error("--records, --rounds, --workers and --batch must be at least 1")
    res = case(args.records, args.rounds, args.workers, args.batch, args.timeout,
               emit=lambda r: print(json.dumps(r), flush=True))
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}), flush=True)
    print()
    print("\n".join(summary_lines(res)))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1) + "\n")
    if not res["correct"]["ok"]:
        print(f"NOT EXACT (or failed): {res['correct']['detail']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
