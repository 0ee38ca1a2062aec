"""One engine rank's KV cache on NIXL: kvgeom plans turned into registered tensors, prepared dlists and
READ/WRITE transfers, authenticated and fenced.

``KVRank(card, config)`` allocates the rank's regions as torch tensors laid out as its
:class:`RankGeometry` says (one tensor per region: hybrid regions are shared by one layer of every group),
registers them (DRAM for CPU tensors, VRAM for CUDA), serves its sealed handshake payload on the
authenticated side channel, and then:

* ``connect(engine_id, ports)`` — fetches the peer ranks' payloads within the handshake bound, checks
  every field, the seal, the card (limits, then kvgeom's rules), the card's regions against what the
  peer's NIXL metadata registers, and the pair; any failure is a typed error and leaves nothing behind;
* ``pull(...)`` (D) / ``push(...)`` (P) — plans a request, checks that every write lands in the
  request's own blocks, checks the peers' metadata generation, posts one transfer per source rank and
  waits, bounded. Each call is one *attempt* of the request (``(request id, attempt)`` is its token,
  carried by every notification); a failed attempt's blocks are zeroed and *quarantined*
  (:mod:`~kvgeom_nixl.fence`) until nothing can write them any more: :meth:`KVRank.settle` returns them
  (a writer is gone only on positive evidence: NIXL's disconnect or a refused side channel; past
  ``quarantine_bound_s`` an attempt is retired and reported, :meth:`KVRank.retired`), and the calls that
  take ids refuse quarantined ones (:class:`~kvgeom_nixl.errors.QuarantinedBlockError`);
* ``wait_received(...)`` (D in push) — waits for the authenticated ``W`` notice of exactly this attempt
  from every producer rank that writes to it; ``wait_released(...)`` (P in pull) — for the consumers'
  ``D`` (done) notices.

Notifications are decoded and checked here (:func:`~kvgeom_nixl.auth.decode_notice`): one without a
valid tag for its claimed sender and for us is dropped and counted (``stats["rejected_notices"]``).
"""

from __future__ import annotations

import ctypes
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvgeom import (
    GeometryCard,
    KvgeomError,
    Pairing,
    RequestPlan,
    check_pair,
    plan_request,
)
from kvgeom.errors import PlanError
from kvgeom.layout.card import DEFAULT_LIMITS, CardLimits
from kvgeom.layout.runs import addressed, merge_runs
from kvgeom.plan.blockrows import block_rows, zero_runs
from kvgeom.plan.pairing import push_writers
from kvgeom.plan.receive import receive_step
from kvgeom.plan.requestplan import Regroup, check_writes, contiguous_runs

from .agent import Endpoint, Prepped, Telemetry, Transfer
from .auth import Auth, Notice, decode_notice, encode_notice
from .config import TransportConfig
from .discovery import Directory, EtcdClient, Registration, engine_key, seal_record
from .errors import (
    AdapterError,
    DiscoveryError,
    HandshakeTimeout,
    NotifTimeout,
    PeerGone,
    PeerUnknown,
    ProtocolError,
    QuarantinedBlockError,
    TransferError,
)
from .fence import Fence, Held, Token
from .sidechannel import Session, SideChannelServer, check_generation, fetch, make_payload

__all__ = [
    "KVRank",
    "PeerLink",
    "RequestResult",
    "Settled",
    "allocate",
    "apply_post_receive",
    "block_rows",
    "merge_runs",
    "request_block_rows",
    "zero_runs",
]

_PROBE_EVERY_S = 0.5  # how often a silent writer's side channel is asked whether its process is alive
_REPROBE_S = 0.1  # how often while its side channel refuses (a streak that must last gone_refused_s)
_GONE_REFUSALS = 3  # at least this many refusals in a row, over at least gone_refused_s
_SESSION_FRESH_S = 20.0  # a writer's session unused this long is renewed when an attempt starts waiting
_GONE_DRAIN_S = 0.2  # progress driven after a writer's death, so that bytes already received are applied
_ETCD_RETRY_S = 5.0  # after etcd failed a freshness check, peers' side channels are asked for this long
MAX_REQUEST_ID = 1024  # a notice carries the request id and must fit MAX_NOTICE_BYTES
log = logging.getLogger(__name__)


def allocate(card: GeometryCard, device: str = "cpu") -> list[Any]:
    """One zeroed uint8 tensor per region of the card's geometry (``region.nbytes`` each)."""
    import torch

    return [torch.zeros(r.nbytes, dtype=torch.uint8, device=device) for r in card.geometry.regions]


_MAX_CHUNKS_PER_RUN = 4
"""Short runs split into more chunks than this each are zeroed one ``memset`` each (measured: numpy's indexed
write costs about as much per chunk as a call costs per run once a run is a few chunks)."""
_VEC_MIN_RUNS = 64
"""A region's short runs are zeroed together (:func:`_zero_short`) from this many on; fewer, one call each
(the indexed write's fixed cost, tens of microseconds, is that of a few dozen calls)."""
_FEW_ROWS = 64
"""Up to this many rows are zeroed as given, one call each (:func:`_zero_few`), without merging."""
_LOOP_MIN_BYTES = 16384
"""Runs at least this long are zeroed one call each (a memset); shorter ones together, by one indexed write.
Measured on CPU tensors (``bench/bench_zero.py``): a per-run call costs about a microsecond of Python, which a
16 KiB memset hides; below that one indexed write over all the short runs is faster."""


def _host(t: Any) -> bool:
    """Whether ``t``'s bytes are host memory this process may write directly (libc, numpy); the other
    devices' tensors are zeroed by torch alone (tests force that path on CPU tensors through this)."""
    return bool(t.is_cpu)


def _chunks(start: np.ndarray, end: np.ndarray, nbytes: int) -> tuple[int, np.ndarray]:
    """The runs as ``g``-byte chunks: ``g`` the largest size dividing every start, every length and the
    region, and the chunk indices (a ``[-1, g]`` view's rows) in run order."""
    g = int(np.gcd.reduce(np.concatenate([start, end - start, [nbytes]])))
    per = (end - start) // g
    first = start // g
    if (per == 1).all():
        return g, first
    at = np.repeat(np.cumsum(per) - per, per)
    return g, np.repeat(first, per) + (np.arange(int(per.sum())) - at)


def _zero_short(t: Any, start: np.ndarray, end: np.ndarray) -> None:
    """Zero ``[start, end)`` runs of one flat uint8 tensor by one indexed write of a ``[-1, g]`` view
    (:func:`_chunks`): numpy's on CPU tensors (in 8-byte words where aligned), ``index_fill_`` on others.
    On a contiguous CPU tensor whose runs would need more than ``_MAX_CHUNKS_PER_RUN`` chunks each (their
    starts share little alignment), one ``memset`` per run instead."""
    import torch

    g, idx = _chunks(start, end, t.numel())
    cpu = _host(t)
    if cpu and idx.size > _MAX_CHUNKS_PER_RUN * start.size and t.is_contiguous():
        p, memset = t.data_ptr(), ctypes.memset
        for s, e in zip(start.tolist(), end.tolist()):
            memset(p + s, 0, e - s)
        return
    if cpu:
        rows2d = t.view(-1, g).numpy()  # a view: writes land in the tensor
        if g % 8 == 0 and rows2d.ctypes.data % 8 == 0 and rows2d.strides[1] == 1:
            rows2d = rows2d.view(np.uint64)  # 8-byte words: numpy's row copy runs 8x fewer elements
        rows2d[idx] = 0
    else:
        t.view(-1, g).index_fill_(0, torch.from_numpy(idx).to(t.device), 0)


