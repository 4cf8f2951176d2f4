"""Connectors refused where they name the service's own Redis store (issue 34, item 5).

A redis-stream source or sink pointed at the Redis server that holds the service's
store reads or writes the store's keyspace: a sink's ``redis_stream: mw:ranges:{C}``
creates, as a stream, a key the store later needs as a sorted set, and computation
``C`` never runs. So the controller refuses, at registration, a redis-stream
connector whose server is one the store uses (:func:`check_not_own_store`), and the
worker refuses to build one (the second line: a registry written before this check).

**What "the same server" is.** Host and port, compared after normalising: the port
defaults to 6379; a host is lowercased, without brackets or a trailing dot; every
loopback spelling (``localhost``, ``127.0.0.0/8``, ``::1``, ``0.0.0.0``) is one host;
a name is also resolved (``getaddrinfo``, bounded by :data:`RESOLVE_TIMEOUT_S`: a
name that does not resolve in time is compared by its text alone) and two hosts
sharing an address are one. The store's servers are its URL's and, on Redis Cluster,
every node its client knows (:meth:`RedisConnection.servers`), replicas included.

**The database number is ignored: the same host and port is refused whatever the
``/db``.** Keys of two databases cannot collide, but the server is still the store's:
one memory limit and eviction policy (a connector's stream filling it evicts or
refuses the store's writes), one AOF and its fsync policy, one ``FLUSHALL`` or
restart, and on Redis Cluster there is only database 0. Refusing the server whole is
the rule that needs no argument; a connector wanting Redis beside the store runs its
own ``redis-server``.

Not caught: a server reached by an address that neither spells nor resolves like the
store's (a proxy, NAT, another interface of the store's machine). Nothing here
connects to anything: a connector's server is judged by its URL's text.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from typing import Any, Iterable, Sequence
from urllib.parse import urlsplit

from millwheel.errors import InvalidSpecError
from millwheel.state.url_display import redact

DEFAULT_PORT = 6379
RESOLVE_TIMEOUT_S = 1.0
LOOPBACK = "loopback"
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}
#: The connector kinds that talk to a Redis server (their ``url`` is a redis:// URL).
REDIS_KINDS = ("redis-stream",)

Server = tuple[str, int]


def host_key(host: str) -> str:
    """``host`` as compared: lowercased, no brackets or trailing dot, every loopback
    spelling (and the unspecified address, which reaches this machine) ``loopback``."""
    host = host.strip().strip("[]").rstrip(".").lower()
    if not host or host in _LOOPBACK_NAMES or host.endswith(".localhost"):
        return LOOPBACK
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.is_loopback or ip.is_unspecified:
        return LOOPBACK
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return host_key(str(ip.ipv4_mapped))
    return str(ip)


def server_of(url: str) -> Server | None:
    """A redis:// or rediss:// URL's (host key, port); None for another URL or a bad port."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return None
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        return None
    return host_key(parts.hostname or ""), port  # redis-py's default host is localhost


def _resolve(host: str) -> set[str]:
    """The host keys of ``host``'s addresses (itself when it is an address or loopback);
    empty when it does not resolve within RESOLVE_TIMEOUT_S."""
    try:
        ipaddress.ip_address(host)
        return {host}
    except ValueError:
        if host == LOOPBACK:
            return {host}
    found: set[str] = set()

    def look() -> None:
        try:
            found.update(host_key(str(info[4][0])) for info in socket.getaddrinfo(host, None))
        except (OSError, UnicodeError):
            pass

    # A thread of its own: getaddrinfo has no timeout, and a registration must not hang on DNS.
    t = threading.Thread(target=look, name="resolve", daemon=True)
    t.start()
    t.join(RESOLVE_TIMEOUT_S)
    return set(found) if not t.is_alive() else set()


def same_server(a: Server, b: Server) -> bool:
    """Whether ``a`` and ``b`` name one server (see the module docstring)."""
    if a[1] != b[1]:
        return False
    if a[0] == b[0]:
        return True
    return bool(_resolve(a[0]) & _resolve(b[0]))


def store_servers(store: Any) -> list[Server]:
    """The Redis servers ``store`` keeps its data on (none for another kind of store):
    its URL's, and every node of its cluster its client knows. No call is made."""
    servers = getattr(store, "servers", None)
    if not callable(servers):
        return []
    out: list[Server] = []
    for host, port in servers():
        out.append((host_key(str(host)), int(port)))
    return out


def check_not_own_store(what: str, kind: str, settings: dict[str, Any], store: Sequence[Server]) -> None:
    """Refuse (InvalidSpecError: INVALID_ARGUMENT) a Redis connector named ``what``
    (``injector 'x' source``, ``sink 'y'``) whose server is one of ``store``'s."""
    if kind not in REDIS_KINDS or not store:
        return
    url = settings.get("url")
    server = server_of(url) if isinstance(url, str) else None
    if server is None:
        return
    if any(same_server(server, (host_key(h), p)) for h, p in store):
        raise InvalidSpecError(
            f"{what}: {kind} URL {redact(str(url))[:200]!r} names the Redis server that holds this "
            "service's own store: it would read and write the service's own keys (corrupting them); "
            "point it at another Redis server")


def refuse_own_store(connectors: Iterable[tuple[str, str, dict[str, Any]]], store: Any) -> None:
    """:func:`check_not_own_store` for each ``(what, kind, settings)``, the store's
    servers read once (and only when a Redis connector is among them)."""
    items = [c for c in connectors if c[1] in REDIS_KINDS]
    if not items:
        return
    servers = store_servers(store)
    for what, kind, settings in items:
        check_not_own_store(what, kind, settings, servers)
