"""The one SparkSession of a process, and the one module that imports pyspark.

A worker process keeps one long-lived session (starting Spark costs seconds, a job on
a warm session a fraction of one). It is started lazily by the first job, on
``local[*]`` unless configured otherwise, and stopped at interpreter exit. The master
comes from, in order: an explicit command-line flag (``millwheel backfill --master``),
the ``MILLWHEEL_SPARK_MASTER`` environment variable (a deployment's default, which
overrides what a spec says), the stage's ``master`` parameter, ``local[*]``;
``spark://``, ``yarn``, ``k8s://`` all work. A flag always beats the environment.

:func:`run_job` is how every Spark job runs: on a job error it retries with
exponential backoff, restarting the session first if it died (e.g. the JVM was
killed), and reports each attempt; after the last attempt it raises
:class:`SparkJobError`, so the caller commits nothing and the window is retried later.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence, TypeVar

from millwheel.errors import MillWheelError, MissingDependencyError

log = logging.getLogger(__name__)

DEFAULT_MASTER = "local[*]"
MASTER_ENV = "MILLWHEEL_SPARK_MASTER"
#: Small-data defaults; any of them can be overridden by ``spark_conf``.
DEFAULT_CONF: dict[str, str] = {
    "spark.app.name": "millwheel",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.session.timeZone": "UTC",
}

T = TypeVar("T")
#: ``on_attempt(outcome, seconds, error)`` with outcome "ok", "retry" or "failed".
AttemptHook = Callable[[str, float, "BaseException | None"], None]


class SparkJobError(MillWheelError):
    """A Spark job failed on every attempt; nothing of it was emitted."""


_lock = threading.RLock()
_session: Any = None
_settings: tuple[str, tuple[tuple[str, str], ...]] | None = None
_atexit_registered = False
_restarts = 0


#: How to get pyspark: it is an optional dependency (about 500 MB), the ``spark`` extra.
INSTALL_HINT = "pip install 'millwheel[spark]'"


def require_pyspark(what: str) -> None:
    """Raise :class:`MissingDependencyError` saying how to install pyspark if this Python
    lacks it. Called where a Spark stage is built and where backfill starts, so a spec
    that needs Spark fails at once with the fix, not at its first window (or after a
    job's retries)."""
    if importlib.util.find_spec("pyspark") is None:
        raise MissingDependencyError(
            f"{what} needs pyspark, which is not installed in this Python ({sys.executable}); "
            f"install it with: {INSTALL_HINT} (Spark also needs a Java 17 runtime)"
        )


def resolve_master(master: str | None, explicit: str | None = None) -> str:
    """``explicit`` (a flag) > $MILLWHEEL_SPARK_MASTER > ``master`` (the spec) > local[*]."""
    return explicit or os.environ.get(MASTER_ENV) or master or DEFAULT_MASTER


def get_session(master: str | None = None, conf: Mapping[str, Any] | None = None,
                explicit_master: str | None = None) -> Any:
    """The process's SparkSession, started on first use (or again if it died).

    The first caller's master and settings win; a later caller asking for another
    master gets the running session and a warning (one session per process).
    """
    global _session, _settings, _atexit_registered, _restarts
    wanted = (resolve_master(master, explicit_master), tuple(sorted((k, str(v)) for k, v in (conf or {}).items())))
    with _lock:
        if _session is not None and is_alive():
            if _settings is not None and wanted[0] != _settings[0]:
                log.warning("Spark session already runs on %s; ignoring master %s", _settings[0], wanted[0])
            return _session
        if _session is not None:
            log.warning("Spark session on %s was lost; starting a new one", _settings and _settings[0])
            _restarts += 1
            _discard()
        require_pyspark("a Spark job")
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        from pyspark.sql import SparkSession

        builder = SparkSession.builder.master(wanted[0])
        for key, value in {**DEFAULT_CONF, **dict(wanted[1])}.items():
            builder = builder.config(key, value)
        started = time.perf_counter()
        _session = builder.getOrCreate()
        _session.sparkContext.setLogLevel("ERROR")
        _settings = wanted
        log.info("Spark session on %s started in %.1fs", wanted[0], time.perf_counter() - started)
        if not _atexit_registered:
            atexit.register(stop_session)
            _atexit_registered = True
        return _session


def is_alive() -> bool:
    """True if the session exists and its JVM answers."""
    with _lock:
        if _session is None:
            return False
        try:
            jsc = _session.sparkContext._jsc
            return jsc is not None and not jsc.sc().isStopped()
        except Exception:  # the JVM is gone: py4j cannot reach it
            return False


def restart_count() -> int:
    """How many times a lost session was replaced in this process (for status)."""
    return _restarts


def gateway_pid() -> int | None:
    """PID of the driver JVM (tests kill it to simulate a lost session)."""
    with _lock:
        if _session is None:
            return None
        proc = getattr(_session.sparkContext._gateway, "proc", None)
        return None if proc is None else int(proc.pid)


def stop_session() -> None:
    """Stop the session (at exit, or when a runner shuts down)."""
    global _session, _settings
    with _lock:
        if _session is None:
            return
        try:
            _session.stop()
        except Exception:
            _discard()
        _session = None
        _settings = None


def _discard() -> None:
    """Forget a dead session and its JVM so the next :func:`get_session` starts anew."""
    global _session
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    try:
        _session.stop()
    except Exception:
        pass
    gateway = getattr(SparkContext, "_gateway", None)
    proc = getattr(gateway, "proc", None)
    if proc is not None and proc.poll() is None:
        proc.kill()
    for attr in ("_gateway", "_jvm", "_active_spark_context"):
        setattr(SparkContext, attr, None)
    for attr in ("_instantiatedSession", "_activeSession"):
        if hasattr(SparkSession, attr):
            setattr(SparkSession, attr, None)
    _session = None


def run_job(
    job: Callable[[Any], T],
    *,
    master: str | None = None,
    conf: Mapping[str, Any] | None = None,
    explicit_master: str | None = None,
    attempts: int = 4,
    backoff_s: float = 0.5,
    on_attempt: AttemptHook | None = None,
) -> T:
    """Run ``job(spark)`` with retries; see the module docstring."""
    delay = backoff_s
    for attempt in range(1, attempts + 1):
        started = time.perf_counter()
        try:
            result = job(get_session(master, conf, explicit_master))
        except MillWheelError:
            raise  # a spec/user error or no pyspark, found before Spark ran: retrying cannot help
        except Exception as exc:
            seconds = time.perf_counter() - started
            last = attempt == attempts
            if on_attempt is not None:
                on_attempt("failed" if last else "retry", seconds, exc)
            if last:
                raise SparkJobError(
                    f"Spark job failed {attempts} times; last error: "
                    f"{exc.__class__.__name__}: {_first_line(exc)}"
                ) from exc
            log.warning("Spark job attempt %d/%d failed (%s); retrying in %.1fs",
                        attempt, attempts, _first_line(exc), delay)
            # A dead session is replaced by the next get_session() (counted there).
            time.sleep(delay)
            delay *= 2
        else:
            if on_attempt is not None:
                on_attempt("ok", time.perf_counter() - started, None)
            return result
    raise AssertionError("unreachable")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


# -- DataFrame construction (kept here so no other module imports pyspark) ---------------

#: The value column's Spark type per kind of stored value.
VALUE_TYPES = ("double", "string", "pair")


def _value_type(value_type: str) -> Any:
    """``pair`` is top_k's ``{"item": string, "score": double}`` (see millwheel.holistic)."""
    from pyspark.sql import types as T_

    if value_type == "pair":
        return T_.StructType([T_.StructField("item", T_.StringType(), True),
                              T_.StructField("score", T_.DoubleType(), True)])
    return T_.DoubleType() if value_type == "double" else T_.StringType()


def sql_window() -> Any:
    """``pyspark.sql.Window``, for ranking within a window's records (top_k)."""
    from pyspark.sql import Window

    return Window


def window_frame(spark: Any, rows: Sequence[tuple[str, int, int, int, Any]], value_type: str) -> Any:
    """A DataFrame ``(key, window_start, window_end, timestamp, value)`` of window records."""
    from pyspark.sql import types as T_

    value: Any = _value_type(value_type)
    schema = T_.StructType([
        T_.StructField("key", T_.StringType(), False),
        T_.StructField("window_start", T_.LongType(), False),
        T_.StructField("window_end", T_.LongType(), False),
        T_.StructField("timestamp", T_.LongType(), False),
        T_.StructField("value", value, True),
    ])
    return spark.createDataFrame(list(rows), schema, verifySchema=False)  # typed by construction


def sql_functions() -> Any:
    """``pyspark.sql.functions``, for aggregation expressions."""
    from pyspark.sql import functions

    return functions


def staged_frame(spark: Any, directory: str, value_type: str, size_us: int,
                 wanted: Sequence[tuple[str, int]] | None) -> Any:
    """The window records staged under ``directory`` as JSON lines, one sub-directory
    ``window_start=S`` per window (Spark's partition discovery supplies the column), as
    :func:`window_frame`'s DataFrame, restricted to the ``wanted`` (key, window_start)
    pairs unless that is None. The executors parse the files; the driver ships only
    the pairs (a broadcast join, ~0.3 s per job on 2 cores, hence optional)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T_

    value: Any = _value_type(value_type)
    schema = T_.StructType([
        T_.StructField("key", T_.StringType(), True),
        T_.StructField("timestamp", T_.LongType(), True),
        T_.StructField("value", value, True),
        T_.StructField("window_start", T_.LongType(), True),
    ])
    records = spark.read.schema(schema).option("mode", "FAILFAST").json(directory)
    if wanted is not None:
        pairs = spark.createDataFrame(list(wanted), "key string, window_start long")
        records = records.join(F.broadcast(pairs), ["key", "window_start"], "inner")
    return records.select(
        "key", "window_start", (F.col("window_start") + F.lit(int(size_us))).alias("window_end"),
        "timestamp", "value")
