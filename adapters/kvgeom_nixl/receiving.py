"""The receiving side of :class:`~kvgeom_nixl.kvrank.KVRank`: notices taken and checked (:meth:`Receiving.drain`), D in push waiting for its writers' ``W`` notices (:meth:`Receiving.wait_received`), P in pull waiting for its consumers' ``D`` notices (:meth:`Receiving.wait_released`), and the guard that refuses quarantined ids."""

from __future__ import annotations

import time
from collections.abc import Mapping

from kvgeom import GeometryCard
from kvgeom.plan.receive import receive_step

from .auth import decode_notice
from .errors import NotifTimeout, QuarantinedBlockError, TransferError
from .rankrecords import RequestResult
from .zeroing import _zero_rows, apply_post_receive, request_block_rows


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


class Receiving:
    """Notices, waits and the ids guard (mixed into :class:`~kvgeom_nixl.kvrank.KVRank`, whose state it uses)."""

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
