"""A plan's byte moves as Mooncake batches: pure numpy, no transfer engine.

:func:`batches` turns :meth:`kvgeom.RequestPlan.moves` (columns :data:`kvgeom.MOVE_COLUMNS`) into one
``(local addresses, remote addresses, lengths)`` batch per remote rank, with each side's region bases
applied, and merges consecutive descriptors where **both** sides are contiguous (the local end is the
next local start and the remote end the next remote start). Moves are first ordered by local address;
every move's bytes are kept, no byte is added.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvgeom import Pairing, PlanError, RequestPlan

__all__ = ["Batch", "batches", "merge_runs", "addresses"]


@dataclass(frozen=True)
class Batch:
    """One remote rank's descriptors: local and remote addresses, lengths (int64 arrays)."""

    remote_rank: int
    local: np.ndarray
    remote: np.ndarray
    length: np.ndarray
    moves: int  # descriptors before merging

    def __len__(self) -> int:
        return int(self.length.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


def merge_runs(
    local: np.ndarray, remote: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Order by local address and merge neighbours contiguous on both sides; zero-length moves dropped."""
    local, remote, length = (np.asarray(a, dtype=np.int64) for a in (local, remote, length))
    keep = length > 0
    local, remote, length = local[keep], remote[keep], length[keep]
    if local.size <= 1:
        return local, remote, length
    order = np.lexsort((remote, local))
    local, remote, length = local[order], remote[order], length[order]
    joins = (local[:-1] + length[:-1] == local[1:]) & (remote[:-1] + length[:-1] == remote[1:])
    start = np.flatnonzero(np.concatenate(([True], ~joins)))
    total = np.add.reduceat(length, start)
    return local[start], remote[start], total


def addresses(regions: np.ndarray, offsets: np.ndarray, bases: Sequence[int], side: str) -> np.ndarray:
    """Absolute addresses of ``(region, offset)`` pairs; a region out of range is a :class:`PlanError`."""
    b = np.asarray(bases, dtype=np.int64)
    regions = np.asarray(regions, dtype=np.int64)
    if regions.size and (regions.min() < 0 or regions.max() >= b.size):
        bad = int(regions.max() if regions.max() >= b.size else regions.min())
        raise PlanError(
            f"{side} region",
            f"a move names region {bad}; there are {b.size}",
            value=bad,
            expected=int(b.size),
        )
    out: np.ndarray = b[regions] + np.asarray(offsets, dtype=np.int64)
    return out


def batches(
    plan: RequestPlan,
    pairing: Pairing,
    local_bases: Sequence[int],
    remote_bases: Mapping[int, Sequence[int]],
    merge: bool = True,
) -> list[Batch]:
    """One :class:`Batch` per remote rank the plan reads from (pull) or writes to (push), in the order of
    ``plan.transfers``. ``remote_bases``: per remote TP rank, its regions' addresses."""
    moves = plan.moves(pairing)
    pull = plan.mode == "pull"
    peer_col = 0 if pull else 3
    out: list[Batch] = []
    ranks = list(dict.fromkeys(t.remote_rank for t in plan.transfers))
    for rank in ranks:
        m = moves[moves[:, peer_col] == pairing.remotes[rank].global_rank]
        if pull:  # src remote, dst local
            rr, ro, lr, lo = m[:, 1], m[:, 2], m[:, 4], m[:, 5]
        else:
            lr, lo, rr, ro = m[:, 1], m[:, 2], m[:, 4], m[:, 5]
        la = addresses(lr, lo, local_bases, "local")
        ra = addresses(rr, ro, remote_bases[rank], "remote")
        ln = m[:, 6].astype(np.int64)
        if merge:
            la, ra, ln = merge_runs(la, ra, ln)
        out.append(Batch(rank, la, ra, ln, int(len(m))))
    return out
