"""What :class:`~kvgeom_nixl.kvrank.KVRank` keeps and returns: a remote rank's link, one attempt's result, settled quarantine entries, and the bounded stores of notices."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvgeom import GeometryCard

from .agent import Prepped, Telemetry


@dataclass
class PeerLink:
    """A remote rank as this rank sees it: its payload, its agent and our prepared table for it."""

    rank: int
    host: str
    port: int
    agent: str
    generation: int
    card: GeometryCard
    bases: tuple[int, ...]
    device: int
    prepped: Prepped | None = None
    via: str = "sidechannel"  # where its payload came from, and where its freshness is checked


@dataclass
class RequestResult:
    """What one request (attempt) did on this rank."""

    request_id: str
    ok: bool
    descriptors: int = 0
    bytes_moved: int = 0
    bytes_zeroed: int = 0
    nixl_desc_count: int = 0
    runs: int = 0
    seconds: float = 0.0
    transfer_seconds: float = 0.0  # posted -> every transfer observed done (the NIXL part of ``seconds``)
    error: str | None = None
    telemetry: list[Telemetry] = field(default_factory=list)
    attempt: int = 0


@dataclass(frozen=True)
class Settled:
    """Quarantined blocks that nothing can write any more: zeroed again, free to be reused."""

    request_id: str
    attempt: int
    ids: list[list[int]]
    held_s: float
    cleared_by: tuple[str, ...]
    reason: str
    retired: bool = False  # it had passed the quarantine bound (reported) before it cleared


class _Bounded(OrderedDict):
    """An insertion-ordered map that drops its oldest entries beyond ``cap``."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def touch(self, key: Any, default: Any) -> Any:
        if key not in self:
            self[key] = default
            while len(self) > self.cap:
                self.popitem(last=False)
        return self[key]
