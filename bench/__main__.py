"""``python -m bench [--quick] [--only SECTION ...]``: millwheel's benchmark suite.

Writes ``bench/results/<date>-<commit>[-quick].json`` and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench import suite
from bench.harness import commit
from bench.report.tables import markdown
from bench.report.targets import ratios_and_targets

SECTIONS = ("limits", "throughput", "latency", "recovery", "service", "ha", "growth", "ttl", "peer", "cli",
            "scale", "subscribe", "registry", "soak", "nexmark", "nexmark-latency")
#: registry (~10 minutes), the soak (30), nexmark (~15, PyFlink's JVMs) and nexmark-latency
#: (~15): run only when asked for
DEFAULT_SECTIONS = tuple(s for s in SECTIONS if s not in ("registry", "soak", "nexmark", "nexmark-latency"))
RESULTS = Path(__file__).resolve().parent / "results"

DESCRIPTION = """\
Measure millwheel against the machine's physical limits and a peer (Bytewax), in one
run, and check every run's output against the exact expected window counts.

Sections (all but soak by default, in this order; latency uses throughput's figures):
  limits      raw Redis Lua checkpoint (batch 100/1000), grpcio bidi stream of
              100-record batches, pybloom-live adds/lookups
  throughput  records/s draining a fixed backlog: pipelines single (1 stage, 10 s
              tumbling count) and three (parse -> count -> sink), SQLite / Redis /
              Redis AOF everysec, exactly-once strong / weak / at-least-once
  latency     paced injection at 25/50/75% of that throughput: record latency,
              window-result latency, watermark lag added per node
  recovery    kill -9 of a `millwheel run` process at 50% load: time to first
              record and to steady lag; output still exact
  service     the three-stage pipeline across `millwheel up --workers 2` (SQLite,
              Redis AOF everysec): backlog through Inject to Subscribe, and
              window-result latency at 50% of that rate
  ha          the same service pipeline on a Redis Cluster (3 masters + 3
              replicas) against one Redis, AOF always, interleaved rounds: the
              ratio; and leader kill -9 with 2 controllers: time until a standby
              leads and until the next window result
  growth      one single-stage run (SQLite, EO strong, streamed workload) at
              100k, 1M and 10M records (quick: 20k, 200k): records/s, last 30%,
              peak RSS, store bytes per record; the largest over the smallest
  ttl         per-key state TTL (1 h) on vs off, interleaved rounds: the ratio
  peer        Bytewax's keyed windowed count, its recovery off and on; Flink SQL's
              (window TVF, exactly-once checkpoints every 1 s; full runs only: its
              own virtualenv bench/.peers/flink is made on first use, Java needed).
              Interleaved rounds against millwheel: python -m bench.peers.peer_flink N ROUNDS;
              Pathway with persistence (full runs only, bench/.peers/pathway)
  cli         issue 31: the public CLI only, as a user runs it: `millwheel up
              --workers 2` + register + `inject --done` + `subscribe` against
              `millwheel run` on the same files, SQLite, 200k records, 3
              interleaved rounds (quick: 20k, 1): records/s and CPU per record
              summed over every process, both ratios (bench/cases/cli_vs_local.py)
  scale       issue 31: the three stages across `millwheel up --workers W`, fed by
              max(2, W) parallel writers, SQLite, 200k records, W = 1, 2, 4, 8 up
              to half the cores (quick: 20k, W = 1, 2), and local mode beside:
              speed-up over 1 worker, x local, CPU per record (bench/cases/scale.py)
  subscribe   issue 31: `millwheel subscribe --json` of a 1M-row log, 3 rounds
              (quick: 100k rows, 1): rows/s (bench/cases/subscribe.py)
  registry    opt-in (--only registry): registry size (512/2048/8192 key ranges;
              100/500 computations with 64 KiB params) vs heartbeat latency,
              worker RSS, ClusterStatus time and worker flaps (bench/cases/registry_scale.py)
  soak        opt-in (--only soak): `millwheel up --workers 2`, three stages, at
              --soak-load % of its measured capacity (default 50) for
              --soak-minutes (default 30; quick 6):
              RSS per process, store size, consumed-ID and log rows, watermark lag
              and records/s every minute to CSV and PNG; targets: RSS and store
              growth <= 10% over the last 20 minutes, lag flat, output exact
              (alone: python -m bench.cases.soak --help; its STEM.json judged in
              another run's table with --soak-from)
  nexmark     opt-in (--only nexmark): issue 32, Nexmark q0-q5, q7, q8, q11 on
              200k generated events, local mode beside PyFlink SQL (q5, q8 also
              the service), 2 interleaved rounds (quick: 20k, 1): events/s per
              core, every output checked against Flink's (~15 minutes on 2 cores;
              alone: python -m bench.cases.nexmark --help)
  nexmark-latency
              opt-in (--only nexmark-latency): issue 32, p50/p95/max latency of
              the same queries in the service fed at 50% of each one's measured
              capacity, 30 s each (quick: q0 and q5, 15 s), output checked
              against local mode's (~15 minutes on 2 cores; alone:
              python -m bench.cases.nexmark --latency --help)

