"""Load user code named by ``pkg.module:attribute``, only from modules a deployment allows.

Validation never comes here: a spec is checked from its data alone
(:mod:`millwheel.operators.schema`), import paths by their shape. Only a process that
is about to run the code imports it, and a service worker does so only for modules its
allow-list (``--allow-code 'mypkg.*,otherpkg.mod'``) names. ``allow=None`` allows
everything: ``millwheel run`` runs the user's own code on the user's own machine.

The allow-list is checked twice: on the module named in the path before it is
imported, and on the object the path resolves to before anything can call it. An
allowed module also holds whatever it imported (``mypkg.mod:subprocess.Popen``,
``mypkg.mod:os.system``, ``system`` after ``from os import system``), so the object
itself must be a class or function whose own defining module (``__module__``) is
allowed; builtins, instances, partials and other callables are refused
(:meth:`AllowList.check_object`).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

from millwheel.errors import InvalidSpecError, MillWheelError, PermissionDeniedError

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_IDENT}(?:\.{_IDENT})*"
IMPORT_PATH = re.compile(rf"({_DOTTED}):({_DOTTED})")
_PATTERN = re.compile(rf"\*|{_DOTTED}(?:\.\*)?")
MAX_IMPORT_PATH_CHARS = 200


def check_import_path(path: str, what: str) -> str:
    """The module of ``path`` if it is ``pkg.module:attribute`` (dotted identifiers, by
    shape only: nothing is imported); else InvalidSpecError naming ``what``."""
    if len(path) > MAX_IMPORT_PATH_CHARS:
        raise InvalidSpecError(
            f"{what}: import path of {len(path)} characters, over the limit of {MAX_IMPORT_PATH_CHARS}")
    match = IMPORT_PATH.fullmatch(path)
    if match is None:
        raise InvalidSpecError(f"{what} {path!r}: expected 'pkg.module:attribute' (dotted identifiers)")
    return match.group(1)


@dataclass(frozen=True)
class AllowList:
    """Modules whose code may be imported: ``pkg.*`` (the package and everything under
    it), ``pkg.mod`` (that module only) or ``*`` (anything). Empty: built-ins only."""

    patterns: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> AllowList:
        patterns = tuple(p.strip() for p in (text or "").split(",") if p.strip())
        for p in patterns:
            if not _PATTERN.fullmatch(p):
                raise InvalidSpecError(
                    f"allow-code pattern {p!r}: expected 'pkg.*', 'pkg.module' or '*'")
        return cls(patterns)

    def allows(self, module: str) -> bool:
        for p in self.patterns:
            if p == "*" or p == module:
                return True
            if p.endswith(".*") and (module == p[:-2] or module.startswith(p[:-1])):
                return True
        return False

    def describe(self) -> str:
        return ",".join(self.patterns) if self.patterns else "none: built-in operators only"

    def check(self, path: str, what: str) -> None:
        """PermissionDeniedError unless the module of import path ``path`` is allowed."""
        module = check_import_path(path, what)
        if not self.allows(module):
            raise PermissionDeniedError(
                f"{what} {path!r}: module {module!r} is not in this deployment's code "
                f"allow-list (--allow-code: {self.describe()})")

    def check_object(self, obj: Any, path: str, what: str) -> None:
        """PermissionDeniedError unless ``obj`` (what ``path`` resolved to) is a class or
        a function defined in an allowed module: its own ``__module__``, not the module
        it was reached through, and never ``builtins``."""
        kind = "class" if inspect.isclass(obj) else "function" if (
            inspect.isfunction(obj) or inspect.isbuiltin(obj)) else None
        defined_in = getattr(obj, "__module__", None) if kind is not None else None
        if kind is None:
            problem = f"it is {_a(type(obj).__name__)}, not a class or function"
        elif not isinstance(defined_in, str) or not defined_in:
            problem = f"the {kind} names no defining module"
        elif defined_in == "builtins":
            problem = f"the {kind} is a Python builtin"
        elif not self.allows(defined_in):
            problem = f"the {kind} is defined in module {defined_in!r}, not in the allow-list"
        else:
            return
        raise PermissionDeniedError(
            f"{what} {path!r}: {problem}: only classes and functions defined in an allowed "
            f"module may run (--allow-code: {self.describe()})")


def import_object(path: str, *, what: str = "object", allow: AllowList | None = None) -> Any:
    """Import ``pkg.module:attribute``; with ``allow``, only from an allowed module and
    only a class or function defined in one (checked before anything is called)."""
    if allow is not None:
        allow.check(path, what)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidSpecError(f"{what} {path!r}: expected 'pkg.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidSpecError(f"{what} {path!r}: cannot import {module_name!r}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InvalidSpecError(
                f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    if allow is not None:
        allow.check_object(obj, path, what)
    return obj


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1] in "aeiou" else f"a {noun}"


class CodeReloadError(MillWheelError):
    """A user module could not be imported again (:func:`reload_module`); the module
    is as it was before the attempt. ``exc_type``: the error the import raised."""

    def __init__(self, message: str, exc_type: str) -> None:
        super().__init__(message)
        self.exc_type = exc_type


#: Module name prefixes never reloaded: the service's own code (a reload of those would
#: swap the classes the running service holds under its feet).
OWN_MODULES = ("millwheel", "services")


def module_of(path: str) -> str:
    """The module part of ``pkg.module:attribute`` (by shape; nothing is imported)."""
    return path.partition(":")[0]


def reload_module(name: str, allow: AllowList) -> bool:
    """Import module ``name`` again from its file (:func:`importlib.reload`), under
    ``allow``: the new version of a user's code, for a worker that already imported the
    old one (``sys.modules`` would otherwise hand the old one to every later import).

    False when the module is not imported yet (the next import reads the file anyway).
    A module that fails to load (a syntax error, an exception at import) is left as it
    was before the call, every attribute restored, and the error is raised as
    :class:`~millwheel.errors.CodeReloadError`: the caller keeps running the old code.
    The service's own modules and modules outside the allow-list are refused
    (PermissionDeniedError), as for an import."""
    if name.split(".", 1)[0] in OWN_MODULES:
        raise PermissionDeniedError(f"module {name!r}: the service's own code is never reloaded")
    if not allow.allows(name):
        raise PermissionDeniedError(f"module {name!r} is not in this deployment's code allow-list "
                                    f"(--allow-code: {allow.describe()})")
    module = sys.modules.get(name)
    if module is None:
        return False
    saved = dict(module.__dict__)
    # A bytecode cache written in the same second as an edit of the same size passes for
    # fresh (.pyc files record the source's mtime in whole seconds): read the source.
    cached = getattr(module, "__cached__", None)
    if isinstance(cached, str):
        try:
            os.unlink(cached)
        except OSError:
            pass
    try:
        importlib.reload(module)
    except BaseException as exc:  # noqa: BLE001 - SyntaxError, SystemExit at import: the old code stays
        module.__dict__.clear()
        module.__dict__.update(saved)
        sys.modules[name] = module
        raise CodeReloadError(f"module {name!r} could not be loaded again: {type(exc).__name__}: "
                              f"{exc}", exc_type=type(exc).__name__) from exc
    return True
