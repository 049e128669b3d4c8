"""``Connection``: how a client reaches its store (address, deadline, credentials, shared memory), in one object.

``CheckpointClient``, ``MemStoreWriter``/``MemStoreReader`` and ``memstore.ray`` take it as ``connection=``::

    from trainer_client import CheckpointClient, Connection

    client = CheckpointClient("run-1", rank, world, connection=Connection("10.0.0.5:7070", timeout=30))
    client = CheckpointClient("run-1", rank, world, connection=Connection.from_env())  # read and checked now

What a connection leaves out (``address``, ``credentials`` as None) comes from the environment when a client
connects, exactly as :meth:`Connection.from_env` reads it (:func:`trainer_client.knobs.store_address` and
:func:`~trainer_client.knobs.credentials`, where every switch of the trainer side is read):

- ``MEMSTORE_STORE``: the store's ``HOST:PORT`` (on Kubernetes the pod sets it to ``$(HOST_IP):7070``),
  else ``127.0.0.1:7070``;
- ``MEMSTORE_AUTH_TOKEN`` (the token) or ``MEMSTORE_AUTH_TOKEN_FILE``; ``MEMSTORE_TLS_CA``,
  ``MEMSTORE_TLS_CERT``, ``MEMSTORE_TLS_KEY`` (PEM paths) and ``MEMSTORE_TLS_SERVER_NAME``
  (``memstore.v1.security``).

The keyword arguments these classes took before (``store=``, ``timeout=``, ``use_shared_memory=``,
``auth_token=``, ``tls_ca=``, ``tls_cert=``, ``tls_key=``) still work for one release, each with a
``DeprecationWarning``; :func:`connection_from_kwargs` is their one translation.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memstore.errors import ConfigError
from memstore.v1.security import Credentials
from trainer_client import knobs
from trainer_client.errors import InvalidArgumentError
from trainer_client.knobs import address_problem

DEFAULT_STORE = "127.0.0.1:7070"
DEFAULT_TIMEOUT = 60.0

#: the old keyword arguments, each with what replaces it
DEPRECATED_KWARGS: Mapping[str, str] = {
    "store": "Connection(address=...)",
    "timeout": "Connection(timeout=...)",
    "use_shared_memory": "Connection(shared_memory=...)",
    "auth_token": "Connection(credentials=Credentials(token=...))",
    "tls_ca": "Connection(credentials=Credentials(ca=...))",
    "tls_cert": "Connection(credentials=Credentials(cert=...))",
    "tls_key": "Connection(credentials=Credentials(key=...))",
}


@dataclass(frozen=True)
class Connection:
    """How a client reaches its store.

    Args:
        address: the store's ``HOST:PORT``; None (default): ``MEMSTORE_STORE``, else ``127.0.0.1:7070``,
            read when a client connects.
        timeout: deadline in seconds of each control call (and of the initial connection).
        credentials: the token and TLS files to present (:class:`memstore.v1.security.Credentials`, also
            exported by ``trainer_client``); None (default): from ``MEMSTORE_AUTH_TOKEN[_FILE]`` and
            ``MEMSTORE_TLS_CA/CERT/KEY/SERVER_NAME`` when a client connects.
        shared_memory: force the shared-memory path on or off; None (default): on when the store shares this
            machine's memory.

    Frozen and picklable (``MemStoreWriter`` travels to DCP's checkpoint process with it); ``repr`` hides the
    token and the key path. Bad values raise :class:`~trainer_client.errors.InvalidArgumentError`.
    """

    address: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    credentials: Credentials | None = None
    shared_memory: bool | None = None

    def __post_init__(self) -> None:
        if self.address is not None and address_problem(self.address):
            raise InvalidArgumentError(f"Connection address {self.address!r} is invalid: {address_problem(self.address)}")
        timeout = self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (math.isfinite(timeout) and timeout > 0):
            raise InvalidArgumentError(f"Connection timeout {timeout!r} is invalid: expected a positive number of seconds")
        object.__setattr__(self, "timeout", float(timeout))
        if self.credentials is not None and not isinstance(self.credentials, Credentials):
            raise InvalidArgumentError(
                f"Connection credentials must be a trainer_client.Credentials, got a {type(self.credentials).__name__}"
            )
        if self.shared_memory is not None and not isinstance(self.shared_memory, bool):
            raise InvalidArgumentError(f"Connection shared_memory {self.shared_memory!r} is invalid: expected True, False or None")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 shared_memory: bool | None = None) -> Connection:  # fmt: skip
        """The connection the environment describes (``MEMSTORE_STORE``, ``MEMSTORE_AUTH_TOKEN[_FILE]``,
        ``MEMSTORE_TLS_*``), read and checked now: a bad value raises ``InvalidArgumentError`` naming the
        variable (and its value, except a token's). ``address`` stays None when ``MEMSTORE_STORE`` is unset
        (the default store; ``memstore.ray`` then picks the node's own)."""
        return cls(address=knobs.store_address(env), timeout=timeout, credentials=knobs.credentials(env), shared_memory=shared_memory)

    def resolved(self, env: Mapping[str, str] | None = None) -> Connection:
        """This connection with the address and credentials it leaves out read from the environment."""
        if self.address is not None and self.credentials is not None:
            return self
        return dataclasses.replace(
            self,
            address=self.address if self.address is not None else knobs.store_address(env) or DEFAULT_STORE,
            credentials=self.credentials if self.credentials is not None else knobs.credentials(env),
        )

    @property
    def address_source(self) -> str:
        """Where an unset address comes from, for error messages: ``" (from MEMSTORE_STORE)"`` or ``" (the default)"``."""
        if self.address is not None:
            return ""
        return f" (from {knobs.STORE_ENV})" if knobs.store_address() else " (the default)"


#: ``CheckpointClient``'s keyword options besides its connection: what an integration may pass on to the client it makes
CLIENT_OPTIONS = ("on_capacity", "spill_compression", "run_id", "remote_save", "replica_group", "verify_replicas", "group")


def check_options(owner: str, options: Mapping[str, Any], accepted: Sequence[str], takes: str) -> None:
    """Refuse, when ``owner`` (an integration) is made, not at its first save, an option its client would refuse:
    a connection keyword (``store=``, ``timeout=``, ...; ``TypeError`` naming its place in ``connection=``) or a name
    not in ``accepted`` (naming what ``owner`` takes: ``takes``, then ``accepted``)."""
    deprecated = [name for name in options if name in DEPRECATED_KWARGS]
    if deprecated:
        replacements = "; ".join(DEPRECATED_KWARGS[name] for name in deprecated)
        raise TypeError(f"{owner}({', '.join(f'{n}=' for n in deprecated)}) is not accepted: pass connection= ({replacements})")
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(f"{owner}() got unexpected options {', '.join(unknown)}: it takes {takes}{', '.join(f'{o}=' for o in accepted)}")


def connection_from_kwargs(owner: str, connection: Connection | None, old: Mapping[str, Any]) -> Connection:
    """The connection of ``owner`` (a class name) from ``connection=`` or the deprecated keyword arguments ``old``.

    ``old`` maps names to values as the caller passed them (None counts as not passed). Passing any warns once
    (``DeprecationWarning`` naming each and its replacement); passing one together with ``connection``, or a
    name that was never an argument, is a ``TypeError``.
    """
    unknown = sorted(set(old) - set(DEPRECATED_KWARGS))
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    given = {name: value for name, value in old.items() if value is not None}
    if connection is not None:
        if given:
            names = ", ".join(f"{name}=" for name in given)
            raise TypeError(f"{owner}() got both connection= and the deprecated {names}: pass only connection=, with them in it")
        if not isinstance(connection, Connection):
            raise TypeError(f"{owner}(connection=...) expects a trainer_client.Connection, got a {type(connection).__name__}")
        return connection
    if given:
        names = ", ".join(f"{name}=" for name in given)
        replacement = "; ".join(DEPRECATED_KWARGS[name] for name in given)
        warnings.warn(
            f"{owner}({names}) is deprecated and will be removed in the next release: pass connection= instead ({replacement})",
            DeprecationWarning,
            stacklevel=3,
        )
    credentials = None
    if any(name in given for name in ("auth_token", "tls_ca", "tls_cert", "tls_key")):
        try:  # as before: what is not passed still comes from the environment
            credentials = Credentials.from_env(token=given.get("auth_token"), ca=given.get("tls_ca"), cert=given.get("tls_cert"),
                                               key=given.get("tls_key"))  # fmt: skip
        except ConfigError as exc:
            raise InvalidArgumentError(str(exc)) from None
    return Connection(
        address=given.get("store") or None,  # store="" meant the default, as None did
        timeout=given.get("timeout", DEFAULT_TIMEOUT),
        credentials=credentials,
        shared_memory=given.get("use_shared_memory"),
    )
