"""What the console shows, refreshed in its own thread from the controller.

The Tracker API never reads the controller under its lock: a :class:`Snapshotter`
thread copies what it needs under the lock (registry, owners and tokens, workers and
the watermarks, exactly what ``ClusterStatus`` holds it for) and does everything slow
without it: the error reports in the store, the workers' ``/metrics`` (throughput,
checkpoints) and the tails of logged streams. Requests are then served from the last
snapshot, a plain dict replaced whole (readers never see half of one).

Health of a computation, worst first:

* ``failing``: key ranges of it cannot run at all (their code cannot be built, their
  checkpoints keep failing, or ``--allow-code`` refuses their code): retried with
  backoff, shown with the owner's error;
* ``dead-lettering``: its dead-letter count rose within the last minute;
* ``retrying``: user code is failing on items it still retries (or, under
  ``on_error: fail``, is stuck on);
* ``lagging``: its input watermark is ahead of its output watermark and the output
  watermark has not moved for ``STUCK_S`` seconds (work is waiting, nothing completes);
* ``ok`` otherwise.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from millwheel import late
from millwheel.nodes import injector_node, sink_node
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP
from millwheel.state.url_display import redact
from millwheel.topology import ComputationSpec, Topology

from ..controller.errors import error_info
from ..controller.held_by import LeastWriter
from ..controller.held_by import held_by as _held_by
from ..metrics import ControllerView, Samples, scrape
from .graph import EdgeRates, edge_rates, sink_edge
from .graph import graph as _graph
from .graph import quantile_ms as _quantile_ms
from .history import History

if TYPE_CHECKING:
    from ..controller.plane import ControlPlane

log = logging.getLogger("millwheel.ui")

INTERVAL_S = 1.0
STUCK_S = 30.0
DEAD_LETTER_WINDOW_S = 60.0
TAIL = 200  # records kept per logged stream
LOCK_WAIT_S = 0.5  # then a refresh shows the last snapshot with what a rescale under way says
EDGE_WINDOW_S = 5.0  # an edge's records/s is averaged over this long (batches arrive in bursts)
TAIL_READ = 2000  # log entries read per stream per refresh (a long log is caught up gradually)


def _lag_s(wm: int, now_us: int) -> float | None:
    if wm <= MIN_TIMESTAMP or wm >= MAX_TIMESTAMP:
        return None
    return max(0.0, (now_us - wm) / 1e6)


_NO_USAGE: dict[str, float | None] = {"rss_mb": None, "cpu_pct": None}


def _last_savepoint(store: Any) -> dict[str, Any] | None:
    """The last savepoint taken (services/controller/savepoint.py), None if none."""
    raw = store.get_meta("savepoint/last")
    try:
        return dict(json.loads(raw)) if raw else None
    except (ValueError, TypeError):
        return None


def _rescaling(store: Any) -> dict[str, int]:
    """Computation -> the key-range count a rescale under way takes it to: its journal
    entry ``rescale/NAME`` (services/controller/rescale.py) exists from the fence to the
    end, and after a rescale cut short by a store failure until it is finished (not once
    it says ``cleanup``: the new layout runs, the staging node is being deleted)."""
    out: dict[str, int] = {}
    for key, raw in store.list_meta("rescale/").items():
        try:
            entry = json.loads(raw)
            if entry.get("phase") != "cleanup":
                out[key[len("rescale/"):]] = int(entry["to"])
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return out


def _wm(wm: int) -> int | str:
    """A watermark for JSON: microseconds, or "-inf" / "+inf" at the ends."""
    return "-inf" if wm <= MIN_TIMESTAMP else "+inf" if wm >= MAX_TIMESTAMP else wm


class Snapshotter:
    def __init__(self, controller: ControlPlane, interval_s: float = INTERVAL_S,
                 least_writer: LeastWriter | None = None) -> None:
        """``least_writer``: an injector's least live writer (services/controller/writers.py),
        for what holds a watermark (``held_by``); None: writers are not named."""
        self.controller = controller
        self.interval_s = interval_s
        self.history = History(interval_s)
        self.snapshot: dict[str, Any] = {"ready": False}
        self.topology = Topology()
        self._prev: dict[tuple[str, str, tuple[tuple[str, str], ...]], tuple[float, float]] = {}
        self._cpu: dict[str, tuple[float, float]] = {}  # worker -> (time, CPU seconds) last read
        self._dead_seen: dict[str, tuple[int, float]] = {}
        self._wm_moved: dict[str, tuple[int, float]] = {}
        self._tails: dict[str, tuple[int, deque[dict[str, Any]]]] = {}
        self._edge_prev: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
        self._edge_total: dict[tuple[str, str, str], float] = {}
        self._edge_hist: dict[tuple[str, str, str], deque[tuple[float, float]]] = {}
        self.least_writer = least_writer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ui-snapshot", daemon=True)

    def start(self) -> None:
        self.refresh()
        self._thread.start()

    def stop(self) -> None:
        """Stop refreshing; returns once no refresh runs (the store may then close)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)

    def _loop(self) -> None:
        took = 0.0
        # A refresh that takes long (a big registry, a slow store) spaces the next one
        # out: the console never keeps the store or the lock busy more than a third of the time.
        while not self._stop.wait(max(self.interval_s, 2 * took)):
            started = time.monotonic()
            try:
                self.refresh()
            except Exception:
                log.exception("console snapshot failed")
            took = time.monotonic() - started

    # -- one refresh ---------------------------------------------------------------------
    def refresh(self) -> None:
        c = self.controller
        mono = time.monotonic()
        leading = c.leading()  # a standby hears no heartbeats: worker liveness is unknown there
        # Read off the lock: a savepoint's cut holds the lock for its reads (a rescale only
        # for its decisions), and this is how the console shows a rescale meanwhile.
        rescaling = _rescaling(c.store)
        if not c.lock.acquire(timeout=LOCK_WAIT_S):
            self._mark_rescaling(rescaling)
            return
        try:  # only what ClusterStatus reads under it, copied
            topo = c.registry.topology
            version = c.registry.version
            out, inputs = c.watermarks()
            owners = dict(c.assigner.units)
            units = {u: (o.worker_id, o.token) for u, o in owners.items()}
            pending = dict(c.pending)
            sinks_down = {w: dict(v) for w, v in c.sinks_down.items()}
            workers = [(w.worker_id, w.address, w.metrics_address, w.alive, w.draining,
                        w.heartbeat_age_s()) for w in c.assigner.workers.values()]
            held = self._held_by(topo, out, inputs)
        finally:
            c.lock.release()
        now_us = c.clock.now_us()
        t = time.time()
        self.topology = topo
        addr = {w[0]: w[1] for w in workers}
        samples = self._scrape([(w[0], w[2]) for w in workers if (w[3] or not leading) and w[2]])
        rates = self._rates(samples, t)
        edges = (self._edges(samples, t, {s.name: s.stream for s in topo.sinks})
                 if samples or self._edge_hist else None)
        into = edge_rates(edges)[1] if edges is not None else None  # (stream, consumer) -> records/s
        usage = self._usage(samples, t)
        comps: dict[str, Any] = {}
        producers: dict[str, set[str]] = {}  # stream -> the nodes writing it
        for inj in topo.injectors:
            producers.setdefault(inj.stream, set()).add(injector_node(inj.name))
        for spec in topo.computations:
            for stream in spec.written_streams():
                producers.setdefault(stream, set()).add(spec.name)
        for spec in topo.computations:
            wms = c.store.read_watermarks(spec.name)
            ranges = [{"range": r, "worker": units.get((spec.name, r), (None, 0))[0] or "",
                       "address": addr.get(units.get((spec.name, r), (None, 0))[0] or "", ""),
                       "token": units.get((spec.name, r), (None, 0))[1],
                       "watermark": _wm(wms.get(r, MIN_TIMESTAMP)), "pending": pending.get((spec.name, r), 0)}
                      for r in range(spec.options.key_ranges)]
            failing = c.failing.of_node(spec.name, owners)
            for f in failing:
                if 0 <= f.range_id < len(ranges):
                    ranges[f.range_id]["failing"] = f"{f.stage}: {f.exception_type}: {f.message}"[:1000]
            errs = error_info(c.store, spec, failing)
            info = {
                "name": spec.name, "version": c.registry.version_of(spec.name),
                "rescaling_to": rescaling.get(spec.name),
                "inputs": [i.stream for i in spec.inputs],
                "outputs": list(spec.written_streams()), "code": spec.code.name,
                "on_error": spec.options.on_error.value,
                "low_watermark": _wm(out[spec.name]), "input_low_watermark": _wm(inputs[spec.name]),
                "lag_s": _lag_s(out[spec.name], now_us), "input_lag_s": _lag_s(inputs[spec.name], now_us),
                "ranges": ranges,
                "dead_lettered": errs["dead_lettered"], "skipped": errs["skipped"],
                "late_dropped": errs["late_dropped"],
                "late": _late(errs["late"], spec),
                "recent_errors": [_err(e) for e in errs["recent_errors"][:10]],
                "retrying": [_err(e) for e in errs["retrying"][:10]],
                "failing_ranges": [_failure(f) for f in errs["failing_ranges"][:100]],
                **rates.get(spec.name, _no_rates()),
            }
            if into is not None:  # what its consumers acknowledged, not what it ran (retries counted)
                info["in_per_s"] = round(sum(into.get((i, spec.name), 0.0) for i in info["inputs"]), 2)
            info["held_by"] = held.get(spec.name, "")
            # records its producers checkpointed and it (or a sibling consumer) has not acked
            upstream = {n for i in info["inputs"] for n in producers.get(i, ())}
            info["backlog"] = sum(v for (n, _r), v in pending.items() if n in upstream)
            info["health"], info["health_reason"] = self._health(
                spec.name, info, out[spec.name], inputs[spec.name], mono)
            comps[spec.name] = info
            for kind, value in (("lag", info["lag_s"]), ("input_lag", info["input_lag_s"]),
                                ("in", info["in_per_s"]), ("out", info["out_per_s"]),
                                ("dead", info["dead_lettered"]), ("checkpoint_ms", info["checkpoint_ms"]),
                                ("checkpoint_p95_ms", info["checkpoint_p95_ms"]),
                                ("checkpoints", info["checkpoints_per_s"])):
                if value is not None:
                    self.history.add(kind, spec.name, t, value)
        injectors: dict[str, Any] = {}
        for inj in topo.injectors:
            node = injector_node(inj.name)
            owner = units.get((node, 0), (None, 0))
            # The owner reports its outbox's length with every heartbeat; reading the
            # outbox from the store (up to 50,000 rows, every refresh) took a fifth of
            # the controller's CPU under load. The store only while nothing was reported.
            reported = pending.get((node, 0))
            outbox = reported if reported is not None else len(c.store.read_outbox(node, 0))
            waited = c.sensors.sample("millwheel_backpressure_seconds_total",
                                      {"destination": node}) if c.sensors is not None else None
            injectors[inj.name] = {
                "name": inj.name, "stream": inj.stream, "low_watermark": _wm(out.get(node, MIN_TIMESTAMP)),
                "lag_s": _lag_s(out.get(node, MIN_TIMESTAMP), now_us), "worker": owner[0] or "",
                "token": owner[1], "outbox": outbox, "backpressure_s_total": waited or 0.0,
                **rates.get(node, _no_rates())}
            self.history.add("outbox", node, t, outbox)
        sinks: dict[str, Any] = {}  # a connector sink: who runs it, failing since how long
        for sink in topo.sinks:
            owner = units.get((sink_node(sink.name), 0), (None, 0))
            down = sinks_down.get(owner[0] or "", {}).get(sink.name)
            sinks[sink.name] = {"name": sink.name, "stream": sink.stream, "type": sink.connector.type,
                                "worker": owner[0] or "", "down_s": None if down is None else round(down, 1)}
        # Liveness first: a worker that drained and exited keeps its draining flag.
        worker_rows = [{"id": w[0], "address": w[1], "metrics": w[2],
                        "state": (("draining" if w[4] else "alive") if w[3]
                                  else "dead" if leading else "unknown"),
                        "last_heartbeat_s": round(w[5], 2), **usage.get(w[0], _NO_USAGE),
                        "ranges": sorted(f"{n}/{r}" for (n, r), o in units.items() if o[0] == w[0])}
                       for w in sorted(workers)]
        logged = topo.logged_streams()
        self._tail(logged)
        self.history.keep([*comps, *(injector_node(i) for i in injectors)])
        nodes = {*comps, *(injector_node(i) for i in injectors)}
        sink_edges = {sink_edge(s.name, s.stream) for s in topo.sinks}
        for edge in [e for e in self._edge_total if e not in sink_edges and (
                e[0] not in nodes or not (e[2] in nodes or e[2].startswith("log:")))]:  # unregistered: forgotten
            del self._edge_total[edge]
            self._edge_hist.pop(edge, None)
        self.snapshot = {
            "ready": True, "time_us": now_us, "version": version,
            "store": redact(c.store.url),  # never the password (as ClusterStatus)
            "leader": c.elector.leader_address or "", "leading": leading,
            "computations": comps, "injectors": injectors, "workers": worker_rows, "sinks": sinks,
            "logged_streams": logged, "graph": _graph(topo, comps, injectors, sinks, edges),
            "last_savepoint": _last_savepoint(c.store),
        }

    def _held_by(self, topo: Topology, out: dict[str, int], inputs: dict[str, int]) -> dict[str, str]:
        """Per computation, what holds its low watermark, in words
        (services/controller/held_by.py, as ``millwheel watermark --why``); the caller
        holds the controller's lock. A rule that cannot say is left out, not fatal."""
        held: dict[str, str] = {}
        for spec in topo.computations:
            try:
                held[spec.name] = _held_by(self.controller, spec.name, out, inputs, self.least_writer)
            except Exception as exc:  # noqa: BLE001 - one line of the console, not the refresh
                log.debug("held_by of %s failed: %s", spec.name, exc)
        return held

    def _mark_rescaling(self, rescaling: dict[str, int]) -> None:
        """The controller's lock is held (a savepoint's cut, say): the last
        snapshot again (its ``time_us`` says how old), each computation's
        ``rescaling_to`` as the store says now."""
        snap = self.snapshot
        if not snap.get("ready"):
            return
        comps = {n: {**info, "rescaling_to": rescaling.get(n)} for n, info in snap["computations"].items()}
        self.snapshot = {**snap, "computations": comps}

    def _scrape(self, targets: list[tuple[str, str]]) -> dict[str, Samples]:
        got: dict[str, Samples] = {}
        for wid, address in targets:
            try:
                got[wid] = scrape(address)
            except (OSError, ValueError) as exc:
                log.debug("cannot read %s's metrics at %s: %s", wid, address, exc)
        return got

    def _usage(self, samples: dict[str, Samples], t: float) -> dict[str, dict[str, float | None]]:
        """Per worker: its RSS (MB) and CPU (% of one core since the last refresh), from
        the process collector of its /metrics."""
        out: dict[str, dict[str, float | None]] = {}
        prev, self._cpu = self._cpu, {}
        for wid, got in samples.items():
            rss = got.get(("process_resident_memory_bytes", ()))
            cpu = got.get(("process_cpu_seconds_total", ()))
            pct = None
            if cpu is not None:
                self._cpu[wid] = (t, cpu)
                before = prev.get(wid)
                if before is not None and t > before[0] and cpu >= before[1]:
                    pct = round(100.0 * (cpu - before[1]) / (t - before[0]), 1)
            out[wid] = {"rss_mb": round(rss / 2**20, 1) if rss is not None else None, "cpu_pct": pct}
        return out

    def _rates(self, samples: dict[str, Samples], t: float) -> dict[str, dict[str, Any]]:
        """Per computation: records in/out per second, checkpoints per second and their
        mean latency since the last refresh, summed over workers (a worker restarted
        since, whose counter went down, counts from its new value); and the records
        in/out the live workers counted in all."""
        wanted = {"millwheel_records_in_total": "in", "millwheel_records_out_total": "out",
                  "millwheel_checkpoint_seconds_count": "cp", "millwheel_checkpoint_seconds_sum": "cp_s"}
        delta: dict[str, dict[str, float]] = {}
        totals: dict[str, dict[str, float]] = {}
        prev, self._prev = self._prev, {}
        for wid, got in samples.items():
            for (name, labels), value in got.items():
                kind = wanted.get(name)
                if kind is None and name == "millwheel_checkpoint_seconds_bucket":
                    kind = "le:" + dict(labels).get("le", "+Inf")  # cumulative count at or under
                if kind is None:
                    continue
                comp = dict(labels).get("computation", "")
                if kind in ("in", "out"):
                    total = totals.setdefault(comp, {"in": 0.0, "out": 0.0})
                    total[kind] += value
                key = (wid, name, labels)
                self._prev[key] = (t, value)
                before = prev.get(key)
                if before is None:
                    continue
                grown = value - before[1] if value >= before[1] else value
                slot = delta.setdefault(comp, {"in": 0.0, "out": 0.0, "cp": 0.0, "cp_s": 0.0, "dt": 0.0})
                slot[kind] = slot.get(kind, 0.0) + grown
                slot["dt"] = max(slot["dt"], t - before[0])
        out: dict[str, dict[str, Any]] = {}
        for comp, d in delta.items():
            dt = d["dt"] or self.interval_s
            out[comp] = {"in_per_s": round(d["in"] / dt, 2), "out_per_s": round(d["out"] / dt, 2),
                         "checkpoints_per_s": round(d["cp"] / dt, 2),
                         "checkpoint_ms": round(1000 * d["cp_s"] / d["cp"], 3) if d["cp"] else None,
                         "checkpoint_p50_ms": _quantile_ms(d, 0.5), "checkpoint_p95_ms": _quantile_ms(d, 0.95)}
        for comp, total in totals.items():  # what the live workers counted since they started
            out.setdefault(comp, _no_rates()).update(
                records_in_total=int(total["in"]), records_out_total=int(total["out"]))
        return out

    def _edges(self, samples: dict[str, Samples], t: float, sinks: dict[str, str]) -> EdgeRates:
        """Records/s per stream edge (producer node, stream, consumer) over the last
        ``EDGE_WINDOW_S``: what consumers acknowledged (``millwheel_edge_records_total``,
        counted by the producer's worker once per record acked, so a retried or resent
        batch counts once), and per connector sink of ``sinks`` (name -> its stream) what
        it wrote out (``millwheel_sink_records_total``, counted by the worker running it
        once its external system committed them), on the edge from its stream's log
        (:func:`~services.ui.graph.sink_edge`). Summed over workers; a worker restarted
        since (its counter went down) counts from its new value; a series first seen
        counts from there."""
        prev, self._edge_prev = self._edge_prev, {}
        for wid, got in samples.items():
            for (name, labels), value in got.items():
                if name == "millwheel_edge_records_total":
                    d = dict(labels)
                    edge = (d.get("producer", ""), d.get("stream", ""), d.get("consumer", ""))
                elif name == "millwheel_sink_records_total":
                    sink = dict(labels).get("sink", "")
                    if sink not in sinks:  # not registered (any more)
                        continue
                    edge = sink_edge(sink, sinks[sink])
                else:
                    continue
                key = (wid, name, labels)
                self._edge_prev[key] = value
                before = prev.get(key)
                grown = 0.0 if before is None else value - before if value >= before else value
                self._edge_total[edge] = self._edge_total.get(edge, 0.0) + grown
        size = max(2, int(EDGE_WINDOW_S / self.interval_s) + 1)
        out: EdgeRates = {}
        for edge, total in self._edge_total.items():
            ring = self._edge_hist.setdefault(edge, deque(maxlen=size))
            ring.append((t, total))
            t0, v0 = ring[0]
            out[edge] = (total - v0) / (t - t0) if t > t0 else 0.0
        return out

    def _health(self, name: str, info: dict[str, Any], wm: int, in_wm: int, mono: float) -> tuple[str, str]:
        dead = int(info["dead_lettered"])
        seen = self._dead_seen.get(name)
        if seen is None or dead != seen[0]:
            # A count seen for the first time is not "rising" unless errors are fresh.
            fresh = seen is not None or any(
                e["time"] and (time.time() * 1e6 - e["time"]) < DEAD_LETTER_WINDOW_S * 1e6
                for e in info["recent_errors"])
            self._dead_seen[name] = (dead, mono if fresh else mono - DEAD_LETTER_WINDOW_S)
            seen = self._dead_seen[name]
        moved = self._wm_moved.get(name)
        if moved is None or moved[0] != wm:
            self._wm_moved[name] = moved = (wm, mono)
        failing = info.get("failing_ranges")
        if failing:
            f = failing[0]
            return "failing", (f"{len(failing)} key range(s) cannot run ({f['stage']}): "
                               f"{f['type']}: {f['message'][:200]}")
        if dead and mono - seen[1] < DEAD_LETTER_WINDOW_S:
            return "dead-lettering", f"{dead} dead-lettered, rising in the last minute"
        if info["retrying"]:
            return "retrying", f"{len(info['retrying'])} item(s) failing and being retried"
        if in_wm > wm and wm < MAX_TIMESTAMP and mono - moved[1] >= STUCK_S:
            return "lagging", f"output watermark has not moved for {mono - moved[1]:.0f} s"
        return "ok", ""

    def _tail(self, streams: list[str]) -> None:
        for stream in [s for s in self._tails if s not in streams]:
            del self._tails[stream]
        for stream in streams:
            pos, ring = self._tails.get(stream, (0, deque(maxlen=TAIL)))
            for seq, rec in self.controller.store.read_log(stream, pos, TAIL_READ):
                ring.append({"seq": seq, "key": rec.key, "value": rec.value.decode("utf-8", "replace"),
                             "timestamp": rec.timestamp, "id": rec.record_id})
                pos = seq
            self._tails[stream] = (pos, ring)

    def tail(self, stream: str, n: int) -> list[dict[str, Any]] | None:
        got = self._tails.get(stream)
        return None if got is None else list(got[1])[-n:]


