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
import json
import secrets
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvgeom import (
    GeometryCard,
    KvgeomError,
    Pairing,
    RankGeometry,
    Regroup,
    RequestPlan,
    block_rows,
    check_writes,
    plan_request,
    push_writers,
    receive_step,
    zero_runs,
)

from .batches import Batch, batches
from .engine import Engine
from .errors import (
    MooncakeTransportError,
    NotifTimeout,
    PeerRefused,
    QuarantinedBlockError,
    TransferFailed,
    TransferTimeout,
)

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


def allocate(card: GeometryCard) -> list[np.ndarray]:
    """One zeroed uint8 array per region of the card's geometry (``region.nbytes`` each)."""
    return [np.zeros(r.nbytes, dtype=np.uint8) for r in card.geometry.regions]


block_spans = block_rows
"""``(region, offset, length)`` rows covering every kernel block of a request on this rank, in every region
(whole block strides): :func:`kvgeom.block_rows`, the geometry both transports zero with."""


def zero_rows(arrays: Sequence[np.ndarray], rows: np.ndarray) -> int:
    """Zero ``(region, offset, length)`` rows (merged per region where they touch); the rows' byte total.
    A row outside its region is a :class:`kvgeom.PlanError` before any byte is written."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    sizes = np.asarray([a.size for a in arrays], dtype=np.int64)
    run_region, start, end, total = zero_runs(rows, sizes)  # the fewest runs (kvgeom.zero_runs)
    for r, o, e in zip(run_region.tolist(), start.tolist(), end.tolist()):
        arrays[r][o:e] = 0
    return total


_ORDER = {"head_major": (0, 2, 1, 3, 4), "token_major": (0, 1, 3, 2, 4)}
"""Axes of a block seen as ``[block, bsr, heads, tokens / bsr, head_bytes]`` in the order each layout stores."""


def _regroup(arrays: Sequence[np.ndarray], geom: RankGeometry, step: Regroup) -> None:
    blocks = np.asarray(step.blocks, dtype=np.int64)
    n = step.tokens // step.bsr
    for region in step.regions:
        r = geom.regions[region]
        view = arrays[region].reshape(r.num_blocks, r.block_stride)
        page = view[blocks, : r.block_len]
        view[blocks, : r.block_len] = (
            page.reshape(-1, step.bsr, step.heads, n, step.head_bytes)
            .transpose(_ORDER[step.layout.value])
            .reshape(blocks.size, -1)
        )


def apply_receive(
    arrays: Sequence[np.ndarray], geom: RankGeometry, regroups: Sequence[Regroup], zero: np.ndarray
) -> int:
    """The consumer's receive step on its arrays: the plan's regroups, then its zero ranges."""
    for step in regroups:
        _regroup(arrays, geom, step)
    return zero_rows(arrays, zero)


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


class MooncakeRank:
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

    def _check_free(self, name: str, ids: Sequence[Sequence[int]]) -> None:
        want = {int(b) for g in ids for b in g}
        for held in self._held:
            hit = sorted(want & {b for g in held.ids for b in g})
            if hit:
                raise QuarantinedBlockError(
                    name,
                    f"block id(s) {hit[:16]} are quarantined by attempt {held.token[1]} of "
                    f"{held.token[0]!r} (a batch may still write them); use them once settle() returns them",
                    ids=hit,
                    held_by=held.token,
                )

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

    def _fail(
        self,
        exc: BaseException,
        token: tuple[str, int],
        ids: Sequence[Sequence[int]],
        zero: bool,
        writers: set[tuple[str, int]] | None = None,
    ) -> None:
        """A failed attempt: zero its blocks (``zero``) and hold them while a batch of ours is running or
        (``writers``, push on D) a writer may still write."""
        pending = [f for f in self._inflight if not f.done()]
        self._inflight = []
        try:
            if zero:
                zero_rows(self.arrays, block_spans(self.card.geometry, ids))
        except KvgeomError:
            return  # ids that are not this rank's blocks: nothing was posted towards them
        if pending or writers:
            self._held.append(
                Held(
                    token,
                    [list(map(int, g)) for g in ids],
                    pending,
                    f"{type(exc).__name__}: {exc}",
                    writers=set(writers or ()),
                )
            )

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

    def drain(self) -> None:
        """Take Mooncake's notifications; keep those whose tag holds for their claimed sender and us."""
        for name, msg in self.engine.notifications():
            parts = msg.split("|")
            if len(parts) != 7 or parts[0] != "W":
                self.stats["rejected_notices"] += 1
                continue
            _, engine, rank, rid, attempt, _, tag = parts
            body = "|".join(parts[:6])
            want = self._tag(f"{body}|{self.session}".encode())[:32]
            if not hmac.compare_digest(tag.encode("utf-8", "surrogateescape"), want.encode()):
                self.stats["rejected_notices"] += 1
                continue
            if not (rank.isdigit() and attempt.isdigit()):  # tagged by a key holder, still not ours
                self.stats["rejected_notices"] += 1
                continue
            who = (engine, int(rank))
            known = self._senders.get(who)
            if known is not None and known != name:  # a key holder claiming another rank's identity
                self.stats["rejected_notices"] += 1
                continue
            key = (rid, int(attempt))
            held = next((h for h in self._held if h.token == key), None)
            if held is not None:  # after its bytes: this writer writes nothing more of that attempt
                self.stats["late_notices"] += 1
                if who in held.writers:
                    held.writers.discard(who)
                    held.cleared_by.append(f"{who[0]}:{who[1]} late W")
                continue
            self._arrived.setdefault(key, set()).add(who)

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

    def wait_received(
        self,
        producer: GeometryCard,
        local_ids: Sequence[Sequence[int]],
        producer_ids: Sequence[Sequence[int]],
        request_id: str,
        num_tokens: int | None = None,
        prefill_tokens: int | None = None,
        timeout_s: float | None = None,
        attempt: int = 1,
        compat: str = "kvgeom",
        prefix_caching: bool = False,
    ) -> MoonResult:
        """D in push: wait for the ``W`` notice of exactly this attempt from every producer rank that
        writes here (:func:`kvgeom.push_writers`), then :func:`kvgeom.receive_step`. The deadline zeroes
        the request's blocks and quarantines them while a writer that had not notified may still write:
        :meth:`settle` gives them back once each such writer's late notice came (after its bytes), or
        :meth:`release` once the producer is known to have stopped."""
        self._check_free("local_ids", local_ids)
        attempt = self._attempt(request_id, attempt)
        t0 = time.monotonic()
        token = (request_id, attempt)
        writers = {(producer.engine_id, p) for p in push_writers(producer, self.card, compat)}
        end = t0 + (timeout_s if timeout_s is not None else self.config.notif_timeout_s)
        self._inflight = []
        got: set[tuple[str, int]] = set()
        try:
            while True:
                self.drain()
                got = self._arrived.get(token, set())
                if writers <= got:
                    break
                if time.monotonic() >= end:
                    raise NotifTimeout(
                        f"{len(writers & got)} of {len(writers)} producer rank(s) completed attempt {attempt} "
                        f"of {request_id!r} before the deadline",
                        stage="notif",
                        status="TIMEOUT",
                    )
                time.sleep(self.config.poll_interval_s)
            regroups, zero = receive_step(
                self.card.geometry,
                producer.geometry,
                local_ids,
                producer_ids,
                num_tokens,
                prefix_caching,
                prefill_tokens,
            )
            zeroed = apply_receive(self.arrays, self.card.geometry, regroups, zero)
        except BaseException as exc:
            self._fail(exc, token, local_ids, zero=True, writers=writers - got)
            raise
        finally:
            self._arrived.pop(token, None)
        return MoonResult(request_id, True, attempt, bytes_zeroed=zeroed, seconds=time.monotonic() - t0)

    # -- quarantine ----------------------------------------------------------------------------------
    def settle(self) -> list[Held]:
        """Attempts that nothing can write any more: none of their batches pending and, push on D, every
        writer that had not notified has sent its late ``W`` notice (:meth:`drain`); their blocks zeroed
        again (late bytes may have landed) and given back. A push consumer's entry whose writer stays
        silent stays until :meth:`release`."""
        self.drain()
        out = []
        for held in list(self._held):
            held.pending = [f for f in held.pending if not f.done()]
            if not held.pending and not held.writers:
                zero_rows(self.arrays, block_spans(self.card.geometry, held.ids))
                self._held.remove(held)
                out.append(held)
        return out

    def release(self, request_id: str, attempt: int) -> Held | None:
        """Give back a push consumer's quarantined attempt once nothing can write it (its producer is
        stopped or answered); zeroes its blocks again."""
        for held in self._held:
            if held.token == (request_id, attempt):
                zero_rows(self.arrays, block_spans(self.card.geometry, held.ids))
                self._held.remove(held)
                return held
        return None

    def quarantined(self) -> list[Held]:
        return list(self._held)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> MooncakeRank:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
