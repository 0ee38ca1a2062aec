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
from kvgeom.layout.view import OFFSET_MASK, REGION_SHIFT, EngineView, pseudo_bases
from kvgeom.plan.splits import expand_strided
from kvgeom.plan.strided import block_strided_rows, fa_local_rows, fa_remote_rows, mamba_local_rows

__all__ = ["Dlist", "local_dlist", "remote_dlist", "routed_tables", "cut_fa_rows"]


class Dlist:
    """A descriptor table kept as strided runs: ``runs`` is an N x 5 int64 array ``(region << 44 | offset,
    length, 0, stride, count)``, each run standing for ``count`` descriptors ``stride`` bytes apart
    (NIXL >= 1.5's compressed form). Descriptor ids index the expansion in run order; ``num_fa`` of them
    are attention rows.

    ``Dlist(rows, num_fa)`` takes either the runs (N x 5) or expanded ``(region, offset, length)`` rows
    (N x 3, one descriptor each). The expanded rows (:attr:`rows`) are built only when asked for; the
    handshake checks, NIXL binding (:meth:`bind_strided`) and per-id lookups (:meth:`take`) work on the
    runs, so a table's memory and its checks are linear in runs, not in blocks.
    """

    def __init__(self, rows: np.ndarray, num_fa: int) -> None:
        arr = np.asarray(rows, dtype=np.int64)
        self._rows: np.ndarray | None = None  # the expanded rows: given (N x 3), or built by :attr:`rows`
        if arr.size == 0:
            arr = arr.reshape(0, arr.shape[1] if arr.ndim == 2 and arr.shape[1] in (3, 5) else 5)
        if arr.ndim != 2 or arr.shape[1] not in (3, 5):
            raise PlanError(
                "rows",
                f"must be an N x 3 (region, offset, length) or N x 5 strided array, got shape {arr.shape}",
                value=arr.shape,
            )
        if arr.shape[1] == 3:
            if arr.size and (int(arr[:, 1].min()) < 0 or int(arr[:, 1].max()) > OFFSET_MASK):
                raise PlanError(
                    "rows",
                    f"offsets must lie in [0, 2**{REGION_SHIFT}) (a pseudo-address's offset bits)",
                    value=(int(arr[:, 1].min()), int(arr[:, 1].max())),
                )
            runs = np.empty((arr.shape[0], 5), dtype=np.int64)
            runs[:, 0] = (arr[:, 0] << REGION_SHIFT) | arr[:, 1]
            runs[:, 1] = arr[:, 2]
            runs[:, 2] = 0
            runs[:, 3] = arr[:, 2]
            runs[:, 4] = 1
            self._rows = arr
            arr = runs
        self.runs = arr
        self.num_fa = int(num_fa)

    @cached_property
    def _ends(self) -> np.ndarray:
        return np.cumsum(self.runs[:, 4])

    @cached_property
    def _len(self) -> int:
        return int(self._ends[-1]) if self._ends.size else 0

    def __len__(self) -> int:
        return self._len

    @property
    def rows(self) -> np.ndarray:
        """The expanded N x 3 ``(region, offset, length)`` rows, one per descriptor (built on first use)."""
        if self._rows is None:
            pseudo = expand_strided(self.runs)
            out = np.empty((pseudo.shape[0], 3), dtype=np.int64)
            out[:, 0] = pseudo[:, 0] >> REGION_SHIFT
            out[:, 1] = pseudo[:, 0] & OFFSET_MASK
            out[:, 2] = pseudo[:, 1]
            self._rows = out
        return self._rows

    def take(self, ids: np.ndarray) -> np.ndarray:
        """``(region, offset, length)`` of descriptors ``ids`` without expanding the table."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= len(self)):
            raise PlanError(
                "descriptor ids",
                f"id outside the {len(self)}-row table",
                value=int(ids.max()),
                expected=len(self),
            )
        if self._rows is not None:
            return np.asarray(self._rows[ids], dtype=np.int64)
        run = np.searchsorted(self._ends, ids, side="right")
        r = self.runs[run]
        addr = r[:, 0] + (ids - (self._ends[run] - r[:, 4])) * r[:, 3]
        out = np.empty((ids.size, 3), dtype=np.int64)
        out[:, 0] = addr >> REGION_SHIFT
        out[:, 1] = addr & OFFSET_MASK
        out[:, 2] = r[:, 1]
        return out

    def _bases(self, bases: Sequence[int]) -> np.ndarray:
        base = np.asarray(bases, dtype=np.uint64)
        regions = self.runs[:, 0] >> REGION_SHIFT
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
        out[:, 0] = base[self.runs[:, 0] >> REGION_SHIFT] + (self.runs[:, 0] & OFFSET_MASK).astype(np.uint64)
        out[:, 2] = np.uint64(device)
        return out

    def pseudo_addresses(self) -> np.ndarray:
        """N x 3 int64 ``(region << 44 | offset, length, 0)``: lets address-based code run address-free."""
        return expand_strided(self.runs)

    @classmethod
    def from_pseudo(cls, descs: np.ndarray, num_fa: int) -> Dlist:
        """A table from pseudo-addressed rows: N x 3 ``(addr, len, dev)`` or N x 5 strided runs."""
        descs = np.asarray(descs, dtype=np.int64)
        if descs.ndim == 2 and descs.shape[1] == 5:
            runs = descs.copy()
            runs[:, 2] = 0
            return cls(runs, num_fa)
        rows = np.empty((descs.shape[0], 3), dtype=np.int64)
        rows[:, 0] = descs[:, 0] >> REGION_SHIFT
        rows[:, 1] = descs[:, 0] & OFFSET_MASK
        rows[:, 2] = descs[:, 1]
        return cls(rows, num_fa)

    def check_bounds(self, region_bytes: Sequence[int], side: str) -> None:
        """Raise unless every descriptor lies inside its region (invariant I6); checked per run (its first
        and last descriptor), never per descriptor."""
        runs = self.runs[self.runs[:, 4] > 0]
        if not len(runs):
            return
        sizes = np.asarray(region_bytes, dtype=np.int64)
        r, off, ln = runs[:, 0] >> REGION_SHIFT, runs[:, 0] & OFFSET_MASK, runs[:, 1]
        last = off + (runs[:, 4] - 1) * runs[:, 3]
        lo, hi = np.minimum(off, last), np.maximum(off, last)
        bad = (r < 0) | (r >= sizes.size) | (lo < 0) | (ln < 0)
        bad |= ~bad & (hi + ln > sizes[np.clip(r, 0, sizes.size - 1)])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            first = int(np.cumsum(runs[:, 4])[i] - runs[i, 4])
            raise PlanError(
                f"{side} dlist[{first}]",
                f"run (region {r[i]}, offset {off[i]}, length {ln[i]}, "
                f"stride {runs[i, 3]}, count {runs[i, 4]}) leaves its registered region of "
                f"{int(sizes[np.clip(r[i], 0, sizes.size - 1)])} bytes",
                value=(int(r[i]), int(off[i]), int(ln[i]), int(runs[i, 3]), int(runs[i, 4])),
            )


def _ssm_rows(
    regions: np.ndarray, page: np.ndarray, nbl: int, pieces: Sequence[tuple[int, int]]
) -> np.ndarray:
    """SSM runs: for each SSM region, for each piece ``(offset, length)``, one run over the logical blocks
    (state pages ``page`` bytes apart)."""
    if not len(regions) or not len(pieces):
        return np.zeros((0, 5), dtype=np.int64)
    offs = np.asarray([p[0] for p in pieces], dtype=np.int64)
    lens = np.asarray([p[1] for p in pieces], dtype=np.int64)
    runs = np.empty((len(regions), len(pieces), 5), dtype=np.int64)
    runs[..., 0] = (np.asarray(regions, dtype=np.int64) << REGION_SHIFT)[:, None] + offs[None, :]
    runs[..., 1] = lens[None, :]
    runs[..., 2] = 0
    runs[..., 3] = np.asarray(page, dtype=np.int64)[:, None]
    runs[..., 4] = nbl
    return runs.reshape(-1, 5)


def _fa_rows(
    lens: np.ndarray,
    strides: np.ndarray,
    nb: int,
    bsr: int,
    bases: Sequence[int],
    offsets: np.ndarray,
    lengths: np.ndarray,
) -> np.ndarray:
    """Attention runs: stream-major, block-minor, ``bsr`` sub-blocks per block (streams start at ``bases``),
    each descriptor moved by its stream's ``offsets`` and cut to its ``lengths``."""
    parts = [
        block_strided_rows(int(b), int(n) // bsr, int(st), nb, bsr) for b, n, st in zip(bases, lens, strides)
    ]
    counts = np.asarray([len(x) for x in parts], dtype=np.int64)
    runs = np.concatenate(parts) if parts else np.zeros((0, 5), dtype=np.int64)
    runs[:, 0] += np.repeat(offsets, counts)
    runs[:, 1] = np.repeat(lengths, counts)
    return runs


def cut_fa_rows(
    bases: Sequence[int], strides: Sequence[int], num_blocks: Sequence[int], units: Sequence[np.ndarray]
) -> np.ndarray:
    """Attention runs of pages cut by their token runs (:func:`kvgeom.layout.tokenruns.unit_runs`): per
    stream ``i`` (first byte ``bases[i]``, ``num_blocks[i]`` kernel blocks ``strides[i]`` apart), per block,
    its ``units[i]`` (``M x 4`` ``(offset, length, stride, count)`` within a block), in that order: stream-major,
    block, then unit, as :func:`local_dlist` orders sub-blocks."""
    parts = []
    for base, stride, nb, u in zip(bases, strides, num_blocks, units):
        u = np.asarray(u, dtype=np.int64).reshape(-1, 4)
        runs = np.empty((int(nb), u.shape[0], 5), dtype=np.int64)
        runs[..., 0] = int(base) + np.arange(int(nb), dtype=np.int64)[:, None] * int(stride) + u[None, :, 0]
        runs[..., 1] = u[None, :, 1]
        runs[..., 2] = 0
        runs[..., 3] = u[None, :, 2]
        runs[..., 4] = u[None, :, 3]
        parts.append(runs.reshape(-1, 5))
    return np.concatenate(parts) if parts else np.zeros((0, 5), dtype=np.int64)


def _table(fa: np.ndarray, ssm: np.ndarray | None) -> Dlist:
    """A table from strided rows on pseudo-addresses: attention rows, then SSM rows."""
    rows = fa if ssm is None or not len(ssm) else np.concatenate([fa, ssm])
    return Dlist.from_pseudo(rows, int(fa[:, 4].sum()))


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
    fa = fa_local_rows(
        view.pseudo_bases(), view.block_lens, view.block_strides, [view.num_blocks] * view.num_regions, bsr
    )
    ssm = None
    if view.ssm_sizes is not None and view.conv_offsets is not None:
        ssm = mamba_local_rows(
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
    return _table(fa, ssm)


def _ple_rows(local: EngineView, remote: EngineView, bases: Sequence[int]) -> np.ndarray:
    """The replicated state page of ``remote`` (region ``local.ple_region``) as one row over its logical
    blocks, copied whole; the two sides' pages must be equally long (vLLM's handshake rule)."""
    if local.ple_region is None:
        return np.zeros((0, 5), dtype=np.int64)
    if remote.ple_region is None or local.ple_len * local.ppl != remote.ple_len * remote.ppl:
        raise IncompatiblePairError(
            "ple_block_len",
            "replicated state (PLE) pages must be equally long on both sides",
            local=local.ple_len * local.ppl,
            remote=None if remote.ple_region is None else remote.ple_len * remote.ppl,
        )
    r = local.ple_region
    return np.asarray(
        [
            [
                int(bases[r]),
                remote.ple_len * remote.ppl,
                0,
                int(remote.block_strides[r]) * remote.ppl,
                remote.logical_num_blocks,
            ]
        ],
        dtype=np.int64,
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
    fa = fa_remote_rows(
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
        ssm = _rows_over(
            bases,
            remote.block_strides,
            local.ssm_region_indices,
            ssm_pieces,
            remote.ppl,
            remote.logical_num_blocks,
        )
        ssm = np.concatenate([ssm, _ple_rows(local, remote, bases)])
    return _table(fa, ssm)


def _rows_over(
    bases: Sequence[int],
    strides: Sequence[int],
    regions: Sequence[int],
    pieces: Sequence[tuple[int, int]],
    ppl: int,
    nbl: int,
) -> np.ndarray:
    """Strided SSM rows of ``pieces`` in every region of ``regions`` (state pages ``stride * ppl`` apart)."""
    return np.asarray(
        [(int(bases[i]) + off, size, 0, int(strides[i]) * ppl, nbl) for i in regions for off, size in pieces],
        dtype=np.int64,
    ).reshape(-1, 5)


def routed_tables(
    local: EngineView,
    remote: EngineView,
    local_rows: int,
    remote_rows: int,
    fa: Sequence[tuple[int, int, int]],
    ssm: Sequence[tuple[int, int, int]] | None,
    cut: tuple[np.ndarray, np.ndarray] | None = None,
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
    base: np.ndarray,
    rrows: np.ndarray,
) -> tuple[Dlist, Dlist]:
    """Both tables of :func:`routed_tables`: the attention runs given, then each side's SSM runs."""
    lstride = np.asarray(local.block_strides, dtype=np.int64)
    rstride = np.asarray(remote.block_strides, dtype=np.int64)
    lssm = rssm = np.zeros((0, 5), dtype=np.int64)
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
        lssm = np.concatenate([lssm, _ple_rows(local, local, pseudo_bases(local.num_regions))])
        rssm = np.concatenate([rssm, _ple_rows(local, remote, pseudo_bases(remote.num_regions))])
    return (
        Dlist(np.concatenate([base, lssm]), int(base[:, 4].sum())),
        Dlist(np.concatenate([rrows, rssm]), int(rrows[:, 4].sum())),
    )
