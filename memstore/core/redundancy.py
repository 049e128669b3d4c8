"""How a step is protected in RAM: R whole copies (``replicas:R``) or erasure coding (``ec:K+M``).

``replicas:R`` keeps the owner's copy plus R-1 whole copies on its group's peers (what ``--replicas R`` means). ``ec:K+M``
keeps each host's shards whole on that host only, and M parity fragments per row of a group of K+M hosts
(``docs/erasure.md``): a group survives any M lost hosts at 1 + M/K of the state per kept step, where R copies survive
R-1 at R times the state.

The text form is what ``--redundancy`` takes and what status reports; ``str(Redundancy.parse(text)) == text`` for every
accepted text. Plain Python: no gRPC, no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The most columns (K + M) one erasure-coded group may have: the codec's limit.
MAX_EC_COLUMNS = 64

FORMS = "replicas:R (e.g. replicas:2) or ec:K+M (e.g. ec:4+1)"

_REPLICAS = re.compile(r"replicas:(\d+)")
_EC = re.compile(r"ec:(\d+)\+(\d+)")


@dataclass(frozen=True)
class Redundancy:
    """A redundancy scheme. ``replicas`` is R for ``replicas:R`` and 1 (the owner's whole copy) for ``ec:K+M``;
    ``k`` and ``m`` are the data and parity columns of ``ec:K+M`` and 0 for replicas."""

    kind: str  # "replicas" | "ec"
    replicas: int
    k: int = 0
    m: int = 0

    def __post_init__(self) -> None:
        numbers = (self.replicas, self.k, self.m)
        if any(isinstance(n, bool) or not isinstance(n, int) for n in numbers):
            raise ValueError(f"redundancy counts must be integers, got replicas={self.replicas!r}, k={self.k!r}, m={self.m!r}")
        if self.kind == "replicas":
            if self.replicas < 1 or self.k or self.m:
                raise ValueError(f"replicas:R needs R >= 1 (and no K, M), got replicas={self.replicas}, k={self.k}, m={self.m}")
        elif self.kind == "ec":
            if self.replicas != 1 or self.k < 1 or self.m < 1 or self.k + self.m > MAX_EC_COLUMNS:
                raise ValueError(
                    f"ec:K+M needs K >= 1, M >= 1 and K+M <= {MAX_EC_COLUMNS} (and replicas 1), "
                    f"got k={self.k}, m={self.m}, replicas={self.replicas}"
                )
        else:
            raise ValueError(f"redundancy kind {self.kind!r} is invalid: expected replicas or ec")

    @classmethod
    def of_replicas(cls, replicas: int) -> Redundancy:
        """``replicas:R``: what ``--replicas R`` means."""
        return cls("replicas", replicas)

    @classmethod
    def erasure(cls, k: int, m: int) -> Redundancy:
        """``ec:K+M``."""
        return cls("ec", 1, k, m)

    @classmethod
    def parse(cls, text: str) -> Redundancy:
        """``"replicas:2"`` or ``"ec:4+1"``; anything else raises ``ValueError`` naming the text and both forms."""
        if not isinstance(text, str):
            raise ValueError(f"redundancy {text!r} is invalid: expected {FORMS}")
        stripped = text.strip()
        try:
            if found := _REPLICAS.fullmatch(stripped):
                return cls.of_replicas(int(found[1]))
            if found := _EC.fullmatch(stripped):
                return cls.erasure(int(found[1]), int(found[2]))
        except ValueError as exc:
            raise ValueError(f"redundancy {text!r} is invalid: {exc}; expected {FORMS}") from None
        raise ValueError(f"redundancy {text!r} is invalid: expected {FORMS}")

    @classmethod
    def resolve(cls, replicas: int | None, redundancy: Redundancy | str | None, default_replicas: int = 2) -> Redundancy:
        """The scheme ``--replicas`` and ``--redundancy`` give together (either may be None: not given). ``--replicas R``
        means ``replicas:R``; both given and disagreeing raises ``ValueError`` naming both."""
        scheme = cls.parse(redundancy) if isinstance(redundancy, str) else redundancy
        if scheme is None:
            return cls.of_replicas(default_replicas if replicas is None else replicas)
        if replicas is not None and cls.of_replicas(replicas) != scheme:
            raise ValueError(
                f"--replicas {replicas} and --redundancy {scheme} disagree: give one of them (--replicas R is --redundancy replicas:R)"
            )
        return scheme

    def __str__(self) -> str:
        return f"ec:{self.k}+{self.m}" if self.erasure_coded else f"replicas:{self.replicas}"

    @property
    def erasure_coded(self) -> bool:
        return self.kind == "ec"

    @property
    def group_size(self) -> int:
        """Hosts in one group: R for replicas, K+M for ec (the smallest group; see ``memstore.core.placement``)."""
        return self.k + self.m if self.erasure_coded else self.replicas

    @property
    def survives(self) -> int:
        """Hosts of one group that may be lost at once without losing a step: R-1, or M."""
        return self.m if self.erasure_coded else self.replicas - 1

    @property
    def ram_multiple_per_step(self) -> float:
        """RAM held per byte of state for each kept step: R, or 1 + M/K (shards of equal size)."""
        return 1 + self.m / self.k if self.erasure_coded else float(self.replicas)
