"""A framework's checkpoint dict as a memstore shard: what the shard format holds stays as it is, the rest is pickled.

Frameworks (Lightning) hand over dicts that are mostly tensors, numbers and strings, which memstore's shard format
stores as they are (:mod:`trainer_client.serialization`), but may also hold objects of their own (hyperparameters
given as a ``Namespace``, a dataclass, a ``Path``, an enum). :func:`pack` keeps every value the format can store and
replaces each subtree it cannot with that subtree's ``torch.save`` bytes, recording where; :func:`unpack` puts them
back with ``torch.load``, with the caller's ``weights_only`` (so a framework's own loading rules, e.g. Lightning's
``weights_only``, apply exactly as they would to a ``torch.save`` file). The serializer alone decides what is
storable: :func:`pack` asks it, subtree by subtree, only along the paths of a state it refused.

The stored dict: ``{"format": FORMAT, "state": <the tree>, "pickled": [<path>, ...]}``; a path is the list of keys
and indices from the root to a pickled subtree (a bytes value in the tree).
"""

from __future__ import annotations

import collections
import io
from typing import Any

import torch

from trainer_client import serialization
from trainer_client.errors import InvalidArgumentError, SerializationError

FORMAT = "memstore.framework-state/1"

_Path = tuple[Any, ...]


def wrap(state: Any) -> dict[str, Any]:
    """``state`` as stored when the shard format holds all of it (nothing pickled)."""
    return {"format": FORMAT, "state": state, "pickled": []}


def pack(state: Any) -> dict[str, Any]:
    """``state`` with every subtree the shard format cannot hold replaced by its ``torch.save`` bytes."""
    pickled: list[list[Any]] = []
    return {"format": FORMAT, "state": _portable(state, (), pickled), "pickled": pickled}


def _storable(value: Any) -> bool:
    try:
        serialization.plan(value)
    except SerializationError:
        return False
    return True


def _portable(value: Any, path: _Path, pickled: list[list[Any]]) -> Any:
    if _storable(value):
        return value
    kind = type(value)
    mark = len(pickled)  # the pickled paths found below this one start here
    out: Any = None
    if kind is dict or kind is collections.OrderedDict:
        out = kind((k, _portable(v, (*path, k), pickled)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata  # a module state_dict's versions
    elif kind is list or kind is tuple:
        out = kind(_portable(v, (*path, i), pickled) for i, v in enumerate(value))
    if out is not None and _storable(out):
        return out
    # A leaf of another type, or a container the format refuses as such (a key of another type): pickled whole.
    del pickled[mark:]
    pickled.append(list(path))
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def unpack(stored: Any, *, weights_only: bool | None = None, map_location: Any = None) -> Any:
    """The state :func:`pack` (or :func:`wrap`) stored, its pickled subtrees loaded with ``torch.load(weights_only=...)``."""
    if not isinstance(stored, dict) or stored.get("format") != FORMAT or not isinstance(stored.get("pickled"), list):
        raise InvalidArgumentError(f"not a framework checkpoint stored by memstore (expected format {FORMAT!r})")
    state = stored["state"]
    for path in stored["pickled"]:
        state = _replace(state, list(path), lambda blob: torch.load(io.BytesIO(blob), weights_only=weights_only, map_location=map_location))
    return state


def _replace(tree: Any, path: list[Any], load: Any) -> Any:
    """``tree`` with the value at ``path`` loaded; dicts and lists change in place, tuples are rebuilt."""
    if not path:
        return load(tree)
    key, rest = path[0], path[1:]
    if isinstance(tree, tuple):
        items = list(tree)
        items[key] = _replace(items[key], rest, load)
        return tuple(items)
    tree[key] = _replace(tree[key], rest, load)
    return tree
