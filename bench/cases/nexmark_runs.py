"""One run of each system for the Nexmark cases (bench/cases/nexmark.py per core,
bench/cases/nexmark_latency.py at 50% of capacity): the data, ``millwheel run``, the Flink
job, the service (``millwheel up`` with a query registered), the CPU of every process
(the subreaper that catches PyFlink's orphaned JVM), and what the figures were measured on.
nexmark.py's docstring says how each run is made and counted."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.harness import ROOT, log, process_cpu_s
from bench.peers import nexmark_compare as nc
from millwheel.nexmark.generate import write
from millwheel.nexmark.generator import GeneratorConfig
from millwheel.nexmark.meta import read_meta
from millwheel.nexmark.queries import write_specs

if TYPE_CHECKING:
    from bench.cases.service import Service

FLINK_PARALLELISM = 2
SERVICE_WORKERS = 2
PR_SET_CHILD_SUBREAPER = 36

# -- CPU of every process ----------------------------------------------------------------------

_reaping = False  # this process became a subreaper for the Flink runs (reap_orphans acts only then)


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux), so a JVM that
    outlives its PyFlink parent is re-parented here and its CPU reaches RUSAGE_CHILDREN.
    Only for runs with Flink: a process that embeds the case (a test session) must not
    inherit every orphan of everything it runs afterwards."""
    global _reaping
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        _reaping = bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        _reaping = False
    return _reaping


def reap_orphans(timeout_s: float = 60.0) -> int:
    """Wait for every re-parented descendant to exit and reap it (its CPU then counts in
    RUSAGE_CHILDREN); returns how many. Only called while this process has no child of
    its own running (a Popen's child would be reaped behind its back)."""
    if not _reaping:  # not a subreaper: no orphans come here, and other children are not ours to reap
        return 0
    reaped = 0
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid:
            reaped += 1
        elif time.monotonic() > deadline:
            log(f"  warning: descendants still running after {timeout_s:g} s; their CPU is not counted")
            return reaped
        else:
            time.sleep(0.05)


def children_cpu_s() -> float:
    t = os.times()
    return t.children_user + t.children_system


def cli_env() -> dict[str, str]:
    """The CLI's environment: this checkout importable, no MILLWHEEL_* settings of the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


# -- the data ----------------------------------------------------------------------------------

def write_data(where: Path, events: int, rate: int, seed: int, disorder: int) -> Path:
    """Generate ``events`` events and every query's spec rendered for them into ``where``."""
    config = GeneratorConfig(events=events, rate=rate, seed=seed, out_of_order_group_size=disorder)
    write(config, where)
    write_specs(where, where)
    return where


# -- one run of each system ------------------------------------------------------------------

def local_run(data: Path, query: str, work: Path, label: str, timeout_s: float) -> dict[str, Any]:
    """``millwheel run`` of the rendered spec on a fresh SQLite file: wall, CPU, the rows."""
    store = work / f"local-{query}-{label}.db"
    out_path = work / f"local-{query}-{label}.jsonl"
    reap_orphans()
    cpu0 = children_cpu_s()
    with open(out_path, "wb") as out:
        started = time.monotonic()
        done = subprocess.run(nc.run_command(data / f"{query}.yaml", query, f"sqlite:///{store}"), cwd=ROOT,
                              env=cli_env(), stdout=out, stderr=subprocess.PIPE, timeout=timeout_s)
        wall = time.monotonic() - started
    reap_orphans()
    cpu = children_cpu_s() - cpu0
    run: dict[str, Any] = {"system": "local", "query": query, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}
    if done.returncode != 0:
        run["error"] = f"millwheel run exited {done.returncode}: {done.stderr.decode(errors='replace')[-1500:]}"
        run["values"] = []
    else:
        run["values"] = nc.values(out_path.read_text().splitlines())
    out_path.unlink(missing_ok=True)
    for leftover in work.glob(f"local-{query}-{label}.db*"):
        leftover.unlink(missing_ok=True)
    return run


def flink_run(data: Path, query: str, work: Path, label: str, timeout_s: float) -> dict[str, Any]:
    """The Flink job for one query in a fresh JVM: wall, CPU of Python and the JVM, the rows."""
    out = work / f"flink-{query}-{label}"
    cmd, env = nc.flink_command(data, out, [query], FLINK_PARALLELISM)
    reap_orphans()
    cpu0 = children_cpu_s()
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=timeout_s)
    wall = time.monotonic() - started
    reaped = reap_orphans()
    cpu = children_cpu_s() - cpu0
    run: dict[str, Any] = {"system": "flink", "query": query, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                           "orphans_reaped": reaped}
    if done.returncode != 0:
        run["error"] = f"the Flink job exited {done.returncode}: {done.stderr[-1500:]}"
        run["rows"] = []
    else:
        report = json.loads(done.stdout.strip().splitlines()[-1])
        run["jvm_start_s"] = round(report["jvm_start_s"], 3)
        run["query_s"] = round(report["queries"][query]["seconds"], 3)
        run["rows"] = nc.read_flink(out, query)
    shutil.rmtree(out, ignore_errors=True)
    return run


