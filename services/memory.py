"""A long-running process's memory: freed heap memory handed back to the system, and
``tracemalloc`` snapshots on request.

**Trimming** (on by default). A worker's allocations come and go in bursts: a batch of
5,000 records converted from protobuf, a backlog drained from an outbox, a range taken
and its Bloom filter rebuilt. Once freed, glibc's malloc keeps most of that memory for
reuse rather than giving it back, so the process's RSS stays at the highest burst it
ever had: in a soak, workers held 20-30 MB free-but-kept beside 20 MB in use
(docs/service.md, "Memory"). Every ``MILLWHEEL_MALLOC_TRIM_S`` seconds (default 60; 0
turns it off) a thread calls glibc's ``malloc_trim(0)``, which returns the free pages
of every arena (a few milliseconds). Elsewhere than glibc it does nothing.

**Tracing** (off by default), to find what grows. Off unless
``MILLWHEEL_TRACEMALLOC_S`` is set (seconds between snapshots) and, when
``MILLWHEEL_TRACEMALLOC_ROLES`` is set too (``worker``, ``controller`` or both,
comma-separated), names this process's role. Then the process traces allocations
(``MILLWHEEL_TRACEMALLOC_FRAMES`` frames each, default 10) and, every that many
seconds, appends to ``MILLWHEEL_TRACEMALLOC_DIR/tracemalloc-ROLE-PID.txt`` (default:
the working directory) its RSS (anonymous and file-backed), the traced total, the
memory outside Python's allocators (SQLite's heap, glibc malloc's bytes in use and
free-but-kept), the object counts by type that grew most, and the allocation sites
(by traceback) that grew most since the first snapshot and since the previous one.
The first snapshot is the baseline: taken one interval in, after start-up, so what
follows is what the process accumulates while it runs.

Tracing costs: every allocation records its traceback (a worker runs ~1.5-2x slower,
and the trace itself takes memory), so this is a diagnostic for a soak
(``bench/cases/soak.py --tracemalloc-s``), never a default. When the variable is unset
nothing is imported or started for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

ENV_TRIM = "MILLWHEEL_MALLOC_TRIM_S"
TRIM_S = 60.0
ENV_EVERY = "MILLWHEEL_TRACEMALLOC_S"
ENV_DIR = "MILLWHEEL_TRACEMALLOC_DIR"
ENV_FRAMES = "MILLWHEEL_TRACEMALLOC_FRAMES"
ENV_ROLES = "MILLWHEEL_TRACEMALLOC_ROLES"
TOP = 25  # allocation sites written per comparison
TOP_TYPES = 15


def start_from_env(role: str) -> None:
    """Start the trimmer (unless ``MILLWHEEL_MALLOC_TRIM_S`` is 0) and, if
    ``MILLWHEEL_TRACEMALLOC_S`` asks for it, tracing and its snapshot thread."""
    start_trimmer(_seconds(ENV_TRIM, TRIM_S))
    start_tracing(role)


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r}: not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name}={raw!r}: must be 0 (off) or a positive number of seconds")
    return value


def malloc_trim() -> bool:
    """Give malloc's free pages back to the system (glibc); False where there is none."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def start_trimmer(every_s: float) -> threading.Thread | None:
    """Call :func:`malloc_trim` every ``every_s`` seconds (0: never) on a daemon thread."""
    if every_s <= 0 or not hasattr(ctypes.CDLL(None), "malloc_trim"):
        return None

    def run() -> None:
        while True:
            time.sleep(every_s)
            malloc_trim()

    thread = threading.Thread(target=run, name="malloc-trim", daemon=True)
    thread.start()
    return thread


def start_tracing(role: str) -> threading.Thread | None:
    """Start tracing and the snapshot thread if ``MILLWHEEL_TRACEMALLOC_S`` asks for it."""
    every = os.environ.get(ENV_EVERY, "").strip()
    roles = os.environ.get(ENV_ROLES, "").split(",")
    if not every or (roles != [""] and role not in roles):
        return None
    try:
        every_s = float(every)
        frames = int(os.environ.get(ENV_FRAMES, "10"))
    except ValueError as exc:
        raise ValueError(f"{ENV_EVERY}={every!r} / {ENV_FRAMES}: not a number ({exc})") from None
    if not every_s > 0 or not 1 <= frames <= 100:
        raise ValueError(f"{ENV_EVERY} must be > 0 seconds and {ENV_FRAMES} 1..100, got {every!r}, {frames}")
    import tracemalloc

    tracemalloc.start(frames)
    path = Path(os.environ.get(ENV_DIR) or ".") / f"tracemalloc-{role}-{os.getpid()}.txt"
    thread = threading.Thread(target=_run, args=(path, every_s), name="tracemalloc", daemon=True)
    thread.start()
    return thread


