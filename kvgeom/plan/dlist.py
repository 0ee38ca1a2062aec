"""Descriptor tables (dlists), address-free.

A :class:`Dlist` is an ordered table of ``(region, offset, length)`` rows: row ``i`` is NIXL
descriptor ``i`` once bound to the region base addresses (``bind``). Orderings follow vLLM's NIXL
connector (region-major, block-minor; attention part first, SSM part appended), so descriptor ids
computed by :mod:`kvgeom.plan.descids` index these tables directly.

* :func:`local_dlist` -- this rank's whole-region table at a sub-block granularity ``bsr``;
* :func:`remote_dlist` -- a remote rank's table, every attention row already cut to this rank's share;
* :func:`routed_tables` -- kvgeom mode: both tables of one remote rank, every row cut by its route
  (vLLM mode's per-source split tables come from :func:`kvgeom.plan.splits.build_local_splits`).

All tables are built with numpy broadcasting (no Python loop per descriptor).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np

from kvgeom.errors import IncompatiblePairError, PlanError
from kvgeom.layout.runs import Runs
from kvgeom.layout.view import OFFSET_MASK, REGION_SHIFT, EngineView, pseudo_bases
from kvgeom.plan.strided import block_strided_rows, fa_local_rows, fa_remote_rows, mamba_local_rows

__all__ = ["Dlist", "check_bounds_all", "local_dlist", "remote_dlist", "routed_tables", "cut_fa_rows"]


class Dlist:
    """A descriptor table: its :class:`~kvgeom.layout.runs.Runs` (``layout``) at pseudo-addresses (``region
    << 44 | offset``), each run standing for ``count`` descriptors ``stride`` bytes apart; descriptor ids index
    its elements in run order, and ``num_fa`` of them are attention rows. :attr:`runs` is the same as NIXL's
    N x 5 strided rows ``(region << 44 | offset, length, 0, stride, count)``.

    ``Dlist(rows, num_fa)`` takes the runs (a :class:`~kvgeom.layout.runs.Runs`, or N x 5 rows) or expanded
    ``(region, offset, length)`` rows (N x 3, one descriptor each). The handshake checks, NIXL binding
    (:meth:`bind_strided`) and per-id lookups (:meth:`take`) work on the runs, so a table's memory and its
    checks are linear in runs, not in blocks; the expanded rows (:attr:`rows`) are derived on first use.
    """

    def __init__(self, rows: np.ndarray | Runs, num_fa: int) -> None:
        self.layout = rows if isinstance(rows, Runs) else _as_runs(rows)
        self.num_fa = int(num_fa)

    @cached_property
    def runs(self) -> np.ndarray:
        """NIXL's N x 5 strided rows of :attr:`layout` (device 0)."""
        return self.layout.nixl()

    @cached_property
    def _ends(self) -> np.ndarray:
        out: np.ndarray = np.cumsum(self.layout.count)
        return out

    def __len__(self) -> int:
        return int(self._ends[-1]) if self._ends.size else 0

    @cached_property
    def rows(self) -> np.ndarray:
        """The expanded N x 3 ``(region, offset, length)`` rows, one per descriptor."""
        return self.layout.rows()

    def take(self, ids: np.ndarray) -> np.ndarray:
        """``(region, offset, length)`` of descriptors ``ids`` without expanding the table."""
        ids = np.asarray(ids, dtype=np.int64)
        n = len(self)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise PlanError(
                "descriptor ids", f"id outside the {n}-row table", value=int(ids.max()), expected=n
            )
        lay = self.layout
        run = np.searchsorted(self._ends, ids, side="right")
        addr = lay.base[run] + (ids - (self._ends[run] - lay.count[run])) * lay.stride[run]
        out = np.empty((ids.size, 3), dtype=np.int64)
        out[:, 0] = addr >> REGION_SHIFT
        out[:, 1] = addr & OFFSET_MASK
        out[:, 2] = lay.length[run]
        return out

    def _bases(self, bases: Sequence[int]) -> np.ndarray:
        base = np.asarray(bases, dtype=np.uint64)
        regions = self.layout.base >> REGION_SHIFT
        if regions.size and int(regions.max()) >= base.size:
            raise PlanError(
                "bases",
                f"{base.size} base addresses for a table over {int(regions.max()) + 1} regions",
                value=base.size,
            )
        return base

    def bind(self, bases: Sequence[int], device: int = 0) -> np.ndarray:
        """NIXL's expanded N x 3 uint64 ``(addr, len, dev)`` array for region base addresses ``bases``."""
        base = self._bases(bases)
        out = np.empty((len(self), 3), dtype=np.uint64)
        out[:, 0] = base[self.rows[:, 0]] + self.rows[:, 1].astype(np.uint64)
        out[:, 1] = self.rows[:, 2].astype(np.uint64)
        out[:, 2] = np.uint64(device)
        return out

    def bind_strided(self, bases: Sequence[int], device: int = 0) -> np.ndarray:
        """NIXL's N x 5 uint64 strided ``(addr, len, dev, stride, count)`` array (``prep_xfer_dlist`` with a
        memory type, NIXL >= 1.5): the same descriptor ids as :meth:`bind`, one row per run."""
        base = self._bases(bases)
        out = self.runs.astype(np.uint64)
        lay = self.layout
        out[:, 0] = base[lay.base >> REGION_SHIFT] + (lay.base & OFFSET_MASK).astype(np.uint64)
        out[:, 2] = np.uint64(device)
        return out

    def pseudo_addresses(self) -> np.ndarray:
        """N x 3 int64 ``(region << 44 | offset, length, 0)``: lets address-based code run address-free."""
        addr, length = self.layout.expand()
        return np.column_stack([addr, length, np.zeros_like(addr)])

    @classmethod
    def from_pseudo(cls, descs: np.ndarray, num_fa: int) -> Dlist:
        """A table from pseudo-addressed rows: N x 3 ``(addr, len, dev)`` or N x 5 strided runs."""
        return cls(Runs.from_nixl(np.asarray(descs, dtype=np.int64)), num_fa)

    def check_bounds(self, region_bytes: Sequence[int], side: str) -> None:
        """Raise unless every descriptor lies inside its region (invariant I6); checked per run (its first
        and last descriptor), never per descriptor."""
        lay = self.layout
        keep = lay.count > 0
        if not keep.any():
            return
        base, ln, stride, count = lay.base[keep], lay.length[keep], lay.stride[keep], lay.count[keep]
        sizes = np.asarray(region_bytes, dtype=np.int64)
        r, off = base >> REGION_SHIFT, base & OFFSET_MASK
        bad = _out_of_bounds(off, ln, stride, count, _limits(r, sizes))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            first = int(np.cumsum(count)[i] - count[i])
            raise PlanError(
                f"{side} dlist[{first}]",
                f"run (region {r[i]}, offset {off[i]}, length {ln[i]}, "
                f"stride {stride[i]}, count {count[i]}) leaves its registered region of "
                f"{int(sizes[np.clip(r[i], 0, sizes.size - 1)])} bytes",
                value=(int(r[i]), int(off[i]), int(ln[i]), int(stride[i]), int(count[i])),
            )