def _no_rates() -> dict[str, Any]:
    return {"in_per_s": None, "out_per_s": None, "checkpoints_per_s": None, "checkpoint_ms": None,
            "checkpoint_p50_ms": None, "checkpoint_p95_ms": None,
            "records_in_total": None, "records_out_total": None}


def _err(e: Any) -> dict[str, Any]:
    return {"range": e.range_id, "key": e.key[:200], "record_id": e.record_id[:200], "time": e.time,
            "attempts": e.attempts, "type": e.exception_type[:200], "message": e.message[:1000],
            "outcome": e.outcome}


def _late(counts: list[Any], spec: ComputationSpec) -> list[dict[str, Any]]:
    """Late records per input stream: every input of ``spec`` (zeros when none were
    late), then any other counted (``""``: the stream was not known, e.g. a replayed
    dead letter), each with its count per action and the name to show."""
    rows = {i.stream: dict.fromkeys(late.ACTIONS, 0) for i in spec.inputs}
    for c in counts:
        rows.setdefault(c.input, dict.fromkeys(late.ACTIONS, 0))[c.action] = c.count
    return [{"input": s, "label": late.show_input(s), **actions} for s, actions in rows.items()]


def _failure(f: Any) -> dict[str, Any]:
    return {"range": f.range_id, "worker": f.worker_id, "stage": f.stage, "attempts": f.attempts,
            "since": f.since, "last": f.last, "type": f.exception_type[:200], "message": f.message[:1000],
            "retry_in_s": round(f.retry_in_s, 2)}


def controller_view(controller: ControlPlane) -> Callable[[], ControllerView]:
    """What the controller's ``millwheel_error_records`` and ``millwheel_worker_up``
    series are computed from at scrape time (:meth:`PrometheusSensors.controller_view`):
    the registry and workers read without the lock (both are replaced or added to whole,
    and copied here first), the error counts from the store."""
    def view() -> ControllerView:
        topo = controller.registry.topology
        # Only the leader hears heartbeats: a standby reports no worker (not "all dead").
        workers = ({w.worker_id: w.alive for w in list(controller.assigner.workers.values())}
                   if controller.leading() else {})
        errors = {}
        owners = dict(controller.assigner.units)
        for spec in topo.computations:
            e = error_info(controller.store, spec, controller.failing.of_node(spec.name, owners))
            errors[spec.name] = {"dead_lettered": e["dead_lettered"], "skipped": e["skipped"],
                                 "late_dropped": e["late_dropped"], "retrying": len(e["retrying"]),
                                 "failing_ranges": len(e["failing_ranges"])}
        return errors, workers

    return view
