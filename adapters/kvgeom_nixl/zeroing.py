"""Zeroing a request's blocks on a rank's tensors (the fewest calls for the runs given: a few rows merged in
plain Python, one ``memset`` per run; more merged by numpy, the runs of one length in every region by one numpy
write of a view of host memory) and the consumer's post-receive step (regroups, then zero ranges)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvgeom import GeometryCard
from kvgeom.errors import PlanError
from kvgeom.plan.blockrows import block_runs, zero_runs
from kvgeom.plan.requestplan import Regroup

_FEW_ROWS = 64
"""Up to this many rows are zeroed in plain Python (:func:`_zero_few`): numpy's fixed cost per call (a
microsecond or more at these sizes, a dozen calls to merge) would be most of the time."""
_WINDOW_MIN_RUNS = 4
"""Host runs of one length are zeroed by one numpy write (:func:`_zero_windows`) from this many on; fewer,
one ``memset`` each (the write's fixed cost, a few microseconds, is that of a few ``ctypes`` calls)."""
_WINDOW_MAX_BYTES = 1 << 20
"""Runs this long or longer are one ``memset`` each: the call's cost is lost in the bytes' time."""
_VEC_MIN_RUNS = 64
"""Off the host (or on a tensor that is not contiguous) a region's short runs are zeroed together by one
indexed write (:func:`_zero_short`) from this many on; fewer, one ``zero_()`` each."""
_LOOP_MIN_BYTES = 16384
"""Off the host, runs at least this long are one ``zero_()`` each, shorter ones together (:func:`_zero_short`)."""
_MAX_CHUNKS_PER_RUN = 4
"""On a host tensor that is not contiguous, short runs that :func:`_chunks` would split into more chunks
than this each (their starts share little alignment) are one ``zero_()`` each instead of an index per chunk."""

_MEMSET = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)(
    ctypes.cast(ctypes.memset, ctypes.c_void_p).value
)
"""libc's ``memset`` as ``ctypes.memset`` calls it, without a result: ctypes builds no return object (5-10 %
of a short call, which the smallest requests make a few of)."""


def _host(t: Any) -> bool:
    """Whether ``t``'s bytes are host memory this process may write directly (libc, numpy); the other
    devices' tensors are zeroed by torch alone (tests force that path on CPU tensors through this)."""
    return t.is_cpu


class _HostBytes:
    """Host bytes from ``base`` as numpy sees them through ``__array_interface__``: ``count`` windows of
    ``length`` bytes, window ``i`` at ``base + i`` (strides ``(1, 1)``). Indexing it by ``start - base`` picks
    the run at ``start`` in any tensor above ``base``, so one write zeroes runs of many tensors."""

    __slots__ = ("__array_interface__",)

    def __init__(self, base: int, count: int, length: int) -> None:
        self.__array_interface__ = {
            "version": 3,
            "typestr": "|u1",
            "data": (base, False),
            "shape": (count, length),
            "strides": (1, 1),
        }


def _zero_windows(addr: np.ndarray, length: int) -> bool:
    """Zero ``length`` bytes at each host address in ``addr`` by one numpy indexed write of a
    :class:`_HostBytes` view spanning them (numpy runs one ``memset`` per index in C: no Python per run), if
    they are at least ``_WINDOW_MIN_RUNS`` runs shorter than ``_WINDOW_MAX_BYTES`` and the view stays within
    numpy's size limit; returns whether it did. ``addr``: disjoint runs, each checked inside its own tensor;
    no other byte is written."""
    if addr.size < _WINDOW_MIN_RUNS or length >= _WINDOW_MAX_BYTES:
        return False
    base = int(addr.min())
    count = int(addr.max()) - base + 1
    if count * length >= 1 << 62:
        return False
    view = np.asarray(_HostBytes(base, count, length))
    view[addr - base] = 0
    return True


def _zero_host(addr: np.ndarray, length: np.ndarray) -> None:
    """Zero disjoint host runs (absolute addresses, lengths): the runs of each length together
    (:func:`_zero_windows`: a request's runs mostly share a length, a block's or a tail's), every other run
    by one ``memset``."""
    rest = None
    if addr.size >= _WINDOW_MIN_RUNS:
        lo, hi = int(length.min()), int(length.max())
        if lo == hi:  # the common case: one length, no sort
            if _zero_windows(addr, lo):
                return
        else:
            order = np.argsort(length, kind="stable")
            cut = [0, *(np.flatnonzero(np.diff(length[order])) + 1).tolist(), addr.size]
            rest = np.ones(addr.size, dtype=bool)
            for a, b in zip(cut[:-1], cut[1:]):
                if _zero_windows(addr[order[a:b]], int(length[order[a]])):
                    rest[order[a:b]] = False
    if rest is not None:
        addr, length = addr[rest], length[rest]
    memset = _MEMSET
    for a, n in zip(addr.tolist(), length.tolist()):
        memset(a, 0, n)


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
    """Zero ``[start, end)`` runs of one flat uint8 tensor that is not contiguous host memory by one indexed
    write of a ``[-1, g]`` view (:func:`_chunks`): numpy's on a host tensor, ``index_fill_`` on others. On a
    host tensor whose runs would need more than ``_MAX_CHUNKS_PER_RUN`` chunks each, one ``zero_()`` per run."""
    import torch

    g, idx = _chunks(start, end, t.numel())
    if not _host(t):
        t.view(-1, g).index_fill_(0, torch.from_numpy(idx).to(t.device), 0)
    elif idx.size > _MAX_CHUNKS_PER_RUN * start.size:
        for s, e in zip(start.tolist(), end.tolist()):
            t[s:e].zero_()
    else:
        t.view(-1, g).numpy()[idx] = 0  # a view: writes land in the tensor


