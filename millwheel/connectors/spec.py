"""Connector settings in a spec: an injector's ``source:`` and the top-level ``sinks:``.

Only the settings' text is checked here (type, URL scheme, required and known fields,
bounds) against each kind's schema in :mod:`millwheel.connectors.registry`; no client
library is imported and nothing is connected to, so ``register``
refuses a typo at once and the controller never imports a client to validate. Errors
name the injector or sink and the field, and show a URL only without its password
(:func:`millwheel.state.url_display.redact`), as ClusterStatus does for the store.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from millwheel.connectors import registry
from millwheel.errors import InvalidSpecError, PermissionDeniedError
from millwheel.limits import MAX_DURATION_US, check_name
from millwheel.nodes import sink_node  # noqa: F401 (re-exported: where callers find it)
from millwheel.state.url_display import redact

#: Fields every source accepts besides its kind's own (a kind's own: connectors/registry.py).
SOURCE_COMMON = {"type", "until", "max_disorder_us", "idle_timeout_us", "fields"}
RECORD_FIELDS = ("key", "value", "timestamp", "id")
MAX_SETTING_CHARS = 2048  # a URL, a table or stream name, a glob
MAX_SINKS = 256


@dataclass(frozen=True)
class ConnectorSpec:
    """A source's or sink's settings: its type and the whole mapping as canonical JSON
    (hashable and comparable, so registering the same spec again is a no-op)."""

    type: str
    settings_json: str

    @property
    def settings(self) -> dict[str, Any]:
        return dict(json.loads(self.settings_json))

    def public(self) -> dict[str, Any]:
        """The settings as they may be shown: every URL without its password."""
        out = self.settings
        if isinstance(out.get("url"), str):
            out["url"] = redact(out["url"])
        return out


@dataclass(frozen=True)
class SinkSpec:
    """A sink attached to a stream: it follows the stream's durable log and writes
    every record to an external system (``millwheel.runtime.sink_runner``)."""

    name: str
    stream: str
    connector: ConnectorSpec


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_SETTING_CHARS:
        raise InvalidSpecError(f"{where}: must be a non-empty string of at most {MAX_SETTING_CHARS} characters")
    return value


def _duration(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_DURATION_US:
        raise InvalidSpecError(f"{where}: must be an integer 0..{MAX_DURATION_US} (microseconds), got {value!r}")
    return value


def _connector(data: Any, where: str, roles: Mapping[str, registry.Role], common: set[str]) -> ConnectorSpec:
    """The settings checked against the schema of their kind's source or sink (``roles``),
    then by the kind's own check of its structured settings."""
    if not isinstance(data, Mapping):
        raise InvalidSpecError(f"{where}: must be a mapping with a 'type'")
    kind = data.get("type")
    if kind not in roles:
        raise InvalidSpecError(f"{where}.type: must be one of {sorted(roles)}, got {str(kind)[:100]!r}")
    schema = roles[str(kind)].schema
    schemes, required, optional = schema.schemes, schema.required, schema.optional
    missing = sorted(required - set(data))
    if missing:
        raise InvalidSpecError(f"{where}: a {kind} needs {missing}")
    unknown = sorted(str(k)[:100] for k in set(data) - required - optional - common)
    if unknown:
        raise InvalidSpecError(f"{where}: unknown fields {unknown} (a {kind} has "
                               f"{sorted(required | optional | (common - {'type'}))})")
    for name in required | optional:
        if name in data and name not in schema.structured:
            _text(data[name], f"{where}.{name}")
    if "url" in data:
        url = data["url"]
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if scheme not in schemes:
            raise InvalidSpecError(f"{where}.url: a {kind} URL starts with "
                                   f"{' or '.join(s + '://' for s in schemes)}, got {redact(url)[:200]!r}")
    if schema.check is not None:
        schema.check(data, where)
    return ConnectorSpec(str(kind), json.dumps(dict(data), sort_keys=True))


def source_from_dict(data: Any, where: str, max_disorder_us: int) -> ConnectorSpec:
    """An injector's ``source:``; the injector's ``max_disorder_us`` is its default."""
    spec = _connector(data, where, registry.sources(), SOURCE_COMMON)
    settings = spec.settings
    settings.setdefault("max_disorder_us", max_disorder_us)
    _duration(settings["max_disorder_us"], f"{where}.max_disorder_us")
    if "idle_timeout_us" in settings:
        _duration(settings["idle_timeout_us"], f"{where}.idle_timeout_us")
    if settings.setdefault("until", "never") not in ("never", "end"):
        raise InvalidSpecError(f"{where}.until: 'end' (stop at what is there at start) or 'never'")
    fields = settings.setdefault("fields", {})
    if not isinstance(fields, Mapping) or set(fields) - set(RECORD_FIELDS):
        raise InvalidSpecError(f"{where}.fields: maps {list(RECORD_FIELDS)} to the source's field names")
    for name, value in fields.items():
        _text(value, f"{where}.fields.{name}")
    return ConnectorSpec(spec.type, json.dumps(settings, sort_keys=True))


