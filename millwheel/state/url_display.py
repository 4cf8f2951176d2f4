"""A store URL as people see it: without its password, a SQLite file resolved.

These only read the URL's text. They live apart from :mod:`millwheel.state.url` (which
turns a URL into a backend, so imports every backend) because the backends show
their own URL too: :mod:`millwheel.state.redis_connection` redacts it in every message,
and importing it from the module that opens the Redis store was an import cycle.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit


def redact(url: str) -> str:
    """The URL without its password: what logs, start-up lines and ClusterStatus show."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{netloc}").geturl()


def describe_store(url: str) -> str:
    """``url`` as a person should read it at start-up: a SQLite URL with the absolute
    file it resolves to from here (``sqlite:///tmp/x.db`` is ``./tmp/x.db``), any
    password replaced by ``***``."""
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///"):].split("?", 1)[0]
        return f"{url} (file {Path(path).resolve()})"
    return redact(url)
