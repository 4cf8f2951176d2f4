"""What the peers share: a virtualenv of their own, and the CSV input they read.

A peer whose pins clash with the project's (apache-flink, pathway) is never a
dependency of the project: on first use :func:`prepare` makes its virtualenv under
``bench/.peers/`` (gitignored) with ``pip install PACKAGE``, and the peer's job script
runs with that interpreter (:func:`venv_python`). :func:`write_input` writes the
workload's records as the CSV file those jobs read.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from millwheel.record import Record

#: ``bench/.peers``: one virtualenv per peer, made on first use.
VENVS = Path(__file__).resolve().parents[1] / ".peers"
INSTALL_TIMEOUT_S = 1800


def venv_python(venv: Path = VENVS / "flink") -> Path:
    return venv / "bin" / "python"


def _imports(venv: Path, module: str) -> str | None:
    python = venv_python(venv)
    if not python.exists():
        return f"no peer virtualenv at {venv}"
    done = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True)
    return None if done.returncode == 0 else f"{module} does not import in {venv}: {done.stderr.strip()[-300:]}"


def prepare(venv: Path = VENVS / "flink", install: bool = True, package: str = "apache-flink",
            module: str = "pyflink") -> str | None:
    """Make a peer's virtualenv with ``package`` on first use. None when ready, else why not."""
    if _imports(venv, module) is None:
        return None
    if not install:
        return f"{package} not installed (no install asked): {_imports(venv, module)}"
    try:
        if not venv_python(venv).exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, text=True)
        subprocess.run([str(venv_python(venv)), "-m", "pip", "install", "-q", package], check=True,
                       capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        return f"pip install {package} failed: {(exc.stderr or '').strip()[-500:]}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"pip install {package} failed: {exc.__class__.__name__}: {exc}"
    return _imports(venv, module)


def write_input(records: list[Record], path: Path) -> int:
    """The records as CSV ``key,event time ms,record ID``, in injection order; returns the count."""
    with path.open("w") as f:
        f.writelines(f"{r.key},{r.timestamp // 1000},{r.record_id}\n" for r in records)
    return len(records)
