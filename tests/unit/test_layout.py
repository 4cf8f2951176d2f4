"""The code's layout rules, checked from the source text (nothing is imported or run).

* No import cycle among the project's own modules, counting imports made under
  ``if TYPE_CHECKING:`` and inside functions: a cycle hidden that way is still a knot in
  the design (two modules that each need the other), only harder to see.
* No module of ``millwheel/`` or ``services/`` over 400 lines: past that, split it along
  its seams.
* ``services/`` is grouped by the process a module runs in: its top level holds a few
  modules shared by every process and no module named for one process
  (``controller_*``, ``worker_*``, ``cli_*``), which belongs in that process's folder.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("millwheel", "services", "bench")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if "generated" in rel.parts or "results" in rel.parts:
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """Every project module that ``name`` imports, wherever the import statement stands."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if origin.startswith("millwheel_service"):
                origin = "services" + origin[len("millwheel_service"):]
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import Name``
            # imports mod (the package's __init__ counts only when a name comes from it).
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: set(_imports(name, path, modules)) for name, path in modules.items()}
    # A package's __init__ that defines nothing of its own is not a module one depends on:
    # importing pkg.mod runs it, but it imports nothing back here.
    cycles = _cycles(graph)
    assert not cycles, "import cycles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_no_module_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for name, p in _modules().items()
            if not name.startswith("bench") and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them along their seams): {long}"


def test_services_is_grouped_by_process() -> None:
    top = sorted(p.name for p in (ROOT / "services").glob("*.py"))
    assert len(top) <= 10, f"services/ top level has {len(top)} modules: {top}"
    prefixed = [n for n in top if n.startswith(("controller_", "worker_", "cli_"))]
    assert not prefixed, f"modules named for one process belong in its folder: {prefixed}"
    for wing in ("controller", "worker", "cli", "rpc", "ui"):
        assert (ROOT / "services" / wing / "__init__.py").is_file(), f"services/{wing}/ is missing"
