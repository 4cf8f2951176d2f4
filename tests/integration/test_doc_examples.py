"""Every shell and Python example of the README and docs/ runs, as a reader would run it.

Each page is read by a fresh user: its fenced ``bash``/``sh``/``python`` blocks run in
page order in a directory of their own, against a real service (``millwheel up`` on
free ports, started by the test where the page says to start one, or at the first
block that needs one). A block that cannot run here (a Kubernetes deployment, a Spark
or Redis cluster elsewhere, the test suite itself) says so in the markdown, right
before its fence, with ``<!-- not-run: REASON -->``; a marker without a reason fails.

What the test changes, and only that: the ``millwheel up`` line of a block is run in
the background with ``--port``/``--ui-port`` on free ports (the commands after it find
the controller through ``$MILLWHEEL_CONTROLLER``, as the README says they do), and
``127.0.0.1:PORT`` (the console's port, as ``millwheel up`` prints it) is the port
the test chose. A Python block whose first line is ``# NAME.py — run with: COMMAND`` is
saved as NAME.py and COMMAND runs; any other Python block runs as a script.
Every block must exit 0 and print no traceback; a few also have their output
checked (:data:`CHECKS`) the way a reader would look at it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
SHELL = {"bash", "sh", "shell"}
PYTHON = {"python", "py"}
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*not-run:(.*?)-->")
RUN_WITH = re.compile(r"^# (\S+\.py) — run with: (.+)$")
UP_LINE = re.compile(r"^millwheel up(?:\s+([^#]*?))?\s*(?:#.*)?$", re.M)
#: The input a reader of the README has at hand for its first example (pipeline.py reads
#: it before the quickstart shows how to make one): the quickstart's own clicks.
CLICKS = "".join(json.dumps({"key": f"c{i}", "value": {"user": ["ann", "bob", "cy"][i % 3] if i < 40 else "ann"},
                             "timestamp": 1_700_000_000_000_000 + i * 500_000}) + "\n" for i in range(60))


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    body: str
    not_run: str | None  # the reason, when the page marks the block not-run

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        out.append(Block(page, text[:m.start()].count("\n") + 1, m.group(1).lower(), m.group(2),
                         marker.group(1).strip() if marker else None))
    return out


def runnable(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang in SHELL | PYTHON]


def test_every_example_runs_or_says_why_not() -> None:
    """A not-run marker names its reason and sits right before a shell or Python fence
    (a stray marker, or one before a YAML block, would silence nothing)."""
    seen = 0
    for page in PAGES:
        text = page.read_text()
        markers = len(MARKER.findall(text))
        marked = [b for b in blocks(page) if b.not_run is not None]
        assert markers == len(marked), f"{page.name}: a not-run marker that is not right before a fence"
        for b in marked:
            assert b.lang in SHELL | PYTHON, f"{b.where}: not-run marker on a {b.lang or 'text'} block"
            assert len(b.not_run or "") >= 10, f"{b.where}: not-run needs a reason"
        seen += len(runnable(page))
    assert seen >= 20  # the pages have examples: the parser found them


def test_the_readme_is_a_guide_and_the_figures_live_in_docs_bench() -> None:
    """Benchmark tables belong to docs/bench.md (before, ~250 of the README's 646 lines
    were result tables a newcomer scrolled past); the README links them."""
    text = (ROOT / "README.md").read_text()
    tables = [line for line in text.splitlines() if line.startswith("|")]
    figures = [line for line in tables if re.search(r"records/s|events/s|rows/s|µs/record|x local", line)]
    assert not figures, figures
    assert "docs/bench.md" in text
    assert len(text.splitlines()) <= 650  # a guide that grows past today's ~570 lines: split it


def test_the_readme_opens_with_its_title() -> None:
    first = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.strip())
    assert first == "# millwheel"


# -- running a page -------------------------------------------------------------------------------
class Reader:
    """One reader of one page: a directory, an environment, and the service when started."""

    def __init__(self, page: Path, home: Path) -> None:
        self.page = page
        self.home = home
        self.up: subprocess.Popen[bytes] | None = None
        self.port = free_port()
        self.ui_port = free_port()
        # This checkout's millwheel and millwheel_service, whatever the venv has installed
        # (a `pip install -e` elsewhere); the venv's commands (millwheel, python3) first.
        shim = home.parent / f"{home.name}-shim"
        shim.mkdir()
        (shim / "millwheel").symlink_to(ROOT / "millwheel")
        (shim / "millwheel_service").symlink_to(ROOT / "services")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MILLWHEEL_", "PYTHON"))}
        self.env = {**env, "PYTHONPATH": str(shim), "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",
                    "MILLWHEEL_CONTROLLER": f"127.0.0.1:{self.port}"}
        (home / "clicks.jsonl").write_text(CLICKS)

    def start(self, args: str) -> None:
        """``millwheel up ARGS`` as the page says, on the test's ports, in the background."""
        if self.up is not None:
            return
        log = (self.home / "up.log").open("wb")
        self.up = subprocess.Popen(["millwheel", "up", *args.split(), "--port", str(self.port),
                                    "--ui-port", str(self.ui_port)],
                                   cwd=self.home, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        deadline = time.monotonic() + 90
        while "millwheel is up" not in (self.home / "up.log").read_text():
            assert self.up.poll() is None, f"millwheel up ended:\n{(self.home / 'up.log').read_text()}"
            assert time.monotonic() < deadline, f"millwheel up did not come up:\n{(self.home / 'up.log').read_text()}"
            time.sleep(0.3)

    def stop(self) -> None:
        if self.up is None or self.up.poll() is not None:
            return
        os.killpg(self.up.pid, signal.SIGINT)
        try:
            self.up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.up.pid, signal.SIGKILL)
            self.up.wait()

    def run(self, block: Block, index: int) -> subprocess.CompletedProcess[str]:
        body = block.body.replace("127.0.0.1:PORT", f"127.0.0.1:{self.ui_port}")
        if block.lang in SHELL:
            for m in UP_LINE.finditer(body):
                self.start(m.group(1) or "")
            body = UP_LINE.sub("", body)
            argv = ["bash", "-euo", "pipefail", "-c", body]
        else:
            first = body.split("\n", 1)[0]
            named = RUN_WITH.match(first)
            if named:
                (self.home / named.group(1)).write_text(body)
                argv = ["bash", "-euo", "pipefail", "-c", named.group(2)]
            else:
                script = self.home / f"example_{index}.py"
                script.write_text(body)
                argv = ["python3", script.name]
        if needs_service(block.body):
            self.start("")
        return subprocess.run(argv, cwd=self.home, env=self.env, capture_output=True, text=True, timeout=300)


