"""Who may call what: the role every RPC needs, in one table.

A credential (a bearer token, or a client certificate under ``--tls-role``) carries one
role; each role may do what the one below it may, and more:

- **read**: look (watermarks, state, keys, status, list/describe, subscribe, reflection,
  the console read-only);
- **client**: feed and shape the pipeline: read, plus Inject, the workers' public
  ``Ingest.Write``, InjectRoutes/WriterWatermark, register, update and unregister
  computations, injectors and sinks;
- **operator**: run the deployment: client, plus rescale, savepoint (and so stop and
  drain, which are savepoint options), restore, dead-letter replay and the console's
  actions;
- **cluster**: the cluster secret the controller and workers hold: everything,
  including the internal ``Cluster`` and ``Worker`` services.

Why one table of method -> role (:data:`METHOD_ROLES`) rather than a mark on each
servicer method: the check runs in the interceptor, before any servicer (so a refused
call changes nothing) and on every server alike (the controller's client port, the
workers' Ingest listener); and a test (tests/unit/test_roles.py) checks the table
against every RPC of every service in ``proto/``, so a new RPC without an entry fails
the suite instead of being open to everyone. A method missing from the table needs the
cluster secret at run time (closed, not open).

Health checking stays open (load balancers and probes carry no credential).
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass
from typing import Protocol


class Role(enum.IntEnum):
    """A credential's powers, ordered: a role may do all that a lower one may."""

    READ = 1
    CLIENT = 2
    OPERATOR = 3
    CLUSTER = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Role:
        """A role a user names (``read``, ``client``, ``operator``); not ``cluster``:
        that power belongs to the cluster secret alone."""
        for role in (cls.READ, cls.CLIENT, cls.OPERATOR):
            if text.strip().lower() == role.label:
                return role
        raise ValueError(f"unknown role {text[:40]!r}: one of read, client, operator")


READ, CLIENT, OPERATOR, CLUSTER = Role.READ, Role.CLIENT, Role.OPERATOR, Role.CLUSTER

#: ``package.Service/Method`` -> the least role that may call it.
METHOD_ROLES: dict[str, Role] = {
    # -- millwheel.v1.Controller: reads ---------------------------------------------------
    "millwheel.v1.Controller/ListComputations": READ,
    "millwheel.v1.Controller/DescribeComputation": READ,
    "millwheel.v1.Controller/GetWatermark": READ,
    "millwheel.v1.Controller/GetState": READ,
    "millwheel.v1.Controller/ListKeys": READ,
    "millwheel.v1.Controller/Subscribe": READ,
    "millwheel.v1.Controller/ClusterStatus": READ,
    # -- feeding and shaping the pipeline ---------------------------------------------------
    "millwheel.v1.Controller/RegisterComputation": CLIENT,
    "millwheel.v1.Controller/RegisterInjector": CLIENT,
    "millwheel.v1.Controller/RegisterTopology": CLIENT,
    "millwheel.v1.Controller/UnregisterComputation": CLIENT,
    "millwheel.v1.Controller/UpdateComputation": CLIENT,
    "millwheel.v1.Controller/Inject": CLIENT,
    "millwheel.v1.Controller/InjectRoutes": CLIENT,
    "millwheel.v1.Controller/WriterWatermark": CLIENT,
    "millwheel.v1.Ingest/Write": CLIENT,
    # -- running the deployment -------------------------------------------------------------
    "millwheel.v1.Controller/RescaleComputation": OPERATOR,
    "millwheel.v1.Controller/CreateSavepoint": OPERATOR,  # --stop and --drain too
    "millwheel.v1.Controller/RestoreSavepoint": OPERATOR,
    "millwheel.v1.Controller/ReplayDeadLetters": OPERATOR,
    # -- internal to the cluster -----------------------------------------------------------
    "millwheel.v1.Cluster/Heartbeat": CLUSTER,
    "millwheel.v1.Worker/Deliver": CLUSTER,
}

#: Whole services outside ``proto/``: reflection describes the API (read); health is open.
SERVICE_ROLES: dict[str, Role | None] = {
    "grpc.reflection.v1.ServerReflection": READ,
    "grpc.reflection.v1alpha.ServerReflection": READ,
    "grpc.health.v1.Health": None,
}

#: Services only cluster members call (their refusal says so).
INTERNAL_SERVICES = frozenset({"millwheel.v1.Cluster", "millwheel.v1.Worker"})

#: What the console lets a session do beyond reading (services/ui/server.py).
CONSOLE_ACTION_ROLE = OPERATOR


def service_of(method: str) -> str:
    """``/package.Service/Method`` -> ``package.Service``."""
    return method.split("/")[1] if method.count("/") >= 2 else method


def required(method: str) -> Role | None:
    """The least role that may call ``method`` (``/package.Service/Method``), None for an
    open one (health); a method in no table needs the cluster secret."""
    service = service_of(method)
    if service in SERVICE_ROLES:
        return SERVICE_ROLES[service]
    return METHOD_ROLES.get(method.lstrip("/"), CLUSTER)


@dataclass(frozen=True)
class Identity:
    """Who a credential is: its ``name`` (a named credential's, or ``client token``,
    ``operator token``, ``cluster secret``, ``certificate CN``), its ``role``, and
    whether it names one client (``per_client``: admission limits then count per name,
    not per address; a token every client shares names nobody in particular)."""

    name: str
    role: Role
    per_client: bool = False

    def describe(self) -> str:
        return f"{self.name} (role {self.role.label})"


class CredentialLookup(Protocol):
    """A source of named credentials (services/credentials.py's ``CredentialBook``)."""

    def lookup(self, token: str) -> Identity | None:
        """The credential ``token`` is, or None if it is none (unknown or revoked)."""
        ...


OPERATOR_HINT = ("the operator token: --operator-token-file FILE, $MILLWHEEL_OPERATOR_TOKEN or "
                 "$MILLWHEEL_OPERATOR_TOKEN_FILE, or the file `millwheel up` writes beside the client "
                 "token (its data directory's operator-token), or a credential made with "
                 "`millwheel credentials create NAME --role operator`")


def refusal_message(method: str, needed: Role, held: Identity) -> str:
    """The PERMISSION_DENIED message: the method, the role it needs, the one held, and
    how to get the one needed."""
    how = {READ: "", CLIENT: "; send the client token ($MILLWHEEL_AUTH_TOKEN) or a credential "
                             "with role client",
           OPERATOR: f"; send {OPERATOR_HINT}", CLUSTER: ""}[needed]
    return (f"permission denied: {method} needs role {needed.label}; this call's credential is "
            f"{held.describe()}{how}")


def identify(token: str, *, cluster_secret: str | None, operator_token: str | None = None,
             client_token: str | None = None, book: CredentialLookup | None = None) -> Identity | None:
    """The credential a presented bearer ``token`` is, or None (unknown). The
    deployment's own tokens are compared in constant time; a named credential is
    found by its hash (services/credentials.py)."""
    for name, expected, role in (("cluster secret", cluster_secret, CLUSTER),
                                 ("operator token", operator_token, OPERATOR),
                                 ("client token", client_token, CLIENT)):
        if expected is not None and hmac.compare_digest(token.encode(), expected.encode()):
            return Identity(name, role)
    return book.lookup(token) if book is not None and token else None
