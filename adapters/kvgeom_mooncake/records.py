"""What a :class:`~kvgeom_mooncake.rank.MooncakeRank` is configured with, keeps and returns: its configuration (the secret), one attempt's result, a quarantined attempt, a remote rank's link, and the canonical JSON its seals cover."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvgeom import GeometryCard, KvgeomError


@dataclass(frozen=True)
class MooncakeConfig:
    """``secret``: the deployment's shared key (payload seals and notices are HMAC-SHA256 under it);
    without one, ``insecure=True`` must say so. Timeouts in seconds."""

    secret: str | bytes | None = None
    insecure: bool = False
    protocol: str = "tcp"
    transfer_timeout_s: float = 10.0
    notif_timeout_s: float = 10.0
    poll_interval_s: float = 0.0005
    merge: bool = True

    def key(self) -> bytes:
        if self.secret is None or self.secret in ("", b""):
            if not self.insecure:
                raise KvgeomError(
                    "secret",
                    "the Mooncake transport authenticates payloads and notices; give a secret "
                    "(or insecure=True for a closed test)",
                    value=None,
                )
            return b"kvgeom-mooncake-insecure"
        return self.secret.encode() if isinstance(self.secret, str) else bytes(self.secret)


@dataclass
class MoonResult:
    """What one attempt did on this rank. ``descriptors``: the plan's descriptor pairs; ``posted``: the
    descriptors handed to Mooncake after merging; ``batches``: one per remote rank."""

    request_id: str
    ok: bool
    attempt: int = 1
    descriptors: int = 0
    posted: int = 0
    batches: int = 0
    bytes_moved: int = 0
    bytes_zeroed: int = 0
    seconds: float = 0.0
    transfer_seconds: float = 0.0


@dataclass
class Held:
    """A failed attempt's blocks, zeroed and kept out of use while a batch of it may still move bytes:
    one of ours still running (``pending``), or, push on D, a writer whose ``W`` notice had not come
    (``writers``: ``(engine, rank)``; its late notice, delivered after its batch's bytes, clears it)."""

    token: tuple[str, int]
    ids: list[list[int]]
    pending: list[Future[int]]  # batches still running
    reason: str
    since: float = field(default_factory=time.monotonic)
    writers: set[tuple[str, int]] = field(default_factory=set)
    cleared_by: list[str] = field(default_factory=list)


@dataclass
class _Link:
    rank: int
    session: str
    bases: tuple[int, ...]
    card: GeometryCard


def _canon(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _result(
    request_id: str, attempt: int, plan: Any, bs: list[Any], zeroed: int, t0: float, moved_s: float
) -> MoonResult:
    """A served request's result: the plan's descriptor pairs, the merged runs posted and the batches that
    carried them, their bytes, what the receive step zeroed, the wall time and the time in batches."""
    return MoonResult(
        request_id,
        True,
        attempt,
        plan.num_descriptors,
        sum(len(b) for b in bs),
        sum(1 for b in bs if len(b)),
        sum(b.nbytes for b in bs),
        zeroed,
        time.monotonic() - t0,
        moved_s,
    )