def _out_of_bounds(
    off: np.ndarray, ln: np.ndarray, stride: np.ndarray, count: np.ndarray, limit: np.ndarray
) -> np.ndarray:
    """Per run of at least one descriptor (offset, length, stride, count): whether its first or last
    descriptor leaves its region of ``limit`` bytes (``-1``: the run names no region)."""
    last = off + (count - 1) * stride
    lo, hi = np.minimum(off, last), np.maximum(off, last)
    out: np.ndarray = (limit < 0) | (lo < 0) | (ln < 0) | (hi + ln > limit)
    return out


def _limits(r: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The bytes of region ``r`` of ``sizes`` for every run, ``-1`` where ``r`` names no region."""
    ok = (r >= 0) & (r < sizes.size)
    return np.where(ok, sizes[np.clip(r, 0, max(sizes.size - 1, 0))] if sizes.size else -1, -1)


def check_bounds_all(tables: Sequence[tuple[Dlist, Sequence[int], str]]) -> None:
    """:meth:`Dlist.check_bounds` of every ``(table, region bytes, side)`` in one vectorised check over all
    their runs (a handshake's tables, one per remote rank); where a run is out of bounds, the first such
    table raises its own error, as checked alone."""
    if not tables:
        return
    lays = [t.layout for t, _, _ in tables]
    which = np.repeat(np.arange(len(tables)), [lay.base.size for lay in lays])
    col = {
        f: np.concatenate([getattr(lay, f) for lay in lays]) for f in ("base", "length", "stride", "count")
    }
    keep = col["count"] > 0
    r, which = col["base"][keep] >> REGION_SHIFT, which[keep]
    width = max(1, max(len(sizes) for _, sizes, _ in tables))
    # each table's region sizes, one row each; the last column (no such region) stays -1
    grid = np.full((len(tables), width + 1), -1, dtype=np.int64)
    for i, (_, sizes, _) in enumerate(tables):
        grid[i, : len(sizes)] = sizes
    n = np.asarray([len(sizes) for _, sizes, _ in tables], dtype=np.int64)[which]
    limit = grid[which, np.where((r >= 0) & (r < n), r, width)]
    off = col["base"][keep] & OFFSET_MASK
    bad = _out_of_bounds(off, col["length"][keep], col["stride"][keep], col["count"][keep], limit)
    if bad.any():
        table, region_bytes, side = tables[int(which[np.flatnonzero(bad)[0]])]
        table.check_bounds(region_bytes, side)


def _as_runs(rows: np.ndarray) -> Runs:
    """N x 5 strided rows or N x 3 ``(region, offset, length)`` rows as runs at pseudo-addresses."""
    arr = np.asarray(rows, dtype=np.int64)
    if arr.size == 0:
        return Runs.empty()
    if arr.ndim != 2 or arr.shape[1] not in (3, 5):
        raise PlanError(
            "rows",
            f"must be an N x 3 (region, offset, length) or N x 5 strided array, got shape {arr.shape}",
            value=arr.shape,
        )
    if arr.shape[1] == 5:
        return Runs.from_nixl(arr)
    if int(arr[:, 1].min()) < 0 or int(arr[:, 1].max()) > OFFSET_MASK:
        raise PlanError(
            "rows",
            f"offsets must lie in [0, 2**{REGION_SHIFT}) (a pseudo-address's offset bits)",
            value=(int(arr[:, 1].min()), int(arr[:, 1].max())),
        )
    return Runs.from_rows(arr)


def _ssm_rows(regions: np.ndarray, page: np.ndarray, nbl: int, pieces: Sequence[tuple[int, int]]) -> Runs:
    """SSM runs: for each SSM region, for each piece ``(offset, length)``, one run over the logical blocks
    (state pages ``page`` bytes apart)."""
    if not len(regions) or not len(pieces):
        return Runs.empty()
    offs = np.asarray([p[0] for p in pieces], dtype=np.int64)
    lens = np.asarray([p[1] for p in pieces], dtype=np.int64)
    base = (np.asarray(regions, dtype=np.int64) << REGION_SHIFT)[:, None] + offs[None, :]
    return Runs.of(base.reshape(-1), np.tile(lens, len(regions)), np.repeat(page, len(pieces)), nbl)


def _fa_rows(
    lens: np.ndarray,
    strides: np.ndarray,
    nb: int,
    bsr: int,
    bases: Sequence[int],
    offsets: np.ndarray,
    lengths: np.ndarray,
) -> Runs:
    """Attention runs: stream-major, block-minor, ``bsr`` sub-blocks per block (streams start at ``bases``),
    each descriptor cut to its stream's slice ``(offsets, lengths)`` (a route's)."""
    parts = [
        block_strided_rows(int(b), int(n) // bsr, int(st), nb, bsr) for b, n, st in zip(bases, lens, strides)
    ]
    counts = np.asarray([len(x) for x in parts], dtype=np.int64)
    runs = Runs.from_nixl(np.concatenate(parts)) if parts else Runs.empty()
    return runs.slice(np.repeat(offsets, counts), np.repeat(lengths, counts))


def cut_fa_rows(
    bases: Sequence[int], strides: Sequence[int], num_blocks: Sequence[int], units: Sequence[Runs]
) -> Runs:
    """Attention runs of pages cut by their token runs (:func:`kvgeom.layout.tokenruns.unit_runs`): per
    stream ``i`` (first byte ``bases[i]``, ``num_blocks[i]`` kernel blocks ``strides[i]`` apart), per block,
    its ``units[i]`` (runs within a block), in that order: stream-major, block, then unit, as
    :func:`local_dlist` orders sub-blocks."""
    return Runs.concat(
        [
            Runs.of(int(b), 0, int(st), int(nb)).compose(u)
            for b, st, nb, u in zip(bases, strides, num_blocks, units)
        ]
    )


def _table(fa: Runs, ssm: Runs | None) -> Dlist:
    """A table from runs on pseudo-addresses: attention runs, then SSM runs."""
    return Dlist(fa if ssm is None else Runs.concat([fa, ssm]), fa.size)


def local_dlist(view: EngineView, bsr: int = 1) -> Dlist:
    """This rank's whole-region table at ``bsr`` sub-blocks per kernel block (vLLM B.2.3 / B.6.1.4).

    Attention row ``r*NB*bsr + b*bsr + j`` is sub-block ``j`` of kernel block ``b`` of region ``r``; SSM
    rows follow, never ratio-expanded: per SSM region, per conv piece then the temporal state, one
    row per logical block (:func:`kvgeom.plan.strided.fa_local_rows`, :func:`kvgeom.plan.strided.mamba_local_rows`).
    """
    lens = np.asarray(view.block_lens, dtype=np.int64)
    if bsr < 1 or np.any(lens % bsr):
        raise PlanError(
            "block_size_ratio",
            f"{bsr} does not divide every block length {view.block_lens}",
            value=bsr,
            expected=view.block_lens,
        )
    fa = Runs.from_nixl(
        fa_local_rows(
            view.pseudo_bases(),
            view.block_lens,
            view.block_strides,
            [view.num_blocks] * view.num_regions,
            bsr,
        )
    )
    ssm = None
    if view.ssm_sizes is not None and view.conv_offsets is not None:
        ssm = Runs.from_nixl(
            mamba_local_rows(
                pseudo_bases(view.num_regions),
                view.block_strides,
                view.ssm_region_indices,
                view.conv_offsets,
                view.ssm_sizes,
                view.ppl,
                view.logical_num_blocks,
                ple_region=view.ple_region,
                ple_block_len=view.ple_len if view.ple_region is not None else None,
            )
        )
    return _table(fa, ssm)


def _ple_rows(local: EngineView, remote: EngineView, bases: Sequence[int]) -> Runs:
    """The replicated state page of ``remote`` (region ``local.ple_region``) as one run over its logical
    blocks, copied whole; the two sides' pages must be equally long (vLLM's handshake rule)."""
    if local.ple_region is None:
        return Runs.empty()
    if remote.ple_region is None or local.ple_len * local.ppl != remote.ple_len * remote.ppl:
        raise IncompatiblePairError(
            "ple_block_len",
            "replicated state (PLE) pages must be equally long on both sides",
            local=local.ple_len * local.ppl,
            remote=None if remote.ple_region is None else remote.ple_len * remote.ppl,
        )
    r = local.ple_region
    return Runs.of(
        int(bases[r]),
        remote.ple_len * remote.ppl,
        int(remote.block_strides[r]) * remote.ppl,
        remote.logical_num_blocks,
    )


def remote_dlist(
    local: EngineView,
    remote: EngineView,
    bsr: int,
    attn_reads: int,
    rank_offset_factor: int,
    ssm_pieces: Sequence[tuple[int, int]] | None,
    draft: tuple[int, int] | None = None,
) -> Dlist:
    """A remote rank's table as this rank reads it (vLLM B.2.4): every attention row cut to this rank's
    share (``attn_reads`` sources split a SPLIT row; MLA rows are read whole; ``draft``: ``(reads, rank offset
    factor)`` of the head-sharded layers next to MLA layers), then per SSM region one row per logical block
    for each of ``ssm_pieces`` (``(offset, length)`` in the remote state page of every conv piece and the
    temporal state, as this rank reads them)."""
    if local.num_regions != remote.num_regions:
        raise PlanError(
            "num_regions",
            f"local has {local.num_regions} regions, remote {remote.num_regions}",
            local=local.num_regions,
            remote=remote.num_regions,
        )
    bases = pseudo_bases(remote.num_regions)
    drafts = [k for k, mla in enumerate(local.region_is_mla) if not mla] if draft is not None else []
    reads, factor = draft if draft is not None else (1, 0)
    fa = fa_remote_rows(  # vLLM's N x 5 rows
        remote.pseudo_bases(),
        remote.block_strides,
        [remote.num_blocks] * remote.num_regions,
        local.block_lens,
        local.region_is_mla,
        bsr,
        max(attn_reads, 1),
        rank_offset_factor,
        draft_regions=drafts,
        draft_reads=max(reads, 1),
        draft_offset_factor=factor,
    )
    ssm = None
    if ssm_pieces is not None:
        over = _rows_over(
            bases,
            remote.block_strides,
            local.ssm_region_indices,
            ssm_pieces,
            remote.ppl,
            remote.logical_num_blocks,
        )
        ssm = Runs.concat([over, _ple_rows(local, remote, bases)])
    return _table(Runs.from_nixl(fa), ssm)


def _rows_over(
    bases: Sequence[int],
    strides: Sequence[int],
    regions: Sequence[int],
    pieces: Sequence[tuple[int, int]],
    ppl: int,
    nbl: int,
) -> Runs:
    """Strided SSM runs of ``pieces`` in every region of ``regions`` (state pages ``stride * ppl`` apart)."""
    if not len(regions) or not len(pieces):
        return Runs.empty()
    cols = np.asarray(
        [(int(bases[i]) + off, size, int(strides[i]) * ppl) for i in regions for off, size in pieces],
        dtype=np.int64,
    )
    return Runs.of(cols[:, 0], cols[:, 1], cols[:, 2], nbl)


def routed_tables(
    local: EngineView,
    remote: EngineView,
    local_rows: int,
    remote_rows: int,
    fa: Sequence[tuple[int, int, int]],
    ssm: Sequence[tuple[int, int, int]] | None,
    cut: tuple[Runs, Runs] | None = None,
) -> tuple[Dlist, Dlist]:
    """kvgeom mode: the local and remote tables of one remote rank, every row cut by its slice
    (``(local offset, remote offset, length)`` per attention region and per SSM piece, from
    :func:`kvgeom.pair.route.route`). Row counts and orders are those of :func:`local_dlist` and
    :func:`remote_dlist` at ``local_rows`` / ``remote_rows`` rows per kernel block (1 remote row unless
    token-major pages are cut per token). ``cut``: the local and remote attention runs of pages cut by their
    token runs (:func:`cut_fa_rows`), taken as they are (their route moves whole rows)."""
    if cut is not None:
        base, rrows = cut
        return _with_ssm(local, remote, ssm, base, rrows)
    lo, ro, ln = (np.asarray([s[i] for s in fa], dtype=np.int64) for i in range(3))
    base = _fa_rows(
        np.asarray(local.block_lens, dtype=np.int64),
        np.asarray(local.block_strides, dtype=np.int64),
        local.num_blocks,
        local_rows,
        local.pseudo_bases(),
        lo,
        ln,
    )
    rrows = _fa_rows(
        np.asarray(remote.block_lens, dtype=np.int64),
        np.asarray(remote.block_strides, dtype=np.int64),
        remote.num_blocks,
        remote_rows,
        remote.pseudo_bases(),
        ro,
        ln,
    )
    return _with_ssm(local, remote, ssm, base, rrows)


def _with_ssm(
    local: EngineView,
    remote: EngineView,
    ssm: Sequence[tuple[int, int, int]] | None,
    base: Runs,
    rrows: Runs,
) -> tuple[Dlist, Dlist]:
    """Both tables of :func:`routed_tables`: the attention runs given, then each side's SSM runs."""
    lstride = np.asarray(local.block_strides, dtype=np.int64)
    rstride = np.asarray(remote.block_strides, dtype=np.int64)
    lssm = rssm = Runs.empty()
    if local.ssm_sizes is not None and local.conv_offsets is not None and remote.ssm_sizes is not None:
        regions = np.asarray(local.ssm_region_indices, dtype=np.int64)
        if ssm is None:  # this rank sends no state: whole pieces on each side (in bounds, never referenced)
            lpieces = list(local.conv_offsets) + [(local.ssm_sizes[0], local.ssm_sizes[1])]
            rpieces = list(remote.conv_offsets or local.conv_offsets) + [
                (remote.ssm_sizes[0], remote.ssm_sizes[1])
            ]
        else:
            lpieces = [(s[0], s[2]) for s in ssm]
            rpieces = [(s[1], s[2]) for s in ssm]
        lssm = _ssm_rows(regions, lstride[regions] * local.ppl, local.logical_num_blocks, lpieces)
        rssm = _ssm_rows(regions, rstride[regions] * remote.ppl, remote.logical_num_blocks, rpieces)
        # the replicated page, whole on both sides
        lssm = Runs.concat([lssm, _ple_rows(local, local, pseudo_bases(local.num_regions))])
        rssm = Runs.concat([rssm, _ple_rows(local, remote, pseudo_bases(remote.num_regions))])
    return Dlist(Runs.concat([base, lssm]), base.size), Dlist(Runs.concat([rrows, rssm]), rrows.size)
