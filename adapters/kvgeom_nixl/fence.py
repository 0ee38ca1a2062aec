"""Fencing: a failed request's blocks stay quarantined until nothing can write them any more.

A deadline that passes does not stop a transfer. Measured on NIXL 1.5.1 with UCX (docs/reliability.md):
releasing (cancelling) a READ that is still in flight over TCP, and even ``remove_remote_agent`` of its
peer, still let every byte land once the peer resumed; a producer that was stopped before its WRITE
writes all of it when it resumes, whatever the consumer did meanwhile (deregistering its memory,
removing the producer's metadata). So the only safe rule is: a block that a transfer *could* still
write is never handed to another request. A :class:`Held` entry names the blocks, our own transfers that
may still write them (``transfers``: polled until they end) and the peers whose WRITE may still land
(``writers``: cleared by that peer's authenticated notice for this very attempt, its ``A``bort notice,
or its death: a refused side channel or a NIXL disconnect, never a reset, an EOF or a timeout). The
blocks are zeroed again and returned by :meth:`Fence.ready` once both are empty.

No step is known on NIXL/UCX here that makes a late byte impossible while the writer lives, so the
quarantine's *time* bound (``TransportConfig.quarantine_bound_s``) cannot hand blocks back: an entry held
longer is **retired** (:meth:`Fence.retire`): reported once, counted, and kept out of the pool. A retired
entry still comes back through :meth:`Fence.ready` on the same positive evidence as any other (its
writer's notice, its transfers' end, its writer's death), never on time alone. :meth:`Fence.owner` is
the guard where ids enter: an id held here belongs to the attempt that holds it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Token", "Held", "Fence"]

Token = tuple[str, int]  # (request id, attempt)


@dataclass
class Held:
    """Blocks of one failed attempt, and what may still write them."""

    token: Token
    ids: list[list[int]]
    transfers: list[Any] = field(default_factory=list)
    writers: set[tuple[str, int]] = field(default_factory=set)
    peers: dict[tuple[str, int], str] = field(default_factory=dict)  # (engine, rank) -> its NIXL agent
    reason: str = ""
    since: float = field(default_factory=time.monotonic)
    cleared_by: list[str] = field(default_factory=list)
    retired_at: float | None = None  # monotonic time the entry passed the quarantine bound

    @property
    def retired(self) -> bool:
        return self.retired_at is not None

    @property
    def blocks(self) -> int:
        return len({b for g in self.ids for b in g})

    @property
    def open(self) -> bool:
        return bool(self.writers) or any(x.live for x in self.transfers)


class Fence:
    """The quarantine of one rank (see the module docstring)."""

    def __init__(self) -> None:
        self._held: dict[Token, Held] = {}

    def hold(
        self,
        token: Token,
        ids: Any,
        transfers: Iterable[Any] = (),
        writers: Iterable[tuple[str, int]] = (),
        reason: str = "",
        peers: Mapping[tuple[str, int], str] | None = None,
    ) -> Held:
        """Quarantine ``ids`` for attempt ``token``; merges with an entry of the same token. ``peers``
        names the NIXL agent of each peer rank ``transfers`` may move bytes with, so that a peer proven
        gone ends them (:meth:`peer_gone`)."""
        ids = [[int(b) for b in g] for g in ids]
        entry = self._held.get(token)
        if entry is None:
            entry = self._held[token] = Held(token, ids, reason=reason)
        entry.transfers.extend(x for x in transfers if x.live)
        entry.writers.update(writers)
        entry.peers.update(peers or {})
        return entry

    def clear_writer(self, token: Token, writer: tuple[str, int], why: str) -> bool:
        """``writer`` can no longer write attempt ``token`` (its notice arrived). True if it was awaited."""
        entry = self._held.get(token)
        if entry is None or writer not in entry.writers:
            return False
        entry.writers.discard(writer)
        entry.cleared_by.append(f"{writer[0]}:{writer[1]} {why}")
        return True

    def writer_gone(self, writer: tuple[str, int]) -> int:
        """``writer``'s process is gone: it writes nothing more. Returns how many entries awaited it."""
        n = 0
        for entry in self._held.values():
            if writer in entry.writers:
                entry.writers.discard(writer)
                entry.cleared_by.append(f"{writer[0]}:{writer[1]} gone")
                n += 1
        return n

    def peer_gone(self, peer: tuple[str, int]) -> int:
        """``peer``'s process is gone (positive evidence, and the bytes it sent before dying already
        applied: the caller drained first): our fenced transfers with it can move nothing more (neither a
        READ from its memory nor a WRITE into it), so they end here, their handles released. Returns how
        many transfers it ended."""
        n = 0
        for entry in self._held.values():
            agent = entry.peers.get(peer)
            ended = [x for x in entry.transfers if x.live and x.peer == agent]
            for x in ended:
                x.abandon()
            if ended:
                entry.cleared_by.append(f"{peer[0]}:{peer[1]} gone")
            n += len(ended)
        return n

    def transfer_peers(self) -> set[tuple[str, int]]:
        """The peers our fenced transfers still move bytes with."""
        out: set[tuple[str, int]] = set()
        for e in self._held.values():
            live = {x.peer for x in e.transfers if x.live}
            out.update(k for k, agent in e.peers.items() if agent in live)
        return out

    def poll(self) -> None:
        """Drive our own fenced transfers (each poll makes progress; an ended one is released)."""
        for entry in self._held.values():
            for x in entry.transfers:
                if x.live:
                    try:
                        x.poll()
                    except Exception:  # an error state is an end: the transfer writes no more
                        pass

    def ready(self) -> list[Held]:
        """Remove and return every entry whose transfers all ended and whose writers are all cleared."""
        self.poll()
        done = [t for t, e in self._held.items() if not e.open]
        return [self._held.pop(t) for t in done]

    def retire(self, bound_s: float, now: float | None = None) -> list[Held]:
        """Mark every entry held longer than ``bound_s`` retired; return the newly retired ones. Retiring
        frees nothing: the entry stays until positive evidence clears it (see the module docstring)."""
        now = time.monotonic() if now is None else now
        out = [e for e in self._held.values() if not e.retired and now - e.since >= bound_s]
        for e in out:
            e.retired_at = now
        return out

    def owner(self, ids: Any) -> tuple[Held, list[int]] | None:
        """The first entry holding any of ``ids`` (one id list per group), with the ids it holds."""
        wanted = _flat(ids)
        if not wanted:
            return None
        for entry in self._held.values():
            hit = sorted(wanted & {b for g in entry.ids for b in g})
            if hit:
                return entry, hit
        return None

    def writers(self) -> set[tuple[str, int]]:
        return {w for e in self._held.values() for w in e.writers}

    def retired(self) -> list[Held]:
        return [e for e in self._held.values() if e.retired]

    def held(self) -> list[Held]:
        return list(self._held.values())

    def __contains__(self, token: Token) -> bool:
        return token in self._held

    def __len__(self) -> int:
        return len(self._held)


def _flat(ids: Any) -> set[int]:
    """Every id of ``ids`` (one id list per group); an empty set for input that is not id lists (the
    caller's own validation then names what is wrong with it)."""
    try:
        return {int(b) for g in ids for b in g}
    except (TypeError, ValueError, OverflowError):
        return set()
