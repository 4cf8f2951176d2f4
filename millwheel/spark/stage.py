"""The Spark stage: a windowed aggregation whose windows are computed by PySpark jobs.

Behaviour a user can rely on (the same windows and output as ``window_aggregate``):

* each record is checkpointed into its key's state, per window, like any computation;
* when the input low watermark passes a window's end, the window is due; every window
  due in a key range at that moment goes to ONE Spark job, and each result is produced
  as JSON ``{"key", "start", "end", "agg", "value", "count"}`` stamped ``end - 1``;
* the result's record ID derives from (computation, key, window) through the timer
  that fired it, and the job's results, the timer deletions and the state cleanup are
  one checkpoint: a job retried after a crash re-produces the same IDs (downstream
  drops repeats) and a crash mid-job emits nothing; a window's records are deleted
  only in the checkpoint that holds its result;
* pending end-of-window timers hold the output watermark, so results are never late;
* with ``allowed_lateness_us`` > 0 a window is kept that much longer; a late record
  updates it and a corrected result (a new record ID) follows at the next firing;
  records later than that follow the late-data policy (the runtime applies it);
* Spark failures are retried with backoff (see :mod:`millwheel.spark.session`),
  reported to the sensors (``spark_job``) and in :attr:`SparkAggregate.status`.

Where records go (see docs/spark.md, "How it works"): each record is appended, as one
JSON line ``{"key", "timestamp", "value"}``, to the range's append-only window buffer
named by the window start (:meth:`Context.append_buffer`), in the record's checkpoint:
one row per window per batch, so a record costs the same whatever the window holds.
Per-key state is only ``META\n`` (window start -> results emitted so far), rewritten
when a key enters or leaves a window. State written before window buffers existed,
``META\n`` plus ``TIMESTAMP\tJSON\n`` record lines, is still read: those lines join
the window's records and are dropped with the window as before.

A firing writes the due windows' buffers as JSON-lines files under a staging directory
(``$MILLWHEEL_SPARK_STAGING``, default a ``millwheel-spark-staging`` directory in the
temp dir), one ``window_start=S`` sub-directory per window, and the executors read them
(:func:`~millwheel.spark.session.staged_frame`): the worker joins bytes, it does not
parse or loop over records. A window's buffer is deleted in the checkpoint of the
firing that holds every timer due once the window is closed for good (its end plus the
allowed lateness below the input watermark).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import uuid
from typing import Any, Iterable, Mapping, Sequence

from millwheel.computation import Computation, Context
from millwheel.errors import InvalidSpecError
from millwheel.record import Record, Timer
from millwheel.spark.aggregations import Aggregation
from millwheel.spark.session import restart_count, run_job, staged_frame
from millwheel.windows import Windowing

META_CACHE_KEYS = 100_000
STAGING_ENV = "MILLWHEEL_SPARK_STAGING"


class SparkAggregate(Computation):
    #: The operator name in messages (the in-process holistic window_aggregate reuses this class).
    OPERATOR = "spark_aggregate"

    def __init__(
        self,
        *,
        size_us: int,
        period_us: int | None = None,
        aggregation: str = "count",
        field: str | None = None,
        percentile: float = 0.5,
        p: float | None = None,
        k: int | None = None,
        by: str | None = None,
        function: str | None = None,
        output: str | None = None,
        allowed_lateness_us: int = 0,
        master: str | None = None,
        spark_conf: Mapping[str, Any] | None = None,
        max_attempts: int = 4,
        retry_backoff_s: float = 0.5,
    ) -> None:
        self.windowing = Windowing(int(size_us), int(period_us) if period_us else None)
        self.agg = Aggregation(aggregation, field, percentile, function, p=p, k=k, by=by, operator=self.OPERATOR)
        self.output = output
        self.allowed_lateness_us = int(allowed_lateness_us)
        self.master = master
        self.spark_conf = dict(spark_conf or {})
        if int(max_attempts) < 1:
            raise InvalidSpecError("spark_aggregate: max_attempts must be >= 1")
        self.max_attempts = int(max_attempts)
        self.retry_backoff_s = float(retry_backoff_s)
        self.name = "spark_aggregate"
        self.sensors: Any = None
        self._meta_cache: dict[str, tuple[bytes, dict[str, int]]] = {}
        self.status: dict[str, Any] = {"jobs": 0, "windows": 0, "retries": 0, "failures": 0,
                                       "last_error": None, "last_job_s": None,
                                       "job_seconds": 0.0, "session_restarts": 0}

    # -- wiring --------------------------------------------------------------
    def bind_outputs(self, outputs: tuple[str, ...]) -> None:
        if self.output is None:
            if not outputs:
                raise InvalidSpecError(f"{self.OPERATOR} needs an output stream")
            self.output = outputs[0]

    def bind_sensors(self, sensors: Any, computation: str) -> None:
        self.sensors = sensors
        self.name = computation

    # -- records -------------------------------------------------------------
    def process_record(self, ctx: Context, record: Record) -> None:
        self.process_records(ctx, (record,))

    def process_records(self, ctx: Context, records: Iterable[Record]) -> None:
        """The per-key batch hook: the key's window header is read once, each record
        becomes one JSON line, and each window gets one append per batch (so a record
        costs the same whatever its window already holds); the header is written back
        only if a window was opened."""
        state = ctx.state
        cached = self._meta_cache.get(ctx.key)
        # The header of the state this stage last wrote for the key, if that is still it
        # (same bytes object): saves parsing it for every batch.
        meta = dict(cached[1]) if cached is not None and cached[0] is state else _meta(state)
        meta_changed = False
        lateness = self.allowed_lateness_us
        key_json = json.dumps(ctx.key)
        pending: dict[int, list[bytes]] = {}
        windowing, extract = self.windowing, self.agg.extract
        for record in records:
            value = extract(record.value, record.record_id)
            line = b""
            for start in windowing.assign(record.timestamp):
                end = windowing.end(start)
                emitted = meta.get(str(start))
                if emitted is None:
                    if end - 1 + lateness < ctx.input_watermark:
                        continue  # closed for good; the late policy let the record through
                    meta[str(start)] = 0
                    meta_changed = True
                    ctx.set_timer(f"fire:{start}:0", end - 1)
                    if lateness:
                        ctx.set_timer(f"gc:{start}", end - 1 + lateness, hold=False)
                elif emitted > 0:  # already produced: a corrected result follows
                    ctx.set_timer(f"fire:{start}:{emitted}", end - 1)
                if not line:
                    line = (f'{{"key":{key_json},"timestamp":{record.timestamp},'
                            f'"value":{json.dumps(value)}}}\n').encode()
                lines = pending.get(start)
                if lines is None:
                    pending[start] = [line]
                else:
                    lines.append(line)
        for start, lines in pending.items():
            ctx.append_buffer(str(start), b"".join(lines))  # type: ignore[attr-defined]
        if meta_changed:
            new_state = _meta_bytes(meta) + _split(state)[1]  # legacy record lines kept
            ctx.set_state(new_state)
            if len(self._meta_cache) >= META_CACHE_KEYS:
                self._meta_cache.clear()
            self._meta_cache[ctx.key] = (new_state, meta)

    # -- timers --------------------------------------------------------------
    def process_timer(self, ctx: Context, timer: Timer) -> None:
        self.process_timer_batch([(ctx, timer)])

    def process_timer_batch(self, items: Sequence[tuple[Context, Timer]]) -> None:
        """Every due timer of one key range: one Spark job for all due windows."""
        keys: dict[str, _KeyState] = {}
        fires: list[tuple[Context, _KeyState, int, int]] = []
        gcs: list[tuple[_KeyState, int]] = []
        for ctx, timer in items:
            kind, _, rest = timer.tag.partition(":")
            start_s, _, rev_s = rest.partition(":")
            ks = keys.get(ctx.key)
            if ks is None:
                ks = keys[ctx.key] = _KeyState(ctx, ctx.state)
            if start_s not in ks.meta:
                continue
            if kind == "fire":
                fires.append((ctx, ks, int(start_s), int(rev_s or 0)))
            elif kind == "gc":
                gcs.append((ks, int(start_s)))
        if fires:
            wanted = {(ctx.key, start) for ctx, _ks, start, _rev in fires}
            legacy = {(k, st): keys[k].records_in(st, self.windowing.end(st))
                      for k, st in wanted if keys[k].records}  # state from before buffers
            results = self._run(items[0][0], sorted(wanted), legacy)
            for ctx, ks, start, rev in fires:
                found = results.get((ctx.key, start))
                if found is not None:
                    self._emit(ctx, start, *found)
                if self.allowed_lateness_us:
                    ks.meta[str(start)] = max(ks.meta.get(str(start), 0), rev + 1)
                else:
                    ks.meta.pop(str(start), None)
        for ks, start in gcs:
            ks.meta.pop(str(start), None)
        for ks in keys.values():
            ks.save(self.windowing)
        self._drop_closed(items[0][0])

    def _drop_closed(self, ctx: Context) -> None:
        """Delete the buffers of windows closed for good, once every timer due now has
        run (so every firing that reads them is in this checkpoint or an earlier one):
        a window whose end plus lateness is below the watermark takes no record again."""
        if not getattr(ctx, "all_due_timers_fired", False):
            return  # the batch limit left due timers for the next batch: it decides
        for name in ctx.list_buffers():  # type: ignore[attr-defined]
            try:
                start = int(name)
            except ValueError:
                continue  # not one of this stage's
            if self.windowing.end(start) - 1 + self.allowed_lateness_us < ctx.input_watermark:
                ctx.delete_buffer(name)  # type: ignore[attr-defined]

    def _stage(self, ctx: Context, wanted: list[tuple[str, int]],
               legacy: dict[tuple[str, int], list[tuple[int, Any]]]) -> str:
        """Write the windows' buffers as JSON-lines files, one directory per window."""
        root = staging_root()
        sweep_staging(root)
        batch = os.path.join(root, f"{_owner_tag()}_{uuid.uuid4().hex}")
        for start in sorted({s for _k, s in wanted}):
            part = os.path.join(batch, f"window_start={start}")
            os.makedirs(part, mode=0o700)
            with open(os.path.join(part, "part-0.json"), "wb") as f:
                for chunk in ctx.read_buffer(str(start)):  # type: ignore[attr-defined]
                    f.write(chunk)
                for (key, s), records in legacy.items():  # state from before buffers
                    if s == start:
                        f.writelines(
                            json.dumps({"key": key, "timestamp": ts, "value": v}).encode() + b"\n"
                            for ts, v in records)
        return batch

    def _run(self, ctx: Context, wanted: list[tuple[str, int]],
             legacy: dict[tuple[str, int], list[tuple[int, Any]]]) -> dict[tuple[str, int], Any]:
        n_windows = len(wanted)
        batch = self._stage(ctx, wanted, legacy)
        try:
            return run_job(
                # A built-in aggregates each (key, window) alone: the other keys of a
                # staged window cost a little Spark work but never change a result, and
                # results of keys not firing are ignored. A user function sees exactly
                # the due (key, window) records (it may look across keys).
                lambda spark: self.agg.aggregate(staged_frame(
                    spark, batch, self.agg.value_type, self.windowing.size_us,
                    wanted if self.agg.function is not None else None)),
                master=self.master, conf=self.spark_conf, attempts=self.max_attempts,
                backoff_s=self.retry_backoff_s, on_attempt=self._on_attempt(n_windows),
            )
        finally:
            shutil.rmtree(batch, ignore_errors=True)

    def _on_attempt(self, n_windows: int) -> Any:
        def on_attempt(outcome: str, seconds: float, error: BaseException | None) -> None:
            self.status["last_job_s"] = round(seconds, 3)
            self.status["job_seconds"] = self.status.get("job_seconds", 0.0) + seconds
            self.status["session_restarts"] = restart_count()
            if outcome == "ok":
                self.status["jobs"] += 1
                self.status["windows"] += n_windows
            else:
                self.status["retries" if outcome == "retry" else "failures"] += 1
                self.status["last_error"] = f"{error.__class__.__name__}: {str(error)[:300]}"
            hook = getattr(self.sensors, "spark_job", None)
            if hook is not None:
                hook(self.name, outcome, seconds, n_windows)

        return on_attempt

    def _emit(self, ctx: Context, start: int, value: Any, count: int) -> None:
        end = self.windowing.end(start)
        payload = {"key": ctx.key, "start": start, "end": end, "agg": self.agg.label,
                   "value": value, "count": count}
        assert self.output is not None
        ctx.produce(self.output, ctx.key, json.dumps(payload).encode(), end - 1)


