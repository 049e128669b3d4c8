"""A thin layer over fsspec: the few operations the durable tier needs, with atomic publish.

On a local filesystem a file is written under a temporary name and renamed into place (atomic);
object stores (s3://) make a PUT visible only once complete, so objects are written in place.
Every failure becomes a ``SpillStorageError`` with a ``kind`` (unavailable, permission, full, other)
so callers can report it and retry; ``SpillUnreachable`` means the storage did not answer (connection refused or
reset, a timeout, throttling), which callers tell apart from an answer about one object (missing, denied, corrupt).
"""

from __future__ import annotations

import errno
import json
import secrets
from collections.abc import Iterable, Iterator
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from memstore.errors import SpillPermissionDenied, SpillStorageError, SpillStorageFull, SpillUnreachable

# s3fs's errnos for a server that answered 503 SlowDown, ServiceUnavailable or 500 InternalError (after botocore's retries)
_NO_ANSWER = {errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EBUSY)}


def _classify(exc: BaseException) -> type[SpillStorageError]:
    """Our type for an exception of fsspec or its backends (whose own types differ per backend and version).

    A missing object is an answer, never ``SpillUnreachable`` (whatever its path spells: ``step-000000000503``); the
    words below match what is left (botocore's connection errors, s3fs's errors by their server code).
    """
    if isinstance(exc, FileNotFoundError):
        return SpillStorageError
    if isinstance(exc, PermissionError):
        return SpillPermissionDenied
    if isinstance(exc, (ConnectionError, TimeoutError)) or (isinstance(exc, OSError) and exc.errno in _NO_ANSWER):
        return SpillUnreachable
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return SpillStorageFull
    text = f"{type(exc).__name__} {exc}".lower()
    if "accessdenied" in text or "forbidden" in text or "403" in text:
        return SpillPermissionDenied
    if any(w in text for w in ("connect", "endpoint", "timeout", "unavailable", "refused", "503", "slowdown")):
        return SpillUnreachable
    if "quota" in text or "no space" in text:
        return SpillStorageFull
    return SpillStorageError


def parse_options(text: str | dict[str, Any] | None) -> dict[str, Any]:
    """``--spill-options``: a JSON object, or ``key=value,key=value`` (values parsed as JSON when they can be)."""
    if not text:
        return {}
    if isinstance(text, dict):
        return dict(text)
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"--spill-options is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("--spill-options JSON must be an object")
        return value
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--spill-options entry {item!r} is invalid: expected KEY=VALUE")
        try:
            out[key] = json.loads(raw)
        except (json.JSONDecodeError, RecursionError):
            out[key] = raw
    return out


class Durable:
    """Durable storage at ``url`` (any fsspec URL)."""

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        options = dict(options or {})
        if url.startswith(("s3://", "s3a://")):
            # Fail a call to an unreachable or stalled endpoint in seconds, not minutes; the spiller retries.
            options.setdefault("config_kwargs", {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3}})
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError, TypeError) as exc:
            raise SpillStorageError(f"--spill {url!r} cannot be opened: {exc}") from None
        self.url = url
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)

    def _wrap(self, what: str, exc: BaseException) -> SpillStorageError:
        return _classify(exc)(f"{what} on {self.url}: {type(exc).__name__}: {exc}")

    def write_stream(self, path: str, pieces: Iterable[memoryview | bytes]) -> int:
        """Write ``pieces`` to ``path``; on a local filesystem the file appears only when complete."""
        target = f"{path}.tmp-{secrets.token_hex(4)}" if self.local else path
        written = 0
        try:
            if self.local:
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            with self.fs.open(target, "wb") as fh:
                for piece in pieces:
                    fh.write(piece)
                    written += len(piece)
            if self.local:
                self.fs.mv(target, path)
        except SpillStorageError:
            self._discard(target)
            raise
        except Exception as exc:
            self._discard(target)
            raise self._wrap(f"writing {path}", exc) from None
        return written

    def write_small(self, path: str, data: bytes) -> None:
        self.write_stream(path, [data])

    def _discard(self, path: str) -> None:
        try:
            self.fs.rm(path)
        except Exception:
            pass

    def read(self, path: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(path))
        except Exception as exc:
            raise self._wrap(f"reading {path}", exc) from None

    def read_stream(self, path: str, sizes: Iterable[int]) -> Iterator[bytes]:
        """Read ``path`` piece by piece, the pieces being ``sizes`` bytes long."""
        try:
            with self.fs.open(path, "rb") as fh:
                for size in sizes:
                    data = fh.read(size)
                    if len(data) != size:
                        raise SpillStorageError(f"{path} is truncated: wanted {size} bytes, got {len(data)}")
                    yield data
        except SpillStorageError:
            raise
        except Exception as exc:
            raise self._wrap(f"reading {path}", exc) from None

    def size(self, path: str) -> int:
        try:
            return int(self.fs.size(path))
        except Exception as exc:
            raise self._wrap(f"stat of {path}", exc) from None

    def exists(self, path: str) -> bool:
        try:
            return bool(self.fs.exists(path))
        except Exception as exc:
            raise self._wrap(f"stat of {path}", exc) from None

    def list_files(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Every file below ``prefix`` (recursive) with its info; {} if the prefix does not exist."""
        try:
            self.fs.invalidate_cache()  # object stores cache listings; spills by other stores must show up
            if not self.fs.exists(prefix):
                return {}
            found = self.fs.find(prefix, detail=True)
            return {str(k): v for k, v in found.items()}
        except Exception as exc:
            raise self._wrap(f"listing {prefix}", exc) from None

    def local_subdirs(self, prefix: str) -> list[str]:
        """Directories right below ``prefix`` on a local filesystem ([] elsewhere: object stores have no empty dirs)."""
        if not self.local:
            return []
        try:
            return [str(e["name"]) for e in self.fs.ls(prefix, detail=True) if e.get("type") == "directory"]
        except OSError:
            return []

    def remove_empty_dirs(self, dirs: list[str]) -> None:
        """Local filesystems keep empty step directories after their files are gone; object stores don't."""
        if not self.local:
            return
        for d in dirs:
            try:
                self.fs.rmdir(d)
            except OSError:
                pass  # not empty (another store's ranks) or already gone

    def delete(self, paths: list[str]) -> None:
        if not paths:
            return
        try:
            self.fs.rm(paths)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._wrap(f"deleting {len(paths)} files", exc) from None
