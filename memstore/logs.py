"""Structured logs: every record carries the store's host id and, where a message is about a shard, its job,
step and rank; printed for people (``--log-format human``) or one JSON object per line (``json``).

The engine logs as it always has (``log.warning("repair of %s failed: %s", key, exc)``). A filter finds
the fields: the host id is fixed per process, and job, step and rank come from ``extra={...}`` when a
call passes them, else from the first argument that is a shard key (or has one: a manifest, a holding).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

FORMATS = ("human", "json")
FIELDS = ("host", "job", "step", "rank")
_HANDLER = "memstore"
_HUMAN = "%(asctime)s %(levelname)s %(name)s%(context)s: %(message)s"


class ContextFilter(logging.Filter):
    """Adds ``host`` and, when the record is about a shard, ``job``, ``step`` and ``rank``; ``context`` is their
    human form (`` [host=h0 job=j step=3 rank=1]``)."""

    def __init__(self, host: str = "") -> None:
        super().__init__()
        self.host = host

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "host", None):
            record.host = self.host
        key = _key_in(record.args)
        for name, attr in (("job", "job_id"), ("step", "step"), ("rank", "rank")):
            if getattr(record, name, None) is None:
                setattr(record, name, getattr(key, attr, None) if key is not None else None)
        parts = [f"{name}={getattr(record, name)}" for name in FIELDS if getattr(record, name, None) not in (None, "")]
        record.context = f" [{' '.join(parts)}]" if parts else ""
        return True


def _key_in(args: Any) -> Any:
    """The first shard key among a record's arguments (a ShardKey, or anything with a ``key`` that is one)."""
    for arg in args if isinstance(args, tuple) else ():
        for candidate in (arg, getattr(arg, "key", None)):
            if candidate is not None and all(hasattr(candidate, a) for a in ("job_id", "step", "rank")):
                return candidate
    return None


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (RFC 3339, UTC), level, logger, message, the context fields, and the
    exception when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value not in (None, ""):
                doc[name] = value
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure(level: str, fmt: str = "human", host: str = "") -> None:
    """Route the root logger to stderr in ``fmt`` at ``level``; ``host``: this process's store (or "")."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is invalid: expected one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler()
    handler.addFilter(ContextFilter(host))
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_HUMAN))
    handler.set_name(_HANDLER)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER]:  # ours from an earlier call; others stay
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level, logging.INFO))
