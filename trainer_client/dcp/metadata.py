"""DCP ``Metadata`` <-> tagged plain dicts, never pickled (used by :mod:`trainer_client.dcp.storage_layer`).

:func:`encode_metadata` turns the dataclass tree of ``torch.distributed.checkpoint``'s global
``Metadata`` into tagged plain dicts/lists/scalars that memstore's safe shard format stores as is:
an explicit allowlist of types, anything else raises ``SerializationError`` naming the path.
:func:`decode_metadata` rebuilds it, constructing only allowlisted classes, and raises
``CorruptShardError`` for anything malformed or unknown.

Also home of :class:`MemStoreStorageInfo` (the ``storage_data`` of every item, part of the
metadata) and of the item keys it holds. Everything public here is re-exported by
:mod:`trainer_client.dcp`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, cast

import torch
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardedTensorProperties
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from trainer_client.errors import CorruptShardError, SerializationError

__all__ = ["MemStoreStorageInfo", "decode_metadata", "encode_metadata"]


@dataclass(frozen=True)
class MemStoreStorageInfo:
    """Where one DCP item lives: in the shard of saving rank ``rank``, under ``items[key]``."""

    rank: int
    key: str


def item_key(index: MetadataIndex) -> str:
    """Stable, unique-per-rank string of a MetadataIndex: ``fqn|offsets|index``."""
    offset = "" if index.offset is None else ",".join(str(int(o)) for o in index.offset)
    hint = "" if index.index is None else str(int(index.index))
    return f"{index.fqn}|{offset}|{hint}"


# --------------------------------------------------------------------------------------------
# metadata <-> tagged plain dicts (no pickle)
# --------------------------------------------------------------------------------------------

_TAG: Final = "__dcp__"


def _torch_constants(kind: type) -> dict[str, Any]:
    return {name: value for name, value in vars(torch).items() if isinstance(value, kind)}


_DTYPES: Final = _torch_constants(torch.dtype)
_LAYOUTS: Final = _torch_constants(torch.layout)
_MEMORY_FORMATS: Final = _torch_constants(torch.memory_format)
_CONSTANT_TABLES: Final[dict[str, tuple[type, dict[str, Any]]]] = {
    "dtype": (torch.dtype, _DTYPES),
    "layout": (torch.layout, _LAYOUTS),
    "memory_format": (torch.memory_format, _MEMORY_FORMATS),
}


def _is_opt(kind: type) -> Callable[[Any], bool]:
    return lambda v: v is None or _is(kind)(v)


def _is(kind: type) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, kind) and (kind is bool or type(v) is not bool)


def _is_list_of(kind: type) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(isinstance(x, kind) for x in v)


def _is_storage_types(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(x, (TensorStorageMetadata, BytesStorageMetadata)) for k, x in v.items()
    )


def _is_properties(v: Any) -> bool:
    return type(v) in (TensorProperties, ShardedTensorProperties)


def _anything(_: Any) -> bool:
    return True  # still restricted to what the decoder can build: allowlisted types only


# class -> (tag, {field: check}); the encoder writes exactly these fields, the decoder requires exactly them.
_DATACLASSES: Final[dict[type, tuple[str, dict[str, Callable[[Any], bool]]]]] = {
    Metadata: (
        "Metadata",
        {
            "state_dict_metadata": _is_storage_types,
            "planner_data": _anything,
            "storage_data": _anything,
            "storage_meta": _is_opt(StorageMeta),
            "version": _is_opt(str),
        },
    ),
    TensorStorageMetadata: (
        "TensorStorageMetadata",
        {"properties": _is_properties, "size": _is(torch.Size), "chunks": _is_list_of(ChunkStorageMetadata)},
    ),
    BytesStorageMetadata: ("BytesStorageMetadata", {}),
    ChunkStorageMetadata: ("ChunkStorageMetadata", {"offsets": _is(torch.Size), "sizes": _is(torch.Size)}),
    TensorProperties: (
        "TensorProperties",
        {
            "dtype": _is(torch.dtype),
            "layout": _is(torch.layout),
            "requires_grad": _is(bool),
            "memory_format": _is(torch.memory_format),
            "pin_memory": _is(bool),
        },
    ),
    # The legacy class of ShardedTensor metadata (``torch.distributed._shard.sharded_tensor.metadata``), same
    # fields: DCP metadata of older torch versions (DCP used this class before it had its own) carries it.
    ShardedTensorProperties: (
        "ShardedTensorProperties",
        {
            "dtype": _is(torch.dtype),
            "layout": _is(torch.layout),
            "requires_grad": _is(bool),
            "memory_format": _is(torch.memory_format),
            "pin_memory": _is(bool),
        },
    ),
    StorageMeta: (
        "StorageMeta",
        {"checkpoint_id": _is_opt(str), "save_id": _is_opt(str), "load_id": _is_opt(str), "modules": _is_list_of(str)},
    ),
    MetadataIndex: ("MetadataIndex", {"fqn": _is(str), "offset": _is_opt(torch.Size), "index": _is_opt(int)}),
    MemStoreStorageInfo: ("MemStoreStorageInfo", {"rank": _is(int), "key": _is(str)}),
}
_BY_TAG: Final = {tag: (cls, fields) for cls, (tag, fields) in _DATACLASSES.items()}
_ALLOWED_NAMES: Final = (
    "None, bool, int, float, str, list, tuple, dict, torch.Size, torch.dtype, torch.layout, torch.memory_format, "
    + ", ".join(tag for tag, _ in _DATACLASSES.values())
)


def encode_metadata(metadata: Metadata) -> dict[str, Any]:
    """``Metadata`` -> tagged plain dicts/lists/scalars that memstore's safe format stores as is.

    Raises ``SerializationError`` (naming the path) for any value outside the allowlist.
    """
    if type(metadata) is not Metadata:
        raise SerializationError(f"expected torch.distributed.checkpoint.metadata.Metadata, got {type(metadata).__qualname__}", "metadata")
    return cast(dict[str, Any], _encode(metadata, "metadata"))


def _encode(value: Any, path: str) -> Any:
    t = type(value)
    if value is None or t in (bool, int, float, str):
        return value
    if t is list:
        return [_encode(x, f"{path}[{i}]") for i, x in enumerate(value)]
    if t is tuple:
        return {_TAG: "tuple", "items": [_encode(x, f"{path}[{i}]") for i, x in enumerate(value)]}
    if t is dict:
        return {_TAG: "dict", "items": [[_encode(k, f"{path}.<key>"), _encode(v, f"{path}[{k!r}]")] for k, v in value.items()]}
    if t is torch.Size:
        return {_TAG: "Size", "dims": [int(d) for d in value]}
    return _encode_object(value, t, path)


def _encode_object(value: Any, t: type, path: str) -> Any:
    """A torch constant (dtype, layout, memory format) or an allowlisted dataclass; else raise."""
    for name, (kind, table) in _CONSTANT_TABLES.items():
        if t is kind:
            for const_name, const in table.items():
                if const == value:
                    return {_TAG: name, "name": const_name}
            raise SerializationError(f"unknown {name} {value!r}", path)
    spec = _DATACLASSES.get(t)
    if spec is not None:
        tag, fields = spec
        for extra in dataclasses.fields(value):  # a field a newer torch added: never drop it silently
            if extra.name not in fields and getattr(value, extra.name) is not None:
                raise SerializationError(f"{tag}.{extra.name} is not known to memstore's DCP metadata encoding", path)
        # getattr with a default: a field this torch's class lacks (Metadata.version before torch 2.9) is None
        return {_TAG: tag, **{f: _encode(getattr(value, f, None), f"{path}.{f}") for f in fields}}
    raise SerializationError(
        f"unsupported type {t.__module__}.{t.__qualname__} in DCP metadata (it is never pickled); allowed: {_ALLOWED_NAMES}", path
    )


def decode_metadata(encoded: Any) -> Metadata:
    """Rebuild ``Metadata`` from :func:`encode_metadata`'s output; builds allowlisted types only.

    Raises ``CorruptShardError`` for anything malformed or unknown.
    """
    try:
        md = _decode(encoded, "metadata")
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:
        # nesting past the recursion limit; a key whose repr hits the int-digits limit; a dataclass refusing its fields
        raise CorruptShardError(f"metadata: malformed: {type(exc).__name__}: {exc!s:.200}") from None
    if type(md) is not Metadata:
        raise CorruptShardError(f"metadata: expected an encoded Metadata, got {type(md).__qualname__}")
    return md


def _decode(value: Any, path: str) -> Any:
    t = type(value)
    if value is None or t in (bool, int, float, str):
        return value
    if t is list:
        return [_decode(x, f"{path}[{i}]") for i, x in enumerate(value)]
    if t is not dict:
        raise CorruptShardError(f"{path}: unexpected {t.__qualname__} in encoded DCP metadata")
    tag = value.get(_TAG)
    if not isinstance(tag, str):
        raise CorruptShardError(f"{path}: encoded DCP metadata dict without a {_TAG!r} tag")
    if tag in ("tuple", "dict"):
        return _decode_container(value, tag, path)
    if tag == "Size":
        _need(value, tag, {"dims"}, path)
        dims = value["dims"]
        if type(dims) is not list or not all(type(d) is int and d >= 0 for d in dims):
            raise CorruptShardError(f"{path}: Size dims must be a list of ints >= 0")
        return torch.Size(dims)
    if tag in _CONSTANT_TABLES:
        _need(value, tag, {"name"}, path)
        _, table = _CONSTANT_TABLES[tag]
        const = table.get(value["name"]) if isinstance(value["name"], str) else None
        if const is None:
            raise CorruptShardError(f"{path}: unknown {tag} {value['name']!r}")
        return const
    return _decode_dataclass(value, tag, path)


def _need(value: dict[str, Any], tag: str, keys: set[str], path: str) -> None:
    """``value`` (an encoded ``tag``) must hold exactly ``keys`` besides its tag."""
    if set(value) != keys | {_TAG}:
        raise CorruptShardError(f"{path}: {tag} has fields {sorted(set(value) - {_TAG})}, expected {sorted(keys)}")


def _decode_container(value: dict[str, Any], tag: str, path: str) -> tuple[Any, ...] | dict[Any, Any]:
    """An encoded tuple or dict (``tag`` is ``"tuple"`` or ``"dict"``)."""
    _need(value, tag, {"items"}, path)
    items = value["items"]
    if type(items) is not list:
        raise CorruptShardError(f"{path}: {tag} items must be a list")
    if tag == "tuple":
        return tuple(_decode(x, f"{path}[{i}]") for i, x in enumerate(items))
    out: dict[Any, Any] = {}
    for pair in items:
        if type(pair) is not list or len(pair) != 2:
            raise CorruptShardError(f"{path}: dict items must be [key, value] pairs")
        key = _decode(pair[0], f"{path}.<key>")
        try:
            out[key] = _decode(pair[1], f"{path}[{key!r}]")
        except TypeError:
            raise CorruptShardError(f"{path}: unhashable dict key {key!r}") from None
    return out


def _decode_dataclass(value: dict[str, Any], tag: str, path: str) -> Any:
    """An allowlisted dataclass, its fields decoded and checked; any other tag raises."""
    spec = _BY_TAG.get(tag)
    if spec is None:
        raise CorruptShardError(f"{path}: type tag {tag!r} is not allowed in DCP metadata (allowed: {_ALLOWED_NAMES})")
    cls, fields = spec
    _need(value, tag, set(fields), path)
    kwargs = {f: _decode(value[f], f"{path}.{f}") for f in fields}
    for f, check in fields.items():
        if not check(kwargs[f]):
            raise CorruptShardError(f"{path}.{f}: {type(kwargs[f]).__qualname__} is not valid for {tag}.{f}")
    declared = {f.name for f in dataclasses.fields(cls)}
    obj = cls(**{f: v for f, v in kwargs.items() if f in declared})
    for f in kwargs.keys() - declared:  # a field this torch's class lacks (Metadata.version before torch 2.9): kept as an attribute
        setattr(obj, f, kwargs[f])
    return obj
