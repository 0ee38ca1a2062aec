"""The byte rows of a request's blocks on one rank, and rows as the fewest runs: the pure geometry every
transport zeroes with (a failed request's blocks, a quarantined attempt's blocks given back, the receive
step's zero rows). Rows are ``(region, offset, length)`` triples of ``int64``, as the plan's moves are.
"""

from __future__ import annotations

import numpy as np

from kvgeom.blocks import BlockIds, as_group_ids
from kvgeom.errors import BlockIdError, PlanError
from kvgeom.layout.geometry import RankGeometry
from kvgeom.layout.view import OFFSET_MASK, REGION_SHIFT

__all__ = ["block_rows", "block_runs", "zero_runs"]


def _kernel_blocks(geom: RankGeometry, ids: BlockIds) -> np.ndarray:
    """The request's kernel blocks on this rank, sorted, each once (:func:`block_rows`' checks)."""
    groups = as_group_ids(ids, geom.group_is_ssm, "ids")
    logical = np.concatenate([np.zeros(0, np.int64), *groups])
    limit = geom.logical_num_blocks
    if logical.size and (logical.min() < 0 or logical.max() >= limit):
        bad = int(logical.min() if logical.min() < 0 else logical.max())
        raise BlockIdError("ids", f"block id {bad} outside 0..{limit - 1}", value=bad, expected=limit)
    ppl = geom.ppl
    if ppl == 1:
        return np.unique(logical)
    return np.unique((np.unique(logical)[:, None] * ppl + np.arange(ppl)).ravel())


def _rows(geom: RankGeometry, first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Rows of runs of ``count`` kernel blocks from ``first`` in every region, region-major."""
    index = np.asarray([r.index for r in geom.regions], dtype=np.int64)
    stride = np.asarray([r.block_stride for r in geom.regions], dtype=np.int64)
    rows = np.empty((index.size, first.size, 3), dtype=np.int64)
    rows[:, :, 0] = index[:, None]
    rows[:, :, 1] = stride[:, None] * first[None, :]
    rows[:, :, 2] = stride[:, None] * count[None, :]
    return rows.reshape(-1, 3)


def block_rows(geom: RankGeometry, ids: BlockIds) -> np.ndarray:
    """``(region, offset, length)`` rows covering every block of a request on this rank: every region,
    whole block strides, one row per (region, kernel block), region-major, each kernel block once. Logical
    id ``b`` of any group is kernel blocks ``b * ppl + j``, ``j < ppl`` (an attention block is split into
    ``ppl`` kernel blocks; an SSM slot's page spans as many). ``ids``: one id list per group
    (:class:`~kvgeom.errors.BlockIdError` / ``GroupMismatchError`` otherwise); an id outside
    ``0 .. geom.logical_num_blocks - 1`` is a :class:`~kvgeom.errors.BlockIdError` naming it and the limit.
    """
    blocks = _kernel_blocks(geom, ids)
    return _rows(geom, blocks, np.ones(blocks.size, dtype=np.int64))


def block_runs(geom: RankGeometry, ids: BlockIds) -> np.ndarray:
    """The bytes of :func:`block_rows` as the fewest rows: one row per (region, run of adjacent kernel
    blocks), region-major, in block order (checks as :func:`block_rows`). What a failed request zeroes:
    blocks side by side are one range in every region (a block's bytes end where the next one's start), so
    the runs are found once on the ids, not per region on the rows, and zeroing makes one call per run."""
    blocks = _kernel_blocks(geom, ids)
    if not blocks.size:
        return np.zeros((0, 3), dtype=np.int64)
    cut = np.flatnonzero(blocks[1:] != blocks[:-1] + 1) + 1
    first = np.append(0, cut)
    return _rows(geom, blocks[first], np.diff(np.append(first, blocks.size)))


def zero_runs(
    rows: np.ndarray, sizes: np.ndarray | list[int] | tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``(region, offset, length)`` rows as the fewest disjoint runs: ``(region, start, end)`` arrays sorted
    by region then start, where touching or overlapping rows of one region are one run (never across
    regions), and the rows' byte total (every row counted, as zeroed). Rows of length 0 are dropped. A row
    outside its region (``sizes``: each region's bytes) or a region that is not one raises
    :class:`~kvgeom.errors.PlanError` naming the row."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        e = np.zeros(0, np.int64)
        return e, e, e, 0
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise PlanError("zero", f"rows must be (region, offset, length) triples, got shape {rows.shape}")
    size = np.asarray(sizes, dtype=np.int64)
    region, offset, length = rows.T
    lo, hi = int(region.min()), int(region.max())
    if lo < 0 or hi >= size.size:
        raise PlanError("zero", f"rows name region {lo if lo < 0 else hi}; there are {size.size}")
    over = (offset < 0) | (length < 0) | (offset + length > size[region])
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise PlanError(
            "zero", f"row {i} {rows[i].tolist()} lies outside its region ({int(size[region[i]])} B)"
        )
    total = int(length.sum())
    if total == 0:
        e = np.zeros(0, np.int64)
        return e, e, e, 0
    run_region, start, end = _merged(region, offset, length)
    return run_region, start, end, total


def _merged(
    region: np.ndarray, offset: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Checked rows (some of them non-empty) as :func:`zero_runs`' ``(region, start, end)`` arrays: at
    pseudo-addresses ``region << REGION_SHIFT | offset`` (two regions never touch), sorted only when they
    are not already (a request's rows are region-major and in block order), joined where one reaches the
    next. A dozen numpy calls, since a small request's zeroing is mostly their fixed cost."""
    keep = length > 0
    if not keep.all():
        region, offset, length = region[keep], offset[keep], length[keep]
    addr = (region << REGION_SHIFT) | offset
    stop = addr + length
    if addr.size > 1 and (addr[1:] < addr[:-1]).any():
        order = np.argsort(addr, kind="stable")
        addr, stop = addr[order], stop[order]
    reach = np.maximum.accumulate(stop)  # a row may end before one it lies in
    first = np.flatnonzero(addr[1:] > reach[:-1]) + 1
    start = addr[np.append(0, first)]
    end = reach[np.append(first - 1, addr.size - 1)]
    return start >> REGION_SHIFT, start & OFFSET_MASK, end - (start & ~OFFSET_MASK)
