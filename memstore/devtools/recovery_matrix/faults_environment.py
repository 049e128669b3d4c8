"""The recovery matrix's faults of the machine's services: S3 throttling and outage, DNS outage and flapping, OOM kill, ENOSPC."""

from __future__ import annotations

from memstore.devtools.recovery_matrix.fault import Fault

ENVIRONMENT_FAULTS: tuple[Fault, ...] = ()
