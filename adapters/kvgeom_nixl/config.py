"""Transport configuration: one frozen value, readable from the environment."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from kvgeom.errors import ConfigError

__all__ = ["TransportConfig"]

_ENV_PREFIX = "KVGEOM_NIXL_"
_BOOLS = ("progress_thread", "telemetry", "insecure")
_TUPLES = ("backends", "etcd_endpoints")
_STRS = ("secret", "discovery", "etcd_prefix", "net_devices", "kvgeom_post")
DISCOVERY = ("sidechannel", "etcd")
KVGEOM_POST = ("initialize", "prep", "ids")
_INTS = ("max_message_bytes", "max_connections", "max_peer_payloads", "max_pending_notifs")
_PARSED_INTS = _INTS + ("max_pending",)  # read as integers from the environment
MIN_SECRET_BYTES = 16
MAX_PENDING_LIMIT = 1 << 16  # unauthenticated connections held at most (one file descriptor each)
PREAMBLE_TIMEOUT_LIMIT_S = 60.0
#: the float fields, checked in this order: (fields, the rule each value must meet, the rule in words)
_FLOATS: tuple[tuple[tuple[str, ...], Callable[[float], bool], str], ...] = (
    (("etcd_lease_ttl_s",), lambda v: v >= 1, "must be >= 1"),
    (
        ("handshake_timeout_s", "transfer_timeout_s", "notif_timeout_s", "etcd_timeout_s"),
        lambda v: v > 0,
        "must be > 0",
    ),
    (("poll_interval_s", "close_drain_s"), lambda v: v >= 0, "must be >= 0"),
    (
        ("peer_payload_ttl_s", "replay_window_s", "notif_ttl_s", "quarantine_bound_s", "gone_refused_s"),
        lambda v: v > 0,
        "must be > 0",
    ),
)


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

    secret: bytes | None = field(default=None, repr=False)
    """The deployment's shared secret (at least 16 bytes; a ``str`` is taken as UTF-8). Every
    side-channel message, handshake payload and notification carries an HMAC-SHA256 under keys derived
    from it; a peer without it is refused. Read from ``KVGEOM_NIXL_SECRET``. See docs/reliability.md."""

    insecure: bool = False
    """Run without a secret (no authentication at all). Only for a local experiment: anyone who reaches
    the side channel gets the agent metadata, which lets it read and write the registered memory."""

    max_message_bytes: int = 16 << 20
    """Largest side-channel message accepted (a payload with a big model's card and metadata is < 2 MiB)."""

    max_connections: int = 32
    """Authenticated side-channel requests handled at once. Connections that have not authenticated never
    take a handler: the accept thread holds at most ``max_pending`` of them, 132 bytes of buffer each, for
    ``preamble_timeout_s``."""

    max_pending: int = 512
    """Side-channel connections that have not authenticated yet, held at once by the accept thread (each
    costs one file descriptor and at most a 132-byte preamble buffer, ~0.4 KB of RSS measured). When it is
    full, the oldest is dropped for a new one, so a flood of idle connections cannot lock a new peer out;
    it must stay under the process's file-descriptor limit. 1 to 65536."""

    preamble_timeout_s: float = 1.0
    """A side-channel connection whose 132-byte authenticated preamble is not complete this long after
    accept is dropped (a slow drip holds a slot at most this long). A peer sends its preamble at once after
    the server's greeting, so this only needs to cover one round trip on a busy host. Capped by the
    server's I/O deadline (``min(5 s, handshake_timeout_s)``). Above 0, at most 60 s."""

    max_peer_payloads: int = 256
    """Payloads kept from ``exchange`` requests (oldest dropped first)."""

    peer_payload_ttl_s: float = 600.0
    """How long a payload received through ``exchange`` is kept."""

    replay_window_s: float = 60.0
    """Side-channel requests older (or newer) than this by their timestamp are refused, and each nonce
    is accepted once within it. Hosts' clocks must agree to within this window. (A request is also bound to
    the server's incarnation and to its connection's challenge: it is never good for another server, another
    connection, or after a restart.)"""

    notif_ttl_s: float = 120.0
    """Notifications nobody consumed are dropped after this long."""

    max_pending_notifs: int = 65536
    """At most this many unconsumed notifications are kept (oldest dropped first)."""

    net_devices: str = "auto"
    """Which network interfaces UCX may use, and so where its TCP transport listens (``UCX_NET_DEVICES``
    while the agent is created). ``"auto"``: the operator's ``UCX_NET_DEVICES`` if set, else the interface
    holding the address the rank's side channel binds (``lo`` for ``127.0.0.1``; every interface for
    ``0.0.0.0``; loopback only for an :class:`~kvgeom_nixl.agent.Endpoint` made without a host). ``"all"``: UCX's
    default, every usable interface (NIXL 1.5.1 then listens on the external interface too, even in a
    loopback run). Anything else is a UCX device list used as given (``eth0``, ``mlx5_0:1``)."""
    quarantine_bound_s: float = 60.0
    """How long a failed attempt's blocks may stay quarantined before they are **retired**: reported
    (a ``WARNING`` log line naming the request, the ids and the writers it still waits for;
    ``KVRank.retired()``; ``stats["retired"]`` / ``stats["retired_blocks"]``) and kept out of the pool.
    Retiring hands nothing back: no step is known on NIXL/UCX that stops a live writer's late bytes
    (docs/reliability.md), so a retired entry is returned by ``settle()`` only on the same positive
    evidence as any other (the writer's notice, the transfer's end, the writer's death)."""

    gone_refused_s: float = 1.0
    """How long a silent writer's side channel must keep *refusing* connections before the writer counts
    as gone (its blocks then leave the quarantine): every probe over at least this long, at least 3 of
    them, refused (``ECONNREFUSED``), with no other outcome in between and no kept-open session to it
    answering. One refusal is no evidence: a live but flooded server's port was measured to refuse some
    fresh connections (docs/reliability.md). A killed process refuses every connect at once, so its
    blocks come back about this long after its death. Above 0."""

    discovery: str = "sidechannel"
    """How a rank finds its peers' handshake payloads: ``"sidechannel"`` (ask each peer rank's side channel,
    whose addresses the caller gives) or ``"etcd"`` (every rank publishes its sealed, encrypted payload in
    etcd under ``etcd_prefix``; peers are found by engine id). See docs/deployment.md."""

    etcd_endpoints: tuple[str, ...] = ()
    """etcd members' client URLs (``http://host:2379``), for ``discovery="etcd"``."""

    etcd_prefix: str = "/kvgeom"
    """The deployment's key prefix in etcd: ranks register under ``<prefix>/engines/<engine id>/<rank>``."""

    etcd_timeout_s: float = 2.0
    """Deadline of one etcd request (every member tried). Past it, the per-request freshness check asks the
    peer's side channel instead; a handshake through etcd fails at its own deadline."""

    etcd_lease_ttl_s: float = 10.0
    """TTL of a rank's etcd lease (refreshed every third of it): a dead rank's record disappears after it."""

    kvgeom_post: str = "initialize"
    """How a kvgeom-mode request is posted (vLLM-compatible mode always posts vLLM's descriptor ids into the
    handshake's prepared tables). ``"initialize"``: one descriptor per maximal run contiguous on both sides,
    as per-request lists through NIXL's ``initialize_xfer`` (measured fastest, ``bench/bench_descs.py``);
    ``"prep"``: the same runs as per-request prepared lists (``prep_xfer_dlist`` + ``make_prepped_xfer``);
    ``"ids"``: the plan's descriptor ids into the prepared tables, one per plan pair (NIXL merges only
    neighbours in the list)."""

    def __post_init__(self) -> None:
        self._normalize_backends()
        if self.kvgeom_post not in KVGEOM_POST:
            raise ValueError(f"kvgeom_post: expected one of {KVGEOM_POST}, got {self.kvgeom_post!r}")
        if self.discovery not in DISCOVERY:
            raise ValueError(f"discovery: expected one of {DISCOVERY}, got {self.discovery!r}")
        self._normalize_etcd()
        if not isinstance(self.net_devices, str) or not self.net_devices.strip():
            raise ValueError(
                f"net_devices: expected 'auto', 'all' or a UCX device list, got {self.net_devices!r}"
            )
        object.__setattr__(self, "net_devices", self.net_devices.strip())
        for names, ok, what in _FLOATS:
            for f in names:
                v = float(getattr(self, f))
                if not ok(v):
                    raise ValueError(f"{f}: {what}, got {v!r}")
                object.__setattr__(self, f, v)
        for f in _INTS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}: must be an integer >= 1, got {v!r}")
        self._check_side_channel_bounds()
        self._normalize_secret()
        object.__setattr__(self, "insecure", bool(self.insecure))

    def _normalize_backends(self) -> None:
        backends = self.backends
        if isinstance(backends, str):
            backends = (backends,)
        backends = tuple(str(b) for b in backends)
        if not backends or any(not b for b in backends):
            raise ValueError(f"backends: need at least one non-empty backend name, got {self.backends!r}")
        object.__setattr__(self, "backends", backends)

    def _normalize_etcd(self) -> None:
        """``etcd_endpoints`` (a comma-separated string too) and ``etcd_prefix``."""
        eps = self.etcd_endpoints
        if isinstance(eps, str):
            eps = tuple(e.strip() for e in eps.split(",") if e.strip())
        eps = tuple(str(e) for e in eps)
        object.__setattr__(self, "etcd_endpoints", eps)
        if self.discovery == "etcd" and not eps:
            raise ValueError("etcd_endpoints: discovery='etcd' needs at least one endpoint, got none")
        if (
            not isinstance(self.etcd_prefix, str)
            or not self.etcd_prefix.startswith("/")
            or len(self.etcd_prefix) > 256
        ):
            raise ValueError(
                f"etcd_prefix: expected a key prefix starting with '/', got {self.etcd_prefix!r}"
            )

    def _normalize_secret(self) -> None:
        secret = self.secret
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None:
            if not isinstance(secret, (bytes, bytearray)):
                raise ValueError(f"secret: must be bytes or str, got {type(secret).__name__}")
            if len(secret) < MIN_SECRET_BYTES:
                raise ValueError(f"secret: must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
            secret = bytes(secret)
        object.__setattr__(self, "secret", secret)

    def _check_side_channel_bounds(self) -> None:
        """``max_pending`` and ``preamble_timeout_s``: a :class:`~kvgeom.errors.ConfigError` naming the
        field, the value given and the range allowed."""
        v = self.max_pending
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_PENDING_LIMIT:
            raise ConfigError(
                "max_pending",
                f"expected an integer in [1, {MAX_PENDING_LIMIT}], got {v!r}",
                value=v,
                expected=(1, MAX_PENDING_LIMIT),
            )
        t = self.preamble_timeout_s
        ok = isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= PREAMBLE_TIMEOUT_LIMIT_S
        if not ok:
            raise ConfigError(
                "preamble_timeout_s",
                f"expected seconds in (0, {PREAMBLE_TIMEOUT_LIMIT_S:g}], got {t!r}",
                value=t,
                expected=(0.0, PREAMBLE_TIMEOUT_LIMIT_S),
            )
        object.__setattr__(self, "preamble_timeout_s", float(t))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> TransportConfig:
        """Build a config from ``KVGEOM_NIXL_<FIELD>`` variables (e.g. ``KVGEOM_NIXL_BACKENDS=UCX,GDS``,
        ``KVGEOM_NIXL_PROGRESS_THREAD=1``, ``KVGEOM_NIXL_TRANSFER_TIMEOUT_S=5``, ``KVGEOM_NIXL_SECRET=...``,
        ``KVGEOM_NIXL_DISCOVERY=etcd``, ``KVGEOM_NIXL_ETCD_ENDPOINTS=http://10.0.0.5:2379``); keyword
        overrides win."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(_ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            if f.name in _TUPLES:
                values[f.name] = tuple(b.strip() for b in raw.split(",") if b.strip())
            elif f.name in _STRS:
                values[f.name] = raw
            elif f.name in _BOOLS:
                low = raw.strip().lower()
                if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(f"{_ENV_PREFIX + f.name.upper()}: not a boolean: {raw!r}")
                values[f.name] = low in ("1", "true", "yes", "on")
            else:
                try:
                    values[f.name] = int(raw) if f.name in _PARSED_INTS else float(raw)
                except ValueError:
                    raise ValueError(f"{_ENV_PREFIX + f.name.upper()}: not a number: {raw!r}") from None
        values.update(overrides)
        return cls(**values)
