"""Typed results to JSON: result dataclasses whose field names are the JSON keys.

Field metadata says how a field is written, so the JSON keeps the exact shape of the bench's output:
``field(metadata=OMIT_NONE)`` leaves a key out when its value is None, ``OMIT_EMPTY`` when it is empty,
``FLATTEN`` merges a nested dataclass's keys into its parent (nothing when None), ``SKIP`` never writes it,
and ``key(name)`` writes it under another name (``pass`` is a Python keyword).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

OMIT_NONE: Mapping[str, Any] = MappingProxyType({"omit": "none"})  # leave the key out when the value is None
OMIT_EMPTY: Mapping[str, Any] = MappingProxyType({"omit": "empty"})  # ... when the value is empty
FLATTEN: Mapping[str, Any] = MappingProxyType({"flatten": True})  # merge a nested dataclass's keys into the parent's
SKIP: Mapping[str, Any] = MappingProxyType({"skip": True})  # never write it


def key(name: str) -> Mapping[str, Any]:
    """Write the field under another name."""
    return MappingProxyType({"key": name})


def to_json(value: Any) -> Any:
    """Dataclasses (as above), dicts, lists and tuples to plain JSON values; anything else as is."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _object(value)
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return value


def _object(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        meta = f.metadata
        omit = meta.get("omit")
        if meta.get("skip") or (omit == "none" and value is None) or (omit == "empty" and not value):
            continue
        if meta.get("flatten"):
            if value is not None:
                out.update(_object(value))
            continue
        out[meta.get("key", f.name)] = to_json(value)
    return out


def json_default(value: Any) -> Any:
    """``json.dumps(default=...)``: sets as lists, anything else unknown as its str()."""
    if isinstance(value, set | tuple):
        return list(value)
    return str(value)
