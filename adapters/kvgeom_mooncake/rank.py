"""One engine rank's KV cache on Mooncake's transfer engine: kvgeom plans carried as Mooncake batches.

``MooncakeRank(card, config)`` allocates the rank's regions as host (DRAM) byte arrays laid out as its
:class:`kvgeom.RankGeometry` says, registers each with its own ``TransferEngine`` (TCP, P2P handshake) and
offers a sealed handshake payload (:meth:`MooncakeRank.payload`) that the deployment carries to the peers
(this transport has no side channel or discovery of its own: a payload is a dict, see docs/mooncake.md).

* :meth:`~MooncakeRank.connect` checks every peer payload (the seal, the rank, the card against kvgeom's
  rules and limits, the advertised regions against the card) and pairs with :meth:`kvgeom.Pairing.create`;
* :meth:`~MooncakeRank.pull` (D) / :meth:`~MooncakeRank.push` (P) plan a request with
  :func:`kvgeom.plan_request`, refuse a plan that writes outside the request (:func:`kvgeom.check_writes`),
  post one batch per remote rank (:func:`kvgeom_mooncake.batches.batches`: the plan's moves, merged where
  both sides are contiguous) and wait, bounded; in pull the consumer then regroups and zeroes as the plan
  says; in push every writer sends an authenticated ``W`` notice after its bytes and D's
  :meth:`~MooncakeRank.wait_received` applies :func:`kvgeom.receive_step`;
* any failure zeroes every block of the request on the consumer (Mooncake reports one status per batch,
  so which bytes landed is unknown) and raises a typed error; a batch still pending at the deadline cannot
  be cancelled: its blocks stay quarantined (:class:`~kvgeom_mooncake.errors.QuarantinedBlockError`)
  until :meth:`~MooncakeRank.settle` sees the batch end.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, wait
from typing import Any

from kvgeom import GeometryCard, KvgeomError, Pairing, RequestPlan, check_writes, plan_request

from .batches import Batch, batches
from .blocks import allocate, apply_receive, block_spans, zero_rows
from .engine import Engine
from .errors import MooncakeTransportError, PeerRefused, TransferFailed, TransferTimeout
from .errors import NotifTimeout as NotifTimeout  # its old home: callers name it rank.NotifTimeout
from .receiving import _Receiving
from .records import Held, MooncakeConfig, MoonResult, _canon, _Link, _result

__all__ = [
    "MooncakeConfig",
    "MooncakeRank",
    "MoonResult",
    "Held",
    "allocate",
    "apply_receive",
    "block_spans",
    "zero_rows",
]

PROTOCOL = 1  # the payload's and notices' format


class MooncakeRank(_Receiving):
    """One engine rank on a Mooncake transfer engine (see the module docstring)."""

    def __init__(
        self, card: GeometryCard, config: MooncakeConfig | None = None, host: str = "127.0.0.1"
    ) -> None:
        if "|" in card.engine_id:  # notices are '|'-separated
            raise KvgeomError(
                "engine_id", "must not contain '|' (the Mooncake notices' separator)", value=card.engine_id
            )
        self.card = card
        self.config = config or MooncakeConfig()
        self._key = self.config.key()
        self.arrays = allocate(card)
        self.engine = Engine(host, self.config.protocol)
        try:
            for a in self.arrays:
                self.engine.register(a.ctypes.data, a.nbytes)
        except BaseException:
            self.engine.close()
            raise
        self.incarnation = secrets.token_hex(8)
        self.pairings: dict[str, Pairing] = {}
        self.links: dict[str, dict[int, _Link]] = {}
        self._held: list[Held] = []
        self._arrived: dict[tuple[str, int], set[tuple[str, int]]] = {}
        self._senders: dict[tuple[str, int], str] = {}  # (engine, rank) -> session, from sealed payloads
        self._attempts: dict[str, int] = {}
        self._inflight: list[Future[int]] = []
        self.stats = {"rejected_notices": 0, "late_notices": 0}

    # -- identity ------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.card.engine.tp_rank

    @property
    def session(self) -> str:
        return self.engine.session

    def _tag(self, body: bytes) -> str:
        return hmac.new(self._key, body, hashlib.sha256).hexdigest()

    def payload(self) -> dict[str, Any]:
        """The sealed handshake payload: engine, rank, session, card, region addresses and sizes."""
        body = {
            "protocol": PROTOCOL,
            "engine_id": self.card.engine_id,
            "rank": self.rank,
            "session": self.session,
            "card": self.card.to_json(),
            "regions": [[int(a.ctypes.data), int(a.nbytes)] for a in self.arrays],
            "incarnation": self.incarnation,
        }
        return {**body, "tag": self._tag(_canon(body))}

    # -- handshake -----------------------------------------------------------------------------------
    def connect(
        self,
        engine_id: str,
        payloads: Mapping[int, Mapping[str, Any]],
        mode: str = "pull",
        compat: str = "kvgeom",
        prefix_caching: bool = False,
    ) -> Pairing:
        """Check the payloads of the remote engine's ranks and pair with them. A payload that is not
        sealed with the deployment's key, names another engine or rank, or advertises regions that
        disagree with its card is a :class:`PeerRefused`; a card or pair kvgeom refuses raises its
        :class:`kvgeom.KvgeomError`. Nothing of a failed handshake is kept."""
        try:
            cards: dict[int, GeometryCard] = {}
            for r, p in payloads.items():
                cards[int(r)] = self._check_payload(engine_id, int(r), p)
            pairing = Pairing.create(self.card, cards, mode, compat, prefix_caching)
            links = {
                r: _Link(
                    r, str(payloads[r]["session"]), tuple(int(x[0]) for x in payloads[r]["regions"]), cards[r]
                )
                for r in pairing.targets
            }
        except (KvgeomError, MooncakeTransportError):
            raise
        except Exception as exc:  # a hostile payload's shape is still a typed refusal
            raise PeerRefused(
                f"handshake with {engine_id} refused: {type(exc).__name__}: {str(exc)[:200]}",
                stage="handshake",
                peer=engine_id,
            ) from exc
        for r, p in payloads.items():
            self._senders[(engine_id, int(r))] = str(p["session"])
        self.pairings[engine_id] = pairing
        self.links[engine_id] = links
        return pairing

    def _check_payload(self, engine_id: str, rank: int, p: Mapping[str, Any]) -> GeometryCard:
        where = f"{engine_id} rank {rank}"
        body = {k: v for k, v in p.items() if k != "tag"}
        tag = p.get("tag")
        if not isinstance(tag, str) or not hmac.compare_digest(
            tag.encode("utf-8", "surrogateescape"), self._tag(_canon(body)).encode()
        ):
            raise PeerRefused(
                f"{where}: the payload is not sealed with this deployment's key",
                stage="handshake",
                peer=where,
            )
        if p.get("protocol") != PROTOCOL:
            raise PeerRefused(
                f"{where}: payload protocol {p.get('protocol')!r}, not {PROTOCOL}",
                stage="handshake",
                peer=where,
            )
        if p["engine_id"] != engine_id or p["rank"] != rank:
            raise PeerRefused(
                f"{where} answered as engine {p['engine_id']!r} rank {p['rank']}",
                stage="handshake",
                peer=where,
            )
        card = GeometryCard.from_json(p["card"])
        if card.engine_id != engine_id or card.engine.tp_rank != rank:
            raise PeerRefused(
                f"{where} sent the card of engine {card.engine_id!r} rank {card.engine.tp_rank}",
                stage="handshake",
                peer=where,
            )
        regions = p["regions"]
        want = [r.nbytes for r in card.geometry.regions]
        got = [int(x[1]) for x in regions]
        if got != want:
            raise PeerRefused(
                f"{where} registers regions of {got[:8]} B; its card says {want[:8]} B",
                stage="handshake",
                peer=where,
            )
        return card

    # -- ids and attempts ----------------------------------------------------------------------------
    def _attempt(self, request_id: str, attempt: int | None) -> int:
        if not isinstance(request_id, str) or not 0 < len(request_id) <= 256 or "|" in request_id:
            raise KvgeomError(
                "request_id", "a string of 1..256 characters without '|'", value=str(request_id)[:80]
            )
        last = self._attempts.get(request_id, 0)
        attempt = last + 1 if attempt is None else attempt
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt <= last:
            raise KvgeomError(
                "attempt",
                f"request {request_id!r} already had attempt {last} here",
                value=attempt,
                expected=last + 1,
            )
        self._attempts[request_id] = attempt
        return attempt

    def invalidate(self, ids: Sequence[Sequence[int]]) -> int:
        """Zero every block of a request on this rank; bytes zeroed."""
        self._check_free("ids", ids)
        return zero_rows(self.arrays, block_spans(self.card.geometry, ids))

    # -- transfers -----------------------------------------------------------------------------------
    def plan(
        self,
        engine_id: str,
        local_ids: Sequence[Sequence[int]],
        remote_ids: Sequence[Sequence[int]],
        request_id: str = "req",
        num_tokens: int | None = None,
        prefill_tokens: int | None = None,
    ) -> tuple[RequestPlan, list[Batch]]:
        """kvgeom's plan of one request and the batches this rank would post for it."""
        pairing = self.pairings[engine_id]
        plan = plan_request(
            pairing, local_ids, remote_ids, request_id, num_tokens=num_tokens, prefill_tokens=prefill_tokens
        )
        check_writes(plan, pairing, local_ids if plan.mode == "pull" else remote_ids)
        links = self.links[engine_id]
        bases = [int(a.ctypes.data) for a in self.arrays]
        return plan, batches(
            plan, pairing, bases, {r: ln.bases for r, ln in links.items()}, self.config.merge
        )

    def _post(
        self,
        engine_id: str,
        op: str,
        bs: Sequence[Batch],
        deadline: float,
        notices: Mapping[int, str] | None = None,
    ) -> float:
        """Start every batch (one worker thread each, so that the ranks' batches run together), then wait
        for all of them until ``deadline``; raise on a failed or late one. Their futures are kept in
        ``self._inflight`` before any wait (the caller fences those still running)."""
        links = self.links[engine_id]
        t0 = time.monotonic()
        self._inflight = []
        for b in bs:
            if not len(b):
                continue
            session = links[b.remote_rank].session
            note = None if notices is None else (self.session, notices[b.remote_rank])
            fut = self.engine.start(op, session, b.local.tolist(), b.remote.tolist(), b.length.tolist(), note)
            self._inflight.append(fut)
        done, late = wait(self._inflight, timeout=max(0.0, deadline - time.monotonic()))
        failed = [f.result() for f in done if f.result() != 0]
        if failed:
            raise TransferFailed(
                f"{len(failed)} of {len(self._inflight)} {op} batch(es) of {engine_id} failed (Mooncake "
                f"returned {failed[0]}: one status per batch, not per descriptor)",
                stage="wait",
                status=failed[0],
                peer=engine_id,
            )
        if late:
            raise TransferTimeout(
                f"{len(late)} of {len(self._inflight)} {op} batch(es) of {engine_id} still running at the deadline",
                stage="wait",
                status="PENDING",
                peer=engine_id,
            )
        return time.monotonic() - t0

    def pull(
        self,
        engine_id: str,
        local_ids: Sequence[Sequence[int]],
        remote_ids: Sequence[Sequence[int]],
        request_id: str,
        num_tokens: int | None = None,
        prefill_tokens: int | None = None,
        timeout_s: float | None = None,
        attempt: int | None = None,
    ) -> MoonResult:
        """D: read a request's bytes from the remote engine (one READ batch per source rank), then the
        plan's regroups and zero ranges. Any failure zeroes the request's blocks here and raises."""
        self._check_free("local_ids", local_ids)
        attempt = self._attempt(request_id, attempt)
        t0 = time.monotonic()
        self._inflight = []
        try:
            plan, bs = self.plan(engine_id, local_ids, remote_ids, request_id, num_tokens, prefill_tokens)
            deadline = t0 + (timeout_s if timeout_s is not None else self.config.transfer_timeout_s)
            moved_s = self._post(engine_id, "READ", bs, deadline)
            zeroed = apply_receive(self.arrays, self.card.geometry, plan.regroup, plan.zero)
        except BaseException as exc:
            self._fail(exc, (request_id, attempt), local_ids, zero=True)
            raise
        self._inflight = []
        return _result(request_id, attempt, plan, bs, zeroed, t0, moved_s)

    def _notice(self, kind: str, request_id: str, attempt: int, count: int, receiver: str) -> str:
        body = f"{kind}|{self.card.engine_id}|{self.rank}|{request_id}|{attempt}|{count}"
        return body + "|" + self._tag(f"{body}|{receiver}".encode())[:32]

    def push(
        self,
        engine_id: str,
        local_ids: Sequence[Sequence[int]],
        remote_ids: Sequence[Sequence[int]],
        request_id: str,
        num_tokens: int | None = None,
        prefill_tokens: int | None = None,
        timeout_s: float | None = None,
        attempt: int = 1,
    ) -> MoonResult:
        """P: write a request's bytes into D's blocks ``remote_ids`` (one WRITE batch per target rank), then
        an authenticated ``W`` notice to each target, carried by the batch's Mooncake notify (delivered
        after the batch's bytes). A plan that notifies a rank it sends no bytes is refused (a Mooncake
        notify rides on a WRITE; docs/mooncake.md). Source ids a late WRITE of ours may still read are
        refused (:class:`QuarantinedBlockError`)."""
        self._check_free("local_ids", local_ids)
        attempt = self._attempt(request_id, attempt)
        t0 = time.monotonic()
        self._inflight = []
        try:
            plan, bs = self.plan(engine_id, local_ids, remote_ids, request_id, num_tokens, prefill_tokens)
            if plan.notify_only:
                raise KvgeomError(
                    "notify_only",
                    "the plan notifies D ranks that receive no bytes; a Mooncake notify rides on a WRITE",
                    value=list(plan.notify_only),
                )
            deadline = t0 + (timeout_s if timeout_s is not None else self.config.transfer_timeout_s)
            links = self.links[engine_id]
            notices = {
                b.remote_rank: self._notice(
                    "W", request_id, attempt, plan.expected_notifications, links[b.remote_rank].session
                )
                for b in bs
            }
            moved_s = self._post(engine_id, "WRITE", bs, deadline, notices)
        except BaseException as exc:
            self._fail(exc, (request_id, attempt), local_ids, zero=False)  # our source blocks: kept
            raise
        self._inflight = []
        return _result(request_id, attempt, plan, bs, 0, t0, moved_s)

    def watch(self, engine_id: str, payloads: Mapping[int, Mapping[str, Any]]) -> None:
        """Push, D: remember the producer ranks' sessions from their sealed payloads (checked as in
        :meth:`connect`), so that a notice claiming one of them from another session is dropped."""
        try:
            checked = {
                int(r): (self._check_payload(engine_id, int(r), p), str(p["session"]))
                for r, p in payloads.items()
            }
        except (KvgeomError, MooncakeTransportError):
            raise
        except Exception as exc:  # a hostile payload's shape is still a typed refusal
            raise PeerRefused(
                f"payloads of {engine_id} refused: {type(exc).__name__}: {str(exc)[:200]}",
                stage="handshake",
                peer=engine_id,
            ) from exc
        for r, (_, session) in checked.items():
            self._senders[(engine_id, r)] = session

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> MooncakeRank:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