def _zero_torch(t: Any, start: np.ndarray, end: np.ndarray) -> None:
    """Zero ``[start, end)`` runs of one tensor that is not contiguous host memory, by torch: its short runs
    (under ``_LOOP_MIN_BYTES``), when at least ``_VEC_MIN_RUNS``, together (:func:`_zero_short`), every
    other run by ``zero_()`` of a slice."""
    short = end - start < _LOOP_MIN_BYTES
    if np.count_nonzero(short) >= _VEC_MIN_RUNS:
        _zero_short(t, start[short], end[short])
        start, end = start[~short], end[~short]
    for s, e in zip(start.tolist(), end.tolist()):
        t[s:e].zero_()


def _zero_few(tensors: Sequence[Any], rows: list[list[int]]) -> int:
    """:func:`_zero_rows` for a few rows, in plain Python (numpy's fixed cost per call would be most of the
    time): one pass checks every row and merges rows sorted by (region, offset) into runs (rows out of
    order: sorted first), then one ``memset`` per run on contiguous host tensors, one ``zero_()`` of a slice
    on others. Nothing is written until every row is checked."""
    count, total, host, other = len(tensors), 0, [], []
    cr: int | None = None
    cs = ce = size = ptr = 0
    for r, o, n in rows:
        e = o + n
        if r != cr or o < cs:  # the first row, a new region (rows are region-major), or out of order
            if cr is not None:
                if r < cr or (r == cr and o < cs):
                    return _zero_few(tensors, sorted(rows))
                host.append((ptr + cs, ce - cs)) if ptr else other.append((cr, cs, ce))
            if not 0 <= r < count:
                raise PlanError("zero", f"rows name region {r}; there are {count}")
            t = tensors[r]
            size, ptr = t.numel(), (t.data_ptr() if _host(t) and t.is_contiguous() else 0)
            if o < 0:
                raise PlanError("zero", f"row {[r, o, n]} lies outside its region ({size} B)")
            cr, cs, ce = r, o, e
        elif o > ce:  # a gap: the run so far is done
            host.append((ptr + cs, ce - cs)) if ptr else other.append((cr, cs, ce))
            cs, ce = o, e
        elif e > ce:
            ce = e
        if n < 0 or e > size:
            raise PlanError("zero", f"row {[r, o, n]} lies outside its region ({size} B)")
        total += n
    host.append((ptr + cs, ce - cs)) if ptr else other.append((cr, cs, ce))
    memset = _MEMSET
    for a, n in host:
        memset(a, 0, n)
    for r, s, e in other:
        if e > s:
            tensors[r][s:e].zero_()
    return total


def _zero_rows(tensors: Sequence[Any], rows: np.ndarray) -> int:
    """Zero ``(region, offset, length)`` rows of one flat uint8 tensor per region; returns the rows' byte
    total. Up to ``_FEW_ROWS`` rows are checked and merged in plain Python (:func:`_zero_few`). More are merged
    first into the fewest disjoint runs (:func:`zero_runs`: a request's blocks that lie side by side are one
    run); the runs
    on contiguous host tensors are zeroed by :func:`_zero_host` (runs of one length together, across
    regions), those on other tensors by torch (:func:`_zero_torch`). Rows outside their region raise
    :class:`~kvgeom.errors.PlanError` before any byte is written."""
    rows = np.asarray(rows, dtype=np.int64)
    if 0 < len(rows) <= _FEW_ROWS and rows.ndim == 2 and rows.shape[1] == 3:
        return _zero_few(tensors, rows.tolist())
    sizes = [t.numel() for t in tensors]
    region, start, end, total = zero_runs(rows, sizes)
    if not region.size:
        return 0
    # libc and the host view write unchecked: a run zero_runs let through would be a kvgeom bug, refused
    outside = (start < 0) | (end > np.asarray(sizes, dtype=np.int64)[region])
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise PlanError(
            "zero",
            f"run [{int(start[i])}, {int(end[i])}) of region {int(region[i])} lies outside it "
            f"({sizes[int(region[i])]} B)",
        )
    ptr = np.asarray([t.data_ptr() if _host(t) and t.is_contiguous() else 0 for t in tensors], np.int64)
    addr = ptr[region]
    direct = addr != 0  # 0: not contiguous host memory, zeroed by torch
    if direct.all():
        _zero_host(addr + start, end - start)
        return total
    _zero_host(addr[direct] + start[direct], (end - start)[direct])
    other = ~direct
    for r in np.unique(region[other]).tolist():
        m = other & (region == r)
        _zero_torch(tensors[r], start[m], end[m])
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
    whole pages): what a failed request zeroes so that no stale or partial bytes are ever read. Blocks side
    by side are one row (:func:`~kvgeom.plan.blockrows.block_runs`), so zeroing makes one call per run."""
    return block_runs(card.geometry, ids)