def staging_root() -> str:
    return os.environ.get(STAGING_ENV) or os.path.join(tempfile.gettempdir(), "millwheel-spark-staging")


def _owner_tag() -> str:
    """``w<pid>@<host>``: who staged a directory, so a later process can tell whether
    its owner is gone (killed mid-job) and remove what it left."""
    return f"w{os.getpid()}@{socket.gethostname()}"


_STAGED = re.compile(r"^w(\d+)@(.+)_[0-9a-f]{32}$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    try:  # a zombie (killed, not yet reaped) holds its pid but writes nothing more
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def sweep_staging(root: str) -> list[str]:
    """Remove the staging directories under ``root`` whose owner, a process of this
    host, is gone (a worker killed mid-job leaves its job's directory behind); run
    before each job, so the next job of any worker on the host cleans up. Directories
    of other hosts (a shared mount) and of live processes are left alone. Returns the
    names removed."""
    host, removed = socket.gethostname(), list[str]()
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = _STAGED.match(name)
        if m is None or m.group(2) != host or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        removed.append(name)
    return removed


class _KeyState:
    """One key's decoded state during a timer batch."""

    def __init__(self, ctx: Context, state: bytes | None) -> None:
        self.ctx = ctx
        self.meta, body = _split(state)
        self.records: list[tuple[int, Any]] = []
        for line in body.split(b"\n"):
            if line:
                ts, _, value = line.partition(b"\t")
                self.records.append((int(ts), json.loads(value)))

    def records_in(self, start: int, end: int) -> list[tuple[int, Any]]:
        return [(ts, v) for ts, v in self.records if start <= ts < end]

    def save(self, windowing: Windowing) -> None:
        """Write back, keeping only records of windows still open (or awaiting lateness)."""
        if not self.meta:
            self.ctx.set_state(None)
            return
        starts = [int(s) for s in self.meta]
        lines = [
            f"{ts}\t{json.dumps(v)}\n" for ts, v in self.records
            if any(s <= ts < windowing.end(s) for s in starts)
        ]
        self.ctx.set_state(_meta_bytes(self.meta) + "".join(lines).encode())


def _meta(state: bytes | None) -> dict[str, int]:
    """Only the header: no copy of the (possibly large) record lines."""
    if not state:
        return {}
    meta: dict[str, int] = json.loads(state[: state.index(b"\n")])
    return meta


def _split(state: bytes | None) -> tuple[dict[str, int], bytes]:
    if not state:
        return {}, b""
    cut = state.index(b"\n")
    meta: dict[str, int] = json.loads(state[:cut])
    return meta, state[cut + 1 :]


def _meta_bytes(meta: dict[str, int]) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode() + b"\n"
