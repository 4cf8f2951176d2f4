"""Leader election among controller replicas, through the store's lease.

Every controller runs an :class:`Elector`: a thread that, every quarter of the lease's
time to live, renews the lease if this controller holds it or tries to claim it if
not (millwheel.state.lease). The holder string starts with the controller's
advertised address, so every replica knows where the leader is (standbys redirect
workers there and forward client writes to it).

Safety does not rest on timing. A leader believes it leads only until
``renewed_at + ttl * SAFETY`` on its own monotonic clock (which keeps running while
the process is SIGSTOPped), and every write it makes carries its epoch
(:class:`LeaderStore`), which the store checks in the same atomic operation: a deposed
leader that wakes up writes nothing, whatever it still believes.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Any, Callable, Mapping
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from millwheel.errors import InvalidSpecError, MillWheelError
from millwheel.state.lease import LeadershipLostError
from millwheel.state.protocol import StateStore

log = logging.getLogger("millwheel.controller")

SAFETY = 0.75  # of the TTL: how long after a renewal was SENT a leader trusts it
MIN_TTL_S, MAX_TTL_S = 0.1, 3600.0  # renewed every quarter of it; the store takes 1 ms..1 h


def lease_store_url(url: str, ttl_s: float) -> str:
    """The store URL the lease is renewed through (its own connection): on Redis, every
    call bounded by the lease's validity (``SAFETY * ttl_s``: socket and connect timeouts
    of half of it, retries until all of it), lower values given in the URL kept. A
    renewal that cannot answer in time is useless anyway; waiting on, it kept the next
    one from being sent: on Redis Cluster a stopped master held the client's topology
    refresh for the whole socket timeout (10 s) and the leader's lease lapsed although
    the lease's own shard was healthy. SQLite URLs are returned unchanged."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return url
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    valid = max(MIN_TTL_S, ttl_s * SAFETY)

    def bound(name: str, limit: float) -> None:
        try:
            given = float(query[name]) if name in query else limit
        except ValueError:
            return  # the store's own parsing says what is wrong with it
        query[name] = f"{min(given, limit):g}" if given > 0 else f"{limit:g}"
    bound("socket_timeout", valid / 2)
    bound("connect_timeout", valid / 2)
    bound("retry_deadline", valid)
    return urlunsplit(parts._replace(query=urlencode(query)))


