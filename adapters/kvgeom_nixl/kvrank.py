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

The class is assembled from one module per responsibility (each a mixin over the state ``__init__``
sets up): :mod:`~kvgeom_nixl.connecting` (handshakes), :mod:`~kvgeom_nixl.posting` (attempts posted as
transfers), :mod:`~kvgeom_nixl.receiving` (notices and waits), :mod:`~kvgeom_nixl.quarantine` (holding and
settling failed attempts' blocks); :mod:`~kvgeom_nixl.zeroing` zeroes blocks and applies the post-receive
step, :mod:`~kvgeom_nixl.rankrecords` holds the records the rank keeps and returns. This module keeps the
rank's identity, registration and lifetime, and every name it always exported.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from kvgeom import GeometryCard, Pairing
from kvgeom.layout.card import DEFAULT_LIMITS, CardLimits
from kvgeom.layout.runs import merge_runs
from kvgeom.plan.blockrows import block_rows, zero_runs

from .agent import Endpoint, Prepped, Transfer
from .auth import Auth
from .config import TransportConfig
from .connecting import Connecting
from .discovery import Directory, EtcdClient, Registration, engine_key, seal_record
from .errors import TransferError
from .fence import Fence, Token
from .posting import MAX_REQUEST_ID, Posting
from .quarantine import Quarantine
from .rankrecords import PeerLink, RequestResult, Settled, _Bounded
from .receiving import Receiving
from .sidechannel import Session, SideChannelServer, make_payload
from .zeroing import _zero_rows, apply_post_receive, request_block_rows

__all__ = [
    "MAX_REQUEST_ID",
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
_REEXPORTED = (_zero_rows,)  # bench/bench_zero.py and tests import it from here (kvgeom_nixl.zeroing)


def allocate(card: GeometryCard, device: str = "cpu") -> list[Any]:
    """One zeroed uint8 tensor per region of the card's geometry (``region.nbytes`` each)."""
    import torch

    return [torch.zeros(r.nbytes, dtype=torch.uint8, device=device) for r in card.geometry.regions]


class KVRank(Connecting, Posting, Receiving, Quarantine):
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
