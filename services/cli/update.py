"""``millwheel update``: change a running computation in place (UpdateComputation).

The controller checks the new spec against the running one before anything changes
(services/controller/compat.py) and switches each key range at a checkpoint boundary
(services/controller/update.py); this module only reads the spec file and prints the
answer.
"""

from __future__ import annotations

import argparse
from typing import Any

from millwheel.errors import InvalidSpecError
from millwheel.spec import load_spec_file, spec_parts

from .output import client_for, client_parser, emit

DESCRIPTION = """\
Change a registered computation's code, params or options while it runs, keeping its
state, timers, pending productions and consumed record IDs. SPEC is a YAML/JSON file
with one computation mapping (as for 'millwheel register'), or a topology file from
which --computation picks one; its name says which computation to change.

What is guaranteed: each key range switches at a checkpoint boundary, so every record
is processed exactly once, by the old code or the new, never both and never neither
(also when a worker dies during the switch). The computation's version goes up by one
('millwheel computations', 'millwheel status'), and the old spec is kept for
--rollback.

What is refused, before anything changes (exit status 2, nothing changed):
  - a spec that cannot be built (built-ins are built as at registration; code named by
    import path is checked against the allow-list, never imported by the controller);
  - a change of options.key_ranges (use 'millwheel rescale') or of the key extractor
    of an input it keeps;
  - inputs/outputs that break the registry's rules (a consumer left without producer,
    a cycle, a logged stream no longer written);
  - a window_aggregate whose size or period changes (or that becomes other code) while
    windows are open, unless --on-open-windows flush or drop.
An unknown computation is an error too (NOT_FOUND). Sending the running spec again
changes nothing, unless --reload.

New code for the same class (--reload): Python keeps a module once imported, so a
fixed file on the worker machines is not read again by itself. Every new version
(an update, a rollback, a rescale) makes the workers import the modules of the
computation's code (its class, or a built-in's 'function') again from their files
before they rebuild its ranges; --reload makes a new version of the running spec just for that
(or of SPEC, if it changes too). Each range switches at a checkpoint boundary, exactly
once, as for any update; dead letters replayed after it run the new code. A module
that fails to load there (a syntax error) leaves the ranges on the code loaded
before: see 'millwheel errors NAME' (outcome reload_failed), fix the file, --reload
again. Modules the named module imports are not reloaded (restart the workers).

Open windows (--on-open-windows, for a window_aggregate whose size or period changes):
  refuse  the default: the update is refused while windows are open;
  flush   each open window's result is emitted first, with the OLD window, exactly once
          (also if a worker dies meanwhile), then the new code runs. It is an early,
          partial result: the records the window holds at the switch, although the
          watermark has not passed its end. Records arriving later go to new windows.
          Refused if a consumer of the results keys them by user code (import:);
  drop    the open windows are discarded: their records count in no result.

examples:
  millwheel update scaled.yaml
  millwheel update counts-5m.yaml --on-open-windows flush   # close today's windows, then 5-minute ones
  millwheel update pipeline.yaml --computation counts --on-open-windows drop
  millwheel update --rollback counts
  millwheel update --reload --computation counts   # the fixed counter.py on the workers, now
  millwheel update counts.yaml --reload
"""


def add_commands(sub: Any) -> None:
    up = client_parser(sub, "update", "change a running computation (code, params, options) in place",
                       DESCRIPTION)
    up.formatter_class = argparse.RawDescriptionHelpFormatter
    up.add_argument("spec", nargs="?", metavar="SPEC.yaml|json",
                    help="the computation's new spec (omit with --rollback)")
    up.add_argument("--computation", metavar="NAME",
                    help="which computation of a topology SPEC file to update")
    up.add_argument("--on-open-windows", choices=("refuse", "drop", "flush"), default="refuse",
                    help="a window_aggregate whose window size/period changes while windows are open: "
                         "refuse the update (default), flush them (emit their results so far with the old "
                         "window, exactly once, then switch), or drop them (their records count in no "
                         "result)")
    up.add_argument("--rollback", metavar="NAME",
                    help="return computation NAME to its version before its last update (no SPEC)")
    up.add_argument("--reload", action="store_true",
                    help="make the workers import the computation's user modules again from their "
                         "files (a new version, also for the running spec); without SPEC, "
                         "--computation NAME names the computation and its running spec is kept")
    up.set_defaults(func=cmd_update)


def _spec_from_file(path: str, computation: str | None) -> Any:
    from ..rpc.convert import spec_to_proto

    data = load_spec_file(path)
    if "name" in data and "computations" not in data:
        comps, _, _, _ = spec_parts({"computations": [data]})
    else:
        comps, _, _, _ = spec_parts(data)
    if computation is not None:
        comps = tuple(c for c in comps if c.name == computation)
        if not comps:
            raise InvalidSpecError(f"{path}: no computation named {computation[:200]!r} in it")
    if len(comps) != 1:
        raise InvalidSpecError(f"{path}: {len(comps)} computations in it; name the one to update "
                               "with --computation NAME")
    return spec_to_proto(comps[0])


def cmd_update(args: argparse.Namespace) -> int:
    by_name = args.reload and args.spec is None and args.rollback is None
    if by_name and not args.computation:
        raise InvalidSpecError("update --reload: give SPEC, or --computation NAME to reload its running spec")
    if not by_name and (args.spec is None) == (args.rollback is None):
        raise InvalidSpecError("update: give SPEC, or --rollback NAME (not both)")
    if args.reload and args.rollback:
        raise InvalidSpecError("update: --reload with --rollback: a rollback loads the modules again anyway")
    spec = None if args.spec is None else _spec_from_file(args.spec, args.computation)
    with client_for(args) as client:
        if by_name:
            spec = client.describe(args.computation).spec  # the running spec, sent back as it is
        resp = client.update(spec, on_open_windows=args.on_open_windows, rollback=args.rollback or "",
                             reload=args.reload)
    info = resp.computation
    modules = list(resp.reload_modules)
    data = {"computation": info.spec.name, "version": info.version, "previous_version": resp.previous_version,
            "changed": resp.changed, "dropped_windows": resp.dropped_windows,
            "flushed_windows": resp.flushed_windows,
            "rolled_back": bool(args.rollback), "reloaded": bool(args.reload and resp.changed),
            "reload_modules": modules}
    if not resp.changed:
        text = f"computation {info.spec.name!r} already runs this spec (version {info.version}): nothing changed"
        if modules:  # what the user who fixed a file most likely wants (issue 34, item 9)
            text += (f".\nIf you changed its code ({', '.join(modules)}) on the worker machines, the workers "
                     "still run what they imported; load it with:\n"
                     f"  millwheel update --reload --computation {info.spec.name}")
    else:
        verb = "rolled back" if args.rollback else "reloaded" if args.reload else "updated"
        text = f"{verb} computation {info.spec.name!r}: version {resp.previous_version} -> {info.version}"
        if modules:
            text += (f"; the workers import {', '.join(modules)} again as they rebuild its ranges (a module "
                     f"that fails to load leaves the code before running: millwheel errors {info.spec.name})")
        if resp.dropped_windows:
            text += f" ({resp.dropped_windows} open windows dropped)"
        if resp.flushed_windows:
            text += f" ({resp.flushed_windows} open windows flushed: their results so far emitted)"
    return emit(args, data, text)