class Elector:
    def __init__(self, store: StateStore, address: str, ttl_s: float = 2.0,
                 on_elected: Callable[[int], None] = lambda e: None,
                 on_deposed: Callable[[], None] = lambda: None) -> None:
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise InvalidSpecError(f"--lease-ttl must be {MIN_TTL_S:g}..{MAX_TTL_S:g} seconds, got {ttl_s:g}")
        self.store = store
        self.address = address
        self.holder = ""
        self.ttl_s = ttl_s
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.epoch: int | None = None  # ours while we lead
        self.leader_address: str | None = None  # whoever leads, as last read
        self.leader_epoch = 0
        self._valid_until = 0.0
        self._sent_at = 0.0  # when the last round began (its renewal or claim sent)
        self._stop = threading.Event()
        self._step_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="elector", daemon=True)

    def start(self, address: str | None = None) -> None:
        """Take part from now on as ``address`` (the holder string starts with it, so
        the others learn where the leader is)."""
        self.address = address or self.address
        self.holder = f"{self.address} {os.getpid()} {secrets.token_hex(4)}"
        self.step(inline=True)  # lead from the first moment if the lease is free
        self._thread.start()

    def is_leader(self) -> bool:
        return self.epoch is not None and time.monotonic() < self._valid_until

    def stop(self, release: bool = True) -> None:
        """Stop electing; hand the lease over at once (a standby need not wait for it to
        run out) when ``release``."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.ttl_s)
        epoch, self.epoch = self.epoch, None
        if release and epoch is not None:
            try:
                self.store.release_lease(self.holder, epoch)
            except MillWheelError as exc:
                log.warning("could not release the controller lease: %s", exc)

    def _loop(self) -> None:
        """A round every quarter of the TTL, counted from when the last one SENT its
        renewal (not from when its answer came back): a renewal answered late (the
        store's one writer busy, the process starved of CPU on a loaded machine) is
        followed by the next one at once, rather than a quarter of the TTL after it,
        while the last renewal still counts (issue 34 item 9: two late rounds in a row,
        each waiting its own quarter, ran past ``SAFETY``)."""
        while not self._stop.wait(self._due_in()):
            try:
                self.step()
            except Exception:
                log.exception("leader election step failed")

    def _due_in(self) -> float:
        """Seconds until the next round: a quarter of the TTL after the last was sent."""
        return max(0.0, self._sent_at + self.ttl_s / 4 - time.monotonic())

    def step(self, inline: bool = False) -> None:
        """One round: renew (leader) or try to claim (standby), then learn the leader.

        A won claim runs ``on_elected`` on a thread of its own, so that renewals go on
        while a large assignment is loaded (``inline``: here, as at start)."""
        with self._step_lock:
            epoch = self._step()
        if epoch is not None:
            if inline:
                self._take_over(epoch)
            else:
                threading.Thread(target=self._take_over, args=(epoch,), name="takeover",
                                 daemon=True).start()

    def _take_over(self, epoch: int) -> None:
        try:
            self.on_elected(epoch)
        except Exception:
            log.exception("taking over as leader (epoch %d) failed; standing by", epoch)
            with self._step_lock:
                if self.epoch == epoch:
                    self._lose("taking over failed")
                    try:
                        self.store.release_lease(self.holder, epoch)
                    except MillWheelError as exc:
                        log.warning("could not release the controller lease: %s", exc)

    def _step(self) -> int | None:
        """The round itself; returns the epoch just won, if any."""
        won = None
        ttl_ms = max(1, int(self.ttl_s * 1000))
        sent = self._sent_at = time.monotonic()
        if self.epoch is not None:
            try:
                renewed: bool | None = self.store.renew_lease(self.holder, self.epoch, ttl_ms)
            except MillWheelError as exc:
                log.warning("cannot renew the controller lease: %s", exc)
                renewed = None
            if renewed:
                self._valid_until = sent + self.ttl_s * SAFETY
            elif renewed is False or time.monotonic() >= self._valid_until:
                self._lose("the lease changed hands" if renewed is False else "the lease ran out")
        else:
            try:
                epoch = self.store.claim_lease(self.holder, ttl_ms)
            except MillWheelError as exc:
                log.warning("cannot claim the controller lease: %s", exc)
                epoch = None
            if epoch is not None:
                self._valid_until = sent + self.ttl_s * SAFETY
                self.epoch = epoch
                self.leader_address, self.leader_epoch = self.address, epoch
                # The first election is routine; a later epoch means a leader changed.
                log.log(logging.INFO if epoch == 1 else logging.WARNING,
                        "controller %s is the leader (epoch %d)", self.address, epoch)
                won = epoch
        try:
            lease = self.store.read_lease()
        except MillWheelError:
            return won
        if lease is not None:
            self.leader_epoch = lease.epoch
            self.leader_address = lease.holder.split(" ", 1)[0] if lease.held else None
        return won

    def _lose(self, why: str) -> None:
        log.warning("controller %s is no longer the leader (epoch %s): %s; standing by",
                    self.address, self.epoch, why)
        self.epoch = None
        self.on_deposed()


class LeaderStore:
    """The store as the leader writes it: ``acquire``, ``put_meta`` and ``put_metas`` carry the
    leader epoch (checked by the store atomically with the write); every write is
    refused at once, before reaching the store, when this controller no longer
    believes it leads. Reads pass through."""

    def __init__(self, store: StateStore, elector: Elector) -> None:
        self._store = store
        self._elector = elector

    def _epoch(self, what: str) -> int:
        epoch = self._elector.epoch
        if epoch is None or not self._elector.is_leader():
            raise LeadershipLostError(what, epoch or 0, None)
        return epoch

    def acquire(self, computation: str, range_id: int) -> int:
        epoch = self._epoch(f"acquire of {computation!r} range {range_id}")
        return self._store.acquire(computation, range_id, epoch=epoch)

    def put_meta(self, name: str, value: bytes | None) -> None:
        self._store.put_meta(name, value, epoch=self._epoch(f"put_meta {name[:100]!r}"))

    def put_metas(self, entries: Mapping[str, bytes | None]) -> None:
        self._store.put_metas(entries, epoch=self._epoch(f"put_metas of {len(entries)} entries"))

    def report_watermark(self, node: str, range_id: int, token: int, watermark: int) -> int:
        """Fenced by the range's token in the store (the owner's report is true whoever
        relays it); refused here too once this controller stopped leading."""
        self._epoch(f"report_watermark of {node!r} range {range_id}")
        return self._store.report_watermark(node, range_id, token, watermark)

    def trim_log(self, stream: str, through_seq: int, max_rows: int) -> int:
        """Log retention is the leader's job (services/controller/retention.py): refused
        here once this controller stopped leading (each batch checks)."""
        self._epoch(f"trim_log of {stream!r}")
        return self._store.trim_log(stream, through_seq, max_rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
