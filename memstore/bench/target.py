"""One target a figure is held to (PASS/MISS/n/a), and the thresholds of issue 16 (what a user sees from the first
save). Pure; :mod:`memstore.bench.targets` has the older thresholds and evaluates a scenario."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from memstore.bench.jsonable import key as json_key

# Issue 16: from the first save, every save timed from the save() call.
FIRST_SAVE_MEMCPY_MAX = 3.0  # save 1 (a fresh job on fresh stores): stall <= 3x the paired memcpy
LATER_SAVES_MEMCPY_MAX = 1.5  # every later save: stall <= 1.5x its paired memcpy
COMMITTED_TCP_MIN = 0.7  # every save: state bytes / (call -> committed) >= 0.7x raw TCP of the same bytes
SMALL_STATE_STALL_MAX = 0.001  # a save of a 1 MiB state: stall p50 <= 1 ms (fixed cost per save, idle machine)
SMALL_STATE_TARGET_SIZE = 1 << 20
PER_TENSOR_MAX_US = 3.0  # each extra tensor costs a save's stall and a load <= 3 us
NO_SHM_TCP_MIN = 0.7  # without shared memory: save, call -> committed and load >= 0.7x raw TCP
STORE_RSS_MAX = 1.15  # store RSS <= 1.15x the shard bytes it holds plus its documented pool (used_bytes)


@dataclass
class Target:
    target: str
    value: float | None
    passed: bool | None = field(metadata=json_key("pass"))  # None: n/a (not measured)
    note: str

    @classmethod
    def check(cls, text: str, value: float | None, ok: Callable[[float], bool], note: str = "") -> Target:
        return cls(target=text, value=value, passed=None if value is None else bool(ok(value)), note=note)

    @classmethod
    def na(cls, text: str, note: str) -> Target:
        return cls(target=text, value=None, passed=None, note=note)
