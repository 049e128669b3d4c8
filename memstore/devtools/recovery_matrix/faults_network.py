"""The recovery matrix's network faults: partitions, a slow peer, bit flips on the wire, a clock jump."""

from __future__ import annotations

from memstore.devtools.recovery_matrix.fault import Fault

NETWORK_FAULTS: tuple[Fault, ...] = ()
