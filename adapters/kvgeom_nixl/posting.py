"""The transfers of :class:`~kvgeom_nixl.kvrank.KVRank`: one attempt of a request planned by kvgeom, its writes checked against the request's blocks and the peers' generation, one READ/WRITE posted per source rank (descriptor ids, or merged runs), the notices it sends, and a failed attempt zeroed and quarantined (:meth:`Posting.pull`, :meth:`Posting.push`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvgeom import GeometryCard, KvgeomError, Pairing, RequestPlan, plan_request
from kvgeom.layout.runs import addressed, merge_runs
from kvgeom.plan.pairing import push_writers
from kvgeom.plan.requestplan import check_writes, contiguous_runs

from .agent import Prepped, Transfer
from .auth import Notice, encode_notice
from .errors import AdapterError, DiscoveryError, TransferError
from .fence import Token
from .rankrecords import PeerLink, RequestResult
from .sidechannel import check_generation
from .zeroing import apply_post_receive

_ETCD_RETRY_S = 5.0  # after etcd failed a freshness check, peers' side channels are asked for this long
MAX_REQUEST_ID = 1024  # a notice carries the request id and must fit MAX_NOTICE_BYTES


class Posting:
    """Plans posted as transfers (mixed into :class:`~kvgeom_nixl.kvrank.KVRank`, whose state it uses)."""

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
        engine_id: str | None = None,
    ) -> None:
        """A failed attempt: zero its blocks now and quarantine them until nothing can write them (our
        transfers with ``engine_id``'s ranks end there, or when that rank's process is proven gone)."""
        peers = {(engine_id, r): link.agent for r, link in self.links.get(engine_id, {}).items()}
        try:
            if zero:
                self._zero(ids)
            self.fence.hold(
                token, ids, [x for x in posted if x.live], writers, f"{type(exc).__name__}: {exc}", peers
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
            self._fail(exc, (request_id, attempt), local_ids, posted, engine_id=engine_id)
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
            self._fail(exc, token, local_ids, posted, zero=False, engine_id=engine_id)  # our sources: kept
            raise

    def _writers(self, producer: GeometryCard, compat: str = "kvgeom") -> set[tuple[str, int]]:
        """The producer ranks that write to this rank in push: the core's answer
        (:func:`kvgeom.plan.pairing.push_writers`: the ranks whose pairing names this one, DCP's widening
        included), not one derived here."""
        return {(producer.engine_id, p) for p in push_writers(producer, self.card, compat)}
