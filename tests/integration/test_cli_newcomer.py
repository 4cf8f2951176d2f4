"""What a newcomer trips on (issue 33), each checked as they would meet it: ``up --port 0``
as ``--help`` offers it, ``up`` on a Redis that is down saying so at once, a client
command against a stopped service or without its token saying what to check, and a spec
whose injector file is missing naming the injector."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.rpc.security import Security
from tests.integration.test_up_cleanup import children, up
from tests.support.redis_server import RedisServer, free_port
from tests.support.service_cluster import ROOT, Cluster, wait_for


def millwheel(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=90, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_up_on_port_0_takes_free_ports_and_says_which(tmp_path: Path) -> None:
    proc = up(tmp_path, 0, "--controllers", "2", "--workers", "1", "--ui-port", "-1",
              "--store", f"sqlite:///{tmp_path}/s.db")
    log = tmp_path / "up.log"
    try:
        wait_for(lambda: "millwheel is up" in log.read_text() or proc.poll() is not None, 90, "up to start")
        text = log.read_text()
        assert proc.poll() is None, text
        found = re.search(r"controllers (127\.0\.0\.1:(\d+)),(127\.0\.0\.1:(\d+))", text)
        assert found, text
        ports = [int(found[2]), int(found[4])]
        assert 0 not in ports and ports[0] != ports[1], text
        assert f"try: millwheel status --controller {found[1]},{found[3]}" in text
        for address in (found[1], found[3]):  # each answers (the standby forwards or reads)
            status = millwheel(tmp_path, "status", "--controller", address)
            assert status.returncode == 0, status.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert not children(ports[0]) and not children(ports[1])
    # A normal election and a clean Ctrl-C are news, not trouble: INFO, never WARNING
    # (before, both logged at WARNING, and a newcomer took them for faults).
    text = log.read_text()
    assert re.search(r" INFO controller \S+ is the leader \(epoch \d+\)", text), text
    alarming = [line for line in text.splitlines() if re.search(r" (WARNING|ERROR|CRITICAL) ", line)
                and re.search(r"lead|elect|lease|stand|stop|signal|interrupt|shut", line, re.I)]
    assert not alarming and "Traceback" not in text, alarming or text


def test_up_on_a_redis_that_is_down_or_refuses_says_why_at_once(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    proc = up(tmp_path, 0, "--ui-port", "-1", "--store", f"redis://127.0.0.1:{port}/0")
    assert proc.wait(60) == 1
    took = time.monotonic() - started
    text = (tmp_path / "up.log").read_text()
    assert "the controller did not start: cannot open the store: " \
           f"redis://127.0.0.1:{port}/0: " in text and "Connection refused" in text, text
    assert took < 12, (took, text)  # not the 20 s up waits for a controller, nor the store's 30 s

    with RedisServer(requirepass="s3cret") as server:
        proc = up(tmp_path, 0, "--ui-port", "-1", "--store", f"redis://127.0.0.1:{server.port}/0")
        assert proc.wait(60) == 1
        text = (tmp_path / "up.log").read_text()
        assert "cannot open the store" in text and "authenticated" in text, text
        # The password where the store looks for it: up starts (the probe in its way of nothing).
        with open(tmp_path / "up.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", "0", "--no-auth",
                                     "--ui-port", "-1", "--metrics-port", "-1", "--workers", "1",
                                     "--store", f"redis://127.0.0.1:{server.port}/0"], cwd=tmp_path,
                                    env={**os.environ, "PYTHONPATH": str(ROOT),
                                         "MILLWHEEL_REDIS_PASSWORD": "s3cret"}, stdout=log, stderr=log)
        try:
            wait_for(lambda: "millwheel is up" in (tmp_path / "up.log").read_text() or proc.poll() is not None,
                     60, "up to start")
            assert proc.poll() is None, (tmp_path / "up.log").read_text()
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)


def test_a_client_against_a_stopped_service_is_asked_whether_up_runs(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    for args in (("status", "--controller", address), ("watermark", "--json", "--controller", address)):
        out = millwheel(tmp_path, *args)
        assert out.returncode == 2 and "[UNAVAILABLE]" in out.stderr, out.stderr
        assert f"is `millwheel up` (or a controller) running at {address}?" in out.stderr, out.stderr
    default = millwheel(tmp_path, "status", env={"MILLWHEEL_CONTROLLER": address})
    assert f"running at {address}?" in default.stderr and "$MILLWHEEL_CONTROLLER" in default.stderr


def test_a_client_without_the_token_is_told_where_it_is_looked_for(tmp_path: Path) -> None:
    token, secret = "t0ken-for-clients", "cluster-s3cret"
    cluster = Cluster(tmp_path, env={"MILLWHEEL_AUTH_TOKEN": token, "MILLWHEEL_CLUSTER_SECRET": secret},
                      security=Security(client_token=token))
    bare = {k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")}
    try:
        cluster.start_controller()
        elsewhere = tmp_path / "elsewhere"  # no ./millwheel-data/client-token here
        elsewhere.mkdir()
        out = subprocess.run([sys.executable, "-m", "services.cli", "status", "--controller", cluster.address],
                             capture_output=True, text=True, cwd=elsewhere, timeout=60,
                             env={**bare, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 2 and "[UNAUTHENTICATED]" in out.stderr, out.stderr
        for where in ("--auth-token-file", "$MILLWHEEL_AUTH_TOKEN", "$MILLWHEEL_AUTH_TOKEN_FILE",
                      str(elsewhere / "millwheel-data" / "client-token")):
            assert where in out.stderr, (where, out.stderr)
        (elsewhere / "wrong").write_text("not-the-token\n")
        wrong = subprocess.run([sys.executable, "-m", "services.cli", "status", "--controller", cluster.address,
                                "--auth-token-file", "wrong"], capture_output=True, text=True, cwd=elsewhere,
                               timeout=60, env={**bare, "PYTHONPATH": str(ROOT)})
        assert wrong.returncode == 2 and "the token sent (--auth-token-file wrong)" in wrong.stderr, wrong.stderr
    finally:
        cluster.stop()


def test_run_names_the_injector_whose_file_is_missing(tmp_path: Path) -> None:
    spec = tmp_path / "pipelines" / "spec.yaml"
    spec.parent.mkdir()
    (spec.parent / "clicks.jsonl").write_text('{"key": "a", "value": 1, "timestamp": 1}\\n')
    spec.write_text("""injectors:
  - {name: clicks, stream: clicks, file: clicks.jsonl}
  - {name: views, stream: views, file: data/views.jsonl}
computations:
  - name: keep
    inputs: [clicks, views]
    outputs: [kept]
    code: {name: filter, params: {expr: "True"}}
""")
    out = millwheel(tmp_path, "run", str(spec), "--store", f"sqlite:///{tmp_path}/local.db")
    assert out.returncode == 2, out.stderr
    assert "injector 'views': file 'data/views.jsonl' does not exist" in out.stderr, out.stderr
    assert str(spec.parent / "data" / "views.jsonl") in out.stderr, out.stderr