def sinks_from_list(data: Any) -> tuple[SinkSpec, ...]:
    """The top-level ``sinks:``: each ``{stream, type, ...}`` with an optional ``name``
    (default ``STREAM.TYPE``), names unique."""
    if not isinstance(data, list):
        raise InvalidSpecError("sinks: must be a list")
    if len(data) > MAX_SINKS:
        raise InvalidSpecError(f"sinks: {len(data)} sinks, over the limit of {MAX_SINKS}")
    sinks: list[SinkSpec] = []
    for i, item in enumerate(data):
        where = f"sinks[{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("stream"), str):
            raise InvalidSpecError(f"{where}: needs a 'stream'")
        check_name(item["stream"], f"{where}.stream")
        settings = {k: v for k, v in item.items() if k not in ("stream", "name")}
        connector = _connector(settings, where, registry.sinks(), {"type"})
        name = item.get("name", f"{item['stream']}.{connector.type}")
        check_name(name, f"{where}.name")
        if any(s.name == name for s in sinks):
            raise InvalidSpecError(f"{where}: sink {name!r} defined twice (give each a 'name')")
        sinks.append(SinkSpec(str(name), item["stream"], connector))
    return tuple(sinks)


def sink_to_dict(sink: SinkSpec) -> dict[str, Any]:
    return {"name": sink.name, "stream": sink.stream, **sink.connector.settings}



_GLOB_MAGIC = re.compile(r"[*?[]")
SOURCE_PATH_FLAG = "--allow-source-path"


def _under(path: str, dirs: tuple[str, ...]) -> bool:
    return any(path == d or path.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)


@dataclass(frozen=True)
class SourcePaths:
    """The directories a files source in the service may read under (``--allow-source-path``
    on the controller and every worker; none by default, as ``--allow-code``): files on
    the workers' machines are the operator's to hand out, not any client's (issue 34).
    ``millwheel run`` reads the user's own machine and never asks.

    A path must be under an allowed directory both as written (``..`` folded, nothing on
    the disk looked at: a path outside is refused whatever is there, a link into an
    allowed directory included) and where it leads (:func:`os.path.realpath`: ``..`` and
    every symbolic link resolved). A refusal names the path as given and the allowed
    directories, never what it resolved to, and reads the same whether or not the file
    exists."""

    dirs: tuple[str, ...] = ()  #: each resolved (realpath) once, at start
    #: the same as given (absolute, normalized, links not followed): how paths under
    #: them are spelled, judged before anything on the disk is looked at
    spelled: tuple[str, ...] = ()

    @classmethod
    def parse(cls, given: Iterable[str]) -> SourcePaths:
        """The flag's values, each resolved against this process's directory; a directory
        need not exist yet (the controller may run on a machine without it)."""
        dirs: list[str] = []
        spelled: list[str] = []
        for d in given:
            if not isinstance(d, str) or not d.strip():
                raise InvalidSpecError(f"{SOURCE_PATH_FLAG}: expected a directory, got {d!r}")
            dirs.append(os.path.realpath(d))
            spelled.append(os.path.abspath(d))
        return cls(tuple(dict.fromkeys(dirs)), tuple(dict.fromkeys(spelled)))

    def describe(self) -> str:
        return ", ".join(self.dirs) if self.dirs else "none given: files sources are off in this service"

    def holds(self, real: str) -> bool:
        """Whether the resolved path ``real`` is an allowed directory or under one."""
        return _under(real, self.dirs)

    def refusal(self, what: str, path: str, why: str) -> PermissionDeniedError:
        return PermissionDeniedError(f"{what} {str(path)[:300]!r}: {why} ({SOURCE_PATH_FLAG}: {self.describe()})")

    def check_pattern(self, pattern: str, what: str) -> None:
        """A files source's ``path`` (a glob) reads only under an allowed directory: it is
        absolute (in the service it is read on the workers' machines, so relative to
        nothing the client knows), the part before its first wildcard resolves under
        an allowed directory, and no ``..`` follows a wildcard. What a wildcard matches
        is judged file by file when it is read (:mod:`millwheel.connectors.files`)."""
        if not self.dirs:
            raise self.refusal(what, pattern, "the service reads no files for clients")
        if not os.path.isabs(pattern):
            raise self.refusal(what, pattern, "a files source in the service names an absolute path "
                                              "on the workers' machines")
        parts = pattern.split(os.sep)
        first = next((i for i, p in enumerate(parts) if _GLOB_MAGIC.search(p)), len(parts))
        if ".." in parts[first:]:
            raise self.refusal(what, pattern, "'..' after a wildcard")
        fixed = os.sep.join(parts[:first]) or os.sep
        # As written first (`..` folded, nothing on the disk looked at), so a path outside
        # is refused whatever is there; then where its links lead.
        if not _under(os.path.normpath(fixed), self.dirs + self.spelled) or not self.holds(os.path.realpath(fixed)):
            raise self.refusal(what, pattern, "not under a directory this service reads files from")

    def check_sources(self, sources: Iterable[tuple[str, ConnectorSpec | None]]) -> None:
        """Every files source among ``sources`` (an injector's name, its source) checked
        before anything is stored: a registration refused here changes nothing."""
        for name, source in sources:
            if source is not None and source.type == "files":
                self.check_pattern(str(source.settings.get("path", "")), f"injector {name!r} source.path")
