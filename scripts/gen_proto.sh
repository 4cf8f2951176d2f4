#!/usr/bin/env bash
# Generate the Python gRPC stubs from proto/ into services/generated/ (gitignored).
# The logic lives in scripts/gen_proto.py, which the package build (setup.py) runs too.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
"$PY" scripts/gen_proto.py "$@" >/dev/null
