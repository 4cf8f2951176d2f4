"""The controller lease: one leader among controller replicas, chosen through the store.

Controllers are replicas over one store (ARCHITECTURE.md, "Controller high
availability"). Leadership is a lease kept in the store's metadata, next to the
registry it guards:

    lease/holder   the holding controller's identity (address/pid/nonce)
    lease/epoch    the leader epoch: +1 each time the lease changes hands, never reset
    lease/until    when the lease runs out, in the store's clock (ms since the epoch)

* :meth:`LeaseStore.claim_lease` takes the lease when it is free or has run out (a new
  epoch) or extends it for its holder (same epoch); otherwise it returns None.
* :meth:`LeaseStore.renew_lease` extends it for ``(holder, epoch)``; False means the
  lease changed hands: the caller is no longer the leader and must stop writing.
* Every controller write passes its epoch (``put_meta(..., epoch=E)``,
  ``acquire(..., epoch=E)``); the store applies it only if ``E`` is still the current
  epoch, in the same atomic operation as the write. A deposed leader that wakes up
  (SIGSTOP, a long GC, a partition) therefore writes nothing:
  :class:`LeadershipLostError`.

Which clock: SQLite (one machine) uses the writing process's wall clock; Redis uses
the server's ``TIME`` inside the script, so controllers on different hosts agree.

On Redis Cluster the lease fields live in the ``mw:meta`` hash with the registry (one
slot): ``put_meta`` is checked atomically there. A range token lives in its range's
slot, which a script cannot check against the lease slot, so each range also keeps
the highest epoch that moved it (``lepoch``) and refuses ``acquire`` from a lower
one; on a single Redis node and on SQLite the lease itself is checked as well.
"""

from __future__ import annotations

from dataclasses import dataclass

from millwheel.errors import InvalidSpecError, MillWheelError

LEASE_PREFIX = "lease/"
HOLDER = "lease/holder"
EPOCH = "lease/epoch"
UNTIL = "lease/until"


class LeadershipLostError(MillWheelError):
    """A controller write carried a leader epoch that is no longer current: another
    controller holds the lease now, and this one must stop writing (stand by)."""

    def __init__(self, what: str, epoch: int, current: int | None) -> None:
        self.epoch = epoch
        self.current = current
        now = "its lease ran out" if current is None else f"current epoch is {current}"
        super().__init__(f"{what}: leader epoch {epoch} is not current ({now}); this "
                         "controller is no longer the leader")


@dataclass(frozen=True)
class Lease:
    """The lease as stored: ``remaining_ms`` <= 0 means it ran out (free to claim)."""

    holder: str
    epoch: int
    remaining_ms: int

    @property
    def held(self) -> bool:
        return bool(self.holder) and self.remaining_ms > 0


def check_meta_name(name: str) -> None:
    """``lease/`` names are the lease's own: only the lease operations write them."""
    if name.startswith(LEASE_PREFIX):
        raise InvalidSpecError(f"metadata name {name[:100]!r}: the 'lease/' names are reserved "
                               "for the controller lease")


def check_ttl(ttl_ms: int) -> None:
    if not 1 <= ttl_ms <= 3_600_000:
        raise InvalidSpecError(f"lease ttl_ms must be 1..3600000, got {ttl_ms}")