def _zero_few(tensors: Sequence[Any], rows: list[list[int]]) -> int:
    """:func:`_zero_rows` for a few rows: each checked, then zeroed by one call, in plain Python (numpy's
    per-call cost would be most of the time)."""
    where: dict[int, tuple[int, int]] = {}
    for r, o, n in rows:
        if not 0 <= r < len(tensors):
            raise PlanError("zero", f"rows name region {r}; there are {len(tensors)}")
        if r not in where:
            t = tensors[r]
            where[r] = (t.data_ptr() if _host(t) and t.is_contiguous() else 0, t.numel())
        if o < 0 or n < 0 or o + n > where[r][1]:
            raise PlanError("zero", f"row {[r, o, n]} lies outside its region ({where[r][1]} B)")
    memset = ctypes.memset
    total = 0
    for r, o, n in rows:
        if n:
            p = where[r][0]
            if p:
                memset(p + o, 0, n)
            else:
                tensors[r][o : o + n].zero_()
            total += n
    return total


def _zero_rows(tensors: Sequence[Any], rows: np.ndarray) -> int:
    """Zero ``(region, offset, length)`` rows of one flat uint8 tensor per region; returns the rows' byte
    total. Up to ``_FEW_ROWS`` rows are zeroed as given (:func:`_zero_few`). More are merged first into the
    fewest disjoint runs (:func:`zero_runs`: a request's blocks that lie side by side are one run); a
    region's short runs (under ``_LOOP_MIN_BYTES``), when it has at least ``_VEC_MIN_RUNS`` of them, are
    zeroed together (:func:`_zero_short`), every other run by one call (libc's ``memset`` on contiguous CPU
    tensors, ``zero_()`` of a slice on others). Rows outside their region raise
    :class:`~kvgeom.errors.PlanError` before any byte is written."""
    rows = np.asarray(rows, dtype=np.int64)
    if 0 < len(rows) <= _FEW_ROWS and rows.ndim == 2 and rows.shape[1] == 3:
        return _zero_few(tensors, rows.tolist())
    sizes = [t.numel() for t in tensors]
    region, start, end, total = zero_runs(rows, sizes)
    if not region.size:
        return 0
    if (start < 0).any() or (end > np.asarray(sizes, dtype=np.int64)[region]).any():  # libc writes unchecked
        raise AssertionError("zero runs left their regions")
    short = end - start < _LOOP_MIN_BYTES
    many = np.flatnonzero(np.bincount(region[short], minlength=len(tensors)) >= _VEC_MIN_RUNS)
    together = short & np.isin(region, many) if many.size else np.zeros(region.size, dtype=bool)
    one = ~together
    region1, start1, end1 = region[one], start[one], end[one]
    ptr = np.zeros(len(tensors), dtype=np.int64)  # 0: not a contiguous CPU tensor, zeroed by torch
    for r in np.unique(region1).tolist():
        t = tensors[r]
        if _host(t) and t.is_contiguous():
            ptr[r] = t.data_ptr()
    addr = ptr[region1]
    direct = addr != 0
    memset = ctypes.memset
    for a, n in zip((addr[direct] + start1[direct]).tolist(), (end1 - start1)[direct].tolist()):
        memset(a, 0, n)
    if not direct.all():
        for r, s, e in zip(region1[~direct].tolist(), start1[~direct].tolist(), end1[~direct].tolist()):
            tensors[r][s:e].zero_()
    for r in many.tolist():
        m = together & (region == r)
        _zero_short(tensors[r], start[m], end[m])
    return total


_REGROUP_ORDER = {"head_major": (0, 2, 1, 3, 4), "token_major": (0, 1, 3, 2, 4)}
"""Axes of a block viewed as ``[block, bsr, heads, n, head_bytes]`` in the order each target layout stores."""


def _regroup(tensors: Sequence[Any], card: GeometryCard, step: Regroup) -> None:
    """``[bsr, heads, tokens/bsr, head_bytes] -> [heads, tokens, head_bytes]`` per listed block (a
    token-major ``step.layout``: ``-> [tokens, heads, head_bytes]``)."""
    import torch

    geom = card.geometry
    blocks = torch.from_numpy(np.asarray(step.blocks, dtype=np.int64))
    n = step.tokens // step.bsr
    for region in step.regions:
        r = geom.regions[region]
        view = tensors[region].view(r.num_blocks, r.block_stride)
        page = view[blocks.to(view.device), : r.block_len]
        page = (
            page.view(-1, step.bsr, step.heads, n, step.head_bytes)
            .permute(*_REGROUP_ORDER[step.layout.value])
            .reshape(len(blocks), -1)
        )
        view[blocks.to(view.device), : r.block_len] = page


def apply_post_receive(
    tensors: Sequence[Any], card: GeometryCard, regroups: Sequence[Regroup], zero: np.ndarray
) -> int:
    """The consumer's post-receive step on its tensors: regroups, then zero ranges. Returns bytes zeroed."""
    for step in regroups:
        _regroup(tensors, card, step)
    return _zero_rows(tensors, zero)


def request_block_rows(card: GeometryCard, ids: Sequence[Sequence[int]]) -> np.ndarray:
    """``(region, offset, length)`` rows covering every block of a request on this rank (all regions,
    whole pages): what a failed request zeroes so that no stale or partial bytes are ever read."""
    return block_rows(card.geometry, ids)


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


def _all_arrived(
    got: Mapping[tuple[str, int], tuple[str, float]],
    writers: set[tuple[str, int]],
    end: float,
    request_id: str,
    attempt: int,
) -> bool:
    """Whether every writer's ``W`` notice of the attempt arrived; an ``A`` from one of them
    (``TransferError``, ``ABORTED``) or the deadline passed (:class:`NotifTimeout`) raise."""
    aborted = sorted(w for w, (kind, _) in got.items() if kind == "A" and w in writers)
    if aborted:
        raise TransferError(
            f"producer rank(s) {aborted} abandoned attempt {attempt} of {request_id!r}",
            stage="notif",
            status="ABORTED",
        )
    if all(w in got for w in writers):
        return True
    if time.monotonic() >= end:
        raise NotifTimeout(
            f"{sum(w in got for w in writers)} of {len(writers)} producer rank(s) "
            f"completed attempt {attempt} of {request_id!r} before the deadline",
            stage="notif",
            status="TIMEOUT",
        )
    return False


