"""The code's layout rules, checked from the source text (nothing is imported or run).

* No import cycle among the project's own modules, counting imports made under
  ``if TYPE_CHECKING:`` and inside functions: a cycle hidden that way is still a knot in
  the design (two modules that each need the other), only harder to see.
* No module of ``millwheel/`` or ``services/`` over 600 lines: one concept is kept whole
  in one module of up to ~600 lines rather than a class split across files (mixins
  spread over modules); past that, split it along its seams.
* No class of ``services/`` or ``millwheel/`` has more than one base class defined by
  the project (in ``millwheel/`` or ``services/``): a class is composed of parts it
  holds, not assembled from mixins, each of which reads attributes only the final class
  sets. Bases from the standard library or third parties (``Protocol``, ``Exception``,
  a generated ``pb_grpc.*Servicer``) do not count.

  Named exception: the state backends in ``millwheel/state/``. ``SQLiteStore``
  (``SQLiteLease``, ``SQLiteErrors``, ``SQLiteShared``, ``SQLiteFile``) and
  ``RedisStore`` (``RedisLease``, ``RedisLog``) each implement the one wide
  :class:`~millwheel.state.protocol.StateStore` protocol, assembled from mixins, one per
  part of it (leases, the stream log and watermarks, failing-record errors, the file or
  connection); every mixin works on the one connection, lock and fence the store holds
  (``_db``/``_lock``, ``_r``), and callers see one object with the protocol's methods.
  Turning the mixins into held parts means re-plumbing that shared connection and
  transaction state through every part, which is not a trivial change; they stay as
  they are, and only they: the rule holds everywhere else in ``millwheel/``.
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
MAX_LINES = 600
#: Where a class may have several project-defined bases (the module docstring says why).
MIXINS_ALLOWED = ("millwheel/state/",)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT)
            # bench/.peers holds the peers' virtualenvs (site-packages): not the project's code
            if "generated" in rel.parts or "results" in rel.parts or ".peers" in rel.parts:
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """Every project module that ``name`` imports, wherever the import statement stands."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = _origin(name, path, node)
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


def test_no_module_over_600_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for name, p in _modules().items()
            if not name.startswith("bench") and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them along their seams): {long}"


def _origin(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` statement of module ``name`` names."""
    if node.level:
        base = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
        base = base[: len(base) - (node.level - 1)]
        origin = ".".join(base + ([node.module] if node.module else []))
    else:
        origin = node.module or ""
    if origin.startswith("millwheel_service"):
        origin = "services" + origin[len("millwheel_service"):]
    return origin


class _Classes:
    """The classes defined in millwheel/ and services/, and what a base expression in a
    module names: a project class (``module:Name``) or nothing of the project's."""

    def __init__(self) -> None:
        self.modules = {n: p for n, p in _modules().items() if n.split(".")[0] in ("millwheel", "services")}
        self.trees = {n: ast.parse(p.read_text(), str(p)) for n, p in self.modules.items()}
        self.defined = {n: {c.name for c in ast.walk(t) if isinstance(c, ast.ClassDef)} for n, t in self.trees.items()}
        # per module: a local name -> (module, name) imported, or (module, "") for a module
        self.imported: dict[str, dict[str, tuple[str, str]]] = {}
        for n, tree in self.trees.items():
            names: dict[str, tuple[str, str]] = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    origin = _origin(n, self.modules[n], node)
                    for a in node.names:
                        sub = f"{origin}.{a.name}"
                        names[a.asname or a.name] = (sub, "") if sub in self.modules else (origin, a.name)
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.asname:
                            names[a.asname] = (a.name, "")
                        else:  # ``import a.b`` binds ``a``
                            top = a.name.split(".")[0]
                            names[top] = (top, "")
            self.imported[n] = names

    def lookup(self, module: str, name: str, depth: int = 0) -> str | None:
        """``module``'s attribute ``name`` if it is a project class (followed through
        re-exports), as ``module:Name``."""
        if module not in self.modules or depth > 10:
            return None
        if name in self.defined[module]:
            return f"{module}:{name}"
        target = self.imported[module].get(name)
        if target is None or not target[1]:
            return None
        return self.lookup(target[0], target[1], depth + 1)

    def resolve(self, module: str, expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Subscript):  # Base[T]
            return self.resolve(module, expr.value)
        if isinstance(expr, ast.Name):
            if expr.id in self.defined[module]:
                return f"{module}:{expr.id}"
            target = self.imported[module].get(expr.id)
            if target is None:
                return None
            return self.lookup(*target) if target[1] else None
        if isinstance(expr, ast.Attribute):  # alias.Name, package.module.Name
            parts: list[str] = []
            value: ast.expr = expr
            while isinstance(value, ast.Attribute):
                parts.insert(0, value.attr)
                value = value.value
            if not isinstance(value, ast.Name):
                return None
            target = self.imported[module].get(value.id)
            if target is None:
                return None
            prefix = target[0] if not target[1] else f"{target[0]}.{target[1]}"
            dotted = ".".join([prefix, *parts])
            owner, _, attr = dotted.rpartition(".")
            return self.lookup(owner, attr)
        return None


def test_no_class_has_several_project_bases() -> None:
    classes = _Classes()
    found = {}
    for name, tree in classes.trees.items():
        rel = str(classes.modules[name].relative_to(ROOT))
        if rel.startswith(MIXINS_ALLOWED):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [b for b in (classes.resolve(name, e) for e in node.bases) if b is not None]
                if len(bases) > 1:
                    found[f"{rel}:{node.name}"] = bases
    assert not found, ("classes with more than one base class defined by the project (hold the parts "
                       f"instead of inheriting them): {found}")


def test_services_is_grouped_by_process() -> None:
    top = sorted(p.name for p in (ROOT / "services").glob("*.py"))
    assert len(top) <= 10, f"services/ top level has {len(top)} modules: {top}"
    prefixed = [n for n in top if n.startswith(("controller_", "worker_", "cli_"))]
    assert not prefixed, f"modules named for one process belong in its folder: {prefixed}"
    for wing in ("controller", "worker", "cli", "rpc", "ui"):
        assert (ROOT / "services" / wing / "__init__.py").is_file(), f"services/{wing}/ is missing"
