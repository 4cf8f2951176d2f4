"""Named credentials: one bearer token per client, each with a role, issued and revoked
by name (``millwheel credentials create|list|revoke``).

**Where they live, and why there.** Each credential is one metadata entry of the
service's store (``credentials/NAME``: its name, role, creation time and the SHA-256 of
its token; never the token, which is printed once, at creation). Every server of a
deployment already reads that store (the controller, and every worker, whose Ingest
listener takes the same tokens), so a :class:`CredentialBook` in each process re-reads
the entries every :data:`REFRESH_S` seconds and a revocation reaches every listener
within a few seconds, with nothing to distribute and no new RPC. The command writes
the store directly: whoever can write the store already holds every power of the
deployment (its state, its registry, its leases), so issuing credentials needs no
weaker proof than that, and a leaked operator token cannot mint new credentials. The
alternative, an operator-only RPC, would make the operator token a master key.

**Hashes.** A token is 32 random bytes (256 bits): a plain SHA-256 of it cannot be
reversed or guessed, so no slow password hash is needed, and a lookup is one hash and
one dictionary probe. Reading the store reveals which credentials exist, not a token.

**Failing closed.** If the store cannot be read for :data:`STALE_S` seconds, the book
forgets every named credential (a revocation must not be outlived by an outage); the
deployment's own tokens (client, operator, cluster secret) are unaffected.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from millwheel.errors import AlreadyExistsError, InvalidSpecError, NotFoundError
from millwheel.state.protocol import StateStore

from .rpc.roles import Identity, Role

log = logging.getLogger("millwheel.credentials")

PREFIX = "credentials/"
REFRESH_S = 2.0
STALE_S = 30.0
TOKEN_PREFIX = "mwc_"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


@dataclass(frozen=True)
class Credential:
    """One named credential as stored (without its token)."""

    name: str
    role: Role
    sha256: str
    created_us: int

    def to_json(self) -> bytes:
        return json.dumps({"name": self.name, "role": self.role.label, "sha256": self.sha256,
                           "created_us": self.created_us}).encode()

    @staticmethod
    def from_json(raw: bytes) -> Credential:
        d = json.loads(raw)
        return Credential(str(d["name"]), Role.parse(str(d["role"])), str(d["sha256"]), int(d["created_us"]))


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise InvalidSpecError(f"credential name {name[:80]!r}: 1-64 characters of letters, digits and "
                               "._@- (starting with a letter or digit)")
    return name


def create(store: StateStore, name: str, role: Role, now_us: int) -> str:
    """Issue credential ``name`` with ``role``; returns its token (shown once: only its
    hash is kept). ALREADY_EXISTS if the name is taken (revoke it first to rotate).

    The entry is written only if the name holds none, in one atomic step of the store
    (:meth:`~millwheel.state.protocol.StateStore.insert_meta`): of two creates of one
    name racing, from any processes, exactly one wins and the other is refused, so no
    token handed out is silently overwritten by another."""
    check_name(name)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    if not store.insert_meta(PREFIX + name, Credential(name, role, digest(token), now_us).to_json()):
        raise AlreadyExistsError(f"credential {name!r} already exists: `millwheel credentials revoke "
                                 f"{name}` first to issue a new token under that name")
    return token


def revoke(store: StateStore, name: str) -> None:
    """Remove credential ``name``: every server refuses its token within :data:`REFRESH_S`."""
    check_name(name)
    if store.get_meta(PREFIX + name) is None:
        raise NotFoundError(f"no credential named {name!r} (`millwheel credentials list` shows them)")
    store.put_meta(PREFIX + name, None)


def listed(store: StateStore) -> list[Credential]:
    """Every named credential, by name (unreadable entries skipped, with a log line)."""
    out = []
    for key, raw in sorted(store.list_meta(PREFIX).items()):
        try:
            out.append(Credential.from_json(raw))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the unreadable credential entry %s: %s", key, exc)
    return out


def reader_url(url: str) -> str:
    """The store URL a book reads through: for SQLite without its own WAL checkpointer
    thread (the process's main connection has one)."""
    if url.startswith("sqlite:") and "wal_checkpointer=" not in url:
        return url + ("&" if "?" in url else "?") + "wal_checkpointer=off"
    return url


class CredentialBook:
    """The named credentials as a server knows them: token hash -> identity, re-read
    from the store every ``refresh_s`` by a thread of its own (``open_store`` is called
    there, so a store that is down delays nothing at start-up)."""

    def __init__(self, open_store: Callable[[], StateStore], refresh_s: float = REFRESH_S,
                 stale_s: float = STALE_S) -> None:
        self._open = open_store
        self._refresh_s = refresh_s
        self._stale_s = stale_s
        self._by_hash: dict[str, Identity] = {}
        self._loaded_at: float | None = None
        self._store: StateStore | None = None
        self._last_log = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="credentials", daemon=True)
        self._thread.start()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> CredentialBook:
        from millwheel.state import open_store

        return cls(lambda: open_store(reader_url(url)), **kwargs)

    def lookup(self, token: str) -> Identity | None:
        return self._by_hash.get(digest(token))

    def refresh(self) -> None:
        """Re-read the entries now (the thread does this every ``refresh_s``)."""
        if self._store is None:
            self._store = self._open()
        self._by_hash = {c.sha256: Identity(c.name, c.role, per_client=True) for c in listed(self._store)}
        self._loaded_at = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._store is not None:
            self._store.close()

    def _run(self) -> None:
        while True:
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001 - the store is down or being replaced: retry
                now = time.monotonic()
                if self._loaded_at is not None and now - self._loaded_at > self._stale_s and self._by_hash:
                    self._by_hash = {}  # fail closed: a revocation must not outlive an outage
                    log.warning("named credentials unreadable for %.0f s: refusing them until the store "
                                "answers", now - self._loaded_at)
                if now - self._last_log > 30.0:
                    self._last_log = now
                    log.warning("cannot read the named credentials from the store: %s", exc)
            if self._stop.wait(self._refresh_s):
                return


_books: dict[str, CredentialBook] = {}
_books_lock = threading.Lock()


def book_for(url: str) -> CredentialBook:
    """This process's book of the store at ``url``: opened on first use, then shared by
    every server and admission check of the process."""
    with _books_lock:
        book = _books.get(url)
        if book is None:
            book = _books[url] = CredentialBook.from_url(url)
        return book