--quick takes under 3 minutes (20k-record cases, a reduced matrix); the full run
takes 20-30 minutes on 2 cores (growth's 10M run alone ~4-5;
cli, scale and subscribe together ~4, quick ~0.5). Redis cases start private redis-servers on free
ports (never the system Redis). See docs/bench.md for what each figure means.
"""


def machine() -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "unknown"
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": cpu, "nproc": str(os.cpu_count()), "memory": mem, "kernel": platform.release()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the short suite (< 3 minutes)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, metavar="SECTION",
                        help=f"run only these sections ({', '.join(SECTIONS)}; registry, soak, nexmark and "
                             "nexmark-latency only when named)")
    parser.add_argument("--soak-minutes", type=float, help="minutes of the soak section (default 30, quick 6)")
    parser.add_argument("--soak-load", type=float, metavar="PCT",
                        help="the soak's share of its measured capacity, in %% (default 50; issue 31's "
                             "target: --soak-minutes 60 --soak-load 70)")
    parser.add_argument("--soak-from", type=Path, metavar="JSON",
                        help="take the soak's rows from a soak run alone (the STEM.json that "
                             "python -m bench.cases.soak wrote) instead of running it in this run")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results directory (default {RESULTS})")
    args = parser.parse_args(argv)
    soak_entry = None
    if args.soak_from is not None:
        from bench.cases.soak import entry_from

        try:
            soak_entry = entry_from(args.soak_from)
        except ValueError as exc:
            parser.error(f"--soak-from: {exc}")
        if args.only and "soak" in args.only:
            parser.error("--soak-from takes the soak's rows from a run alone: leave soak out of --only")
    mode = suite.QUICK if args.quick else suite.FULL
    sections = set(args.only or DEFAULT_SECTIONS)
    if "latency" in sections or "recovery" in sections:
        sections.add("throughput")  # their rates are fractions of the measured throughput
    date = datetime.date.today().isoformat()
    sha = commit()
    print(f"millwheel bench ({mode.name}) at {sha}: {', '.join(s for s in SECTIONS if s in sections)}",
          file=sys.stderr)
    load_before = os.getloadavg()
    started = time.monotonic()
    results = suite.run(mode, sections, soak_minutes=args.soak_minutes, out_dir=args.out,
                        soak_load_pct=args.soak_load)
    if soak_entry is not None:
        results["soak"].append(soak_entry)
    meta = {
        "date": date, "commit": sha, "mode": mode.name, "sections": sorted(sections),
        "machine": machine(), "python": platform.python_version(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "duration_s": time.monotonic() - started,
    }
    ratios, targets = ratios_and_targets(results)
    doc = {"meta": meta, "results": results, "ratios": ratios, "targets": targets}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{date}-{sha}" + ("-quick" if args.quick else "")
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = markdown(doc)
    (args.out / f"{stem}.md").write_text(md)
    print(md)
    print(f"wrote {args.out / stem}.json and .md in {meta['duration_s']:.0f} s", file=sys.stderr)
    wrong = [e for sec in ("throughput", "latency", "recovery", "service", "ha", "long", "soak", "cli", "scale",
                           "subscribe", "nexmark", "nexmark_latency")
             for e in results.get(sec, [])
             if "result" in e and not e["result"]["correct"]["ok"]]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