def needs_service(body: str) -> bool:
    return any(s in body for s in ("ControllerClient(", "millwheel-data/client-token", "127.0.0.1:PORT"))


# -- what a reader would look at ----------------------------------------------------------------
def _pipeline_py_totals(out: subprocess.CompletedProcess[str], home: Path) -> None:
    totals = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {t["key"] for t in totals} == {"ann", "bob", "cy"}, out.stdout


def _idle_alerts(out: subprocess.CompletedProcess[str], home: Path) -> None:
    """The user class of "Your own computation class": one alert per user, stamped its
    timer's time (the user's last click + gap_us), saying that last click."""
    last: dict[str, int] = {}
    for line in (home / "clicks.jsonl").read_text().splitlines():
        click = json.loads(line)
        last[click["value"]["user"]] = max(last.get(click["value"]["user"], 0), click["timestamp"])
    alerts = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {a["key"]: (json.loads(a["value"])["last_click"], a["timestamp"]) for a in alerts} == \
        {user: (t, t + 5_000_000) for user, t in last.items()}, out.stdout
    assert len(alerts) == len(last), out.stdout


def _quickstart(out: subprocess.CompletedProcess[str], home: Path) -> None:
    """The last steps: every window closed, and the sink holds exactly the busy windows
    (3 or more clicks of one user in 10 s) of the clicks the block injected."""
    assert "+inf (done)" in out.stdout, out.stdout
    counts: Counter[tuple[str, int]] = Counter()
    for line in (home / "clicks.jsonl").read_text().splitlines():
        click = json.loads(line)
        counts[(click["value"]["user"], click["timestamp"] - click["timestamp"] % 10_000_000)] += 1
    rows = [json.loads(m.group(1)) for m in re.finditer(r"^\s+\d+\s+\d{4}-\S+Z\s+\S+\s+(\{.*\})$", out.stdout, re.M)]
    assert {(r["key"], r["start"]): r["value"] for r in rows} == {k: n for k, n in counts.items() if n >= 3}, \
        out.stdout


def _python_client(out: subprocess.CompletedProcess[str], home: Path) -> None:
    assert "NodeWatermark(node='tap_counts'" in out.stdout and "KeyState(computation='tap_counts'" in out.stdout
    assert re.search(r"^\d+ ann b'\{.*\"value\": 3", out.stdout, re.M), out.stdout


def _tracker(out: subprocess.CompletedProcess[str], home: Path) -> None:
    overview, _end = json.JSONDecoder().raw_decode(out.stdout)  # curl adds no newline
    assert "graph" in overview and overview["leading"] is True


#: (page, a line of the block) -> the check of its output.
CHECKS: dict[tuple[str, str], Callable[[subprocess.CompletedProcess[str], Path], None]] = {
    ("README.md", "# pipeline.py — run with:"): _pipeline_py_totals,
    ("README.md", "# idle.py — run with:"): _idle_alerts,
    ("README.md", "millwheel subscribe busy"): _quickstart,
    ("service.md", "millwheel subscribe busy"): _quickstart,
    ("README.md", "with ControllerClient() as mw:"): _python_client,
    ("ui.md", "/api/v1/overview"): _tracker,
}


def pages_with_examples() -> Iterator[Path]:
    return (p for p in PAGES if any(b.not_run is None for b in runnable(p)))


@pytest.mark.parametrize("page", list(pages_with_examples()), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_examples_of_a_page_run(page: Path, tmp_path: Path) -> None:
    home = tmp_path / "reader"
    home.mkdir()
    reader = Reader(page, home)
    checked = set()
    try:
        for i, block in enumerate(runnable(page)):
            if block.not_run is not None:
                continue
            out = reader.run(block, i)
            assert out.returncode == 0 and "Traceback" not in out.stderr, (
                f"{block.where} failed ({out.returncode}):\n{block.body}\n"
                f"--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}")
            for (name, line), check in CHECKS.items():
                if name == page.name and line in block.body:
                    check(out, home)
                    checked.add((name, line))
    finally:
        reader.stop()
    assert checked == {k for k in CHECKS if k[0] == page.name}, "a checked example is gone or marked not-run"