def rss_mb() -> dict[str, float]:
    """This process's resident set in MB: the total, the anonymous part (heaps: what
    the process allocated) and the file-backed part (shared libraries, mapped files),
    from Linux's /proc (empty elsewhere)."""
    out: dict[str, float] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile"):
                out[name] = int(value.split()[0]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def native_mb() -> dict[str, float]:
    """Memory outside Python's allocators, best effort (Linux, glibc): SQLite's heap
    (its page caches: ``sqlite3_memory_used``) and glibc malloc's bytes in use and
    free-but-kept (``mallinfo2``: the free part is fragmentation RSS does not give back)."""
    out: dict[str, float] = {}
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("sqlite3") or "libsqlite3.so.0")
        lib.sqlite3_memory_used.restype = ctypes.c_int64
        lib.sqlite3_memory_highwater.restype = ctypes.c_int64
        out["sqlite_heap"] = lib.sqlite3_memory_used() / 2**20
        out["sqlite_heap_peak"] = lib.sqlite3_memory_highwater(0) / 2**20
    except (OSError, AttributeError):
        pass
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
        out["malloc_in_use"] = (info.uordblks + info.hblkhd) / 2**20
        out["malloc_free_kept"] = info.fordblks / 2**20
    except (OSError, AttributeError):
        pass
    return out


def type_counts() -> Counter[str]:
    """Live objects tracked by the garbage collector, by type name."""
    return Counter(type(o).__name__ for o in gc.get_objects())


def _run(path: Path, every_s: float) -> None:
    import tracemalloc

    # Anything allocated with this module or tracemalloc on the stack is the tracing's own
    # (the snapshots, the line cache that formats them); imports are start-up.
    filters = [tracemalloc.Filter(False, name, all_frames=True) for name in (
        tracemalloc.__file__, __file__, "<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")]
    started = time.monotonic()
    first: Any = None
    first_types: Counter[str] = Counter()
    previous: Any = None
    n = 0
    while True:
        time.sleep(every_s)
        n += 1
        snap = tracemalloc.take_snapshot().filter_traces(filters)
        types = type_counts()
        with open(path, "a") as out:
            _header(out, n, time.monotonic() - started, tracemalloc.get_traced_memory())
            if first is None:
                first, first_types = snap, types
                out.write("baseline taken\n\n")
                _top(out, "largest allocation sites", snap.statistics("traceback")[:TOP])
            else:
                grown = types.copy()
                grown.subtract(first_types)
                out.write("object counts grown since the baseline: " + ", ".join(
                    f"{name} {d:+,} ({types[name]:,})" for name, d in grown.most_common(TOP_TYPES) if d > 0) + "\n\n")
                _top(out, "grown since the baseline", _grown(snap.compare_to(first, "traceback")))
                _top(out, "grown since the previous snapshot", _grown(snap.compare_to(previous, "traceback")))
        previous = snap


def _grown(diffs: list[Any]) -> list[Any]:
    """The sites that grew most (compare_to orders by absolute change: shrinking too)."""
    return sorted((d for d in diffs if d.size_diff > 0), key=lambda d: -d.size_diff)[:TOP]


def _header(out: TextIO, n: int, elapsed_s: float, traced: tuple[int, int]) -> None:
    native = ", ".join(f"{k} {v:.1f} MB" for k, v in native_mb().items())
    rss = rss_mb()
    out.write(f"=== snapshot {n} at {elapsed_s / 60:.1f} min: RSS {rss.get('VmRSS', 0):.1f} MB "
              f"(anon {rss.get('RssAnon', 0):.1f}, file {rss.get('RssFile', 0):.1f}), traced "
              f"{traced[0] / 2**20:.1f} MB (peak {traced[1] / 2**20:.1f} MB); {native}\n")


def _top(out: TextIO, title: str, stats: list[Any]) -> None:
    out.write(f"--- {title}\n")
    for stat in stats:
        diff = getattr(stat, "size_diff", None)
        head = (f"{diff / 1024:+,.1f} KiB -> {stat.size / 1024:,.1f} KiB, {stat.count_diff:+,} blocks"
                if diff is not None else f"{stat.size / 1024:,.1f} KiB, {stat.count:,} blocks")
        out.write(head + "\n")
        for line in stat.traceback.format(limit=None, most_recent_first=True)[:12]:
            out.write(f"    {line}\n")
    out.write("\n")
    out.flush()
