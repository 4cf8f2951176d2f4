"""``millwheel credentials create|list|revoke``: named credentials, one per client, each
with a role (read, client, operator).

The command writes the service's store directly (services/credentials.py says why):
run it where the store is reachable, with the URL the service uses (``--store``, else
``$MILLWHEEL_STORE``, else the SQLite file ``millwheel up`` uses by default). Every
controller and worker re-reads the credentials within a few seconds: a new one works,
a revoked one is refused, on every listener.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from millwheel.errors import InvalidSpecError

DEFAULT_STORE = "sqlite:///millwheel-data/service.db"  # `millwheel up`'s (services/cli/service.py)
STORE_ENV = "MILLWHEEL_STORE"

DESCRIPTION = """\
Issue, list and revoke named credentials: a bearer token per client, each with a role
(docs/service.md, Security):

  read      watermarks, state, keys, status, computations, subscribe, the console
  client    read, plus inject (and parallel ingestion), register, update, unregister
  operator  client, plus rescale, savepoint (stop, drain), restore, dead-letters replay

The token is printed once (only its hash is stored); give it to the client as
$MILLWHEEL_AUTH_TOKEN (or $MILLWHEEL_OPERATOR_TOKEN for an operator's commands).
Admission limits (--max-client-streams, ...) count per credential. A revoked token is
refused by every controller and worker within a few seconds.

This writes the service's store itself: run it with the store URL the service uses.

examples:
  millwheel credentials create dashboard --role read
  millwheel credentials create etl-loader --role client
  millwheel credentials list
  millwheel credentials revoke dashboard
"""


def add_commands(sub: Any) -> None:
    p = sub.add_parser("credentials", help="issue, list and revoke named credentials (roles)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    csub = p.add_subparsers(dest="credentials_command", metavar="ACTION", required=True)
    create = csub.add_parser("create", help="issue a credential; prints its token once",
                             description="Issue credential NAME with a role and print its token (once).")
    create.add_argument("name", metavar="NAME")
    create.add_argument("--role", required=True, choices=("read", "client", "operator"))
    listing = csub.add_parser("list", help="list the credentials (names, roles; never tokens)",
                              description="List the named credentials: name, role, when created.")
    revoke = csub.add_parser("revoke", help="revoke a credential on every server",
                             description="Revoke credential NAME: every server refuses it within seconds.")
    revoke.add_argument("name", metavar="NAME")
    for q, func in ((create, cmd_create), (listing, cmd_list), (revoke, cmd_revoke)):
        q.add_argument("--store", default=None,
                       help=f"the service's store URL (default ${STORE_ENV}, else {DEFAULT_STORE})")
        q.add_argument("--json", action="store_true", help="print JSON")
        q.set_defaults(func=func)


def _store(args: argparse.Namespace) -> Any:
    from ..store_lock import open_service_store

    url = args.store or os.environ.get(STORE_ENV) or DEFAULT_STORE
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):].split("?")[0])
        if not path.is_file():  # never create an empty store that no service uses
            raise InvalidSpecError(f"no store at {path}: run this where `millwheel up` keeps its data, or "
                                   "pass the service's store with --store URL (or $MILLWHEEL_STORE)")
    return open_service_store(url)


def cmd_create(args: argparse.Namespace) -> int:
    from ..credentials import create
    from ..rpc.roles import Role

    store = _store(args)
    try:
        token = create(store, args.name, Role.parse(args.role), time.time_ns() // 1000)
    finally:
        store.close()
    if args.json:
        print(json.dumps({"name": args.name, "role": args.role, "token": token}))
    else:
        print(token)
        print(f"credential {args.name!r} (role {args.role}) created; the token above is shown once",
              file=sys.stderr)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from ..credentials import listed
    from .output import table

    store = _store(args)
    try:
        creds = listed(store)
    finally:
        store.close()
    if args.json:
        print(json.dumps([{"name": c.name, "role": c.role.label, "created_us": c.created_us} for c in creds]))
        return 0
    rows = [[c.name, c.role.label, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(c.created_us / 1e6))]
            for c in creds]
    print(table(["NAME", "ROLE", "CREATED"], rows) if rows else "no named credentials")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from ..credentials import revoke

    store = _store(args)
    try:
        revoke(store, args.name)
    finally:
        store.close()
    if args.json:
        print(json.dumps({"name": args.name, "revoked": True}))
    else:
        print(f"credential {args.name!r} revoked; every server refuses it within a few seconds")
    return 0
