"""The Tracker API: read-only JSON about a running deployment (docs/ui.md).

Every answer is built from the :class:`~services.ui.snapshot.Snapshotter`'s last
snapshot, except the on-demand lookups (one key's state and timers, a page of keys),
which read the store directly like ``GetState``/``ListKeys`` do, without the
controller's lock. Every parameter is bounded; bad input is :class:`BadRequest`
(400 with a JSON message naming the parameter and the limit).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import yaml

from millwheel.keys import key_range
from millwheel.nodes import injector_node
from millwheel.spec import computation_to_dict
from millwheel.topology import ComputationSpec

from ..controller.rescale_journal import read_keyed
from .snapshot import Snapshotter
from .state_view import labelled, when

MAX_NAME = 200
MAX_KEY_BYTES = 4096
MAX_PAGE = 1000
DEFAULT_PAGE = 100
MAX_RECORDS = 200
DEFAULT_RECORDS = 20
MAX_STATE_SHOWN = 64 * 1024  # state bytes returned (the rest is cut, and said so)


def _tag_text(tag: str) -> str:
    """A timer tag as shown: the built-in operators' ``end:START`` / ``gc:START`` with
    START (microseconds) as a readable time; any other tag as it is."""
    kind, sep, rest = tag.partition(":")
    if sep and rest.lstrip("-").isdigit() and len(rest) >= 10:
        return f"{kind}:{when(int(rest))}"
    return tag


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


Query = dict[str, list[str]]


def _one(q: Query, name: str, required: bool = True, default: str = "") -> str:
    values = q.get(name, [])
    if len(values) > 1:
        raise BadRequest(f"parameter {name!r} given {len(values)} times")
    if not values:
        if required:
            raise BadRequest(f"parameter {name!r} is required")
        return default
    return values[0]


def _int(q: Query, name: str, default: int, lo: int, hi: int) -> int:
    raw = _one(q, name, required=False, default=str(default))
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"parameter {name!r} must be an integer, got {raw[:50]!r}") from None
    if not lo <= value <= hi:
        raise BadRequest(f"parameter {name!r} must be {lo}..{hi}, got {value}")
    return value


class Tracker:
    def __init__(self, snap: Snapshotter) -> None:
        self.snap = snap
        self.routes: dict[str, Callable[[Query], Any]] = {
            "/api/v1/overview": self.overview,
            "/api/v1/computation": self.computation,
            "/api/v1/workers": self.workers,
            "/api/v1/state": self.state,
            "/api/v1/keys": self.keys,
            "/api/v1/spec": self.spec,
            "/api/v1/records": self.records,
        }

    def handle(self, path: str, q: Query) -> Any:
        route = self.routes.get(path)
        if route is None:
            raise BadRequest(f"no such endpoint {path[:100]!r} (see docs/ui.md)", 404)
        return route(q)

    # -- helpers -------------------------------------------------------------------------
    def _spec(self, q: Query) -> ComputationSpec:
        name = _one(q, "computation")
        if not name or len(name) > MAX_NAME:
            raise BadRequest(f"parameter 'computation' must be 1..{MAX_NAME} characters")
        for spec in self.snap.topology.computations:
            if spec.name == name:
                return spec
        known = ", ".join(c.name for c in self.snap.topology.computations) or "none registered"
        raise BadRequest(f"no computation named {name!r} (known: {known})", 404)

    def _key(self, q: Query, name: str = "key", required: bool = True) -> str:
        key = _one(q, name, required=required)
        if required and not key:
            raise BadRequest(f"parameter {name!r} must not be empty")
        if len(key.encode()) > MAX_KEY_BYTES:
            raise BadRequest(f"parameter {name!r} is {len(key.encode())} bytes, over the limit of {MAX_KEY_BYTES}")
        return key

    # -- endpoints -----------------------------------------------------------------------
    def overview(self, q: Query) -> Any:
        s = self.snap.snapshot
        comps = s.get("computations", {})
        return {
            "time_us": s.get("time_us"), "version": s.get("version"), "store": s.get("store"),
            "leader": s.get("leader", ""), "leading": s.get("leading", True),
            "graph": s.get("graph", {"nodes": [], "edges": []}),
            "computations": [{k: c[k] for k in (
                "name", "health", "health_reason", "low_watermark", "input_low_watermark", "lag_s",
                "input_lag_s", "in_per_s", "out_per_s", "dead_lettered", "version", "rescaling_to",
                "backlog", "held_by") if k in c}
                for c in comps.values()],
            "injectors": list(s.get("injectors", {}).values()),
            "sinks": s.get("sinks", {}),  # connector sinks: type, worker, down_s (None: writing)
            "logged_streams": s.get("logged_streams", []),
            "last_savepoint": s.get("last_savepoint"),
            "workers": {"alive": sum(w["state"] == "alive" for w in s.get("workers", [])),
                        "total": len(s.get("workers", []))},
        }

    def computation(self, q: Query) -> Any:
        spec = self._spec(q)
        info = self.snap.snapshot.get("computations", {}).get(spec.name)
        if info is None:
            raise BadRequest(f"computation {spec.name!r} was just registered; try again in a second", 503)
        h = self.snap.history
        history = {kind: h.get(kind, spec.name) for kind in ("lag", "input_lag", "in", "out", "dead", "checkpoint_ms",
                                                      "checkpoint_p95_ms", "checkpoints")}
        backpressure = [
            {"injector": i["name"], "outbox": i["outbox"], "backpressure_s_total": i["backpressure_s_total"],
             "outbox_history": h.get("outbox", injector_node(i["name"]))}
            for i in self.snap.snapshot.get("injectors", {}).values() if i["stream"] in info["inputs"]]
        return {**info, "time_us": self.snap.snapshot.get("time_us"), "history": history,
                "backpressure": backpressure}

    def workers(self, q: Query) -> Any:
        return {"workers": self.snap.snapshot.get("workers", [])}

    def state(self, q: Query) -> Any:
        spec = self._spec(q)
        key = self._key(q)
        store = self.snap.controller.store
        raw, timers = read_keyed(store, spec.name, lambda node: (
            store.read_state(node, [key]).get(key), store.read_key_timers(node, key)))
        out: dict[str, Any] = {
            "computation": spec.name, "key": key, "exists": raw is not None or bool(timers),
            "range": key_range(key, spec.options.key_ranges), "state_bytes": len(raw or b""),
            "truncated": len(raw or b"") > MAX_STATE_SHOWN,
            "timers": [{"tag": t.tag, "time": t.time, "time_text": when(t.time), "domain": str(t.domain.value),
                        "hold": t.hold, "tag_text": _tag_text(t.tag)} for t in timers[:100]]}
        shown = (raw or b"")[:MAX_STATE_SHOWN]
        text = shown.decode("utf-8", "replace")
        out["state_text"] = text if raw is not None else None
        try:
            out["state_json"] = json.loads(shown) if raw is not None and not out["truncated"] else None
        except ValueError:
            out["state_json"] = None
        # the built-in operators' state with field names and readable times (None: as stored)
        out["state_labelled"] = labelled(spec, out["state_json"]) if out["state_json"] is not None else None
        return out

    def keys(self, q: Query) -> Any:
        spec = self._spec(q)
        limit = _int(q, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
        after = self._key(q, "after", required=False)
        store = self.snap.controller.store
        keys = read_keyed(store, spec.name, lambda node: store.list_keys(node, after or None, limit + 1))
        more = len(keys) > limit
        keys = keys[:limit]
        return {"computation": spec.name, "keys": keys, "next_after": keys[-1] if more and keys else None}

    def spec(self, q: Query) -> Any:
        spec = self._spec(q)
        data = computation_to_dict(spec)
        return {"computation": spec.name, "spec": data,
                "yaml": yaml.safe_dump(data, sort_keys=False, default_flow_style=False)}

    def records(self, q: Query) -> Any:
        stream = _one(q, "stream")
        if not stream or len(stream) > MAX_NAME:
            raise BadRequest(f"parameter 'stream' must be 1..{MAX_NAME} characters")
        n = _int(q, "n", DEFAULT_RECORDS, 1, MAX_RECORDS)
        got = self.snap.tail(stream, n)
        if got is None:
            logged = ", ".join(self.snap.snapshot.get("logged_streams", [])) or "none"
            raise BadRequest(f"stream {stream!r} is not logged (logged streams: {logged})", 404)
        return {"stream": stream, "records": got}