def service_run(data: Path, query: str, work: Path, label: str, expected_rows: int,
                timeout_s: float) -> dict[str, Any]:
    """``millwheel up`` + ``register`` (untimed), then every table's ``inject --done``
    (concurrently) and ``subscribe`` until ``expected_rows`` rows came (timed)."""
    from bench.cases.cli_vs_local import _Lines

    meta = read_meta(data)
    spec, tables = service_spec(data, query)
    svc_dir = work / f"service-{query}-{label}"
    svc_dir.mkdir()
    env = cli_env()
    run: dict[str, Any] = {"system": "service", "query": query, "workers": SERVICE_WORKERS, "values": []}
    svc: Service | None = None
    cli = [sys.executable, "-m", "services.cli"]
    try:
        reap_orphans()
        svc = registered_service(spec, svc_dir)
        pids = {**svc.pids(), "up": svc.proc.pid}
        svc_cpu0 = {role: process_cpu_s(pid) for role, pid in pids.items()}
        cli_cpu0 = children_cpu_s()
        started = time.monotonic()
        injects = [subprocess.Popen([*cli, "inject", str(data / meta["files"][table]), "--injector", name,
                                     "--max-disorder-us", str(meta["max_disorder_us"]), "--done",
                                     "--controller", svc.address],
                                    cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                   for name, table in tables]
        for p in injects:
            _, err = p.communicate(timeout=timeout_s)
            if p.returncode != 0:
                raise RuntimeError(f"millwheel inject exited {p.returncode}: {err.decode(errors='replace')[-1500:]}")
        injected_s = time.monotonic() - started
        cli_cpu1 = children_cpu_s()
        with open(svc_dir / "subscribe.err", "w+b") as err_file:
            sub = subprocess.Popen([*cli, "subscribe", query, "--json", "--follow", "--controller", svc.address],
                                   cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err_file)
            assert sub.stdout is not None
            reader = _Lines(sub.stdout)
            complete = reader.wait(expected_rows, max(1.0, timeout_s - injected_s))
            elapsed = time.monotonic() - started
            svc_cpu = {role: round(process_cpu_s(pid) - svc_cpu0[role], 3) for role, pid in pids.items()}
            time.sleep(0.3)  # a duplicate row would arrive after the last expected one
            reader.stop(sub)
            if not complete:
                err_file.seek(0)
                run["error"] = (f"subscribe printed {len(reader.lines)} of {expected_rows} rows in time: "
                                f"{err_file.read().decode(errors='replace')[-800:]}")
        cpu = {**svc_cpu, "inject": round(cli_cpu1 - cli_cpu0, 3),
               "subscribe": round(children_cpu_s() - cli_cpu1, 3)}
        run.update(wall_s=round(elapsed, 3), inject_s=round(injected_s, 3), cpu_by_process=cpu,
                   cpu_s=round(sum(cpu.values()), 3), values=nc.values(reader.lines))
    except Exception as exc:  # noqa: BLE001 - the run fails, the case goes on
        run["error"] = f"{exc.__class__.__name__}: {exc}"
    finally:
        end_service(svc, svc_dir, run)
    return run


def end_service(svc: Service | None, svc_dir: Path, run: dict[str, Any]) -> None:
    """Stop a run's service, keep the tail of its log in ``run`` when the run failed,
    and remove its directory."""
    if svc is not None:
        svc.stop()
        if run.get("error") and svc.log_path.exists():
            run["up_log_tail"] = svc.log_path.read_text(errors="replace")[-1500:]
    shutil.rmtree(svc_dir, ignore_errors=True)


#: What the service's workers may run beside the built-in operators: the bench's pipelines
#: and q4's running aggregate (user code to the service, docs/nexmark.md).
SERVICE_ALLOW_CODE = "bench.pipelines,millwheel.nexmark.running"


def registered_service(spec: Path, svc_dir: Path) -> Service:
    """``millwheel up --workers 2`` on a fresh SQLite file in ``svc_dir``, ``millwheel
    register SPEC`` and a wait until every key range has an owner (none of it timed)."""
    from bench.cases.service import Service  # noqa: F811 - at run time (the module starts no service on import)

    svc = Service(f"sqlite:///{svc_dir}/service.db", SERVICE_WORKERS, svc_dir,
                  extra_args=("--allow-code", SERVICE_ALLOW_CODE))
    try:
        reg = subprocess.run([sys.executable, "-m", "services.cli", "register", str(spec), "--controller",
                              svc.address], cwd=ROOT, env=cli_env(), capture_output=True, timeout=120)
        if reg.returncode != 0:
            raise RuntimeError(f"millwheel register exited {reg.returncode}: "
                               f"{reg.stderr.decode(errors='replace')[-1500:]}")
        svc.wait_balanced(timeout_s=120)
    except BaseException:
        svc.stop()
        raise
    return svc


#: Why a query's spec is not registered in the service exactly as ``millwheel run`` takes it.
SERVICE_SPEC_CHANGE = ("registered with its injectors' 'file' and 'max_disorder_us' removed: the service "
                       "reads no file of the client's (`millwheel register` refuses both, by name), so "
                       "`millwheel inject FILE --injector T --max-disorder-us N --done` sends each table; the "
                       "computations are the spec's, unchanged")


def service_spec(data: Path, query: str) -> tuple[Path, list[tuple[str, str]]]:
    """The rendered spec as the service registers it (``qN.service.yaml``: see
    :data:`SERVICE_SPEC_CHANGE`), and (injector name, table) of each of its injectors."""
    import yaml

    spec = yaml.safe_load((data / f"{query}.yaml").read_text())
    tables = []
    for injector in spec.get("injectors", []):
        injector.pop("file", None)
        injector.pop("max_disorder_us", None)
        tables.append((injector["name"], injector["stream"]))
    path = data / f"{query}.service.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False, width=200))
    return path, tables


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version()}


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "millwheel", "services",
                            "bench"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return done.stdout.strip() + ("-dirty" if dirty else "")
