"""``millwheel rescale``: change a running computation's key-range count
(RescaleComputation; the controller does the work: services/controller/rescale.py)."""

from __future__ import annotations

import argparse
from typing import Any

from millwheel.limits import MAX_KEY_RANGES

from .output import client_for, client_parser, emit

DESCRIPTION = f"""\
Change how many key ranges a registered computation runs as, while it runs (up or
down, 1..{MAX_KEY_RANGES}). Each key moves, with its state, timers and the computation's
pending productions, to its range under the new count (crc32(key) mod N, the routing
every process uses); every old range's consumed record IDs go to every new range, so a
record delivered again after the rescale is still dropped as a duplicate.

What is guaranteed:
  - exactly once across the rescale: every range is fenced (nobody runs it) while its
    data is moved, records in flight from producers are delivered again to the key's
    new range, and duplicates are dropped;
  - one layout, never a mix: the new layout is staged, then committed in one store
    write; a controller killed before the commit leaves the old layout, after it the
    next leader completes the new one; a worker killed meanwhile is an ordinary move;
  - the computation's watermark does not go back.

What it costs: the computation stops for the copy (every key, timer and pending
production is read once and written twice; the answer says how long), and consumed
IDs are kept N times over until their retention expires them. The rest of the service
runs on meanwhile (the controller's lock is not held for the copy: heartbeats, other
computations and the console go on).

Refused, with nothing changed (exit status 2): an unknown computation (NOT_FOUND), an
injector (it has one range), a count outside 1..{MAX_KEY_RANGES} or one that takes the
registry over its total. The current count changes nothing. While its copy runs, a
second rescale, an update or an unregistration of the same computation is refused
(FAILED_PRECONDITION: "a rescale of ... is under way"); a savepoint waits for it.

examples:
  millwheel rescale counts --key-ranges 8
  millwheel rescale counts --key-ranges 3 --controller 10.0.0.5:50051 --json
"""


def add_commands(sub: Any) -> None:
    p = client_parser(sub, "rescale", "change a running computation's key-range count", DESCRIPTION)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("computation", metavar="COMPUTATION", help="the registered computation to rescale")
    p.add_argument("--key-ranges", type=int, required=True, metavar="N",
                   help=f"its new key-range count, 1..{MAX_KEY_RANGES}")
    p.set_defaults(func=cmd_rescale)


def cmd_rescale(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        resp = client.rescale(args.computation, args.key_ranges)
    info = resp.computation
    now = info.spec.options.key_ranges
    data = {"computation": info.spec.name, "key_ranges": now, "previous_key_ranges": resp.previous_key_ranges,
            "changed": resp.changed, "version": info.version, "pause_us": resp.pause_us, "keys": resp.keys,
            "timers": resp.timers, "productions": resp.productions, "consumed_ids": resp.consumed_ids}
    if not resp.changed:
        text = f"computation {info.spec.name!r} already has {now} key ranges: nothing changed"
    else:
        text = (f"rescaled computation {info.spec.name!r}: {resp.previous_key_ranges} -> {now} key ranges "
                f"(version {info.version}); moved {resp.keys} keys, {resp.timers} timers, "
                f"{resp.productions} pending productions, wrote {resp.consumed_ids} consumed IDs; "
                f"its ranges paused {resp.pause_us / 1e6:.3f} s")
    return emit(args, data, text)
