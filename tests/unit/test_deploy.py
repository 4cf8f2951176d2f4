"""deploy/ agrees with the code it deploys.

Every ``millwheel ...`` command line in the supervisor config, the Kubernetes manifests
and the Dockerfile must be accepted by the real CLI parser, and the ports they name
must agree everywhere (flags = container ports = probes = Services = scrape targets),
so a renamed flag or a moved port breaks a test here instead of a deployment.
"""

from __future__ import annotations

import argparse
import configparser
import functools
import inspect
import json
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from argparse import Namespace
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

import pytest
import yaml

from services.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
MILLWHEEL_IMAGE = "millwheel"


@functools.cache
def parser() -> argparse.ArgumentParser:
    return build_parser()


def parse_cli(argv: list[str], where: str) -> Namespace:
    try:
        return parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: the millwheel CLI rejects {shlex.join(argv)}")


def drain_timeout_s() -> float:
    from services.worker.service import WorkerProcess

    return float(inspect.signature(WorkerProcess.drain_and_stop).parameters["timeout_s"].default)


def hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


# -- Kubernetes -------------------------------------------------------------------------------
@functools.cache
def k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


@functools.cache
def kustomization() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def workloads() -> Iterator[dict[str, Any]]:
    return (d for d in k8s_docs() if d["kind"] in ("Deployment", "StatefulSet"))


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The values a container's $(VAR) references expand to, as the kubelet would."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(find("ConfigMap", source["configMapRef"]["name"])["data"])
    fields = {"metadata.name": "millwheel-worker-0", "status.podIP": "10.1.2.3"}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = "secret"
    return env


def expand(arg: str, env: dict[str, str], where: str) -> str:
    def sub(m: re.Match[str]) -> str:
        # The kubelet leaves an undefined $(VAR) as is: a silent typo, so fail here.
        assert m.group(1) in env, f"{where}: $({m.group(1)}) is not in the container's env"
        return env[m.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


def dockerfile_instruction(name: str) -> list[str]:
    lines = [ln for ln in (DEPLOY / "Dockerfile").read_text().splitlines() if ln.startswith(name + " ")]
    assert len(lines) == 1, f"Dockerfile needs exactly one {name}"
    value: list[str] = json.loads(lines[0][len(name):])
    return value


def millwheel_argv(container: dict[str, Any]) -> list[str]:
    """The argv after ``millwheel`` that a container built from deploy/Dockerfile runs."""
    assert "command" not in container, "millwheel containers use the image's ENTRYPOINT"
    env = container_env(container)
    where = f"container {container['name']}"
    return [expand(str(a), env, where) for a in container["args"]]


def millwheel_containers() -> Iterator[tuple[dict[str, Any], dict[str, Any], Namespace]]:
    for wl in workloads():
        for c in wl["spec"]["template"]["spec"]["containers"]:
            if c["image"].split(":")[0] == MILLWHEEL_IMAGE:
                yield wl, c, parse_cli(millwheel_argv(c), f"{wl['kind']} {wl['metadata']['name']}")


def named_port(container: dict[str, Any], name: str) -> int:
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == name))


def test_every_manifest_parses_and_is_in_the_kustomization() -> None:
    for doc in k8s_docs():
        assert {"apiVersion", "kind", "metadata"} <= doc.keys()
    k = kustomization()
    assert sorted(k["resources"]) == sorted(f"k8s/{p.name}" for p in K8S.glob("*.yaml"))
    for gen in k["configMapGenerator"]:
        for entry in gen["files"]:
            assert (DEPLOY / entry.split("=")[-1]).is_file()
    namespace = find("Namespace", k["namespace"])
    assert namespace["metadata"]["name"] == "millwheel"


