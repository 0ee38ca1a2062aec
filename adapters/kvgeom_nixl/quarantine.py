"""The quarantine of :class:`~kvgeom_nixl.kvrank.KVRank`: failed attempts' blocks held until nothing can write them (:meth:`Quarantine.settle`), silent writers probed over kept-open side-channel sessions (only positive evidence clears one), and attempts past ``quarantine_bound_s`` retired."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from .errors import AdapterError, PeerGone, PeerUnknown
from .fence import Held
from .rankrecords import Settled
from .sidechannel import Session

_PROBE_EVERY_S = 0.5  # how often a silent writer's side channel is asked whether its process is alive
_REPROBE_S = 0.1  # how often while its side channel refuses (a streak that must last gone_refused_s)
_GONE_REFUSALS = 3  # at least this many refusals in a row, over at least gone_refused_s
_SESSION_FRESH_S = 20.0  # a writer's session unused this long is renewed when an attempt starts waiting
_GONE_DRAIN_S = 0.2  # progress driven after a writer's death, so that bytes already received are applied
log = logging.getLogger("kvgeom_nixl.kvrank")  # the rank's log, as before the split


class Quarantine:
    """Holding and settling failed attempts' blocks (mixed into :class:`~kvgeom_nixl.kvrank.KVRank`, whose state it uses)."""

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
        gone = self._probe_peers()
        if gone:  # bytes it sent before dying may still wait in our sockets: apply them first
            self.ep._drain(_GONE_DRAIN_S)
            for w in gone:  # then our own transfers with it can move nothing more: they end
                self.fence.peer_gone(w)
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

    def _probe_peers(self) -> list[tuple[str, int]]:
        """Ask each silent writer's side channel, and that of each peer our fenced transfers still move
        bytes with (at most every ``_PROBE_EVERY_S``, over a kept-open authenticated session), whether its
        process is alive; positive evidence of its death clears it (a writer here; our transfers with it
        in :meth:`settle`, after a drain):
        refusals that last (every probe refused for at least ``gone_refused_s``, at least
        ``_GONE_REFUSALS`` of them, the session to it torn down), or an authenticated answer from another
        incarnation than the one it was known by. One refusal is not evidence: a live server's port under a
        connection flood refused some fresh connects (docs/reliability.md). Returns the peers found gone."""
        now = time.monotonic()
        gone: list[tuple[str, int]] = []
        peers = self.fence.writers() | self.fence.transfer_peers()
        for w in [w for w in self._refusing if w not in peers]:
            del self._refusing[w]
        for w in sorted(peers):
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
                    self.fence.writer_gone(w)
                    gone.append(w)
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
                self.fence.writer_gone(w)
                gone.append(w)
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
                "they stay out of the pool until that writer's notice or death, or the transfers' end or "
                "their peer's death (restart the writer, or this rank, to get them back); ids %s; failure: %s",
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
