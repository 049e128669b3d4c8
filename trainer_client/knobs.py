"""Every environment switch of the trainer side, each read and checked here, in one function named after it.

- ``MEMSTORE_STORE`` (:func:`store_address`): the store's address; default ``127.0.0.1:7070``; read when a client
  connects (``Connection.resolved``);
- ``MEMSTORE_AUTH_TOKEN``, ``MEMSTORE_AUTH_TOKEN_FILE``, ``MEMSTORE_TLS_CA``, ``MEMSTORE_TLS_CERT``,
  ``MEMSTORE_TLS_KEY``, ``MEMSTORE_TLS_SERVER_NAME`` (:func:`credentials`): what a client presents; read when it connects;
- ``MEMSTORE_RUN_ID`` (:func:`run_id`): names this start of the job; default: drawn at the first save; read when a
  client is made;
- ``MEMSTORE_MARKED_CAPTURES`` (:func:`marked_captures`): ``on``, ``off``, ``auto`` (default); read when a client is made;
- ``MEMSTORE_TRAINER_HASHING`` (:func:`trainer_hashing`): ``on``, ``off`` (default); read when a client is made;
- ``MEMSTORE_STRICT_PINNING`` (:func:`strict_pinning`): off by default; read when a registration for DMA fails.

A bad value raises :class:`~trainer_client.errors.InvalidArgumentError` naming the variable (and its value, never a
token's). Every function takes ``env`` (default ``os.environ``), so a test passes a mapping instead of patching the
process's environment. The store's own flags and variables are ``memstore.config``'s, not these.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from memstore.errors import ConfigError
from memstore.v1.keys import timeline_problem
from memstore.v1.security import Credentials, read_token_file, token_problem
from trainer_client.errors import InvalidArgumentError

STORE_ENV = "MEMSTORE_STORE"
RUN_ID_ENV = "MEMSTORE_RUN_ID"
MARKED_CAPTURES_ENV = "MEMSTORE_MARKED_CAPTURES"
TRAINER_HASHING_ENV = "MEMSTORE_TRAINER_HASHING"
STRICT_PINNING_ENV = "MEMSTORE_STRICT_PINNING"
TOKEN_ENV, TOKEN_FILE_ENV = "MEMSTORE_AUTH_TOKEN", "MEMSTORE_AUTH_TOKEN_FILE"
TLS_FILE_ENVS = ("MEMSTORE_TLS_CA", "MEMSTORE_TLS_CERT", "MEMSTORE_TLS_KEY")  # and MEMSTORE_TLS_SERVER_NAME (Credentials.from_env)

MARK_MIN_CPUS = 8  # below this many cores the push takes the copy's cores: the stall doubled on 2 (docs/benchmarks.md)
MAX_RUN_ID = 100  # leaves room for ".<epoch>" within the 128 characters of a timeline


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def address_problem(address: object) -> str | None:
    """Why ``address`` is not a store address (``HOST:PORT``, IPv6 as ``[::1]:PORT``); None when it is one. The rule of
    ``MEMSTORE_STORE`` and of ``Connection(address=...)``."""
    if not isinstance(address, str):
        return f"expected HOST:PORT, got a {type(address).__name__}"
    host, sep, port = address.rpartition(":")
    if not sep or not host.strip("[]") or any(c.isspace() for c in address):
        return "expected HOST:PORT, e.g. 127.0.0.1:7070"
    if not (port.isascii() and port.isdigit() and 0 < int(port) <= 65535):
        return f"port {port!r} is not a number in 1-65535"
    return None


def store_address(env: Mapping[str, str] | None = None) -> str | None:
    """``MEMSTORE_STORE``: the store's ``HOST:PORT`` (on Kubernetes the pod sets it to ``$(HOST_IP):7070``); None when unset
    (the caller's default: ``127.0.0.1:7070``, or on Ray the node's store)."""
    address = _env(env).get(STORE_ENV) or None
    if address is not None and address_problem(address):
        raise InvalidArgumentError(f"{STORE_ENV}={address!r} is invalid: {address_problem(address)}")
    return address


def credentials(env: Mapping[str, str] | None = None) -> Credentials:
    """What a connection that leaves its credentials out presents: ``MEMSTORE_AUTH_TOKEN`` (or the file named by
    ``MEMSTORE_AUTH_TOKEN_FILE``), ``MEMSTORE_TLS_CA``/``CERT``/``KEY`` (PEM paths) and ``MEMSTORE_TLS_SERVER_NAME``
    (``memstore.v1.security``)."""
    env = _env(env)
    token = env.get(TOKEN_ENV) or ""
    if token and token_problem(token):
        raise InvalidArgumentError(f"{TOKEN_ENV} is invalid: {token_problem(token)}")
    try:
        if not token and env.get(TOKEN_FILE_ENV):
            token = read_token_file(env[TOKEN_FILE_ENV], TOKEN_FILE_ENV)
    except ConfigError as exc:
        raise InvalidArgumentError(str(exc)) from None
    for name in TLS_FILE_ENVS:
        path = env.get(name, "")
        if path and not os.path.isfile(path):
            raise InvalidArgumentError(f"{name}={path!r} is invalid: no such file")
    cert, key = TLS_FILE_ENVS[1:]
    if bool(env.get(cert)) != bool(env.get(key)):
        given, missing = (cert, key) if env.get(cert) else (key, cert)
        raise InvalidArgumentError(f"{given} is set but {missing} is not: a client certificate needs its key and a key its certificate")
    try:
        return Credentials.from_env(env, token=token)
    except ConfigError as exc:  # pragma: no cover - every case is checked above
        raise InvalidArgumentError(str(exc)) from None


def run_id_problem(run_id: object) -> str | None:
    """Why ``run_id`` cannot name a start of a job (1-100 characters of ``[A-Za-z0-9._-]``); None when it can."""
    if not isinstance(run_id, str) or not run_id or len(run_id) > MAX_RUN_ID or timeline_problem(run_id):
        return f"run_id {run_id!r} is invalid: expected 1-{MAX_RUN_ID} characters of [A-Za-z0-9._-]"
    return None


def run_id(given: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The run id a client starts with: ``given`` (its ``run_id=``), else ``MEMSTORE_RUN_ID``, else None (drawn at the
    first save, :mod:`trainer_client.run_ids`); a bad one is refused naming where it came from."""
    source = "run_id="
    if given is None and _env(env).get(RUN_ID_ENV):
        given, source = _env(env)[RUN_ID_ENV], RUN_ID_ENV
    if given is not None and run_id_problem(given):
        raise InvalidArgumentError(f"{run_id_problem(given)} (from {source})")
    return given