def test_k8s_millwheel_commands_are_accepted_by_the_cli() -> None:
    commands = {args.command: (wl, c, args) for wl, c, args in millwheel_containers()}
    assert set(commands) == {"controller", "worker"}
    ctl_wl, ctl, ctl_args = commands["controller"]
    wk_wl, wk, wk_args = commands["worker"]
    # Two controller replicas (one leads, one stands by), replaced one at a time.
    assert ctl_wl["kind"] == "Deployment" and ctl_wl["spec"]["replicas"] == 2
    assert ctl_wl["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 1
    # The leader's address, as standbys name it to workers, must be its pod IP.
    ctl_env = {v["name"]: v.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for v in ctl["env"]}
    assert ctl["args"][ctl["args"].index("--advertise") + 1] == "$(POD_IP)"
    assert ctl_env["POD_IP"] == "status.podIP"

    # Workers reach the controller through its Service, at the port it listens on.
    host, port = hostport(wk_args.controller)
    svc = find("Service", host)
    assert port == ctl_args.port and port in {p["port"] for p in svc["spec"]["ports"]}
    # Both use the Redis Service as their store, at the port Redis listens on.
    assert ctl_args.store == wk_args.store
    url = urlsplit(wk_args.store)
    redis_svc = find("Service", url.hostname or "")
    redis = find("StatefulSet", url.hostname or "")["spec"]["template"]["spec"]["containers"][0]
    assert url.scheme == "redis" and url.port == named_port(redis, "redis")
    assert url.port in {p["port"] for p in redis_svc["spec"]["ports"]}
    # A worker registers ADVERTISE:PORT as its address: it must be the pod IP, and its id the pod name.
    env = {v["name"]: v.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for v in wk["env"]}
    assert wk["args"][wk["args"].index("--advertise") + 1] == "$(POD_IP)" and env["POD_IP"] == "status.podIP"
    assert wk["args"][wk["args"].index("--id") + 1] == "$(POD_NAME)" and env["POD_NAME"] == "metadata.name"
    assert wk_wl["kind"] == "StatefulSet"  # at most one pod per worker id


def test_k8s_ports_agree_flags_containers_probes_services_annotations() -> None:
    for wl, c, args in millwheel_containers():
        where = wl["metadata"]["name"]
        pod = wl["spec"]["template"]
        assert named_port(c, "grpc") == args.port, where
        if args.command == "controller":
            assert named_port(c, "cluster") == args.cluster_port != args.port, where
        assert named_port(c, "metrics") == args.metrics_port, where
        # The gRPC port speaks TLS, which the kubelet's grpc probes cannot: they use the
        # plaintext health-only port.
        assert args.tls_cert and args.health_port and args.health_port != args.port, where
        assert named_port(c, "health") == args.health_port, where
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == args.health_port, f"{where} {probe}"
        notes = pod["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true", where
        assert int(notes["prometheus.io/port"]) == args.metrics_port, where
        assert notes["prometheus.io/path"] == "/metrics", where
        # Listen on every interface: Services, probes, scrapes and port-forward all reach it.
        assert args.host == "0.0.0.0", where
    # Every Service port lands on a container port of the same number, named alike.
    for svc in (d for d in k8s_docs() if d["kind"] == "Service"):
        selected = [wl for wl in workloads() if svc["spec"]["selector"].items()
                    <= wl["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, svc["metadata"]["name"]
        containers = selected[0]["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for c in containers for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert ports[p["targetPort"]] == p["port"], f"{svc['metadata']['name']} {p['name']}"
        if "serviceName" in selected[0]["spec"]:
            assert selected[0]["spec"]["serviceName"] == svc["metadata"]["name"]


def test_k8s_pods_get_time_to_drain_and_resources() -> None:
    drain = drain_timeout_s()
    for wl in workloads():
        spec = wl["spec"]["template"]["spec"]
        for c in spec["containers"]:
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
            assert c["resources"]["limits"]["memory"]
        if wl["metadata"]["name"] == "millwheel-worker":
            assert spec["terminationGracePeriodSeconds"] >= drain + 10
    redis = find("StatefulSet", "millwheel-redis")
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] in {
        m["name"] for m in redis["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    conf_mount = next(m for m in redis["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
                      if m["name"] == "config")["mountPath"]
    assert args[:2] == ["redis-server", f"{conf_mount}/redis.conf"]
    generated = {g["name"]: g["files"] for g in kustomization()["configMapGenerator"]}
    volume = next(v for v in redis["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    assert generated[volume["configMap"]["name"]] == ["redis.conf=redis/redis.conf"]


def secret_file(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) a file path in the container comes from, via a volume mount."""
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            assert "secret" in volume, f"{path} must come from a Secret"
            return volume["secret"]["secretName"], path[len(prefix):]
    raise AssertionError(f"{path} is not mounted")


def test_k8s_credentials_and_certificates_come_from_secrets() -> None:
    generated = {g["name"]: {f.split("=")[0] for f in g["files"]}
                 for g in kustomization()["secretGenerator"] if "files" in g}
    commands = {args.command: (wl, c, args) for wl, c, args in millwheel_containers()}
    for role, (wl, c, args) in commands.items():
        pod = wl["spec"]["template"]["spec"]
        files = {"cluster secret": args.cluster_secret_file, "cert": args.tls_cert, "key": args.tls_key,
                 "ca (mTLS)": args.tls_ca}
        if role == "controller":
            files["client token"] = args.auth_token_file
        for what, path in files.items():
            assert path, f"{role} has no {what}"
            secret, key = secret_file(pod, c, path)
            assert key in generated.get(secret, set()), f"{role} {what}: {secret}/{key} is not generated"
        assert args.tls_server_name, f"{role}: workers are dialled by pod IP; certificates carry one name"
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"], \
            f"{role}: the non-root user must be able to read the mounted secrets"
        assert not args.insecure
    _, _, ctl = commands["controller"]
    _, _, wk = commands["worker"]
    assert ctl.cluster_secret_file == wk.cluster_secret_file and ctl.tls_ca == wk.tls_ca
    assert wk.auth_token_file is None, "workers serve no public service: no client token"


def test_k8s_network_policy_admits_only_cluster_and_prometheus_traffic() -> None:
    policies = [d for d in k8s_docs() if d["kind"] == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} and p["spec"]["policyTypes"] == ["Ingress"]
               and not p["spec"].get("ingress") for p in policies), "a default deny for the namespace"
    prometheus = "namespace millwheel.io/prometheus=true"

    def peers(labels: dict[str, str], port: str) -> set[str]:
        """Who may reach ``port`` of pods with ``labels``: components, or other selectors."""
        out: set[str] = set()
        for p in policies:
            if not p["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items():
                continue
            for rule in p["spec"].get("ingress", []):
                if port not in {x["port"] for x in rule.get("ports", [])}:
                    continue
                if "from" not in rule:
                    out.add("anyone")
                for peer in rule.get("from", []):
                    if "namespaceSelector" in peer:
                        (k, v), = peer["namespaceSelector"]["matchLabels"].items()
                        out.add(f"namespace {k}={v}")
                    else:
                        sel = peer["podSelector"]["matchLabels"]
                        out.add(sel.get("app.kubernetes.io/component") or ",".join(f"{k}={v}" for k, v in sel.items()))
        return out

    labels = {wl["metadata"]["name"]: wl["spec"]["template"]["metadata"]["labels"] for wl in workloads()}
    ctl, wk, redis = labels["millwheel-controller"], labels["millwheel-worker"], labels["millwheel-redis"]
    assert peers(ctl, "grpc") == {"worker", "controller", "millwheel.io/client=true"}
    assert peers(ctl, "cluster") == {"worker"}  # heartbeats: no client reaches them
    assert peers(wk, "grpc") == {"controller", "worker"}
    assert peers(redis, "redis") == {"controller", "worker"}
    assert peers(ctl, "console") == {"millwheel.io/client=true"}
    for pod in (ctl, wk):
        assert peers(pod, "metrics") == {prometheus}
        assert peers(pod, "health") == {"anyone"}
    # Every named port of every pod is covered by some rule (else it would be unreachable).
    for wl in workloads():
        for c in wl["spec"]["template"]["spec"]["containers"]:
            for port in c["ports"]:
                assert peers(wl["spec"]["template"]["metadata"]["labels"], port["name"]), \
                    f"{wl['metadata']['name']} port {port['name']} is unreachable"


# -- Dockerfile ---------------------------------------------------------------------------------
def test_dockerfile_runs_millwheel_as_non_root() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)
    assert "openjdk-17-jre-headless" in text and re.search(r'pip install "?\.\[spark\]', text)
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1] not in ("root", "0")
    entry = dockerfile_instruction("ENTRYPOINT")
    assert entry[-1] == "millwheel", "k8s args are appended to `millwheel`"
    parse_cli(dockerfile_instruction("CMD"), "Dockerfile CMD")
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    for _wl, c, _args in millwheel_containers():
        assert {p["containerPort"] for p in c["ports"]} <= exposed


def test_the_console_is_on_a_fixed_exposed_port_in_k8s_and_the_image() -> None:
    """A newcomer must be able to reach the console: a fixed port, exposed by the image,
    a container port, a Service, and a network policy rule (checked above)."""
    text = (DEPLOY / "Dockerfile").read_text()
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    cmd = parse_cli(dockerfile_instruction("CMD"), "Dockerfile CMD")
    assert cmd.command == "up" and cmd.ui_port > 0 and cmd.ui_port in exposed, \
        "the image's default command must put the console on a known, exposed port"
    _wl, ctl, args = next(x for x in millwheel_containers() if x[2].command == "controller")
    assert args.ui_port > 0 and named_port(ctl, "console") == args.ui_port and args.ui_port in exposed
    assert args.auth_token_file, "the console logs in with the client token"
    consoles = [d for d in k8s_docs() if d["kind"] == "Service"
                and any(p["targetPort"] == "console" for p in d["spec"]["ports"])]
    assert len(consoles) == 1 and consoles[0]["spec"].get("sessionAffinity") == "ClientIP", \
        "a login is a session of one replica: a client must stick to it"


def test_the_image_tag_is_the_package_version() -> None:
    from millwheel import __version__

    (image,) = [i for i in kustomization()["images"] if i["name"] == MILLWHEEL_IMAGE]
    assert image["newTag"] == __version__
    for path in (DEPLOY / "Dockerfile", DEPLOY / "README.md", DEPLOY.parent / "README.md"):
        for tag in re.findall(r"\bmillwheel:(\d[\w.]*\d)", path.read_text()):
            assert tag == __version__, f"{path.name} names the image millwheel:{tag}, the package is {__version__}"


# -- supervisord ------------------------------------------------------------------------------
def supervisor_programs() -> dict[str, list[dict[str, str]]]:
    """Program name -> its processes' settings with supervisor's %(...)s expanded."""
    cp = configparser.RawConfigParser()
    cp.read(DEPLOY / "supervisor" / "millwheel.conf")
    assert not [s for s in cp.sections() if s.startswith("group:")], \
        "a group would stop the controller and Redis together with the workers"
    programs: dict[str, list[dict[str, str]]] = {}
    for section in cp.sections():
        if not section.startswith("program:"):
            continue
        name = section.split(":", 1)[1]
        opts = dict(cp.items(section))
        start = int(opts.get("numprocs_start", 0))
        procs = []
        for num in range(start, start + int(opts.get("numprocs", 1))):
            names = {"program_name": name, "process_num": num, "here": str(DEPLOY / "supervisor"),
                     "ENV_PATH": "/usr/bin"}
            procs.append({k: v % names if "%(" in v else v for k, v in opts.items()})
        programs[name] = procs
    return programs


def test_supervisor_commands_are_accepted_by_the_cli_and_agree() -> None:
    programs = supervisor_programs()
    assert set(programs) == {"redis", "controller", "worker"}
    redis_cmd = shlex.split(programs["redis"][0]["command"])
    assert redis_cmd[0] == "redis-server" and Path(redis_cmd[1]).resolve() == DEPLOY / "redis" / "redis.conf"
    redis_port = int(redis_cmd[redis_cmd.index("--port") + 1])

    def millwheel(proc: dict[str, str]) -> Namespace:
        argv = shlex.split(proc["command"])
        assert argv[0] == "millwheel"
        return parse_cli(argv[1:], proc["command"])

    ctl = millwheel(programs["controller"][0])
    workers = [millwheel(p) for p in programs["worker"]]
    assert ctl.command == "controller" and {w.command for w in workers} == {"worker"}
    assert len(workers) >= 2
    for args in [ctl, *workers]:
        url = urlsplit(args.store)
        assert (url.scheme, url.hostname, url.port) == ("redis", "127.0.0.1", redis_port)
    for w in workers:
        assert hostport(w.controller) == (ctl.host, ctl.port)
        assert w.cluster_secret_file == ctl.cluster_secret_file and w.cluster_secret_file
    # Every call authenticated; the client token where `millwheel` run from the
    # repository root finds it (./millwheel-data/client-token).
    root = DEPLOY.parent
    assert Path(ctl.auth_token_file).resolve() == root / "millwheel-data" / "client-token"
    assert Path(ctl.cluster_secret_file).resolve().parent == root / "millwheel-data"
    ports = [a.port for a in [ctl, *workers]] + [a.metrics_port for a in [ctl, *workers]] + [ctl.ui_port,
                                                                                           ctl.cluster_port]
    assert len(set(ports)) == len(ports) and all(p > 0 for p in ports), "fixed, distinct ports"
    assert len({w.worker_id for w in workers}) == len(workers)

    drain = drain_timeout_s()
    prio = {name: int(procs[0]["priority"]) for name, procs in programs.items()}
    assert prio["worker"] > prio["controller"] > prio["redis"], "stop workers, then controller, then Redis"
    for name, procs in programs.items():
        assert procs[0]["stopsignal"] == "TERM" and procs[0]["autorestart"] == "true", name
    assert int(programs["worker"][0]["stopwaitsecs"]) >= drain + 10


# -- Prometheus -------------------------------------------------------------------------------
def test_prometheus_scrapes_what_supervisor_and_k8s_expose() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    static = {t for sc in jobs["millwheel-supervisor"]["static_configs"] for t in sc["targets"]}
    programs = supervisor_programs()
    exposed = set()
    for proc in programs["controller"] + programs["worker"]:
        args = parse_cli(shlex.split(proc["command"])[1:], proc["command"])
        exposed.add(f"{args.host}:{args.metrics_port}")
    assert static == exposed

    k8s = jobs["millwheel-k8s"]
    sd = k8s["kubernetes_sd_configs"][0]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == [kustomization()["namespace"]]
    keep = k8s["relabel_configs"][0]
    assert keep["action"] == "keep" and keep["regex"] == "true"
    assert keep["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    sources = {s for r in k8s["relabel_configs"] for s in r["source_labels"]}
    assert "__meta_kubernetes_pod_annotation_prometheus_io_port" in sources


# -- Redis --------------------------------------------------------------------------------------
def redis_directives() -> dict[str, str]:
    out = {}
    for line in (DEPLOY / "redis" / "redis.conf").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.strip().partition(" ")
            out[key] = value.strip()
    return out


def test_redis_conf_is_durable_and_never_evicts() -> None:
    conf = redis_directives()
    assert conf["appendonly"] == "yes"
    assert conf["appendfsync"] == "always"
    assert conf["no-appendfsync-on-rewrite"] == "no"
    assert conf["maxmemory-policy"] == "noeviction"
    assert conf["protected-mode"] == "yes"


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_redis_server_loads_the_conf() -> None:
    """The installed redis-server accepts every directive (a unix socket: no network)."""
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "redis.sock"
        proc = subprocess.Popen(
            ["redis-server", str(DEPLOY / "redis" / "redis.conf"), "--port", "0",
             "--unixsocket", str(sock), "--dir", tmp],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            import redis

            deadline = time.monotonic() + 5
            while not sock.exists():
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.01)
            client = redis.Redis(unix_socket_path=str(sock))
            got = {k: client.config_get(k)[k] for k in ("appendonly", "appendfsync", "maxmemory-policy")}
            client.close()
            assert got == {"appendonly": "yes", "appendfsync": "always", "maxmemory-policy": "noeviction"}
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout:
                proc.stdout.close()
