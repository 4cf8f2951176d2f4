"""Moving a computation's per-range data to another key-range count (a rescale), through
the store protocol only, so every backend does it the same way.

The caller (services/controller/rescale.py) fences every range involved first and holds
a token for each; this module only reads and writes under those tokens. It copies
from one node's layout (``src``, ``old`` ranges) into another's (``dst``, ``new``
ranges), by key, with the routing the runtime uses (:func:`millwheel.keys.key_range`):

* state and timers: each key's to ``key_range(key, new)``;
* pending productions (the node's own outbox): a production's record key is its
  *consumer's* key, not the key that produced it, and where it waits does not change
  where it goes (senders route every entry at send time), so what matters is that it
  is kept once: old range ``s``'s entries go to new range ``s`` if there is one, else
  to :func:`outbox_home`;
* consumed record IDs: the store keeps them per range without the key they carried, so
  a redelivered record may reach any new range: every old range's IDs are written into
  every new range (``new`` times the IDs, until retention expires them). A rescale
  stages them once (``ids="once"``: into the staging node's range 0, each ID once) and
  spreads them into every range only when it copies the staged layout in
  (:func:`spread_ids`): the IDs are the bulk of what a rescale writes.

:func:`clear` deletes everything of a node's ranges (state, timers, outbox, consumed
IDs, retry attempts). Watermarks and error counters only rise in the store; they are
not copied here (see the controller module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Literal

from millwheel.keys import key_range
from millwheel.record import MAX_TIMESTAMP
from millwheel.state.protocol import ID_PAGE, Checkpoint, StateStore

KEY_PAGE = 1000
FIRST_VALUE_PAGE = 100  #: keys' values read (and written) in the first call, before any size is seen
PAGE_BYTES = 32 << 20  #: about how many bytes of values one read and one checkpoint carry
CHUNK = 2000  #: items per checkpoint written
ID_CHUNK = 10_000  #: consumed IDs per checkpoint written (one statement each on SQLite)

Tokens = Callable[[str, int], int]
#: Where ``copy`` writes consumed IDs: into ``every`` new range, range s into the ``same``
#: range s, ``once`` into range 0 (each ID once), or ``none`` (copied apart).
Ids = Literal["every", "same", "once", "none"]


@dataclass
class Moved:
    """What a copy wrote."""

    keys: int = 0
    timers: int = 0
    productions: int = 0
    ids: int = 0


def keys_by_range(store: StateStore, node: str, count: int) -> dict[int, list[str]]:
    """The node's keys with state, by their range under ``count`` ranges."""
    out: dict[int, list[str]] = {}
    after: str | None = None
    while True:
        page = store.list_keys(node, after, KEY_PAGE)
        for k in page:
            out.setdefault(key_range(k, count), []).append(k)
        if len(page) < KEY_PAGE:
            return out
        after = page[-1]


def outbox_home(s: int, new: int) -> int:
    """Where old range ``s``'s pending productions wait under ``new`` ranges."""
    return s if s < new else s % new


def _write(store: StateStore, node: str, r: int, tokens: Tokens, now_us: int, **fields: object) -> None:
    store.checkpoint(Checkpoint(node, r, tokens(node, r), now_us, **fields))  # type: ignore[arg-type]


