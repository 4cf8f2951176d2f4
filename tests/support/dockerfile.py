"""Build a Dockerfile's file system steps without a Docker daemon.

:func:`instructions` parses a Dockerfile (continuation lines, comments, JSON or shell
form); :func:`context_files` lists the build context as BuildKit sends it (the
``<Dockerfile>.dockerignore`` beside it, else ``.dockerignore`` at the root, with
Docker's pattern rules: ``*`` stays inside a path segment, ``**`` crosses them, a
pattern that matches a directory drops everything under it, ``!`` re-includes);
:class:`ImageBuild` replays ``WORKDIR``/``COPY``/``ENV``/``RUN`` into a directory that
stands for the image's root, running the ``RUN`` steps that make the Python install
with a virtualenv's ``pip`` and ``python`` first on ``PATH``.

A ``RUN`` step is a chain of commands joined by ``&&``. System set-up (``apt-get``,
``useradd``, cleaning apt's lists) is not replayed: the test machine has what the
image's system packages give. Every other command runs, so a build step the Dockerfile
forgot to ``COPY`` an input for fails here as it would under ``docker build``; a
command this module does not know how to classify fails the build loudly rather than
being skipped.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

#: Commands of a RUN step that set up the operating system, not replayed here.
SYSTEM_COMMANDS = ("apt-get", "useradd", "groupadd", "DEBIAN_FRONTEND=")
SYSTEM_PATHS = ("/var/lib/apt/lists",)


@dataclass(frozen=True)
class Instruction:
    name: str
    args: list[str]  # JSON form as given; shell form as one string
    shell: bool


def instructions(path: Path) -> list[Instruction]:
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.rstrip()
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path}: the last instruction ends with a backslash"
    out = []
    for text in logical:
        name, _, rest = text.strip().partition(" ")
        rest = rest.strip()
        if rest.startswith("["):
            out.append(Instruction(name.upper(), json.loads(rest), shell=False))
        else:
            out.append(Instruction(name.upper(), [rest], shell=True))
    return out


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    pattern = pattern.strip().lstrip("/")
    parts = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            parts.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            parts.append(".*")
            i += 2
        elif pattern[i] == "*":
            parts.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            parts.append("[^/]")
            i += 1
        else:
            parts.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(parts) + r"\Z")


def _ignore_rules(root: Path, dockerfile: Path) -> list[tuple[bool, re.Pattern[str]]]:
    own = dockerfile.with_name(dockerfile.name + ".dockerignore")
    path = own if own.is_file() else root / ".dockerignore"
    if not path.is_file():
        return []
    rules = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, _pattern_regex(line[1:] if negate else line)))
    return rules


def _ignored(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parents = [str(p) for p in reversed(PurePosixPath(rel).parents) if str(p) != "."] + [rel]
    ignored = False
    for negate, rx in rules:
        if any(rx.match(p) for p in parents):
            ignored = not negate
    return ignored


def context_files(root: Path, dockerfile: Path) -> list[str]:
    """Relative paths of the regular files in the build context."""
    rules = _ignore_rules(root, dockerfile)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if not _ignored(rel_dir + d, rules)]
        files += [rel_dir + f for f in filenames if not _ignored(rel_dir + f, rules)]
    return sorted(files)


@dataclass
class ImageBuild:
    """Replays a Dockerfile into ``rootfs`` (the image's ``/``), Python into ``venv``."""

    context: Path
    dockerfile: Path
    rootfs: Path
    venv: Path
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    log: list[str] = field(default_factory=list)

    def host(self, image_path: str) -> Path:
        path = PurePosixPath(self.workdir) / image_path
        return self.rootfs / str(path).lstrip("/")

    def run(self) -> None:
        files = context_files(self.context, self.dockerfile)
        for ins in instructions(self.dockerfile):
            if ins.name == "WORKDIR":
                self.workdir = str(PurePosixPath(self.workdir) / ins.args[0])
                self.host(".").mkdir(parents=True, exist_ok=True)
            elif ins.name == "ENV":
                for item in shlex.split(ins.args[0]):
                    key, _, value = item.partition("=")
                    self.env[key] = value
            elif ins.name == "COPY":
                self._copy(ins, files)
            elif ins.name == "RUN":
                command = ins.args[0] if ins.shell else shlex.join(ins.args)
                for step in (s.strip() for s in command.split("&&")):
                    self._run_step(step)

    def _copy(self, ins: Instruction, files: list[str]) -> None:
        words = shlex.split(ins.args[0]) if ins.shell else list(ins.args)
        words = [w for w in words if not w.startswith("--")]
        *sources, dest = words
        assert len(sources) == 1 or dest.endswith("/"), f"COPY {words}: several sources need a dest/"
        for src in sources:
            src = src.rstrip("/").removeprefix("./")
            under = [f for f in files if f.startswith(src + "/")]
            if src in files:
                target = self.host(dest + PurePosixPath(src).name if dest.endswith("/") else dest)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(self.context / src, target)
            elif under:  # a directory: its contents go into dest
                for f in under:
                    target = self.host(dest) / f[len(src) + 1:]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(self.context / f, target)
            else:
                raise AssertionError(f"COPY {src}: not in the build context (missing, or .dockerignored)")
            self.log.append(f"COPY {src} -> {dest}")

    def _run_step(self, step: str) -> None:
        argv = shlex.split(step)
        if not argv:
            return
        if argv[0].startswith(SYSTEM_COMMANDS) or (
                argv[:2] == ["rm", "-rf"] and all(a.startswith(SYSTEM_PATHS) for a in argv[2:])):
            self.log.append(f"skipped (system set-up): {step}")
            return
        if argv[0] == "cd":
            self.workdir = str(PurePosixPath(self.workdir) / argv[1])
            return
        if argv[:2] == ["rm", "-rf"]:
            for target in argv[2:]:
                assert target.startswith("/") and target != "/", f"refusing to replay {step!r}"
                shutil.rmtree(self.host(target), ignore_errors=True)
            return
        env = {**os.environ, **self.env, "PATH": f"{self.venv / 'bin'}:{os.environ['PATH']}",
               "VIRTUAL_ENV": str(self.venv)}
        # The image has no pip cache to keep; here the machine's wheel cache saves minutes.
        env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "PIP_NO_CACHE_DIR")}
        done = subprocess.run(["sh", "-c", step], cwd=self.host("."), env=env, capture_output=True, text=True,
                              timeout=900)
        self.log.append(f"RUN {step} -> {done.returncode}")
        assert done.returncode == 0, f"RUN {step!r} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
