"""Credentials on the wire, for both sides: the auth token every call carries, and TLS for gRPC and the data channel.

A caller (trainer client, CLI, peer store) sends its token in the ``authorization`` metadata of every
gRPC call (``Bearer <token>``); the store maps it to a role (``memstore.server.auth``). TLS is optional:
``ca`` verifies the other side; ``cert``/``key`` are this side's identity (on a client they make it
mutual TLS, which a store started with ``--tls-ca`` requires).

Clients read these from their arguments or from the environment: ``MEMSTORE_AUTH_TOKEN`` (the token
itself) or ``MEMSTORE_AUTH_TOKEN_FILE``, and ``MEMSTORE_TLS_CA``, ``MEMSTORE_TLS_CERT``,
``MEMSTORE_TLS_KEY`` (paths), and ``MEMSTORE_TLS_SERVER_NAME``: the name the stores' certificates carry,
checked instead of the address dialed (stores reached by pod IPs that change share one certificate for
a fixed name). Tokens are never logged or echoed: ``repr`` hides them.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from memstore.errors import ConfigError

AUTH_METADATA_KEY = "authorization"
MIN_TOKEN_CHARS = 16


def read_token_file(path: str | Path, flag: str) -> str:
    """The token in ``path`` (surrounding whitespace stripped). ConfigError names the file and the flag, never the content."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", "") or type(exc).__name__
        raise ConfigError(f"{flag} {path}: cannot read the token file: {reason}") from None
    problem = token_problem(token)
    if problem:
        raise ConfigError(f"{flag} {path}: {problem}")
    return token


def token_problem(token: str) -> str | None:
    if len(token) < MIN_TOKEN_CHARS:
        return f"the token is too short ({len(token)} characters; at least {MIN_TOKEN_CHARS})"
    if any(c.isspace() or not c.isprintable() for c in token):
        return "the token contains whitespace or unprintable characters"
    return None


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class Credentials:
    """What one side presents and trusts. Empty = no token, plaintext."""

    token: str = field(default="", repr=False)
    ca: str = ""  # path of the CA bundle that verifies the other side ("" = no TLS)
    cert: str = ""  # this side's certificate chain (PEM path)
    key: str = field(default="", repr=False)  # this side's private key (PEM path)
    server_name: str = ""  # the name the other side's certificate must carry ("" = the host dialed)

    def __post_init__(self) -> None:
        if self.token and token_problem(self.token):
            raise ConfigError(f"auth token: {token_problem(self.token)}")
        if bool(self.cert) != bool(self.key):
            raise ConfigError("TLS: a certificate needs its key and a key its certificate (--tls-cert and --tls-key together)")

    @property
    def tls(self) -> bool:
        return bool(self.ca)

    def as_kwargs(self) -> dict[str, str]:
        """``auth_token=, tls_ca=, tls_cert=, tls_key=`` for a ``CheckpointClient`` presenting the same credentials."""
        return {"auth_token": self.token, "tls_ca": self.ca, "tls_cert": self.cert, "tls_key": self.key}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, token: str | None = None, ca: str | None = None,
                 cert: str | None = None, key: str | None = None) -> Credentials:  # fmt: skip
        """Arguments win over the environment (MEMSTORE_AUTH_TOKEN[_FILE], MEMSTORE_TLS_CA/CERT/KEY/SERVER_NAME)."""
        env = os.environ if env is None else env
        if token is None:
            token = env.get("MEMSTORE_AUTH_TOKEN") or ""
            if not token and env.get("MEMSTORE_AUTH_TOKEN_FILE"):
                token = read_token_file(env["MEMSTORE_AUTH_TOKEN_FILE"], "MEMSTORE_AUTH_TOKEN_FILE")
        return cls(
            token=token,
            ca=ca if ca is not None else env.get("MEMSTORE_TLS_CA", ""),
            cert=cert if cert is not None else env.get("MEMSTORE_TLS_CERT", ""),
            key=key if key is not None else env.get("MEMSTORE_TLS_KEY", ""),
            server_name=env.get("MEMSTORE_TLS_SERVER_NAME", ""),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        """gRPC channel options: with a ``server_name``, certificates are checked for it, not for the address dialed."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.tls and self.server_name else []

    # -- gRPC ----------------------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "--tls-ca"),
            private_key=_read(self.key, "--tls-key") if self.key else None,
            certificate_chain=_read(self.cert, "--tls-cert") if self.cert else None,
        )

    def server_credentials(self, client_auth: bool = True) -> grpc.ServerCredentials:
        """This store's TLS identity; with ``client_auth``, clients must present a certificate the CA signed (mutual TLS)."""
        if not (self.cert and self.key):
            raise ConfigError("TLS: a store needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials(
            [(_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))],
            root_certificates=_read(self.ca, "--tls-ca") if self.ca else None,
            require_client_auth=bool(self.ca) and client_auth,
        )

    def wrap(self, channel: grpc.Channel) -> grpc.Channel:
        """``channel`` with this side's token in every call's metadata."""
        if not self.token:
            return channel
        return grpc.intercept_channel(channel, _TokenInterceptor(f"Bearer {self.token}"))

    # -- the data channel ----------------------------------------------------------------------
    def client_ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """The data channel's TLS: only stores connect to it, so a client certificate is always required."""
        if not (self.cert and self.key):
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        if self.ca:
            ctx.load_verify_locations(cafile=self.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def token_of(metadata: Any) -> str:
    """The bearer token in a call's invocation metadata ("" if none)."""
    for item in metadata or ():
        if item[0] == AUTH_METADATA_KEY:
            value = str(item[1])
            return value[7:] if value.startswith("Bearer ") else ""
    return ""


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    def __init__(self, value: str) -> None:
        self._value = value

    def __repr__(self) -> str:
        return "_TokenInterceptor(<hidden>)"

    def _details(self, d: Any) -> _Details:
        metadata = [*(d.metadata or ()), (AUTH_METADATA_KEY, self._value)]
        return _Details(d.method, d.timeout, metadata, d.credentials, getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)
