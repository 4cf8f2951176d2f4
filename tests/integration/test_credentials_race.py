"""``millwheel credentials create`` of one name, raced (issue 34): exactly one create
wins, on SQLite and on a real redis-server, and only the winner's token authenticates.

Each racer has its own store connection (as separate ``millwheel credentials create``
processes would), opened the way the command opens it. Every read of an entry is made
slow, as over a slow network: a create that checked whether the name was free and then
wrote it would see it free in every racer and hand out several tokens, all but the last
one silently overwritten; the store's atomic insert leaves one winner however slow the
reads are. A second round races real ``millwheel credentials create`` processes.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from millwheel.errors import AlreadyExistsError
from millwheel.state.protocol import StateStore
from services.credentials import PREFIX, Credential, CredentialBook, create, digest
from services.rpc.roles import CLIENT, OPERATOR, READ
from services.store_lock import open_service_store
from tests.support.redis_server import RedisServer

RACERS = 12
ROOT = Path(__file__).resolve().parents[2]


class SlowReads:
    """A store whose ``get_meta`` answers late: the window between a check and a write."""

    def __init__(self, store: StateStore, delay_s: float = 0.2) -> None:
        self._store = store
        self._delay_s = delay_s

    def get_meta(self, name: str) -> bytes | None:
        value = self._store.get_meta(name)
        time.sleep(self._delay_s)
        return value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.fixture(params=("sqlite", "redis"))
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'service.db'}"
        open_service_store(url).close()  # the service's store exists (the command never creates one)
        yield url
    else:
        with RedisServer() as server:
            yield server.url


def race(url: str, name: str) -> tuple[list[str], list[str]]:
    """RACERS creates of ``name`` at once; (the winners' tokens, the losers' errors)."""
    stores = [open_service_store(url) for _ in range(RACERS)]
    start = threading.Barrier(RACERS)
    won: list[str] = []
    lost: list[str] = []

    def one(i: int) -> None:
        start.wait()
        try:
            slow: Any = SlowReads(stores[i])
            won.append(create(slow, name, (READ, CLIENT, OPERATOR)[i % 3], 1_000 + i))
        except AlreadyExistsError as exc:
            lost.append(str(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(RACERS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for s in stores:
            s.close()
    return won, lost


def test_of_racing_creates_of_one_name_exactly_one_wins(store_url: str) -> None:
    book = CredentialBook.from_url(store_url, refresh_s=3600)
    try:
        for name in ("dashboard", "etl-loader", "x"):
            won, lost = race(store_url, name)
            book.refresh()
            dead = [t for t in won if book.lookup(t) is None]
            assert len(won) == 1, (f"{len(won)} creates of {name!r} succeeded; {len(dead)} of their tokens "
                                   "were silently overwritten and do not authenticate")
            assert len(lost) == RACERS - 1
            assert all(f"credential {name!r} already exists" in m and "revoke" in m for m in lost), lost
            check = open_service_store(store_url)
            try:
                stored = Credential.from_json(check.get_meta(PREFIX + name) or b"")
            finally:
                check.close()
            assert stored.sha256 == digest(won[0])  # the winner's, not a loser's written over it
            who = book.lookup(won[0])
            assert who is not None and who.name == name
    finally:
        book.close()


def test_racing_create_commands_hand_out_one_token(store_url: str, tmp_path: Path) -> None:
    """The real command, several processes at once: one token printed, one refusal each."""
    cmd = [sys.executable, "-m", "services.cli", "credentials", "create", "loader", "--role", "client",
           "--store", store_url]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [(p.wait(120), *p.communicate()) for p in procs]
    winners = [out.strip() for rc, out, _ in outs if rc == 0]
    assert len(winners) == 1, outs
    assert all("credential 'loader' already exists" in err for rc, _, err in outs if rc != 0), outs
    book = CredentialBook.from_url(store_url, refresh_s=3600)
    try:
        book.refresh()
        who = book.lookup(winners[0])
        assert who is not None and who.name == "loader" and who.role == CLIENT
    finally:
        book.close()
