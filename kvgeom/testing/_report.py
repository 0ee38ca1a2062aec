"""What the oracle found: :class:`Violation` records and the :class:`Report` that holds them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["INVARIANTS", "Violation", "Report"]

INVARIANTS = {
    "I1": "neighbour safety: a byte outside the request's destination blocks changed",
    "I2": "pairing: a byte holds another coordinate than the destination layout expects there "
    "(or a descriptor pair of unequal lengths)",
    "I3": "coverage: a coordinate the destination needs was not delivered",
    "I4": "no stale bytes: a byte of the request's destination blocks was neither written nor zeroed",
    "I5": "single writer: a destination byte was written twice with different contents",
    "I6": "bounds: a descriptor, zero range or regroup lies outside its region (or table)",
}


@dataclass(frozen=True)
class Violation:
    """One run of bytes ``[start, stop)`` of ``side`` rank ``rank``, region ``region`` breaking
    ``invariant``; ``expected`` / ``found`` name what the bytes should hold and what they hold (at
    ``start``), ``detail`` says more (e.g. which move)."""

    invariant: str
    side: str
    rank: int
    region: int
    start: int
    stop: int
    expected: str
    found: str
    detail: str = ""

    @property
    def nbytes(self) -> int:
        return self.stop - self.start

    def __str__(self) -> str:
        where = f"{self.side} rank {self.rank} region {self.region} bytes [{self.start}, {self.stop})"
        text = f"{self.invariant} {where}: expected {self.expected}, found {self.found}"
        return f"{text} ({self.detail})" if self.detail else text


@dataclass
class Report:
    """The oracle's verdict on one request. ``violations`` holds at most ``limit`` runs per invariant;
    ``violated_bytes`` counts every offending byte (or descriptor) per invariant."""

    violations: list[Violation] = field(default_factory=list)
    violated_bytes: Counter[str] = field(default_factory=Counter)
    bytes_moved: int = 0
    bytes_zeroed: int = 0
    descriptors: int = 0
    regrouped_blocks: int = 0
    notes: list[str] = field(default_factory=list)
    limit: int = 20

    @property
    def ok(self) -> bool:
        return not self.violated_bytes

    @property
    def invariants(self) -> set[str]:
        """The invariants broken (``{"I2", "I3"}``, ...)."""
        return set(self.violated_bytes)

    def add(self, v: Violation, count: int | None = None) -> None:
        shown = sum(1 for x in self.violations if x.invariant == v.invariant)
        if shown < self.limit:
            self.violations.append(v)
        self.violated_bytes[v.invariant] += v.nbytes if count is None else count

    def of(self, invariant: str) -> list[Violation]:
        return [v for v in self.violations if v.invariant == invariant]

    def __str__(self) -> str:
        head = (
            f"{'OK' if self.ok else 'VIOLATED ' + ', '.join(sorted(self.invariants))}: "
            f"{self.descriptors} descriptor pair(s), {self.bytes_moved} B moved, {self.bytes_zeroed} B zeroed, "
            f"{self.regrouped_blocks} block(s) regrouped"
        )
        lines = [head, *self.notes]
        for inv in sorted(self.invariants):
            lines.append(f"  {inv} ({INVARIANTS[inv]}): {self.violated_bytes[inv]} byte(s)")
            lines.extend(f"    {v}" for v in self.of(inv))
        return "\n".join(lines)
