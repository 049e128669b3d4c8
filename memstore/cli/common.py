"""Helpers the command modules share (not a command)."""

from __future__ import annotations

import argparse
import os


def configure_logging(level: str, fmt: str = "human", host: str = "") -> None:
    """Log to stderr at ``level``, for people or as JSON lines (``memstore.logs``), with this store's ``host`` id."""
    from memstore.logs import configure

    configure(level, fmt, host)


def add_store_address_arguments(p: argparse.ArgumentParser) -> None:
    """``--store``, ``--timeout`` and the credentials: the commands that ask a running cluster."""
    p.add_argument(
        "--store",
        default=os.environ.get("MEMSTORE_STORE") or "127.0.0.1:7070",
        help="address of any store of the cluster (default: $MEMSTORE_STORE, else 127.0.0.1:7070)",
    )
    p.add_argument("--timeout", type=float, default=3.0)
    add_credential_arguments(p)


#: flag dest -> the environment variable every stub of the command reads (memstore.v1.security.Credentials.from_env)
CREDENTIAL_ENV = {
    "auth_token_file": "MEMSTORE_AUTH_TOKEN_FILE",
    "tls_ca": "MEMSTORE_TLS_CA",
    "tls_cert": "MEMSTORE_TLS_CERT",
    "tls_key": "MEMSTORE_TLS_KEY",
    "tls_server_name": "MEMSTORE_TLS_SERVER_NAME",
}


def add_credential_arguments(p: argparse.ArgumentParser) -> None:
    """``--auth-token-file`` and ``--tls-ca/--tls-cert/--tls-key`` for a command that talks to stores."""
    g = p.add_argument_group("credentials (also MEMSTORE_AUTH_TOKEN[_FILE], MEMSTORE_TLS_CA/CERT/KEY/SERVER_NAME)")
    g.add_argument("--auth-token-file", default=None, metavar="PATH", help="file holding the token to present (cluster, job or admin)")
    g.add_argument("--tls-ca", default=None, metavar="PEM", help="CA bundle that verifies the stores' certificates (turns TLS on)")
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="this client's certificate (mutual TLS)")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="this client's private key")
    g.add_argument(
        "--tls-server-name", default=None, metavar="NAME", help="the name the stores' certificates carry, checked instead of the address"
    )


def apply_credential_arguments(args: argparse.Namespace) -> None:
    """Make the credential flags the process's defaults, so every stub and client the command builds presents them."""
    for dest, env in CREDENTIAL_ENV.items():
        value = getattr(args, dest, None)
        if value:
            os.environ[env] = value
            if dest == "auth_token_file":
                os.environ.pop("MEMSTORE_AUTH_TOKEN", None)  # the flag wins over a token in the environment


def resolve_redundancy(replicas: int | None, redundancy: str | None) -> str:
    """A command's ``--replicas``/``--redundancy`` pair as one scheme's text (``Redundancy.resolve``); a bad or
    disagreeing pair is a ``ConfigError`` (the command exits 2 naming it)."""
    from memstore.core.redundancy import Redundancy
    from memstore.errors import ConfigError

    try:
        return str(Redundancy.resolve(replicas, redundancy))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