def copy(store: StateStore, src: str, old: int, dst: str, new: int, tokens: Tokens, now_us: int,
         ids: Ids = "every") -> Moved:
    """Write every item of ``src``'s ``old`` ranges into ``dst``'s ``new`` ranges (which
    the caller cleared). Consumed IDs are remembered at ``now_us``, as ``ids`` says
    (:data:`Ids`; ``same`` is a copy between equal layouts)."""
    moved = Moved()
    by_range = keys_by_range(store, src, old)
    for s in range(old):
        keys = by_range.get(s, [])
        i, n = 0, FIRST_VALUE_PAGE
        while i < len(keys):
            page = keys[i:i + n]
            i += len(page)
            values = store.read_state(src, page, s)
            size = sum(len(v) for v in values.values())
            split: dict[int, dict[str, bytes | None]] = {}
            for k, v in values.items():
                split.setdefault(key_range(k, new), {})[k] = v
            for r, writes in split.items():
                _write(store, dst, r, tokens, now_us, state_writes=writes)
            moved.keys += len(values)
            # The next page sized to about PAGE_BYTES of values (large states are neither
            # read nor checkpointed a thousand at a time: a Redis command takes 512 MiB).
            n = max(1, min(KEY_PAGE, PAGE_BYTES * len(page) // max(1, size)))
        timers: dict[int, list] = {}  # type: ignore[type-arg]
        for t in store.read_timers(src, s):
            timers.setdefault(key_range(t.key, new), []).append(t)
        for r, ts in timers.items():
            for i in range(0, len(ts), CHUNK):
                _write(store, dst, r, tokens, now_us, timer_sets=ts[i:i + CHUNK])
            moved.timers += len(ts)
        prods = store.read_outbox(src, s)
        for i in range(0, len(prods), CHUNK):  # in checkpoint order, as they were
            _write(store, dst, outbox_home(s, new), tokens, now_us, productions=prods[i:i + CHUNK])
        moved.productions += len(prods)
        if ids == "same":
            moved.ids += copy_ids(store, src, s, dst, s, tokens, now_us)
        elif ids != "none":
            moved.ids += _ids_of(store, src, s, dst, new if ids == "every" else 1, tokens, now_us)
    return moved


def _paged(store: StateStore, src: str, s: int, write: Callable[[list[str]], int]) -> int:
    """Range ``s``'s consumed IDs read in pages of ``ID_PAGE``, each handed to ``write``
    (which returns how many it wrote)."""
    n = 0
    page: list[str] = []
    for rid in store.iter_ids(src, s):
        page.append(rid)
        if len(page) >= ID_PAGE:
            n, page = n + write(page), []
    return n + write(page)


def _ids_of(store: StateStore, src: str, s: int, dst: str, new: int, tokens: Tokens, now_us: int) -> int:
    """Range ``s``'s consumed IDs into ``dst``'s ranges 0..new-1, in pages."""
    return _paged(store, src, s, lambda page: _ids_everywhere(store, dst, new, page, tokens, now_us))


def spread_ids(store: StateStore, src: str, s: int, dst: str, new: int, tokens: Tokens, now_us: int) -> int:
    """Range ``s``'s consumed IDs (staged ``once``) into every one of ``dst``'s ``new``
    ranges: a page read once, written to each range, in one store transaction per
    page where the store has write groups (:func:`_grouped`)."""
    return _paged(store, src, s, lambda page: _spread(store, dst, new, page, tokens, now_us))


def _spread(store: StateStore, dst: str, new: int, ids: list[str], tokens: Tokens, now_us: int) -> int:
    """``ids`` into every one of ``dst``'s ``new`` ranges, in checkpoints of ID_CHUNK. (Not
    in one write group: a service's SQLite store takes its cross-process writer lock per
    write, inside which a group's transaction would wait for another process.)"""
    for r in range(new):
        for i in range(0, len(ids), ID_CHUNK):
            _write(store, dst, r, tokens, now_us, consumed_ids=ids[i:i + ID_CHUNK])
    return len(ids) * new


def copy_ids(store: StateStore, src: str, s: int, dst: str, r: int, tokens: Tokens, now_us: int) -> int:
    """One range's consumed IDs into another range, as they are (no fan-out)."""
    page: list[str] = []
    n = 0
    for rid in store.iter_ids(src, s):
        page.append(rid)
        if len(page) >= CHUNK:
            _write(store, dst, r, tokens, now_us, consumed_ids=page)
            n, page = n + len(page), []
    if page:
        _write(store, dst, r, tokens, now_us, consumed_ids=page)
    return n + len(page)


def _ids_everywhere(store: StateStore, dst: str, new: int, ids: list[str], tokens: Tokens, now_us: int) -> int:
    """Write ``ids`` into every new range; those already written (from another old range:
    after an earlier rescale every range held them all) are skipped, by one look at range
    0, which holds every ID written here."""
    if ids:
        seen = store.contains_ids(dst, 0, ids)
        ids = [i for i in ids if i not in seen] if seen else ids
    return _spread(store, dst, new, ids, tokens, now_us)


def clear(store: StateStore, node: str, ranges: Iterable[int], layouts: Iterable[int], tokens: Tokens,
          now_us: int) -> None:
    """Delete everything of ``node``'s ``ranges``: the state of every key that any of the
    range counts in ``layouts`` places there (a copy cut short leaves keys in either
    layout), timers, pending productions, consumed IDs and retry attempts."""
    wanted = set(ranges)
    counts = sorted(set(layouts))
    after: str | None = None
    while True:
        page = store.list_keys(node, after, KEY_PAGE)
        deletes: dict[int, dict[str, bytes | None]] = {}
        for k in page:
            for c in counts:
                r = key_range(k, c)
                if r in wanted:
                    deletes.setdefault(r, {})[k] = None
        for r, writes in deletes.items():
            _write(store, node, r, tokens, now_us, state_writes=writes)
        if len(page) < KEY_PAGE:
            break
        after = page[-1]
    for r in sorted(wanted):
        timers = store.read_timers(node, r)
        for i in range(0, len(timers), CHUNK):
            _write(store, node, r, tokens, now_us,
                   timer_clears=[(t.key, t.tag) for t in timers[i:i + CHUNK]])
        prods = store.read_outbox(node, r)
        for i in range(0, len(prods), CHUNK):
            store.ack(node, r, tokens(node, r), [(p.consumer, p.record.record_id) for p in prods[i:i + CHUNK]])
        store.expire_ids(node, r, tokens(node, r), MAX_TIMESTAMP)
        attempts = list(store.read_errors(node, r).attempts)
        if attempts:
            _write(store, node, r, tokens, now_us, resolved=attempts)