def marked_captures(env: Mapping[str, str] | None = None) -> bool:
    """``MEMSTORE_MARKED_CAPTURES`` on / off / auto (default): whether a large CPU state is pushed by the store while it is
    copied (``CommitRequest.captured_bytes``); auto: on with at least ``MARK_MIN_CPUS`` cores."""
    choice = _env(env).get(MARKED_CAPTURES_ENV, "auto").strip().lower()
    if choice not in ("auto", "on", "off"):
        raise InvalidArgumentError(f"{MARKED_CAPTURES_ENV}={choice!r} is invalid: expected on, off or auto")
    return choice == "on" or (choice == "auto" and (os.cpu_count() or 1) >= MARK_MIN_CPUS)


def trainer_hashing(env: Mapping[str, str] | None = None) -> bool:
    """``MEMSTORE_TRAINER_HASHING`` on / off (default): whether a save copied into shared memory is hashed by the trainer
    as it copies (``CommitRequest.chunk_checksums``). On, the store never reads the shard back to hash it, which on a
    machine whose few cores the trainer, the owner and the replica share takes 0.05 s per GiB off save -> committed; but
    the hashing makes the stall itself 0.04 s per GiB longer (a real model's 0.6 GB state: 104 ms against 79 ms on the
    2-core VM), and the stall is what training waits for."""
    choice = _env(env).get(TRAINER_HASHING_ENV, "off").strip().lower()
    if choice not in ("on", "off"):
        raise InvalidArgumentError(f"{TRAINER_HASHING_ENV}={choice!r} is invalid: expected on or off")
    return choice == "on"


def strict_pinning(env: Mapping[str, str] | None = None) -> bool:
    """``MEMSTORE_STRICT_PINNING``: set (to anything but ``0``), a capture that would copy CUDA tensors through pageable
    memory (its destination not registered) raises ``CaptureError`` instead (the GPU tests run so)."""
    return _env(env).get(STRICT_PINNING_ENV, "") not in ("", "0")


def save_switches(env: Mapping[str, str] | None = None) -> dict[str, bool]:
    """The save path's switches as ``env`` sets them (what ``memstore bench`` records); InvalidArgumentError for a bad one."""
    return {"trainer_hashing": trainer_hashing(env), "marked_captures": marked_captures(env)}
