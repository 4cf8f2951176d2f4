"""Roles: every public RPC has one (so a new RPC cannot be forgotten), the checks the
interceptor makes from them, the CLI's operator commands, and named credentials kept
as hashes in a real SQLite store."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from millwheel.errors import AlreadyExistsError, InvalidSpecError, NotFoundError
from millwheel.state import open_store
from services.cli import build_parser
from services.cli.output import OPERATOR_COMMANDS
from services.credentials import CredentialBook, create, listed, revoke
from services.generated import millwheel_pb2 as pb
from services.rpc.auth import AuthInterceptor
from services.rpc.roles import CLIENT, CLUSTER, METHOD_ROLES, OPERATOR, READ, SERVICE_ROLES, Role, required

DENIED, UNAUTH = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED


def test_every_rpc_of_every_service_in_the_proto_has_a_role() -> None:
    methods = {f"{s.full_name}/{m.name}" for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods}
    assert methods - set(METHOD_ROLES) == set(), "an RPC without a role: add it to services/rpc/roles.py"
    assert set(METHOD_ROLES) - methods == set(), "a role for an RPC the proto no longer has"
    reflection = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name
    assert SERVICE_ROLES[reflection] is READ
    assert required("/grpc.health.v1.Health/Check") is None  # probes carry no credential
    assert required("/millwheel.v1.Controller/NoSuchMethod") is CLUSTER  # unknown: closed


def test_the_classes_of_the_issue() -> None:
    c = "/millwheel.v1.Controller/"
    assert {required(c + m) for m in ("GetWatermark", "GetState", "ClusterStatus", "Subscribe",
                                      "ListComputations", "DescribeComputation", "ListKeys")} == {READ}
    assert {required(c + m) for m in ("Inject", "InjectRoutes", "WriterWatermark", "RegisterComputation",
                                      "RegisterTopology", "RegisterInjector", "UpdateComputation",
                                      "UnregisterComputation")} == {CLIENT}
    assert required("/millwheel.v1.Ingest/Write") is CLIENT
    assert {required(c + m) for m in ("RescaleComputation", "CreateSavepoint", "RestoreSavepoint",
                                      "ReplayDeadLetters")} == {OPERATOR}
    assert required("/millwheel.v1.Cluster/Heartbeat") is CLUSTER
    assert required("/millwheel.v1.Worker/Deliver") is CLUSTER


def test_the_interceptor_refuses_by_role_naming_both() -> None:
    auth = AuthInterceptor("client-t", "secret-t", "operator-t")
    rescale = "/millwheel.v1.Controller/RescaleComputation"
    code, message = auth.refusal(rescale)("client-t") or (None, "")
    assert code == DENIED
    assert "needs role operator" in message and "client token (role client)" in message
    assert "MILLWHEEL_OPERATOR_TOKEN" in message
    assert auth.refusal(rescale)("operator-t") is None
    assert auth.refusal(rescale)("secret-t") is None
    code, message = auth.refusal("/millwheel.v1.Cluster/Heartbeat")("operator-t") or (None, "")
    assert code == DENIED and "internal to the cluster" in message
    assert (auth.refusal(rescale)("nope") or (None,))[0] == UNAUTH
    assert (auth.refusal(rescale)(None) or (None,))[0] == UNAUTH


def test_operator_commands_are_commands_and_take_the_operator_token() -> None:
    for prog in OPERATOR_COMMANDS:
        words = prog.split()[1:]
        extra = ["C", "--key-ranges", "4"] if words[0] == "rescale" else ["X"]
        args = build_parser(words).parse_args([*words, *extra])
        assert args.operator_command is True, prog
        assert hasattr(args, "operator_token_file"), prog
    args = build_parser(["status"]).parse_args(["status"])
    assert args.operator_command is False and not hasattr(args, "operator_token_file")


def test_role_names() -> None:
    assert Role.parse("Operator") is OPERATOR and Role.parse(" read ") is READ
    with pytest.raises(ValueError, match="one of read, client, operator"):
        Role.parse("cluster")  # the cluster secret's alone


def test_named_credentials_are_kept_as_hashes_and_revoked(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    store = open_store(url)
    book = CredentialBook.from_url(url, refresh_s=0.05)
    try:
        token = create(store, "dashboard", READ, 1_000)
        loader = create(store, "loader", CLIENT, 2_000)
        assert token != loader and token.isascii() and " " not in token
        stored = b"".join(store.list_meta("credentials/").values())
        assert token.encode() not in stored and loader.encode() not in stored  # hashes only
        assert [(c.name, c.role) for c in listed(store)] == [("dashboard", READ), ("loader", CLIENT)]
        with pytest.raises(AlreadyExistsError, match="revoke"):
            create(store, "dashboard", OPERATOR, 3_000)
        with pytest.raises(InvalidSpecError, match="credential name"):
            create(store, "two words", READ, 3_000)
        book.refresh()
        who = book.lookup(token)
        assert who is not None and (who.name, who.role, who.per_client) == ("dashboard", READ, True)
        assert book.lookup(token + "x") is None
        revoke(store, "dashboard")
        with pytest.raises(NotFoundError):
            revoke(store, "dashboard")
        deadline = time.monotonic() + 5
        while book.lookup(token) is not None:  # the book's own thread re-reads the store
            assert time.monotonic() < deadline, "the revocation never reached the book"
            time.sleep(0.02)
        assert book.lookup(loader) is not None
    finally:
        book.close()
        store.close()


def test_the_cli_writes_no_store_that_does_not_exist(tmp_path: Path) -> None:
    from services.cli.credentials import cmd_list

    with pytest.raises(InvalidSpecError, match="no store at"):
        cmd_list(argparse.Namespace(store=f"sqlite:///{tmp_path}/none.db", json=False))
    assert not (tmp_path / "none.db").exists()
