"""How a process reads its security settings (services/rpc/security.py) and how the
bearer token is taken from call metadata (services/rpc/auth.py). The behaviour against
real servers is in tests/integration/test_service_security.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.cli import build_parser
from services.rpc.auth import AuthInterceptor, bearer_token
from services.rpc.security import SecurityConfigError, from_args, is_loopback

ENV = ("MILLWHEEL_AUTH_TOKEN", "MILLWHEEL_AUTH_TOKEN_FILE", "MILLWHEEL_CLUSTER_SECRET",
       "MILLWHEEL_CLUSTER_SECRET_FILE", "MILLWHEEL_TLS_CERT", "MILLWHEEL_TLS_KEY", "MILLWHEEL_TLS_CA",
       "MILLWHEEL_TLS_SERVER_NAME")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # no ./millwheel-data/client-token unless a test writes one


def args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_token_sources_in_order_flag_env_value_env_file_then_default_file(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    status = ("status",)
    assert from_args(args(*status), server=False).client_token is None
    default = tmp_path / "millwheel-data" / "client-token"
    default.parent.mkdir()
    default.write_text("from-default\n")
    assert from_args(args(*status), server=False).client_token == "from-default"
    (tmp_path / "env-file").write_text("  from-env-file \n")
    monkeypatch.setenv("MILLWHEEL_AUTH_TOKEN_FILE", str(tmp_path / "env-file"))
    assert from_args(args(*status), server=False).client_token == "from-env-file"
    monkeypatch.setenv("MILLWHEEL_AUTH_TOKEN", "from-env")
    assert from_args(args(*status), server=False).client_token == "from-env"
    (tmp_path / "flag").write_text("from-flag")
    assert from_args(args(*status, "--auth-token-file", str(tmp_path / "flag")), server=False).client_token \
        == "from-flag"
    # Servers do not fall back to the default file: their settings are explicit.
    monkeypatch.delenv("MILLWHEEL_AUTH_TOKEN")
    monkeypatch.delenv("MILLWHEEL_AUTH_TOKEN_FILE")
    assert from_args(args("worker"), server=True).client_token is None


def test_settings_that_cannot_work_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MILLWHEEL_AUTH_TOKEN", "t")
    with pytest.raises(SecurityConfigError, match="needs a cluster secret"):
        from_args(args("controller"), server=True)
    monkeypatch.setenv("MILLWHEEL_CLUSTER_SECRET", "s")
    assert from_args(args("controller"), server=True).cluster_secret == "s"
    monkeypatch.setenv("MILLWHEEL_AUTH_TOKEN", "two words")
    with pytest.raises(SecurityConfigError, match="printable ASCII without spaces"):
        from_args(args("controller"), server=True)
    monkeypatch.delenv("MILLWHEEL_AUTH_TOKEN")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SecurityConfigError, match="is empty"):
        from_args(args("status", "--auth-token-file", str(tmp_path / "empty")), server=False)
    with pytest.raises(SecurityConfigError, match="cannot read"):
        from_args(args("status", "--auth-token-file", str(tmp_path / "missing")), server=False)
    with pytest.raises(SecurityConfigError, match="--tls-cert and --tls-key go together"):
        from_args(args("status", "--tls-cert", str(tmp_path / "empty")), server=False)
    with pytest.raises(SecurityConfigError, match="needs --tls-cert"):
        from_args(args("controller", "--tls-ca", str(tmp_path / "empty")), server=True)
    (tmp_path / "garbage").write_text("not a certificate\n")
    with pytest.raises(SecurityConfigError, match="--tls-ca .* is not a PEM file"):
        from_args(args("status", "--tls-ca", str(tmp_path / "garbage")), server=False)
    with pytest.raises(ValueError, match="needs a cluster secret"):
        AuthInterceptor("t", None)


def test_bearer_token_parsing() -> None:
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("x", "y"), ("authorization", "bearer  abc ")]) == "abc"
    assert bearer_token([("authorization", "Bearer")]) == ""  # present but empty: a wrong token
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([("authorization", "Bearerabc")]) is None
    assert bearer_token(None) is None


def test_loopback_hosts() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert is_loopback("127.0.0.2") and is_loopback("[::1]")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.0.2.2")
    assert not is_loopback("")
