"""Zeroing a request's blocks on a rank's tensors (the fewest calls for the runs given: memsets for long runs, one indexed write for many short ones) and the consumer's post-receive step (regroups, then zero ranges)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvgeom import GeometryCard
from kvgeom.errors import PlanError
from kvgeom.plan.blockrows import block_rows, zero_runs
from kvgeom.plan.requestplan import Regroup

_MAX_CHUNKS_PER_RUN = 4
"""Short runs split into more chunks than this each are zeroed one ``memset`` each (measured: numpy's indexed
write costs about as much per chunk as a call costs per run once a run is a few chunks)."""
_VEC_MIN_RUNS = 64
"""A region's short runs are zeroed together (:func:`_zero_short`) from this many on; fewer, one call each
(the indexed write's fixed cost, tens of microseconds, is that of a few dozen calls)."""
_FEW_ROWS = 64
"""Up to this many rows are zeroed as given, one call each (:func:`_zero_few`), without merging."""
_LOOP_MIN_BYTES = 16384
"""Runs at least this long are zeroed one call each (a memset); shorter ones together, by one indexed write.
Measured on CPU tensors (``bench/bench_zero.py``): a per-run call costs about a microsecond of Python, which a
16 KiB memset hides; below that one indexed write over all the short runs is faster."""


def _host(t: Any) -> bool:
    """Whether ``t``'s bytes are host memory this process may write directly (libc, numpy); the other
    devices' tensors are zeroed by torch alone (tests force that path on CPU tensors through this)."""
    return bool(t.is_cpu)


def _chunks(start: np.ndarray, end: np.ndarray, nbytes: int) -> tuple[int, np.ndarray]:
    """The runs as ``g``-byte chunks: ``g`` the largest size dividing every start, every length and the
    region, and the chunk indices (a ``[-1, g]`` view's rows) in run order."""
    g = int(np.gcd.reduce(np.concatenate([start, end - start, [nbytes]])))
    per = (end - start) // g
    first = start // g
    if (per == 1).all():
        return g, first
    at = np.repeat(np.cumsum(per) - per, per)
    return g, np.repeat(first, per) + (np.arange(int(per.sum())) - at)


def _zero_short(t: Any, start: np.ndarray, end: np.ndarray) -> None:
    """Zero ``[start, end)`` runs of one flat uint8 tensor by one indexed write of a ``[-1, g]`` view
    (:func:`_chunks`): numpy's on CPU tensors (in 8-byte words where aligned), ``index_fill_`` on others.
    On a contiguous CPU tensor whose runs would need more than ``_MAX_CHUNKS_PER_RUN`` chunks each (their
    starts share little alignment), one ``memset`` per run instead."""
    import torch

    g, idx = _chunks(start, end, t.numel())
    cpu = _host(t)
    if cpu and idx.size > _MAX_CHUNKS_PER_RUN * start.size and t.is_contiguous():
        p, memset = t.data_ptr(), ctypes.memset
        for s, e in zip(start.tolist(), end.tolist()):
            memset(p + s, 0, e - s)
        return
    if cpu:
        rows2d = t.view(-1, g).numpy()  # a view: writes land in the tensor
        if g % 8 == 0 and rows2d.ctypes.data % 8 == 0 and rows2d.strides[1] == 1:
            rows2d = rows2d.view(np.uint64)  # 8-byte words: numpy's row copy runs 8x fewer elements
        rows2d[idx] = 0
    else:
        t.view(-1, g).index_fill_(0, torch.from_numpy(idx).to(t.device), 0)


def _zero_few(tensors: Sequence[Any], rows: list[list[int]]) -> int:
    """:func:`_zero_rows` for a few rows: each checked, then zeroed by one call, in plain Python (numpy's
    per-call cost would be most of the time)."""
    where: dict[int, tuple[int, int]] = {}
    for r, o, n in rows:
        if not 0 <= r < len(tensors):
            raise PlanError("zero", f"rows name region {r}; there are {len(tensors)}")
        if r not in where:
            t = tensors[r]
            where[r] = (t.data_ptr() if _host(t) and t.is_contiguous() else 0, t.numel())
        if o < 0 or n < 0 or o + n > where[r][1]:
            raise PlanError("zero", f"row {[r, o, n]} lies outside its region ({where[r][1]} B)")
    memset = ctypes.memset
    total = 0
    for r, o, n in rows:
        if n:
            p = where[r][0]
            if p:
                memset(p + o, 0, n)
            else:
                tensors[r][o : o + n].zero_()
            total += n
    return total


def _zero_rows(tensors: Sequence[Any], rows: np.ndarray) -> int:
    """Zero ``(region, offset, length)`` rows of one flat uint8 tensor per region; returns the rows' byte
    total. Up to ``_FEW_ROWS`` rows are zeroed as given (:func:`_zero_few`). More are merged first into the
    fewest disjoint runs (:func:`zero_runs`: a request's blocks that lie side by side are one run); a
    region's short runs (under ``_LOOP_MIN_BYTES``), when it has at least ``_VEC_MIN_RUNS`` of them, are
    zeroed together (:func:`_zero_short`), every other run by one call (libc's ``memset`` on contiguous CPU
    tensors, ``zero_()`` of a slice on others). Rows outside their region raise
    :class:`~kvgeom.errors.PlanError` before any byte is written."""
    rows = np.asarray(rows, dtype=np.int64)
    if 0 < len(rows) <= _FEW_ROWS and rows.ndim == 2 and rows.shape[1] == 3:
        return _zero_few(tensors, rows.tolist())
    sizes = [t.numel() for t in tensors]
    region, start, end, total = zero_runs(rows, sizes)
    if not region.size:
        return 0
    outside = (start < 0) | (end > np.asarray(sizes, dtype=np.int64)[region])
    # libc writes unchecked: a run zero_runs let through would be a kvgeom bug, refused before any write
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise PlanError(
            "zero",
            f"run [{int(start[i])}, {int(end[i])}) of region {int(region[i])} lies outside it "
            f"({sizes[int(region[i])]} B)",
        )
    short = end - start < _LOOP_MIN_BYTES
    many = np.flatnonzero(np.bincount(region[short], minlength=len(tensors)) >= _VEC_MIN_RUNS)
    together = short & np.isin(region, many) if many.size else np.zeros(region.size, dtype=bool)
    one = ~together
    region1, start1, end1 = region[one], start[one], end[one]
    ptr = np.zeros(len(tensors), dtype=np.int64)  # 0: not a contiguous CPU tensor, zeroed by torch
    for r in np.unique(region1).tolist():
        t = tensors[r]
        if _host(t) and t.is_contiguous():
            ptr[r] = t.data_ptr()
    addr = ptr[region1]
    direct = addr != 0
    memset = ctypes.memset
    for a, n in zip((addr[direct] + start1[direct]).tolist(), (end1 - start1)[direct].tolist()):
        memset(a, 0, n)
    if not direct.all():
        for r, s, e in zip(region1[~direct].tolist(), start1[~direct].tolist(), end1[~direct].tolist()):
            tensors[r][s:e].zero_()
    for r in many.tolist():
        m = together & (region == r)
        _zero_short(tensors[r], start[m], end[m])
    return total


_REGROUP_ORDER = {"head_major": (0, 2, 1, 3, 4), "token_major": (0, 1, 3, 2, 4)}
"""Axes of a block viewed as ``[block, bsr, heads, n, head_bytes]`` in the order each target layout stores."""


def _regroup(tensors: Sequence[Any], card: GeometryCard, step: Regroup) -> None:
    """``[bsr, heads, tokens/bsr, head_bytes] -> [heads, tokens, head_bytes]`` per listed block (a
    token-major ``step.layout``: ``-> [tokens, heads, head_bytes]``)."""
    import torch

    geom = card.geometry
    blocks = torch.from_numpy(np.asarray(step.blocks, dtype=np.int64))
    n = step.tokens // step.bsr
    for region in step.regions:
        r = geom.regions[region]
        view = tensors[region].view(r.num_blocks, r.block_stride)
        page = view[blocks.to(view.device), : r.block_len]
        page = (
            page.view(-1, step.bsr, step.heads, n, step.head_bytes)
            .permute(*_REGROUP_ORDER[step.layout.value])
            .reshape(len(blocks), -1)
        )
        view[blocks.to(view.device), : r.block_len] = page


def apply_post_receive(
    tensors: Sequence[Any], card: GeometryCard, regroups: Sequence[Regroup], zero: np.ndarray
) -> int:
    """The consumer's post-receive step on its tensors: regroups, then zero ranges. Returns bytes zeroed."""
    for step in regroups:
        _regroup(tensors, card, step)
    return _zero_rows(tensors, zero)


def request_block_rows(card: GeometryCard, ids: Sequence[Sequence[int]]) -> np.ndarray:
    """``(region, offset, length)`` rows covering every block of a request on this rank (all regions,
    whole pages): what a failed request zeroes so that no stale or partial bytes are ever read."""
    return block_rows(card.geometry, ids)
