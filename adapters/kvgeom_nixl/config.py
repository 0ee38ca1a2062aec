"""Transport configuration: one frozen value, readable from the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

__all__ = ["TransportConfig"]

_ENV_PREFIX = "KVGEOM_NIXL_"


@dataclass(frozen=True)
class TransportConfig:
    """How an :class:`~kvgeom_nixl.agent.Endpoint` drives its NIXL agent.

    All durations are in seconds; every wait in the adapter is bounded by one of them.
    """

    backends: tuple[str, ...] = ("UCX",)
    """NIXL backend plugins to instantiate, in order. UCX moves DRAM and VRAM between processes."""

    progress_thread: bool = False
    """Run NIXL's busy-polling progress thread. Off by default: on a 2-core machine the two
    progress threads (one per process) halve throughput (measured ~3 GB/s on vs ~5 GB/s off for large
    DRAM transfers). With it off, progress is driven by our own polling (``check_xfer_state`` on the
    initiator, ``get_new_notifs`` on the target), so a target must poll for its notifications."""

    telemetry: bool = True
    """Ask NIXL to capture per-transfer telemetry (descriptor count after merging, bytes, durations)."""

    handshake_timeout_s: float = 10.0
    """Deadline for a side-channel exchange (covers a peer that is not up yet: we retry until then)."""

    transfer_timeout_s: float = 30.0
    """Default deadline for one transfer to reach DONE after it was posted."""

    notif_timeout_s: float = 30.0
    """Default deadline for expected notifications to arrive."""

    poll_interval_s: float = 0.0005
    """Sleep between two polls of a transfer state or of the notification queue."""

    close_drain_s: float = 0.1
    """On close, keep driving NIXL/UCX progress this long (split around dropping peers) so that UCX
    finishes its error handling of endpoints to dead peers before the agent is destroyed. Without it,
    destroying an agent shortly after a peer was SIGKILLed aborted the process in ~1 of 8 runs
    (``arbiter.c: Assertion `ucs_arbiter_group_is_empty(group)' failed``); with 0.1 s, 0 of 40."""

    def __post_init__(self) -> None:
        backends = self.backends
        if isinstance(backends, str):
            backends = (backends,)
        backends = tuple(str(b) for b in backends)
        if not backends or any(not b for b in backends):
            raise ValueError(f"backends: need at least one non-empty backend name, got {self.backends!r}")
        object.__setattr__(self, "backends", backends)
        for f in ("handshake_timeout_s", "transfer_timeout_s", "notif_timeout_s"):
            v = float(getattr(self, f))
            if not v > 0:
                raise ValueError(f"{f}: must be > 0, got {v!r}")
            object.__setattr__(self, f, v)
        for f in ("poll_interval_s", "close_drain_s"):
            v = float(getattr(self, f))
            if not v >= 0:
                raise ValueError(f"{f}: must be >= 0, got {v!r}")
            object.__setattr__(self, f, v)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> TransportConfig:
        """Build a config from ``KVGEOM_NIXL_<FIELD>`` variables (e.g. ``KVGEOM_NIXL_BACKENDS=UCX,GDS``,
        ``KVGEOM_NIXL_PROGRESS_THREAD=1``, ``KVGEOM_NIXL_TRANSFER_TIMEOUT_S=5``); keyword overrides win."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(_ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            if f.name == "backends":
                values[f.name] = tuple(b.strip() for b in raw.split(",") if b.strip())
            elif f.name in ("progress_thread", "telemetry"):
                low = raw.strip().lower()
                if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(f"{_ENV_PREFIX + f.name.upper()}: not a boolean: {raw!r}")
                values[f.name] = low in ("1", "true", "yes", "on")
            else:
                try:
                    values[f.name] = float(raw)
                except ValueError:
                    raise ValueError(f"{_ENV_PREFIX + f.name.upper()}: not a number: {raw!r}") from None
        values.update(overrides)
        return cls(**values)