class KVRank:
    """One engine rank with its KV cache registered on a NIXL agent (see the module docstring)."""

    def __init__(
        self,
        card: GeometryCard,
        config: TransportConfig | None = None,
        device: str = "cpu",
        host: str = "127.0.0.1",
        card_limits: CardLimits = DEFAULT_LIMITS,
    ) -> None:
        self.card = card
        self.config = config or TransportConfig()
        self.auth = Auth.from_config(self.config)  # no secret and not insecure: refused here
        self.card_limits = card_limits
        self.host = host
        # this process's registrations (with ``started``, orders records); its side channel announces it
        # in every greeting, so a peer that sees another incarnation on this port knows we are gone
        self.incarnation = secrets.token_hex(16)
        self.started = time.time()
        self._gen_base = 0  # generations of earlier agents of this rank (rebind): the payload's only grows
        self.tensors = allocate(card, device)
        self.registration: Registration | None = None
        self.directory: Directory | None = None
        self.server: SideChannelServer | None = None
        # (host, port) -> a kept-open session for the freshness check (no new connection per transfer)
        self._sessions: dict[tuple[str, int], Session] = {}
        self.ep = self._new_endpoint()
        try:
            self.regions = self.ep.register_tensors(self.tensors)
            self.mem_type = self.regions[0].mem_type
            self.server = self._new_server(host)
            if self.config.discovery == "etcd":
                self._join_etcd()
        except BaseException:
            self._close_parts()
            raise
        self._init_state()

    def _join_etcd(self) -> None:
        """The etcd directory (peers' records) and this rank's own registration, published."""
        cfg = self.config
        self.directory = Directory(
            EtcdClient(cfg.etcd_endpoints, cfg.etcd_timeout_s, cfg.max_message_bytes),
            cfg.etcd_prefix,
            self.auth,
            cfg.max_message_bytes,
        )
        self.registration = Registration(
            EtcdClient(cfg.etcd_endpoints, cfg.etcd_timeout_s, cfg.max_message_bytes),
            engine_key(cfg.etcd_prefix, self.card.engine_id, self.rank),
            cfg.etcd_lease_ttl_s,
        )
        self._publish(wait_s=cfg.etcd_timeout_s)  # etcd down: the registration thread retries

    def _init_state(self) -> None:
        """The links, the fence, the counters and the bounded notice stores of a rank that started."""
        self.pairings: dict[str, Pairing] = {}
        self.links: dict[str, dict[int, PeerLink]] = {}
        self._local: dict[tuple[str, tuple[int, int]], Prepped] = {}
        self.rejected: dict[str, str] = {}
        self.fence = Fence()
        self.stats = {
            "rejected_notices": 0,
            "late_notices": 0,
            "stale_notices": 0,
            "impersonations": 0,
            "notice_send_errors": 0,
            "etcd_fallbacks": 0,
            "probes_unknown": 0,  # a writer's side channel did not answer: no evidence, kept holding
            "probes_new_incarnation": 0,  # another process answered on a writer's port: it is gone
            "probes_refused": 0,  # a writer's side channel refused: gone only if it lasts gone_refused_s
            "retired": 0,  # attempts whose blocks passed quarantine_bound_s (ever)
            "retired_blocks": 0,  # blocks retired now (out of the pool until positive evidence)
        }
        self._etcd_down_until = 0.0
        cap = self.config.max_pending_notifs
        self._arrived: _Bounded = _Bounded(cap)  # token -> {writer: (kind, time)}
        self._released: _Bounded = _Bounded(cap)  # request id -> {consumer: time}
        self._attempts: _Bounded = _Bounded(cap)  # request id -> last attempt on this rank
        self._watch: dict[tuple[str, int], tuple[str, int]] = {}  # (engine, rank) -> side channel
        # (engine, rank) -> the incarnation its process announced (sealed payload, or the first answer)
        self._incarnations: dict[tuple[str, int], bytes] = {}
        self._agents: dict[
            tuple[str, int], str
        ] = {}  # (engine, rank) -> agent name, from authenticated payloads
        self._probed: dict[tuple[str, int], float] = {}
        # (engine, rank) -> (first refusal of the current streak, refusals in it): every probe refused
        self._refusing: dict[tuple[str, int], tuple[float, int]] = {}
        self._watched: dict[str, dict[int, dict[str, Any]]] = {}  # engine -> rank -> payload (etcd ``watch``)
        self._aborts: list[tuple[Transfer, Token]] = []  # our fenced WRITEs: an A notice if one ends in error
        self._swept = 0.0

    # -- identity --------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.card.engine.tp_rank

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def generation(self) -> int:
        """What peers check before each transfer: grows with every re-registration and every rebind."""
        return self._gen_base + self.ep.generation

    def payload(self) -> dict[str, Any]:
        """The handshake payload (served by the side channel, published in etcd): identity, NIXL metadata,
        card, region bases, generation, and where the side channel listens."""
        port = self.server.port if self.server is not None else 0
        return make_payload(
            engine_id=self.card.engine_id,
            rank=self.rank,
            agent_name=self.ep.name,
            agent_metadata=self.ep.metadata(),
            card=self.card.to_json(),
            regions=[(r.addr, r.nbytes, r.device_id) for r in self.regions],
            device_id=self.regions[0].device_id,
            generation=self.generation,
            sidechannel=[self.host, port],
            incarnation=self.incarnation,
            started=self.started,
        )

    def _new_endpoint(self) -> Endpoint:
        # a random suffix: two processes never share an agent name, so one cannot evict the other's handles
        return Endpoint(
            f"{self.card.engine_id}-{self.card.engine.tp_rank}-{secrets.token_hex(4)}", self.config, self.host
        )

    def _new_server(self, host: str) -> SideChannelServer:
        cfg = self.config
        server = SideChannelServer(
            host,
            0,
            None,
            auth=self.auth,
            io_timeout_s=min(5.0, cfg.handshake_timeout_s),
            max_connections=cfg.max_connections,
            max_message_bytes=cfg.max_message_bytes,
            max_peers=cfg.max_peer_payloads,
            peer_ttl_s=cfg.peer_payload_ttl_s,
            replay_window_s=cfg.replay_window_s,
            max_pending=cfg.max_pending,
            preamble_timeout_s=cfg.preamble_timeout_s,
            incarnation=bytes.fromhex(self.incarnation),
        )
        self.server = server
        server.update(self.payload())  # knows its own port now
        return server.start()

    def _publish(self, wait_s: float = 0.0) -> bool:
        """Serve the current payload on the side channel and (etcd) publish it; returns whether etcd has it
        (``True`` without etcd)."""
        payload = self.payload()
        self.server.update(payload)
        if self.registration is None:
            return True
        value = seal_record(payload, self.auth, self.registration.key, self.config.max_message_bytes)
        return self.registration.publish(value, wait_s)

    # -- handshake -------------------------------------------------------------------------------------
    def connect(
        self,
        engine_id: str,
        ports: Mapping[int, Any] | None = None,
        mode: str = "pull",
        compat: str = "kvgeom",
        timeout_s: float | None = None,
    ) -> Pairing:
        """Handshake with every rank of a remote engine this rank talks to; validate; prepare tables.

        ``ports`` maps each rank of the engine to its side channel: a port on our own ``host``, or a
        ``(host, port)`` pair. Without ``ports`` (``discovery="etcd"``) every rank's payload is read from
        etcd (waiting, within the deadline, until all ranks of the engine are registered).

        Everything a peer sends is checked before use, within ``timeout_s`` (default
        ``handshake_timeout_s``) as a whole: payload fields, the seal, the card (limits first, then its
        own consistency, then the pair's rules), the card's region sizes against the advertised regions
        and those against the peer's NIXL registrations. A refusal is a typed error (an
        :class:`AdapterError`, or a :class:`KvgeomError` for a card or pair kvgeom refuses); nothing of
        the failed handshake is kept. Connecting again to a connected engine replaces its links and
        releases the old handles."""
        timeout = timeout_s if timeout_s is not None else self.config.handshake_timeout_s
        deadline = time.monotonic() + timeout
        try:
            return self._connect(
                engine_id, None if ports is None else dict(ports), mode, compat, deadline, timeout
            )
        except (AdapterError, KvgeomError):
            raise
        except Exception as exc:  # anything else a hostile payload provokes is still a typed refusal
            raise ProtocolError(
                f"handshake with {engine_id} refused: {type(exc).__name__}: {str(exc)[:200]}",
                stage="handshake",
                peer=engine_id,
            ) from exc

    def _left(self, deadline: float, timeout: float, what: str, engine_id: str) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeTimeout(
                f"handshake with {engine_id} did not finish within {timeout:.3g}s ({what})",
                stage="handshake",
                peer=engine_id,
            )
        return left

    def _addr(self, value: Any) -> tuple[str, int]:
        if isinstance(value, int) and not isinstance(value, bool):
            return self.host, value
        host, port = value
        return str(host), int(port)

    def _connect(
        self,
        engine_id: str,
        ports: dict[int, Any] | None,
        mode: str,
        compat: str,
        deadline: float,
        timeout: float,
    ) -> Pairing:
        payloads, addrs, via = self._fetch_payloads(engine_id, ports, deadline, timeout)
        cards = {}
        for r, p in payloads.items():
            cards[r] = self._peer_card(engine_id, r, p, addrs[r])
            self._left(deadline, timeout, "checking cards", engine_id)
        try:
            pairing = Pairing.create(self.card, cards, mode=mode, compat=compat)
        except KvgeomError as exc:
            self.rejected[engine_id] = str(exc)
            raise
        self._drop_engine(engine_id)
        links = self._link_ranks(engine_id, pairing, payloads, addrs, cards, via, (deadline, timeout))
        for r, link in links.items():
            self._agents[(engine_id, r)] = link.agent
            self._watch[(engine_id, r)] = (link.host, link.port)
            self._know_incarnation((engine_id, r), payloads[r])
        self.pairings[engine_id], self.links[engine_id] = pairing, links
        self.rejected.pop(engine_id, None)
        return pairing

    def _fetch_payloads(
        self, engine_id: str, ports: dict[int, Any] | None, deadline: float, timeout: float
    ) -> tuple[dict[int, dict[str, Any]], dict[int, tuple[str, int]], str]:
        """Every rank's payload, its side channel's address, and where they came from (etcd without
        ``ports``, else each rank's side channel), within the deadline."""
        payloads: dict[int, dict[str, Any]] = {}
        if ports is None:
            if self.directory is None:
                raise ValueError(
                    f"connect({engine_id!r}): no side-channel ports given and discovery is "
                    f"{self.config.discovery!r}, not 'etcd'"
                )
            self._left(deadline, timeout, "reading etcd", engine_id)
            payloads = self.directory.engine(engine_id, deadline)
            addrs = {r: (p["sidechannel"][0], p["sidechannel"][1]) for r, p in payloads.items()}
            return payloads, addrs, "etcd"
        addrs = {int(r): self._addr(v) for r, v in ports.items()}
        for r, (host, port) in addrs.items():
            left = self._left(deadline, timeout, f"fetching rank {r}", engine_id)
            payloads[r] = fetch(
                host,
                port,
                self.payload(),
                timeout_s=left,
                auth=self.auth,
                max_bytes=self.config.max_message_bytes,
            )
        return payloads, addrs, "sidechannel"

    def _peer_card(self, engine_id: str, r: int, p: Mapping[str, Any], addr: tuple[str, int]) -> GeometryCard:
        """Rank ``r``'s card from its payload, checked: the identity it answers as, the card (limits and
        consistency), the card's identity and regions, and an agent name no other rank of ours uses."""
        where = f"{engine_id} rank {r} ({addr[0]}:{addr[1]})"
        if p["engine_id"] != engine_id or p["rank"] != r:
            raise ProtocolError(
                f"{where} answered as engine {p['engine_id']!r} rank {p['rank']}",
                stage="handshake",
                peer=where,
            )
        try:
            card = GeometryCard.from_json(p["card"], self.card_limits)
        except KvgeomError as exc:
            self.rejected[engine_id] = str(exc)
            raise
        if card.engine_id != engine_id or card.engine.tp_rank != r:
            raise ProtocolError(
                f"{where} sent the card of engine {card.engine_id!r} rank {card.engine.tp_rank}",
                stage="handshake",
                peer=where,
            )
        self._check_regions(card, p["regions"], where)
        owner = next(
            (k for k, a in self._agents.items() if a == p["agent_name"] and k != (engine_id, r)), None
        )
        if owner is not None:
            raise ProtocolError(
                f"{where} uses agent name {p['agent_name']!r}, which belongs to engine "
                f"{owner[0]!r} rank {owner[1]}",
                stage="handshake",
                peer=where,
            )
        return card

    def _link_ranks(
        self,
        engine_id: str,
        pairing: Pairing,
        payloads: Mapping[int, Mapping[str, Any]],
        addrs: Mapping[int, tuple[str, int]],
        cards: Mapping[int, GeometryCard],
        via: str,
        bound: tuple[float, float],
    ) -> dict[int, PeerLink]:
        """A link (its agent added, its regions checked against its NIXL metadata, its table prepared) to
        every rank the pairing reads or writes; on any failure, everything added here is released."""
        links: dict[int, PeerLink] = {}
        added: list[str] = []
        try:
            for r in pairing.targets:
                p = payloads[r]
                agent = p["agent_name"]
                if agent not in self.ep.peers:
                    added.append(agent)
                self.ep.add_peer(agent, p["agent_metadata"])
                link = PeerLink(
                    r,
                    addrs[r][0],
                    addrs[r][1],
                    agent,
                    p["generation"],
                    cards[r],
                    tuple(x[0] for x in p["regions"]),
                    p["device_id"],
                    via=via,
                )
                self._check_registered(link, p["regions"], f"{engine_id} rank {r}")
                link.prepped = self.ep.prep_remote(
                    agent, pairing.remote_table(r).bind_strided(link.bases, link.device), self.mem_type
                )
                links[r] = link
                self._left(*bound, "preparing tables", engine_id)
        except BaseException:
            for link in links.values():
                if link.prepped is not None:
                    link.prepped.release()
            for agent in added:
                try:
                    self.ep.remove_peer(agent)
                except AdapterError:
                    pass
            raise
        return links

    def _check_regions(self, card: GeometryCard, regions: list[list[int]], where: str) -> None:
        """The card's regions (count, sizes) are the advertised ones, and no two overlap."""
        want = [r.nbytes for r in card.geometry.regions]
        if len(regions) != len(want):
            raise ProtocolError(
                f"{where} advertises {len(regions)} regions, its card has {len(want)}",
                stage="handshake",
                peer=where,
            )
        for i, (n_card, (_, n_adv, _)) in enumerate(zip(want, regions)):
            if n_adv != n_card:
                raise ProtocolError(
                    f"{where} region {i}: advertised {n_adv} bytes, its card implies {n_card}",
                    stage="handshake",
                    peer=where,
                )
        spans = sorted((a, a + n, i) for i, (a, n, _) in enumerate(regions))
        for (a0, e0, i0), (a1, _, i1) in zip(spans, spans[1:]):
            if a1 < e0:
                raise ProtocolError(
                    f"{where} regions {i0} and {i1} overlap ([{a0:#x}, {e0:#x}) and {a1:#x})",
                    stage="handshake",
                    peer=where,
                )

    def _check_registered(self, link: PeerLink, regions: list[list[int]], where: str) -> None:
        """Every advertised region lies inside what the peer's NIXL metadata registers (prep checks it)."""
        descs = np.asarray(regions, dtype=np.uint64).reshape(-1, 3)
        try:
            probe = self.ep.prep_remote(link.agent, descs, self.mem_type)
        except TransferError as exc:
            raise ProtocolError(
                f"{where}: its card's regions are not all registered in its NIXL metadata ({exc.status})",
                stage="handshake",
                peer=where,
            ) from exc
        probe.release()

    def _drop_engine(self, engine_id: str) -> None:
        """Release what a previous connection to ``engine_id`` prepared (reconnecting must not leak)."""
        for link in self.links.pop(engine_id, {}).values():
            if link.prepped is not None and not any(x.live for x in self.ep.live_transfers(link.agent)):
                link.prepped.release()
            session = self._sessions.pop((link.host, link.port), None)
            if session is not None:
                session.close()
        for key in [k for k in self._local if k[0] == engine_id]:
            handle = self._local.pop(key)
            if not self.ep.live_transfers():
                handle.release()
        self.pairings.pop(engine_id, None)

    def check_peers(self, mode: str = "pull", compat: str = "kvgeom") -> dict[str, str]:
        """Validate the cards of every peer that handshook with us (the other side's checks, run here
        too): ``{agent name: error}`` for each refused one. Both sides reach the same verdict."""
        out = {}
        seen = dict(self.server.peers())
        for ranks in self._watched.values():
            seen.update({p["agent_name"]: p for p in ranks.values()})
        for name, payload in seen.items():
            try:
                peer = GeometryCard.from_json(payload["card"], self.card_limits)
                if mode == "pull":  # the peer (D) reads us (P): check from its side
                    check_pair(peer.geometry, self.card.geometry, "pull", compat)
                else:
                    check_pair(self.card.geometry, peer.geometry, "push", compat)
            except KvgeomError as exc:
                out[name] = str(exc)
        self.rejected.update(out)
        return out

    def watch(
        self, engine_id: str, ports: Mapping[int, Any] | None = None, timeout_s: float | None = None
    ) -> None:
        """Remember the side channels of an engine that talks to us without our connecting to it (the
        producers that write to us in push; with etcd, also the consumers that read from us in pull), so
        that the fence can learn when one of its ranks is gone. Without ``ports`` (etcd) its ranks'
        records are read and kept: their agent names identify the senders of notices, and
        :meth:`check_peers` checks their cards."""
        if ports is not None:
            for r, v in ports.items():
                self._watch[(engine_id, int(r))] = self._addr(v)
            return
        if self.directory is None:
            raise ValueError(f"watch({engine_id!r}): no ports given and discovery is not 'etcd'")
        t = timeout_s if timeout_s is not None else self.config.handshake_timeout_s
        payloads = self.directory.engine(engine_id, time.monotonic() + t)
        self._watched[engine_id] = payloads
        for r, p in payloads.items():
            self._watch[(engine_id, r)] = (p["sidechannel"][0], p["sidechannel"][1])
            self._know_incarnation((engine_id, r), p)

    def _know_incarnation(self, key: tuple[str, int], payload: Mapping[str, Any]) -> None:
        """Remember the incarnation a peer's sealed payload names (16 bytes in hex; older peers' shorter
        ones are not a server incarnation and are not kept)."""
        try:
            inc = bytes.fromhex(str(payload.get("incarnation", "")))
        except ValueError:
            return
        if len(inc) == 16:
            self._incarnations[key] = inc

    def _local_handle(self, engine_id: str, key: tuple[int, int]) -> Prepped:
        if (engine_id, key) not in self._local:
            rows = self.pairings[engine_id].local_table(key)
            bases = [r.addr for r in self.regions]
            self._local[(engine_id, key)] = self.ep.prep_local(
                rows.bind_strided(bases, self.regions[0].device_id), self.mem_type
            )
        return self._local[(engine_id, key)]

    # -- notices ---------------------------------------------------------------------------------------
    def _notice(self, kind: str, request_id: str, attempt: int, count: int, receiver: str) -> bytes:
        return encode_notice(
            self.auth,
            Notice(kind, self.card.engine_id, self.rank, request_id, attempt, count),
            self.ep.name,
            receiver,
        )

    def _send(self, agent: str, msg: bytes) -> None:
        try:
            self.ep.send_notif(agent, msg)
        except AdapterError:
            self.stats["notice_send_errors"] += 1

    def drain(self) -> None:
        """Take every pending notification, drop those without a valid tag, and route the rest: a
        ``W``/``A`` of a quarantined attempt clears its writer, one of a live attempt is kept for
        :meth:`wait_received`, a ``D`` counts towards :meth:`wait_released`. Also drives progress."""
        now = time.monotonic()
        for sender, msg in self.ep.take_notifications():
            n = decode_notice(self.auth, msg, sender, self.ep.name)
            if n is None:
                self.stats["rejected_notices"] += 1
                continue
            who = (n.engine, n.rank)
            known = self._agents.get(who) or self._exchanged(who)
            if known is not None and known != sender:
                self.stats["impersonations"] += 1  # a deployment member claiming another rank's identity
                continue
            if n.kind == "D":
                self._released.touch(n.request, {})[who] = now
            elif n.token in self.fence:
                if self.fence.clear_writer(n.token, who, "late " + n.kind):
                    self.stats["late_notices"] += 1
            else:
                last = self._attempts.get(n.request)
                if last is not None and n.attempt < last:
                    self.stats["stale_notices"] += 1  # an older attempt, already settled: nothing to do
                    continue
                self._arrived.touch(n.token, {})[who] = (n.kind, now)
        if now - self._swept < 1.0:
            return
        self._swept = now
        old = now - self.config.notif_ttl_s
        for store in (self._arrived, self._released):
            for key in [
                k
                for k, v in store.items()
                if all((t[1] if isinstance(t, tuple) else t) < old for t in v.values())
            ]:
                del store[key]

    def _exchanged(self, who: tuple[str, int]) -> str | None:
        """The agent name rank ``who`` last announced in an authenticated exchange with us, if any."""
        for payload in reversed(list(self.server.peers().values())):
            if (payload["engine_id"], payload["rank"]) == who:
                return payload["agent_name"]
        watched = self._watched.get(who[0], {}).get(who[1])
        return watched["agent_name"] if watched is not None else None

    # -- transfers -------------------------------------------------------------------------------------
    def plan(
        self,
        engine_id: str,
        local_ids,
        remote_ids,
        request_id: str,
        remote_request_id: str,
        num_tokens: int | None = None,
    ) -> RequestPlan:
        """kvgeom's plan of one request; ``num_tokens`` (the tokens D holds blocks for) is required whenever
        the local blocks include attention blocks (:func:`kvgeom.plan_request` refuses without it)."""
        return plan_request(
            self.pairings[engine_id], local_ids, remote_ids, request_id, remote_request_id, num_tokens
        )

    def _attempt(self, request_id: str, attempt: int | None) -> int:
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID:
            raise ValueError(
                f"request_id: a string of 1..{MAX_REQUEST_ID} characters, got {str(request_id)[:80]!r}"
            )
        last = self._attempts.get(request_id, 0)
        if attempt is None:
            attempt = last + 1
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt <= last:
            raise ValueError(
                f"attempt: request {request_id!r} already had attempt {last} on this rank; a new "
                f"attempt needs a larger number, got {attempt!r}"
            )
        self._attempts.touch(request_id, attempt)
        self._attempts[request_id] = attempt
        return attempt

    def _execute(
        self,
        engine_id: str,
        plan: RequestPlan,
        dst_ids,
        timeout_s: float | None,
        attempt: int,
        posted: list[Transfer],
        rid: str,
    ) -> RequestResult:
        pairing, links = self.pairings[engine_id], self.links[engine_id]
        check_writes(plan, pairing, dst_ids)  # untrusted remote geometry never writes outside the request
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.config.transfer_timeout_s)
        t0 = time.monotonic()
        for t in plan.transfers:
            self._check_fresh(engine_id, links[t.remote_rank], deadline)
        t_post = time.monotonic()  # CMA transfers complete inside post(): time from the first post
        path = self.config.kvgeom_post if pairing.policy.routed else "ids"
        runs, moved = self._post_all(engine_id, plan, path, attempt, posted, rid)
        tels = [x.wait(deadline) for x in posted]
        t_done = time.monotonic()
        if path == "ids":  # the run count is a diagnostic here (the merged paths counted what they posted)
            moves = plan.moves(pairing)
            moved, runs = (int(moves[:, 6].sum()) if len(moves) else 0), contiguous_runs(moves)
        return RequestResult(
            plan.request_id,
            True,
            plan.num_descriptors,
            moved,
            0,
            sum(t.desc_count or 0 for t in tels),
            runs,
            time.monotonic() - t0,
            t_done - t_post,
            None,
            tels,
            attempt,
        )

    def _post_all(
        self, engine_id: str, plan: RequestPlan, path: str, attempt: int, posted: list[Transfer], rid: str
    ) -> tuple[int, int]:
        """Post one transfer per source rank (appended to ``posted`` as each is posted) along ``path``;
        in push, the ranks nothing is written to get their ``W`` notice. Returns the runs and bytes the
        merged paths posted (``0, 0`` on the ids path)."""
        pairing, links = self.pairings[engine_id], self.links[engine_id]
        push = plan.mode == "push"
        runs = moved = 0
        for t in plan.transfers:  # a push WRITE carries its W notice (sent by NIXL once every byte landed)
            link = links[t.remote_rank]
            notif = self._notice("W", rid, attempt, plan.expected_notifications, link.agent) if push else b""
            if path == "ids":  # vLLM's descriptor ids into the handshake's prepared tables
                posted.append(
                    self.ep.post(
                        plan.op,
                        self._local_handle(engine_id, t.local_table),
                        t.local_ids,
                        link.prepped,
                        t.remote_ids,
                        notif,
                    )
                )
                continue
            loc, rem = self._runs(pairing, t, link, push)
            runs, moved = runs + len(loc), moved + int(loc[:, 1].sum())
            posted.append(self.ep.post_descs(plan.op, loc, link.agent, rem, notif, self.mem_type, path))
        if push:
            for r in plan.notify_only:
                self._send(
                    links[r].agent,
                    self._notice("W", rid, attempt, plan.expected_notifications, links[r].agent),
                )
        return runs, moved

    def _runs(self, pairing: Pairing, t: Any, link: PeerLink, push: bool) -> tuple[np.ndarray, np.ndarray]:
        """One transfer's pairs merged into maximal runs contiguous on both sides (:func:`merge_runs`), as
        NIXL's N×3 lists of each side (our registrations' bases, the peer's advertised ones)."""
        lrows = pairing.local_table(t.local_table).take(t.local_ids)
        rrows = pairing.remote_table(t.remote_rank).take(t.remote_ids)
        loc, rem = merge_runs(
            lrows,
            rrows,
            [r.nbytes for r in self.card.geometry.regions],
            [r.nbytes for r in link.card.geometry.regions],
            "local" if push else "remote",
        )
        return addressed(loc, [r.addr for r in self.regions], self.regions[0].device_id), addressed(
            rem, link.bases, link.device
        )

    def _check_fresh(self, engine_id: str, link: PeerLink, deadline: float) -> None:
        """Stale metadata is never used: the peer must still publish the generation we loaded. A link found
        through etcd is checked there (one keys-only request); if etcd does not answer, the peer's own
        side channel is asked instead (authenticated, as in the side-channel mode)."""
        now = time.monotonic()
        if link.via == "etcd" and self.directory is not None and now >= self._etcd_down_until:
            try:
                self.directory.check(
                    engine_id,
                    link.rank,
                    link.generation,
                    link.agent,
                    min(deadline, now + self.config.etcd_timeout_s),
                )
                return
            except DiscoveryError:  # for a while, ask peers directly instead of waiting for etcd each time
                self._etcd_down_until = time.monotonic() + _ETCD_RETRY_S
                self.stats["etcd_fallbacks"] += 1
        elif link.via == "etcd":
            self.stats["etcd_fallbacks"] += 1
        session = self._session((link.host, link.port))
        check_generation(
            link.host,
            link.port,
            link.generation,
            timeout_s=max(0.1, deadline - time.monotonic()),
            auth=self.auth,
            session=session,
        )

    def _fail(
        self,
        exc: BaseException,
        token: Token,
        ids,
        posted: Sequence[Transfer] = (),
        writers: Sequence[tuple[str, int]] = (),
        zero: bool = True,
    ) -> None:
        """A failed attempt: zero its blocks now and quarantine them until nothing can write them."""
        try:
            if zero:
                self._zero(ids)
            self.fence.hold(
                token, ids, [x for x in posted if x.live], writers, f"{type(exc).__name__}: {exc}"
            )
        except KvgeomError:
            pass  # ids that are not this rank's blocks: nothing was posted towards them
        try:
            exc.token = token  # type: ignore[attr-defined]
        except AttributeError:
            pass

    def pull(
        self,
        engine_id: str,
        local_ids,
        remote_ids,
        request_id: str,
        remote_request_id: str,
        timeout_s: float | None = None,
        num_tokens: int | None = None,
        attempt: int | None = None,
    ) -> RequestResult:
        """Read a request's blocks from the remote engine into ours, then regroup and zero, then tell
        every producer rank that we are done (``D`` notice). On any failure (whatever the exception)
        the blocks are zeroed and quarantined, and the error is raised (bounded by ``timeout_s``).
        Ids still quarantined are refused first (:class:`QuarantinedBlockError`)."""
        self._check_free("local_ids", local_ids)
        attempt = self._attempt(request_id, attempt)
        posted: list[Transfer] = []
        try:
            plan = self.plan(engine_id, local_ids, remote_ids, request_id, remote_request_id, num_tokens)
            result = self._execute(engine_id, plan, local_ids, timeout_s, attempt, posted, remote_request_id)
            result.bytes_zeroed = apply_post_receive(self.tensors, self.card, plan.regroup, plan.zero)
        except BaseException as exc:
            self._fail(exc, (request_id, attempt), local_ids, posted)
            raise
        links = self.links[engine_id]
        for r in [t.remote_rank for t in plan.transfers] + list(plan.notify_only):
            self._send(
                links[r].agent,
                self._notice("D", remote_request_id, attempt, plan.expected_notifications, links[r].agent),
            )
        return result

    def push(
        self,
        engine_id: str,
        local_ids,
        remote_ids,
        request_id: str,
        remote_request_id: str,
        timeout_s: float | None = None,
        num_tokens: int | None = None,
        attempt: int = 1,
        not_after: float | None = None,
    ) -> RequestResult:
        """Write a request's blocks into the remote (D) engine's blocks ``remote_ids``, as attempt
        ``attempt`` (given by whoever asked for it; D waits for exactly that one). ``not_after`` (seconds
        since the epoch): past it, nothing is posted and every target gets an ``A`` notice. A WRITE that
        misses its deadline is never cancelled (cancelling would not stop its bytes, only its
        notice): it stays fenced here and its ``W`` notice reaches D when it ends. Source ids that an
        attempt of another request still holds are refused (:class:`QuarantinedBlockError`)."""
        self._check_free("local_ids", local_ids, remote_request_id)
        attempt = self._attempt(remote_request_id, attempt)
        posted: list[Transfer] = []
        token = (remote_request_id, attempt)
        try:
            plan = self.plan(engine_id, local_ids, remote_ids, request_id, remote_request_id, num_tokens)
            if not_after is not None and time.time() > not_after:
                raise TransferError(
                    f"attempt {attempt} of {remote_request_id!r} expired "
                    f"{time.time() - not_after:.3f}s before it could be posted",
                    stage="post",
                    status="EXPIRED",
                )
            return self._execute(engine_id, plan, remote_ids, timeout_s, attempt, posted, remote_request_id)
        except BaseException as exc:
            done = {x.peer for x in posted if x.state == "DONE"}  # NIXL sent their W notices
            live = [x for x in posted if x.live]
            for agent in [link.agent for link in self.links.get(engine_id, {}).values()]:
                if agent not in done and all(x.peer != agent for x in live):
                    self._send(agent, self._notice("A", remote_request_id, attempt, 1, agent))
            self._aborts.extend((x, token) for x in live)  # an A follows if one of them ends in error
            self._fail(exc, token, local_ids, posted, zero=False)  # our source blocks: keep, do not zero
            raise

    def _writers(self, producer: GeometryCard, compat: str = "kvgeom") -> set[tuple[str, int]]:
        """The producer ranks that write to this rank in push: the core's answer
        (:func:`kvgeom.plan.pairing.push_writers`: the ranks whose pairing names this one, DCP's widening
        included), not one derived here."""
        return {(producer.engine_id, p) for p in push_writers(producer, self.card, compat)}

    def wait_received(
        self,
        producer: GeometryCard,
        local_ids,
        producer_ids,
        request_id: str,
        expected: int | None = None,
        timeout_s: float | None = None,
        num_tokens: int | None = None,
        attempt: int = 1,
        compat: str = "kvgeom",
    ) -> RequestResult:
        """D in push: wait for the ``W`` notice of exactly attempt ``attempt`` of ``request_id`` from
        every producer rank that writes to this rank, then apply kvgeom's post-receive step (vLLM never
        zeroes in push). An ``A`` notice, the deadline or any other failure zeroes the blocks and
        quarantines them until every writer that did not finish is cleared (its notice for this
        attempt, even late, or its process gone). Ids still quarantined are refused first
        (:class:`QuarantinedBlockError`). ``compat``: the pair's mode as the producer paired it (its
        ``Pairing.compat``); with it the core names the writers."""
        self._check_free("local_ids", local_ids)
        t0 = time.monotonic()
        attempt = self._attempt(request_id, attempt)
        token = (request_id, attempt)
        writers = self._writers(producer, compat)
        if expected is not None and expected != len(writers):
            raise ValueError(
                f"expected: {len(writers)} producer ranks write to rank {self.rank}, not {expected}"
            )
        end = t0 + (timeout_s if timeout_s is not None else self.config.notif_timeout_s)
        got: dict = {}
        try:
            self._keep_sessions(writers, end)
            while True:
                self.drain()
                got = self._arrived.get(token, {})
                if _all_arrived(got, writers, end, request_id, attempt):
                    break
                time.sleep(self.config.poll_interval_s)
            regroups, zero = receive_step(
                self.card.geometry, producer.geometry, local_ids, producer_ids, num_tokens
            )
            zeroed = apply_post_receive(self.tensors, self.card, regroups, zero)
        except BaseException as exc:
            self._fail(exc, token, local_ids, writers=[w for w in writers if w not in got])
            raise
        finally:
            self._arrived.pop(token, None)
        return RequestResult(
            request_id, True, bytes_zeroed=zeroed, seconds=time.monotonic() - t0, attempt=attempt
        )

    def invalidate(self, ids) -> int:
        """Zero every block of a request on this rank (a failed receive must leave no partial or stale
        bytes behind). Returns bytes zeroed. Quarantined ids are refused (:class:`QuarantinedBlockError`):
        the quarantine zeroes them itself when it returns them."""
        self._check_free("ids", ids)
        return self._zero(ids)

    def _zero(self, ids) -> int:
        return _zero_rows(self.tensors, request_block_rows(self.card, ids))

    def _check_free(self, name: str, ids, request_id: str | None = None) -> None:
        """The guard where ids enter: none may be held by the quarantine (``request_id``: except by an
        attempt of that same request, for a producer's source blocks)."""
        found = self.fence.owner(ids)
        if found is None or found[0].token[0] == request_id:
            return
        held, hit = found
        state = "retired (past quarantine_bound_s)" if held.retired else "quarantined"
        raise QuarantinedBlockError(
            name,
            f"block id(s) {hit[:16]}{' ...' if len(hit) > 16 else ''} are {state} by attempt "
            f"{held.token[1]} of request {held.token[0]!r} "
            + ("(a transfer may still write them)" if held.open else "(nothing writes them any more)")
            + "; use them only once settle() returns them",
            ids=hit,
            held_by=held.token,
            retired=held.retired,
        )

    # -- quarantine ------------------------------------------------------------------------------------
    def settle(self) -> list[Settled]:
        """Drive the quarantine: take notices, poll our fenced transfers, ask silent writers' side
        channels whether their process is alive (only a refused connection says it is gone; a reset, an
        EOF, a timeout or an unreachable route keeps holding); return the entries nothing can write any
        more, with their blocks zeroed again (late bytes may have landed in them). Give those ids back to
        the pool; never reuse a quarantined id before it comes back from here (the calls that take ids
        refuse it). An entry held past ``quarantine_bound_s`` is retired (:meth:`retired`, logged once)."""
        self.drain()
        for x, (rid, attempt) in [a for a in self._aborts if not a[0].live]:
            if x.state != "DONE":  # ended in error: its W will never come, say so
                self._send(x.peer, self._notice("A", rid, attempt, 1, x.peer))
        self._aborts = [a for a in self._aborts if a[0].live]
        if self._probe_writers():  # bytes it sent before dying may still wait in our sockets
            self.ep._drain(_GONE_DRAIN_S)
        out = []
        for held in self.fence.ready():
            self._zero(held.ids)
            if held.retired:
                self.stats["retired_blocks"] -= held.blocks
                log.warning("reclaimed retired blocks of %s: %s", held.token, ", ".join(held.cleared_by))
            out.append(
                Settled(
                    held.token[0],
                    held.token[1],
                    held.ids,
                    time.monotonic() - held.since,
                    tuple(held.cleared_by),
                    held.reason,
                    held.retired,
                )
            )
        self._retire()
        return out

    def _session(self, addr: tuple[str, int]) -> Session:
        """The kept-open side-channel session to ``addr`` (freshness checks and liveness probes share it)."""
        session = self._sessions.get(addr)
        if session is None:
            session = self._sessions[addr] = Session(addr[0], addr[1], self.auth)
        return session

    def _keep_sessions(self, writers: Iterable[tuple[str, int]], end: float) -> None:
        """Before an attempt waits for its writers, make sure each one's liveness session is open and
        recent (one short authenticated query if not), so that if the attempt fails its writer is probed
        over a connection that already exists: a flood that later fills the writer's accept queue, or
        makes its port refuse some fresh connects, then cannot hide a live writer. Failures are ignored
        here (the probes in :meth:`settle` judge them)."""
        now = time.monotonic()
        for w in writers:
            addr = self._watch.get(w)
            if addr is None:
                continue
            session = self._session(addr)
            if session.answered_at is not None and now - session.answered_at < _SESSION_FRESH_S:
                continue
            try:
                seen = session.probe(timeout_s=max(0.01, min(0.25, (end - now) / 4))).incarnation
            except AdapterError:
                continue
            self._incarnations.setdefault(w, seen)

    def _probe_writers(self) -> bool:
        """Ask each silent writer's side channel (at most every ``_PROBE_EVERY_S``, over a kept-open
        authenticated session) whether its process is alive; positive evidence of its death clears it:
        refusals that last (every probe refused for at least ``gone_refused_s``, at least
        ``_GONE_REFUSALS`` of them, the session to it torn down), or an authenticated answer from another
        incarnation than the one it was known by. One refusal is not evidence: a live server's port under a
        connection flood refused some fresh connects (docs/reliability.md). True if one was cleared."""
        now = time.monotonic()
        gone = False
        writers = self.fence.writers()
        for w in [w for w in self._refusing if w not in writers]:
            del self._refusing[w]
        for w in writers:
            addr = self._watch.get(w)
            every = _REPROBE_S if w in self._refusing else _PROBE_EVERY_S
            if addr is None or now - self._probed.get(w, 0.0) < every:
                continue
            self._probed[w] = now
            session = self._session(addr)
            try:
                # the session answers over its open connection (no connect, no accept queue); only a
                # session that is torn down (the kernel closes a dead process's sockets) connects again
                seen = session.probe(timeout_s=0.25).incarnation
            except PeerGone:  # refused: nothing listened on the port for this connect
                self.stats["probes_refused"] += 1
                first, n = self._refusing.get(w, (time.monotonic(), 0))
                self._refusing[w] = (first, n + 1)
                if n + 1 >= _GONE_REFUSALS and time.monotonic() - first >= self.config.gone_refused_s:
                    del self._refusing[w]
                    gone = self.fence.writer_gone(w) > 0 or gone
                continue
            except PeerUnknown:  # reset, EOF, timeout, unreachable: no evidence, keep holding
                self._refusing.pop(w, None)
                self.stats["probes_unknown"] += 1
                continue
            except AdapterError:
                self._refusing.pop(w, None)
                continue
            self._refusing.pop(w, None)  # an authenticated answer: whoever answers is alive
            known = self._incarnations.setdefault(w, seen)  # first answer: who serves the port now
            if seen != known:  # authenticated, and another process: the one we knew is gone
                self.stats["probes_new_incarnation"] += 1
                self._incarnations[w] = seen
                gone = self.fence.writer_gone(w) > 0 or gone
        return gone

    def _retire(self) -> None:
        """Report every entry that passed ``quarantine_bound_s`` (once): its blocks leave the pool."""
        for held in self.fence.retire(self.config.quarantine_bound_s):
            self.stats["retired"] += 1
            self.stats["retired_blocks"] += held.blocks
            waiting = sorted(f"{e}:{r}" for e, r in held.writers)
            live = sum(x.live for x in held.transfers)
            log.warning(
                "retired %d block(s) of attempt %d of request %r after %.1fs in quarantine "
                "(quarantine_bound_s=%.3g): waiting for writer(s) %s and %d live transfer(s) of ours; "
                "they stay out of the pool until that writer's notice or death, or the transfers' end "
                "(restart the writer, or this rank, to get them back); ids %s; failure: %s",
                held.blocks,
                held.token[1],
                held.token[0],
                held.retired_at - held.since,
                self.config.quarantine_bound_s,
                waiting or "none",
                live,
                held.ids,
                held.reason,
            )

    def retired(self) -> list[Held]:
        """Quarantined attempts that passed ``quarantine_bound_s``: their blocks are out of the pool
        (reported once by a ``WARNING`` log line) until positive evidence clears them."""
        return self.fence.retired()

    def quarantined(self) -> list[Held]:
        """Attempts whose blocks are still quarantined."""
        return self.fence.held()

    # -- producer side of pull -------------------------------------------------------------------------
    def released(self) -> dict[str, int]:
        """Take notices; ``{request id: number of consumer ranks that said done}``."""
        self.drain()
        return {rid: len(v) for rid, v in self._released.items()}

    def wait_released(self, request_id: str, expected: int, timeout_s: float | None = None) -> int:
        """P in pull: wait until ``expected`` consumer ranks said they are done with ``request_id``
        (authenticated ``D`` notices, one per consumer rank), consume them and return the count."""
        end = time.monotonic() + (timeout_s if timeout_s is not None else self.config.notif_timeout_s)
        while True:
            n = self.released().get(request_id, 0)
            if n >= expected:
                self._released.pop(request_id, None)
                return n
            if time.monotonic() >= end:
                raise NotifTimeout(
                    f"{n} of {expected} consumer rank(s) released {request_id!r} before the deadline",
                    stage="notif",
                    status="TIMEOUT",
                )
            time.sleep(self.config.poll_interval_s)

    def forget_released(self, request_id: str) -> None:
        self._released.pop(request_id, None)

    def reregister(self) -> None:
        """Re-register fresh tensors (e.g. after a cache resize): bumps the generation that peers check."""
        old = self.tensors
        for h in self._local.values():
            h.release()
        self._local.clear()
        self.ep.deregister_all()
        self.tensors = allocate(self.card, old[0].device.type if old else "cpu")
        self.regions = self.ep.register_tensors(self.tensors)
        self._publish(wait_s=self.config.etcd_timeout_s)

    def rebind(self, host: str) -> None:
        """Serve from ``host`` (this host's address changed): a new NIXL agent (UCX's TCP transport
        listens on, and advertises, the address its interface had when the agent was created), the same
        tensors (their content stays), a new side channel, and a higher generation, served and published
        (etcd). Peers' checks then see the change and handshake again; our own links are dropped (the
        next :meth:`connect` makes new ones). Refused (``TransferError``, ``BUSY``) while transfers of ours
        are live: their bytes could still land."""
        live = self.ep.live_transfers()
        if live:
            raise TransferError(
                f"{len(live)} transfer(s) still live; settle() until they end before rebinding",
                stage="rebind",
                status="BUSY",
            )
        old_ep, old_server = self.ep, self.server
        for h in self._local.values():
            h.release()
        self._local.clear()
        self.links.clear()
        self.pairings.clear()
        old_server.close()
        old_ep.close()
        self._gen_base += old_ep.generation + 1
        self.host = host
        self.ep = self._new_endpoint()
        self.regions = self.ep.register_tensors(self.tensors)
        self._new_server(host)
        self._publish(wait_s=self.config.etcd_timeout_s)

    def _close_parts(self) -> None:
        for session in self._sessions.values():
            session.close()
        self._sessions.clear()
        for part in (self.registration, self.server, self.ep):
            if part is not None:
                try:
                    part.close()
                except Exception:
                    pass

    def close(self) -> None:
        """Unregister from etcd (the lease is revoked: the record goes), stop the side channel, close the
        agent."""
        self._close_parts()

    def __enter__(self) -> KVRank:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
