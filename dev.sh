#!/usr/bin/env bash
# One entry point that sets itself up on a fresh machine, then runs what you ask.
#   ./dev.sh demo [ARGS]   the Zeitgeist demo on the embedded store
#   ./dev.sh test [ARGS]   the whole test suite (what CI runs)
#   ./dev.sh setup         only the set-up: system packages, .venv, pip install (with Spark), protobuf
#   ./dev.sh bench [ARGS]  the benchmark suite (bench/)
#   ./dev.sh mw ARGS       any millwheel command inside the environment
set -euo pipefail
cd "$(dirname "$0")"

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)  # the console's browser tests
# The connector tests start their own PostgreSQL (initdb into a temp dir) and nats-server -js.
command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need_apt+=(postgresql)
command -v nats-server >/dev/null 2>&1 || need_apt+=(nats-server)

setup() {
  if ((${#need_apt[@]})); then
    log "installing system packages: ${need_apt[*]}"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
  fi
  local py=""
  for cand in python3.12 python3.11 python3; do
    # 2>/dev/null: a pyenv shim of a version not installed prints an error when probed
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      py="$cand"; break
    fi
  done
  [ -n "$py" ] || { echo "millwheel needs Python 3.11+ (none found on PATH)" >&2; exit 1; }
  if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $py"
    "$py" -m venv .venv
  fi
  local stamp=".venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    log "installing millwheel and its dependencies into .venv"
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -e '.[spark,dev]'
    rm -f .venv/.installed-*; touch "$stamp"
  fi
  if [ -x scripts/gen_proto.sh ]; then scripts/gen_proto.sh; fi
  # Flink SQL, which tests/integration/test_nexmark_vs_flink.py checks the Nexmark queries
  # against, lives in a virtualenv of its own (apache-flink's pins clash with ours):
  # bench/.peers/flink, made once (bench/peers/peer_common.py's prepare) and kept.
  if ! bench/.peers/flink/bin/python -c 'import pyflink' >/dev/null 2>&1; then
    log "installing apache-flink into bench/.peers/flink (the Flink SQL peer)"
    .venv/bin/python -c 'from bench.peers.peer_common import prepare; why = prepare(); print(why or "", end="")' \
      | grep . >&2 && log "warning: no Flink SQL peer; the Nexmark cross-check will fail" || true
  fi
}

cmd="${1:-help}"; shift || true
case "$cmd" in
  setup) setup ;;
  demo) setup; exec .venv/bin/millwheel demo zeitgeist "$@" ;;
  test) setup; exec .venv/bin/python -m pytest -q "$@" ;;
  bench) setup; exec .venv/bin/python -m bench "$@" ;;
  mw) setup; exec .venv/bin/millwheel "$@" ;;
  *) sed -n '2,8p' "$0"; exit 2 ;;
esac
