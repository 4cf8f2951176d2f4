"""The peer: Flink SQL's keyed 10 s tumbling count on the same workload.

``python -m bench.peers.peer_flink N ROUNDS [--pathway] [--bytewax]`` alternates, in fresh
processes, millwheel's local single stage (:func:`bench.run_local.backlog_case`:
SQLite, exactly-once, strong productions) and Flink SQL (and Pathway with persistence,
:mod:`bench.peers.peer_pathway`; Bytewax with recovery, :mod:`bench.peers.peer_bytewax`) on the same
N records, ROUNDS times, and prints records/s per run and the median ratios.

**Its own virtualenv.** apache-flink pins py4j, protobuf and apache-beam versions that
clash with the project's, so it is never a dependency of the project: on first use the
bench makes ``bench/.peers/flink`` (gitignored) with ``pip install apache-flink`` and runs
:mod:`bench.peers.flink_job` with that interpreter. PyFlink needs Java 11 or 17 (``JAVA_HOME``,
else the ``java`` on PATH). If either is missing, :func:`available` says why and the
suite records "not available"; it never fails the run.

**Same records.** The workload of :mod:`bench.workload` is written to a CSV file
(key, event time in ms, record ID) which Flink's filesystem connector reads; the file is
one split, so one source subtask reads it in order (as millwheel's one injector does)
and the aggregation runs at parallelism 2. Event times are floored to milliseconds
(Flink's rowtime precision): window boundaries are whole seconds, so no record changes
window.

**Same answer, same lateness.** Flink's watermark is bounded out-of-orderness of 2 s
(``WATERMARK FOR ts AS ts - INTERVAL '2' SECOND``), millwheel's source watermark is the
same bound. Both drop a record whose window has already closed (end - 1 < watermark:
millwheel's ``late_policy: drop``, Flink's window TVF drops records of fired windows).
Flink emits its watermark periodically; at its default 200 ms a few of the workload's
late records (22-32 s behind) reach a window still open, so the interval is 10 ms here:
then Flink drops exactly the late records and its per-(key, window) counts are compared
with :func:`bench.workload.check` like every millwheel run's. Flink SQL has no late-drop
counter to read, so ``late_dropped`` is not checked: exact counts over every window
already imply that exactly the late records are missing.

**Startup removed.** The JVM and its mini-cluster start once per process (``jvm_start_s``,
~7-10 s, reported, not counted). In that JVM run, in order: two warm-up jobs on a tiny
file (the workload's first 1000 records: class loading, JIT; discarded), an *empty run*
on the same tiny file, the measured job, a second empty run. SQL planning and code
generation happen before ``execute_sql`` returns (``submit_s``, ~1.2-1.6 s after the
warm-ups, excluded); a job's *run* is from then to its end (``TableResult.wait()``:
scheduling, deployment, the records, the checkpoints, the final checkpoint and the
sink's file commit). The steady figure is ``N / (run - the smaller empty run)`` (the
smaller fixed cost favours Flink); ``records_per_s_raw`` is ``N / (planning + run)``.
millwheel's backlog case is timed from its runner's first step to its last (process
start, workload generation and store opening excluded), so both figures are the rate of
the processing itself.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.peers.peer_common import VENVS, prepare, venv_python, write_input
from bench.run_local import WorkloadArgs, backlog_case
from bench.workload import Workload, check

HERE = Path(__file__).resolve().parent
VENV = VENVS / "flink"
JOB = HERE / "flink_job.py"
TINY = 1000  # records in the warm-up and empty runs


def java_home() -> str | None:
    """JAVA_HOME if it holds a java, else the home of the ``java`` on PATH, else None."""
    env = os.environ.get("JAVA_HOME")
    if env and (Path(env) / "bin" / "java").exists():
        return env
    java = shutil.which("java")
    return str(Path(java).resolve().parents[1]) if java else None


def available(venv: Path = VENV, install: bool = True) -> str | None:
    """None if Flink SQL can run here (Java found, the peer's virtualenv ready), else why not."""
    if java_home() is None:
        return "no Java: PyFlink needs Java 11 or 17 (set JAVA_HOME or put java on PATH)"
    return prepare(venv, install)


def read_counts(sink: Path) -> Counter[tuple[str, int]]:
    """(key, window start in us) -> count from the committed files of a Flink CSV sink.

    Rows are ``key,"YYYY-MM-DD HH:MM:SS.fff",count`` (window start in UTC). Files whose
    name starts with a dot are in progress (not committed by a checkpoint): skipped."""
    counts: Counter[tuple[str, int]] = Counter()
    for part in sorted(sink.rglob("*")):
        if not part.is_file() or part.name.startswith("."):
            continue
        for line in part.read_text().splitlines():
            key, start, n = line.rsplit(",", 2)
            when = datetime.strptime(start.strip('"'), "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC)
            counts[(key, round(when.timestamp() * 1_000_000))] += int(n)
    return counts


def flink_case(wa: WorkloadArgs, parallelism: int = 2, checkpoint_ms: int = 1000, watermark_ms: int = 10,
               venv: Path = VENV) -> dict[str, Any]:
    """One JVM: warm-up, empty run, measured job, empty run; the measured job's output checked."""
    w = wa.build()
    with tempfile.TemporaryDirectory(prefix="bench-flink-") as tmp:
        work = Path(tmp)
        main_csv, tiny_csv = work / "main.csv", work / "tiny.csv"
        write_input(w.records, main_csv)
        write_input(w.records[:TINY], tiny_csv)
        spec = {"workdir": str(work), "parallelism": parallelism, "checkpoint_ms": checkpoint_ms,
                "watermark_ms": watermark_ms,
                "jobs": [["warmup1", str(tiny_csv)], ["warmup2", str(tiny_csv)], ["empty1", str(tiny_csv)],
                         ["main", str(main_csv)], ["empty2", str(tiny_csv)]]}
        env = {**os.environ, "JAVA_HOME": java_home() or ""}
        started = time.perf_counter()
        done = subprocess.run([str(venv_python(venv)), str(JOB), json.dumps(spec)], capture_output=True,
                              text=True, env=env, cwd=tmp)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"flink job failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        out = json.loads(done.stdout.strip().splitlines()[-1])
        jobs = {j["name"]: j for j in out["jobs"]}
        observed = read_counts(Path(jobs["main"]["sink"]))
    return summarize(w, observed, jobs, out, wall, parallelism, checkpoint_ms, watermark_ms)


def summarize(w: Workload, observed: Counter[tuple[str, int]], jobs: dict[str, dict[str, Any]],
              out: dict[str, Any], wall: float, parallelism: int, checkpoint_ms: int,
              watermark_ms: int) -> dict[str, Any]:
    """Rates from the job times; the fixed cost is the smallest empty run's (in Flink's favour)."""
    run_s = float(jobs["main"]["seconds"]) - float(jobs["main"]["submit_s"])
    empty = [float(j["seconds"]) - float(j["submit_s"]) for n, j in jobs.items() if n.startswith("empty")]
    steady = run_s - min(empty)
    if steady < run_s / 2:  # too few records: the fixed cost's noise would be most of the figure
        steady = float("nan")
    verdict = check(w, observed).as_dict()
    verdict["late_dropped_inferred"] = w.size - sum(observed.values())
    return {
        "records": w.size, "seconds": steady,
        "records_per_s": w.size / steady if steady == steady else None,  # None: run too short (use >= 300k)
        "records_per_s_raw": w.size / float(jobs["main"]["seconds"]), "run_s": run_s,
        # JVM CPU over the whole job (planning included), all threads: Flink uses both cores.
        "jvm_cpu_s": jobs["main"].get("jvm_cpu_s"),
        "records_per_cpu_s": w.size / float(jobs["main"]["jvm_cpu_s"]) if jobs["main"].get("jvm_cpu_s") else None,
        "submit_s": float(jobs["main"]["submit_s"]), "job_s": float(jobs["main"]["seconds"]),
        "empty_runs_s": empty, "jvm_start_s": out["jvm_start_s"],
        "warmup_s": [float(j["seconds"]) for n, j in jobs.items() if n.startswith("warmup")],
        "process_wall_s": wall, "peak_rss_mb": out.get("jvm_peak_rss_mb"),
        "parallelism": parallelism, "checkpoint_ms": checkpoint_ms, "watermark_ms": watermark_ms,
        "state_backend": "hashmap", "checkpointing": "EXACTLY_ONCE", "correct": verdict,
    }


def _millwheel(wa: WorkloadArgs, writer_process: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-mw-") as tmp:
        return backlog_case(wa, "single", f"sqlite:///{tmp}/case.db", True, "strong",
                            writer_process=writer_process)


def main(argv: list[str]) -> int:
    from bench.harness import in_fresh_process

    with_pathway = "--pathway" in argv
    with_bytewax = "--bytewax" in argv
    writer_process = "--writer-process" in argv  # millwheel's local runner with its writer process
    argv = [a for a in argv if a not in ("--pathway", "--bytewax", "--writer-process")]
    n = int(argv[0]) if argv else 1_000_000
    rounds = int(argv[1]) if len(argv) > 1 else 3
    if with_pathway:
        from bench.peers import peer_pathway

        why_pw = peer_pathway.available()
        if why_pw is not None:
            print(f"Pathway not available: {why_pw}")
            with_pathway = False
    if with_bytewax:
        from bench.peers import peer_bytewax

        why_bw = peer_bytewax.available()
        if why_bw is not None:
            print(f"Bytewax not available: {why_bw}")
            with_bytewax = False
    why = available()
    if why is not None:
        print(f"Flink SQL not available: {why}")
        return 0
    wa = WorkloadArgs(n, 1_000, "uniform")
    print(f"{n:,} records, uniform 1k keys, {rounds} interleaved rounds; load average {os.getloadavg()}",
          flush=True)
    mw: list[float] = []
    fl: list[float | None] = []
    pw: list[float] = []
    bw: list[float] = []
    for i in range(rounds):
        r = in_fresh_process(_millwheel, wa, writer_process)
        mw.append(r["records_per_s"])
        how = " writer process" if writer_process else ""
        print(f"round {i + 1} millwheel local single SQLite EO strong{how}: {r['records_per_s']:,.0f} rec/s "
              f"({r['seconds']:.1f} s, per CPU-s {r['records_per_cpu_s']:,.0f} of the runner, writer "
              f"process CPU {r['writer_cpu_s']:.1f} s, RSS {r['peak_rss_mb']:.0f} MB) "
              f"output {r['correct']['detail']}", flush=True)
        f = flink_case(wa)
        fl.append(f["records_per_s"])
        print(f"round {i + 1} Flink SQL: {f['records_per_s'] or float('nan'):,.0f} rec/s startup removed "
              f"(run {f['run_s']:.2f} s - empty {min(f['empty_runs_s']):.2f} s of "
              f"{[round(x, 2) for x in f['empty_runs_s']]}; planning {f['submit_s']:.1f} s excluded; with it "
              f"{f['records_per_s_raw']:,.0f} rec/s; JVM CPU {f['jvm_cpu_s']:.1f} s for the job with planning: "
              f"{f['records_per_cpu_s'] or 0:,.0f} rec per CPU-s; "
              f"JVM start {f['jvm_start_s']:.1f} s, JVM RSS {f['peak_rss_mb'] or 0:.0f} MB) "
              f"output {f['correct']['detail']}", flush=True)
        if with_pathway:
            p = peer_pathway.pathway_case(wa)
            pw.append(p["records_per_s"])
            c = p["correct"]
            print(f"round {i + 1} Pathway (persistence on): {p['records_per_s']:,.0f} rec/s ({p['seconds']:.1f} s) "
                  f"output {c['detail']}; on-time exact {c['on_time_exact']}, late counted "
                  f"{c['late_counted']:,} of {c['late_expected']:,}", flush=True)
        if with_bytewax:
            b = in_fresh_process(peer_bytewax.bytewax_case, wa, True)
            bw.append(b["records_per_s"])
            print(f"round {i + 1} Bytewax (recovery on, epoch 1 s): {b['records_per_s']:,.0f} rec/s "
                  f"({b['seconds']:.1f} s, RSS {b['peak_rss_mb']:.0f} MB) output {b['correct']['detail']}", flush=True)
    if None in fl:
        print("Flink SQL's run was too short to remove its startup: use more records (>= 300k)")
        return 0
    rates = [f for f in fl if f]
    ratio = statistics.median(m / f for m, f in zip(mw, rates, strict=True))
    print(f"median millwheel {statistics.median(mw):,.0f} rec/s, Flink SQL {statistics.median(rates):,.0f} rec/s; "
          f"median ratio millwheel/Flink {ratio:.2f}x; load average {os.getloadavg()}")
    if pw:
        print(f"median Pathway {statistics.median(pw):,.0f} rec/s; median ratio millwheel/Pathway "
              f"{statistics.median(m / p for m, p in zip(mw, pw, strict=True)):.2f}x")
    if bw:
        print(f"median Bytewax {statistics.median(bw):,.0f} rec/s; median ratio millwheel/Bytewax "
              f"{statistics.median(m / b for m, b in zip(mw, bw, strict=True)):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
