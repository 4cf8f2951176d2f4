"""Which version of each computation's user code a worker runs: new code reaches running workers.

Python keeps an imported module in ``sys.modules``: without this, a worker that once
imported ``mypkg.counter`` would build every later range of every computation from that
first import, however the file changed (only a worker restart loaded a fixed class, and
``millwheel update`` of the running spec said "nothing changed": issue 34, item 9).

The rule: **each new version of a computation runs the code its modules hold when the
version is made.** The controller sends each computation's version with the registry
(``HeartbeatResponse.computation_versions``); an update, a rollback, a rescale and an
update with ``reload`` (``millwheel update --reload``) each make a new version, and every
range of the computation is rebuilt under a new token at a checkpoint boundary
(services/controller/update.py). Before a worker builds a range of a computation at a
version newer than the one it loaded the computation's code for, it imports the
modules of the spec's code (its class, or a built-in's ``function``) again from
their files (:func:`millwheel.importing.reload_module`: only modules its
``--allow-code`` names, never the service's own). Once per computation and version,
whichever range is built first; the others are built from the reloaded module.

Exactly once holds because a rebuild is how a range always starts: the in-memory
instance is dropped and a new one built from the range's durable state, timers and
outbox, as when a range moves between workers.

A module that fails to load (a syntax error, an exception at import time) is left as it
was: the ranges are built from the code loaded before, and the failure is written to the
computation's recent errors (outcome ``reload_failed``: ``millwheel errors``,
``millwheel status``, DescribeComputation, the console) and logged. Fix the file and
update with ``--reload`` again.

What is not reloaded: ``import:`` key extractors (what they compute must not change:
keys would map away from their state; the routing keeps the function it compiled until
the next registry change), modules the named module imports (``from helpers import f`` keeps
the ``helpers`` loaded before; a restart of the worker loads everything anew), and code
already running: a range keeps the instance it was built with until it is rebuilt.
A computation first built here from a module already imported for another computation
is reloaded only if the module's file changed since this worker imported it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from millwheel.importing import AllowList, CodeReloadError, module_of, reload_module
from millwheel.operators.schema import import_paths
from millwheel.topology import ComputationSpec

log = logging.getLogger("millwheel.worker")


class UserCode:
    """The version of each computation whose user modules this worker has loaded, and
    when it loaded each module (taker threads build ranges at once: one lock)."""

    def __init__(self, allow: AllowList) -> None:
        self.allow = allow
        self._lock = threading.Lock()
        self._loaded: dict[str, int] = {}  # computation -> version its modules were loaded for
        self._module_ns: dict[str, int] = {}  # module -> wall time (ns) it was (re)loaded here

    def prepare(self, spec: ComputationSpec, version: int) -> list[CodeReloadError]:
        """Before building a range of ``spec`` at ``version``: reload its modules if this
        worker loaded them for an older version (or, the first time it builds ``spec``,
        if a module's file changed since it was imported here). Returns the reloads that
        failed (those modules are as they were); never raises for them."""
        # The code's modules, not key extractors' (as the controller's compat.code_modules).
        modules = list(dict.fromkeys(module_of(path) for what, path in import_paths(spec)
                                     if not what.endswith(".key")))
        with self._lock:
            seen = self._loaded.get(spec.name)
            if seen is not None and seen >= version:
                return []
            self._loaded[spec.name] = version
            failed: list[CodeReloadError] = []
            for module in modules:
                if module not in sys.modules or not self.allow.allows(module):
                    continue  # imported fresh by the build; refused by the build
                if seen is None and not self._changed(module):
                    continue
                try:
                    reload_module(module, self.allow)
                except CodeReloadError as exc:
                    failed.append(exc)
                    log.warning("computation %r version %d: %s; its ranges here run the code loaded "
                                "before", spec.name, version, exc)
                    continue
                except Exception as exc:  # noqa: BLE001 - refused: the build says why
                    log.warning("computation %r: module %r not reloaded: %s", spec.name, module, exc)
                    continue
                self._module_ns[module] = time.time_ns()
                log.info("computation %r version %d: module %r loaded again", spec.name, version, module)
            return failed

    def built(self, spec: ComputationSpec) -> None:
        """After a build: when its modules were first imported here (for :meth:`_changed`)."""
        now = time.time_ns()
        with self._lock:
            for _what, path in import_paths(spec):
                self._module_ns.setdefault(module_of(path), now)

    def keep(self, names: set[str]) -> None:
        """Forget computations no longer registered (registered again, one starts at version 1)."""
        with self._lock:
            for name in [n for n in self._loaded if n not in names]:
                del self._loaded[name]

    def _changed(self, module: str) -> bool:
        """Whether ``module``'s source file was modified after this worker loaded it."""
        loaded = self._module_ns.get(module)
        path = getattr(sys.modules.get(module), "__file__", None)
        if loaded is None or not path:
            return False
        try:
            return os.stat(path).st_mtime_ns > loaded
        except OSError:
            return False
