"""Bounds on everything a spec can size, so no request can make a process do unbounded
work or keep unbounded data (names end up in logs, metrics labels and store keys;
key ranges are work under the controller's lock).

Each is a constant here, checked by :meth:`millwheel.topology.Topology.validate` and
:mod:`millwheel.operators.schema`, so ``millwheel run`` and the service refuse the
same specs with the same messages. The service's per-request limits (records per
Inject message, key and record ID sizes, timestamps ahead of the clock) are flags of
the controller: :mod:`services.inject_limits`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from millwheel.errors import InvalidSpecError

#: Computation, injector and stream names: 1..200 of letters, digits and ``_ . - :``.
#: (``injector:NAME`` is how an injector's node is named; ``.`` is for derived streams
#: such as ``<computation>.dead_letters``.)
MAX_NAME_CHARS = 200
NAME_CHARSET = "letters, digits and _ . - :"
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")

MAX_KEY_RANGES = 4096  #: key ranges of one computation
#: Key ranges of all registered computations together. 65,536 did not work: with two
#: workers on one machine the ranges were not all owned after 10 minutes and the workers
#: reached 3-4 GB; 32,768 settled but a worker was declared dead once; 16,384 held,
#: workers stable at 182 MB (bench/cases/registry_scale.py, docs/bench.md).
MAX_TOTAL_KEY_RANGES = 16_384
MAX_PARAMS_BYTES = 64 * 1024  #: a computation's code parameters, as JSON
MAX_PARAMS_DEPTH = 32  #: levels of nested lists and mappings in them (the params mapping is one)
MAX_STREAMS_PER_COMPUTATION = 256  #: inputs, and outputs, of one computation
MAX_COMPUTATIONS = 1000  #: computations in one topology
MAX_INJECTORS = 1000  #: injectors in one topology
MAX_LOG_STREAMS = 1024  #: streams logged although consumed (``log_streams``)
MAX_KEY_EXTRACTOR_CHARS = 256
MAX_WINDOWS_PER_RECORD = 1000  #: size_us / period_us of a sliding window
#: Stream-log retention (``Options.log_retention_us`` / ``log_retention_bytes``; 0 = no
#: limit of that kind): at least a second and a kibibyte, at most a century and a pebibyte
#: (both far inside int64, the wire type).
MIN_LOG_RETENTION_US = 1_000_000
MAX_LOG_RETENTION_US = 100 * 365 * 86_400 * 1_000_000
MIN_LOG_RETENTION_BYTES = 1024
MAX_LOG_RETENTION_BYTES = 1 << 50
#: Every duration a spec gives (window size and period, allowed lateness, record-ID
#: retention, state TTL), microseconds: a century. With event times within +-2^62
#: (:data:`millwheel.record.MAX_TIMESTAMP`), everything derived from them (a window's
#: end plus its lateness, now plus a TTL, now minus a retention) stays well inside an
#: int64, which is what the stores keep (a SQLite INTEGER; larger values failed every
#: checkpoint of the range).
MAX_DURATION_US = 100 * 365 * 86_400 * 1_000_000
#: The times a timer may be set for (user code's ``ctx.set_timer``): an int64.
MIN_TIMER_TIME, MAX_TIMER_TIME = -(2**63), 2**63 - 1
#: The most bytes one key's state may hold (user code's ``ctx.set_state``; a larger
#: value is refused there, naming the key, under the computation's error policy). The
#: stores keep more (Redis 512 MiB a value, SQLite about 1 GB), and a savepoint carries
#: any value up to 512 MiB split across frames; this leaves room for both, and for the
#: worker that holds the value in memory while it checkpoints it.
MAX_STATE_BYTES = 256 << 20


def check_name(name: object, what: str) -> None:
    """InvalidSpecError naming ``what`` unless ``name`` is a valid name."""
    if not isinstance(name, str) or not name:
        raise InvalidSpecError(f"{what}: name must be a non-empty string")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidSpecError(
            f"{what} {name[:40]!r}...: name of {len(name)} characters, over the limit of "
            f"{MAX_NAME_CHARS}")
    if not _NAME.fullmatch(name):
        raise InvalidSpecError(f"{what} {name!r}: names may hold only {NAME_CHARSET}")


def nesting_depth(value: object, limit: int = MAX_PARAMS_DEPTH) -> int:
    """Levels of nested lists and mappings in ``value`` (1 for a flat mapping, 0 for a
    scalar), found without recursion (a value nested deeper than Python's stack is
    exactly what this must survive) and no further than ``limit + 1``. A container met
    twice (YAML aliases) is walked once."""
    deepest = 0
    seen: set[int] = set()
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, Mapping):
            children: Iterable[object] = v.values()
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        if id(v) in seen:
            continue
        seen.add(id(v))
        deepest = max(deepest, depth)
        if deepest > limit:
            break
        stack.extend((c, depth + 1) for c in children)
    return deepest


def check_params_depth(params: object, where: str) -> None:
    """InvalidSpecError naming ``where`` if ``params`` nest deeper than
    :data:`MAX_PARAMS_DEPTH`: every later walk of them (JSON, comparison, copies) may
    recurse, and 1,000 levels fit in 64 KiB of JSON."""
    if nesting_depth(params) > MAX_PARAMS_DEPTH:
        raise params_too_deep(where)


def params_too_deep(where: str) -> InvalidSpecError:
    return InvalidSpecError(
        f"{where}: lists and mappings nested more than {MAX_PARAMS_DEPTH} deep, over the limit of "
        f"{MAX_PARAMS_DEPTH} levels (the params mapping counts as one); flatten the parameters")
