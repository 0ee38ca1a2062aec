"""Descriptor pairs as the fewest pairs: maximal runs contiguous on both sides, and their NIXL addresses.

A transport moves a request's bytes as pairs of ``(region, offset, length)`` rows, row ``i`` of one side
with row ``i`` of the other (what :meth:`kvgeom.plan.dlist.Dlist.take` gives for a transfer's descriptor
ids). :func:`merge_runs` joins every maximal run of pairs that are contiguous on both sides, within one
region on each side, into one pair, so that a transport posts as many descriptors as
:func:`kvgeom.plan.requestplan.contiguous_runs` counts (the fewest possible); :func:`addressed` turns
merged rows into NIXL's N x 3 ``(addr, nbytes, device_id)`` lists for registered base addresses. Both
transports that post per-request lists use them: ``kvgeom_nixl.KVRank`` and ``kvgeom_vllm``'s kvgeom mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvgeom.errors import PlanError

__all__ = ["addressed", "merge_runs"]


def merge_runs(
    local: np.ndarray, remote: np.ndarray, local_sizes: Sequence[int], remote_sizes: Sequence[int], src: str
) -> tuple[np.ndarray, np.ndarray]:
    """One transfer's descriptor pairs (``(region, offset, length)`` rows of each side, row ``i`` moving
    with row ``i``) as the fewest pairs: a maximal run of pairs that are contiguous on both sides, within one
    region on each side, is one pair. Pairs are ordered as :func:`kvgeom.plan.requestplan.contiguous_runs`
    orders moves (by the ``src`` side, ``"local"`` or ``"remote"``, then the other), so the count equals it.
    Returns the merged ``(region, offset, length)`` rows of each side. A merged row outside its region
    (``*_sizes``) raises :class:`~kvgeom.errors.PlanError` (never posted: NIXL would refuse it, or, where two
    registrations lie side by side, move bytes of the wrong region)."""
    local = np.asarray(local, dtype=np.int64).reshape(-1, 3)
    remote = np.asarray(remote, dtype=np.int64).reshape(-1, 3)
    if local.shape != remote.shape:
        raise PlanError("descriptor pairs", f"{len(local)} local rows for {len(remote)} remote rows")
    if (local[:, 2] != remote[:, 2]).any():
        i = int(np.flatnonzero(local[:, 2] != remote[:, 2])[0])
        raise PlanError(
            "descriptor length", f"pair {i}: local {int(local[i, 2])} B, remote {int(remote[i, 2])} B"
        )
    s, d = (local, remote) if src == "local" else (remote, local)
    if len(s) > 1:
        order = np.lexsort((d[:, 1], d[:, 0], s[:, 1], s[:, 0]))
        if (order[1:] < order[:-1]).any():
            s, d = s[order], d[order]
        n = s[:, 2]
        join = (
            (s[1:, 0] == s[:-1, 0])
            & (d[1:, 0] == d[:-1, 0])
            & (s[1:, 1] == s[:-1, 1] + n[:-1])
            & (d[1:, 1] == d[:-1, 1] + n[:-1])
        )
        if join.any():
            first = np.flatnonzero(np.append(True, ~join))
            ends = np.cumsum(n)
            length = ends[np.append(first[1:] - 1, len(n) - 1)] - (ends[first] - n[first])
            s = np.column_stack([s[first, 0], s[first, 1], length])
            d = np.column_stack([d[first, 0], d[first, 1], length])
    out_l, out_r = (s, d) if src == "local" else (d, s)
    for rows, sizes, side in ((out_l, local_sizes, "local"), (out_r, remote_sizes, "remote")):
        size = np.asarray(sizes, dtype=np.int64)
        reg = rows[:, 0]
        if len(rows) and (int(reg.min()) < 0 or int(reg.max()) >= size.size):
            raise PlanError(f"{side} region", f"a run names region {int(reg.max())}; there are {size.size}")
        bad = (rows[:, 1] < 0) | (rows[:, 1] + rows[:, 2] > size[reg]) if len(rows) else np.zeros(0, bool)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise PlanError(
                f"{side} run",
                f"run {rows[i].tolist()} ends past its region ({int(size[reg[i]])} B)",
                value=int(rows[i, 1] + rows[i, 2]),
                expected=int(size[reg[i]]),
            )
    return out_l, out_r


def addressed(rows: np.ndarray, bases: Sequence[int], device: int) -> np.ndarray:
    """``(region, offset, length)`` rows as NIXL's N×3 ``(addr, nbytes, device_id)``."""
    out = np.empty((len(rows), 3), dtype=np.uint64)
    out[:, 0] = np.asarray(bases, dtype=np.uint64)[rows[:, 0]] + rows[:, 1].astype(np.uint64)
    out[:, 1] = rows[:, 2].astype(np.uint64)
    out[:, 2] = np.uint64(device)
    return out
