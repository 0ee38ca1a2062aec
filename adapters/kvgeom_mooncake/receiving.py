"""The receiving side of a Mooncake rank (:class:`~kvgeom_mooncake.rank.MooncakeRank`): ``W`` notices checked against their claimed sender's session and tag, D in push waiting for exactly one attempt's writers, and the quarantine of failed attempts."""

from __future__ import annotations

import hmac
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from kvgeom import GeometryCard, KvgeomError, push_writers, receive_step

from .blocks import apply_receive, block_spans, zero_rows
from .engine import Engine
from .errors import NotifTimeout, QuarantinedBlockError
from .records import Held, MooncakeConfig, MoonResult


class _Receiving:
    """D's side of a :class:`~kvgeom_mooncake.rank.MooncakeRank` and its quarantine (a mixin over the
    rank's state, declared here): notices taken and checked, the wait for an attempt's writers, failed
    attempts' blocks held until nothing can write them, and the guard that refuses held ids."""

    card: GeometryCard
    config: MooncakeConfig
    arrays: list[np.ndarray]
    engine: Engine
    stats: dict[str, int]
    _held: list[Held]
    _arrived: dict[tuple[str, int], set[tuple[str, int]]]
    _senders: dict[tuple[str, int], str]
    _inflight: list[Future[int]]
    if TYPE_CHECKING:  # the rank's own (kvgeom_mooncake.rank.MooncakeRank)

        @property
        def session(self) -> str: ...

        def _tag(self, body: bytes) -> str: ...

        def _attempt(self, request_id: str, attempt: int | None) -> int: ...

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
