"""Fencing: a failed request's blocks stay quarantined until nothing can write them any more.

A deadline that passes does not stop a transfer. Measured on NIXL 1.5.1 with UCX (docs/reliability.md):
releasing (cancelling) a READ that is still in flight over TCP, and even ``remove_remote_agent`` of its
peer, still let every byte land once the peer resumed; a producer that was stopped before its WRITE
writes all of it when it resumes, whatever the consumer did meanwhile (deregistering its memory,
removing the producer's metadata). So the only safe rule is: a block that a transfer *could* still
write is never handed to another request. A :class:`Held` entry names the blocks, our own transfers that
may still write them (``transfers``: polled until they end) and the peers whose WRITE may still land
(``writers``: cleared by that peer's authenticated notice for this very attempt, its ``A``bort notice,
or its death). The blocks are zeroed again and returned by :meth:`Fence.ready` once both are empty.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
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
    reason: str = ""
    since: float = field(default_factory=time.monotonic)
    cleared_by: list[str] = field(default_factory=list)

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
    ) -> Held:
        """Quarantine ``ids`` for attempt ``token``; merges with an entry of the same token."""
        ids = [[int(b) for b in g] for g in ids]
        entry = self._held.get(token)
        if entry is None:
            entry = self._held[token] = Held(token, ids, reason=reason)
        entry.transfers.extend(x for x in transfers if x.live)
        entry.writers.update(writers)
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

    def writers(self) -> set[tuple[str, int]]:
        return {w for e in self._held.values() for w in e.writers}

    def held(self) -> list[Held]:
        return list(self._held.values())

    def __contains__(self, token: Token) -> bool:
        return token in self._held

    def __len__(self) -> int:
        return len(self._held)
