"""The Tracker JSON API (docs/ui.md) of a real controller with a client token.

What it answers agrees with the gRPC API (watermarks, state, keys, records, workers,
spec); every parameter is bounded and bad input is 400 with a message naming it; the
token is required (header or login cookie, never the URL) and the answers carry the
security headers; a poison record shows up as dead-lettered with its error.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record
from millwheel.spec import computation_to_dict
from services.rpc.convert import spec_dict_to_proto, spec_from_proto
from services.rpc.security import Security
from tests.integration.ui_cluster import (
    OPERATOR,
    SECRET,
    T0,
    TOKEN,
    Console,
    console_with_clicks,
    readme_pipeline,
)
from tests.support.certs import CertificateAuthority
from tests.support.redis_server import free_port
from tests.support.service_cluster import ROOT, Cluster, wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    with console_with_clicks(tmp_path_factory.mktemp("ui-api"), workers=1) as con:
        yield con


def as_us(wm: int | str) -> int:
    return {"-inf": MIN_TIMESTAMP, "+inf": MAX_TIMESTAMP}.get(wm, wm)  # type: ignore[arg-type]


def q(**params: object) -> str:
    return urllib.parse.urlencode(params)


def test_token_is_required_in_a_header_or_login_cookie_never_the_url(console: Console) -> None:
    for token in (None, "wrong-token", console.token + "x"):
        status, body = console.get("/api/v1/overview", token)
        assert status == 401 and "client token" in body["error"]
    status, headers, _ = console.request("GET", f"/api/v1/overview?token={console.token}")
    assert status == 401 and headers["www-authenticate"].startswith("Bearer")
    assert console.get("/api/v1/overview")[0] == 200
    # open: health, the static files (no data in them), and whether one is logged in
    assert console.get("/healthz", None) == (200, {"ok": True})
    assert console.get("/api/v1/session", None) == (200, {"auth_required": True, "authorized": False,
                                                          "role": None, "actions": []})
    status, headers, page = console.request("GET", "/")
    assert status == 200 and b"<script src=\"/app.js\"" in page
    assert "script-src 'self'" in headers["content-security-policy"]
    assert "unsafe-inline" not in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"
    assert b"<script>" not in page and b"onclick" not in page  # no inline script at all

    # the login form: a wrong token sets no cookie; the right one an HttpOnly, Strict one
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, headers, _ = console.request("POST", "/login", form, q(token="nope").encode())
    assert status == 303 and headers["location"] == "/?login=failed" and "set-cookie" not in headers
    status, headers, _ = console.request("POST", "/login", form, q(token=console.token).encode())
    cookie = headers["set-cookie"]
    assert status == 303 and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert console.token not in cookie
    session = cookie.split(";")[0]
    status, _, body = console.request("GET", "/api/v1/overview", {"Cookie": session})
    assert status == 200 and json.loads(body)["computations"]
    status, _, _ = console.request("GET", "/api/v1/overview", {"Cookie": session + "x"})
    assert status == 401
    status, headers, _ = console.request("POST", "/logout", {**form, "Cookie": session}, b"")
    assert status == 303 and "Max-Age=0" in headers["set-cookie"]
    status, _, _ = console.request("GET", "/api/v1/overview", {"Cookie": session})
    assert status == 401  # ended on the server, not only in the browser
    status, _, body = console.request("POST", "/api/v1/overview", form, b"")
    assert status == 405 and b"read-only" in body


@pytest.mark.parametrize(("path", "status", "says"), [
    ("/api/v1/keys?" + q(computation="counts", limit=0), 400, "'limit' must be 1..1000, got 0"),
    ("/api/v1/keys?" + q(computation="counts", limit=1001), 400, "'limit' must be 1..1000"),
    ("/api/v1/keys?" + q(computation="counts", limit="ten"), 400, "'limit' must be an integer"),
    ("/api/v1/keys?" + q(computation="counts", after="k" * 4097), 400, "over the limit of 4096"),
    ("/api/v1/state?" + q(computation="counts", key="k" * 4097), 400, "'key' is 4097 bytes"),
    ("/api/v1/state?" + q(computation="counts"), 400, "'key' is required"),
    ("/api/v1/state?" + q(computation="counts", key=""), 400, "'key' must not be empty"),
    ("/api/v1/state?computation=counts&computation=busy&key=a", 400, "'computation' given 2 times"),
    ("/api/v1/state?" + q(computation="nope", key="a"), 404, "no computation named 'nope'"),
    ("/api/v1/computation?" + q(computation="c" * 201), 400, "1..200 characters"),
    ("/api/v1/computation", 400, "'computation' is required"),
    ("/api/v1/records?" + q(stream="counts", n=201), 400, "'n' must be 1..200"),
    ("/api/v1/records?" + q(stream="user_clicks"), 404, "not logged"),
    ("/api/v1/nothing", 404, "no such endpoint"),
])
def test_bad_input_is_refused_with_a_message(console: Console, path: str, status: int, says: str) -> None:
    got, body = console.get(path)
    assert got == status and says in body["error"], body


def test_answers_agree_with_the_grpc_api(console: Console) -> None:
    c = console.cluster.client
    spec = readme_pipeline()
    names = [s["name"] for s in spec["computations"]]
    over = console.api("/api/v1/overview")
    nodes = {(n["kind"], n["name"]) for n in over["graph"]["nodes"]}
    assert {("computation", n) for n in names} | {("injector", "clicks"), ("sink", "busy")} <= nodes
    assert ("stream", "clicks") in nodes and ("stream", "counts") in nodes
    edges = {(e["from"], e["to"]) for e in over["graph"]["edges"]}
    assert {("i:clicks", "s:clicks"), ("s:clicks", "c:by_user"), ("c:busy", "s:busy")} <= edges
    # An edge out of a producer says what it holds unacknowledged: the sum of its ranges'
    # pending outboxes (an injector: its outbox, as the same snapshot shows it).
    outboxes = {i["name"]: i["outbox"] for i in over["injectors"]}
    for e in over["graph"]["edges"]:
        if e["from"].startswith("c:"):
            assert isinstance(e["queued"], int) and e["queued"] >= 0, e
        elif e["from"].startswith("i:"):
            assert e["queued"] == outboxes[e["from"][2:]], e

    wms = {w.node: w for w in c.watermarks()}
    for name in names:
        info = console.api("/api/v1/computation?" + q(computation=name))
        # the snapshot is at most a second old, and watermarks never go back
        assert as_us(info["input_low_watermark"]) <= wms[name].input_low_watermark
        assert info["health"] == "ok", info
        ranges = {r["range"]: (r["worker"], r["token"]) for r in info["ranges"]}
        grpc_ranges = {r.range_id: (r.worker_id, r.token) for r in c.status().ranges if r.node == name}
        assert ranges == grpc_ranges
        registered = computation_to_dict(spec_from_proto(
            next(x.spec for x in c.computations().computations if x.spec.name == name)))
        assert yaml.safe_load(console.api("/api/v1/spec?" + q(computation=name))["yaml"]) == registered
    counts = wait_for(lambda: (x := console.api("/api/v1/computation?" + q(computation="counts")))
                      and len(x["history"]["input_lag"]) >= 3 and x, 10, "three refreshes of history")
    assert counts["input_low_watermark"] == T0 + 29_500_000
    # every click went into by_user once and out of it once, re-keyed (as the workers counted)
    by_user = console.api("/api/v1/computation?" + q(computation="by_user"))
    assert by_user["records_in_total"] == by_user["records_out_total"] == len(console.injected) == 60
    lags = counts["history"]["input_lag"]  # (unix seconds, lag seconds), one a refresh
    assert [t for t, _ in lags] == sorted(t for t, _ in lags) and lags[-1][1] > lags[0][1]
    # the lag behind wall clock (a refresh may land between the two reads: 1 s apart)
    assert lags[-1][1] == pytest.approx((counts["time_us"] - T0 - 29_500_000) / 1e6, abs=1.5)

    # ann's open window (20 s..30 s) holds every one of ann's clicks in it
    expected = sum(1 for r in console.injected if json.loads(r.value)["user"] == "ann"
                   and T0 + 20_000_000 <= r.timestamp < T0 + 30_000_000)
    st = console.api("/api/v1/state?" + q(computation="counts", key="ann"))
    assert st["exists"] and st["state_json"][str(T0 + 20_000_000)][0] == expected
    grpc_state = c.state("counts", "ann")
    assert st["state_text"].encode() == grpc_state.state and st["range"] == grpc_state.range_id
    assert [t["time"] for t in st["timers"]] == [t.time for t in grpc_state.timers]
    none = console.api("/api/v1/state?" + q(computation="counts", key="nobody"))
    assert none["exists"] is False and none["state_text"] is None

    logged = [x for _seq, x in c.subscribe("counts")]
    wait_for(lambda: len(console.api("/api/v1/records?" + q(stream="counts", n=200))["records"])
             == len(logged), 10, "the console's tail of counts")
    tail = console.api("/api/v1/records?" + q(stream="counts", n=3))["records"]
    assert [(r["key"], r["value"].encode(), r["timestamp"]) for r in tail] == \
        [(r.key, r.value, r.timestamp) for r in logged[-3:]]

    workers = console.api("/api/v1/workers")["workers"]
    status = c.status()
    assert [w["id"] for w in workers] == sorted(w.worker_id for w in status.workers)
    assert sorted(workers[0]["ranges"]) == sorted(f"{r.node}/{r.range_id}" for r in status.ranges
                                                  if r.worker_id == workers[0]["id"])
    assert workers[0]["state"] == "alive" and workers[0]["last_heartbeat_s"] < 5
    # Its resources, read from its /metrics: a Python worker is tens of MB; CPU is the
    # share of one core between two refreshes (known from the second on).
    assert 10 < workers[0]["rss_mb"] < 4096, workers[0]
    def cpu_share() -> tuple[float] | None:
        pct = console.api("/api/v1/workers")["workers"][0]["cpu_pct"]
        return None if pct is None else (pct,)
    (cpu,) = wait_for(cpu_share, 10, "a CPU share")
    assert 0 <= cpu <= 100 * (os.cpu_count() or 1), cpu


def test_keys_page_through_every_key_once(console: Console) -> None:
    users = [f"u{i}" for i in range(5)]
    base = T0 + 40_000_000  # one more window, left open: every user has state in counts
    console.inject([Record(f"k-{u}", json.dumps({"user": u}).encode(), base + i, f"page-{u}")
                    for i, u in enumerate(users)])
    console.cluster.wait_watermark("counts", base + 4)
    seen: list[str] = []
    after = ""
    pages = 0
    while True:
        page = console.api("/api/v1/keys?" + q(computation="counts", limit=2, after=after))
        assert len(page["keys"]) <= 2
        seen += page["keys"]
        pages += 1
        if not page["next_after"]:
            break
        after = page["next_after"]
    assert seen == sorted(console.cluster.client.keys("counts")) and set(users) <= set(seen)
    assert pages == (len(seen) + 1) // 2


def test_a_poison_record_is_dead_lettered_and_shown_with_its_error(console: Console) -> None:
    # a second consumer of the clicks that fails (and is retried) instead of dead-lettering
    strict = {"name": "strict", "inputs": [{"stream": "clicks", "key": "key"}], "outputs": ["users"],
              "code": {"name": "map", "params": {"value": "json['user']"}},
              "options": {"on_error": "fail", "key_ranges": 1}}
    console.cluster.client.register_topology([spec_dict_to_proto(strict)], [], [])
    wait_for(lambda: "strict" in {c["name"] for c in console.api("/api/v1/overview")["computations"]},
             10, "the console to show the new computation")
    console.cluster.wait_balanced()
    poison = Record("poison-1", b"this is not json", T0 + 50_000_000, "poison-1")
    console.inject([poison])

    def dead() -> dict[str, object] | None:
        info = console.api("/api/v1/computation?" + q(computation="by_user"))
        return info if info["dead_lettered"] >= 1 else None

    info = wait_for(dead, 30, "by_user to dead-letter the poison record")
    assert info["health"] == "dead-lettering"
    assert any(e["record_id"] == "poison-1" and e["outcome"] for e in info["recent_errors"]), info
    graph = console.api("/api/v1/overview")["graph"]
    assert [n["health"] for n in graph["nodes"] if n["id"] == "c:by_user"] == ["dead-lettering"]
    assert any(n["name"] == "by_user.dead_letters" for n in graph["nodes"])  # now it has some
    assert re.search("json", json.dumps(info["recent_errors"]), re.I)


def test_millwheel_up_serves_the_console_and_prints_its_url(tmp_path: Path) -> None:
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")},
           "PYTHONPATH": str(ROOT)}
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--workers", "1", "--port", str(port)],
                              env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        wait_for(lambda: "millwheel is up" in log.read_text(), 60, f"millwheel up ({log})")
        m = re.search(r"  console: (http://127\.0\.0\.1:(\d+)/)\n", log.read_text())
        assert m, log.read_text()
        token = (tmp_path / "millwheel-data" / "client-token").read_text().strip()
        con = Console(None, int(m.group(2)), token)  # type: ignore[arg-type]
        assert con.get("/api/v1/overview", None)[0] == 401
        workers = wait_for(lambda: con.api("/api/v1/workers")["workers"], 10, "the worker in the console")
        assert [w["state"] for w in workers] == ["alive"]

        # The one-time link it printed signs one browser in (a session cookie, not the
        # token), then is spent; a wrong code signs nobody in and spends nothing.
        link = re.search(rf"  sign in once: http://127\.0\.0\.1:{m.group(2)}(/login\?code=([\w-]+)) ", log.read_text())
        assert link, log.read_text()
        assert token not in link.group(1)
        status, headers, _ = con.request("GET", "/login?code=" + "x" * len(link.group(2)))
        assert (status, headers["location"], "set-cookie" in headers) == (303, "/?login=link-spent", False)
        status, headers, _ = con.request("GET", link.group(1))
        assert status == 303 and headers["location"] == "/" and "HttpOnly" in headers["set-cookie"]
        cookie = headers["set-cookie"].split(";")[0]
        status, _, body = con.request("GET", "/api/v1/workers", {"Cookie": cookie})
        assert status == 200 and json.loads(body)["workers"], body
        status, headers, _ = con.request("GET", link.group(1))  # again: spent
        assert (status, headers["location"], "set-cookie" in headers) == (303, "/?login=link-spent", False)
        assert link.group(2) not in " ".join(Path(f"/proc/{p}/cmdline").read_text() for p in _family(up.pid))
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def _family(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def test_without_a_token_the_console_is_loopback_only(tmp_path: Path) -> None:
    """mTLS authenticates gRPC callers, not a browser: the console still needs a token
    to listen on a non-loopback address (or --insecure)."""
    ca = CertificateAuthority(tmp_path / "ca")
    node = ca.issue("node")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")},
           "PYTHONPATH": str(ROOT), "MILLWHEEL_TLS_CERT": str(node.cert), "MILLWHEEL_TLS_KEY": str(node.key),
           "MILLWHEEL_TLS_CA": str(ca.pem)}
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "controller", "--store", f"sqlite:///{tmp_path}/s.db",
         "--host", "0.0.0.0", "--port", str(free_port()), "--ui-port", str(free_port())],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to serve the console (--ui-port) on 0.0.0.0 without a client token" in proc.stderr


def test_code_failing_under_on_error_fail_shows_as_retrying(console: Console) -> None:
    def retrying() -> dict[str, object] | None:
        info = console.api("/api/v1/computation?" + q(computation="strict"))
        return info if info["retrying"] else None

    info = wait_for(retrying, 30, "strict to retry the poison record")
    assert info["health"] == "retrying" and info["dead_lettered"] == 0
    [e] = info["retrying"]  # type: ignore[misc]
    assert (e["record_id"], e["outcome"]) == ("poison-1", "failing") and e["attempts"] >= 1


def test_under_tls_the_console_is_https_with_a_secure_cookie(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    node = ca.issue("node")
    port = free_port()
    env = {"MILLWHEEL_AUTH_TOKEN": TOKEN, "MILLWHEEL_CLUSTER_SECRET": SECRET,
           "MILLWHEEL_TLS_CERT": str(node.cert), "MILLWHEEL_TLS_KEY": str(node.key)}
    c = Cluster(tmp_path, env=env, security=Security(client_token=TOKEN, tls_ca=str(ca.pem)),
                controller_args=["--ui-port", str(port)])
    try:
        c.start_controller()
        tls = ssl.create_default_context(cafile=str(ca.pem))

        def get(path: str, method: str = "GET", body: bytes | None = None,
                headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=tls, timeout=10)
            conn.request(method, path, body=body, headers=headers or {})
            return conn.getresponse()

        wait_for(lambda: get("/healthz").status == 200, 20, "the console over HTTPS")
        assert get("/api/v1/workers", headers={"Authorization": f"Bearer {TOKEN}"}).status == 200
        assert get("/api/v1/workers").status == 401
        login = get("/login", "POST", f"token={TOKEN}".encode(),
                    {"Content-Type": "application/x-www-form-urlencoded"})
        assert login.status == 303 and "; Secure" in login.headers["Set-Cookie"]
        with pytest.raises(http.client.RemoteDisconnected):  # plaintext HTTP gets nothing
            plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            plain.request("GET", "/healthz")
            plain.getresponse()
    finally:
        c.stop()


def test_the_overview_shows_versions_and_the_last_savepoint(tmp_path: Path) -> None:
    """Issue 22 item 5: each computation's version, and the last savepoint taken (when,
    how big, whether the service was stopped with it)."""
    from tests.integration.ui_cluster import start_console

    con = start_console(tmp_path, workers=1)
    try:
        over = con.api("/api/v1/overview")
        assert over["last_savepoint"] is None
        assert {c["version"] for c in over["computations"]} == {1}
        path = tmp_path / "cut.mwsp"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MILLWHEEL_AUTH_TOKEN": TOKEN,
               "MILLWHEEL_OPERATOR_TOKEN": OPERATOR}  # a savepoint is the operator's (issue 34)
        done = subprocess.run([sys.executable, "-m", "services.cli", "savepoint", "create", str(path),
                               "--controller", con.cluster.address], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        last = wait_for(lambda: con.api("/api/v1/overview")["last_savepoint"], 10, "the savepoint in the console")
        assert last["bytes"] == path.stat().st_size and last["stopped"] is False
        assert abs(last["created_us"] / 1e6 - path.stat().st_mtime) < 120
    finally:
        con.cluster.stop()


def test_a_rescale_under_way_shows_as_rescaling_to_n(tmp_path: Path) -> None:
    """Issue 22: while a rescale copies a computation's keys, the console's row of it
    says where it goes (``rescaling_to``), then the new count and version once it is
    done, and nothing of it after. The copy is held 2 s longer (``MILLWHEEL_HOLD_AT``
    on the controller): on a fast machine 20,000 keys copy in well under a second."""
    import threading

    from bench.cases.savepoint import fill
    from tests.integration.ui_cluster import SECRET

    url = f"sqlite:///{tmp_path}/service.db"
    fill(url, 20_000, ranges=2)  # enough keys that the copy takes seconds
    port = free_port()
    c = Cluster(tmp_path, store_url=url, env={"MILLWHEEL_AUTH_TOKEN": TOKEN, "MILLWHEEL_CLUSTER_SECRET": SECRET,
                                              "MILLWHEEL_OPERATOR_TOKEN": OPERATOR,
                                              "MILLWHEEL_HOLD_AT": "rescale_staged:2"},
                security=Security(client_token=OPERATOR),  # a rescale is the operator's (issue 34)
                controller_args=["--ui-port", str(port)])
    try:
        c.start_controller()
        c.start_worker()
        con = Console(c, port)
        wait_for(lambda: console_row(con, "counts"), 30, "the console to show the computation")
        assert console_row(con, "counts")["rescaling_to"] is None
        answer: dict[str, object] = {}
        c.client.timeout_s = 300
        side = threading.Thread(target=lambda: answer.update(r=c.client.rescale("counts", 4)))
        side.start()
        seen: set[object] = set()
        while side.is_alive():
            seen.add(console_row(con, "counts")["rescaling_to"])
            side.join(0.1)
        assert 4 in seen, f"never saw the rescale under way: {seen}"
        assert answer["r"].changed  # type: ignore[attr-defined]
        wait_for(lambda: console_row(con, "counts")["version"] == 2, 15, "the new version in the console")
        assert console_row(con, "counts")["rescaling_to"] is None
        detail = con.api("/api/v1/computation?computation=counts")
        assert len(detail["ranges"]) == 4 and detail["rescaling_to"] is None
    finally:
        c.stop()


def console_row(con: Console, name: str) -> dict[str, object] | None:
    return next((x for x in con.api("/api/v1/overview")["computations"] if x["name"] == name), None)
