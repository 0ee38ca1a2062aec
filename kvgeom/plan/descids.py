"""NIXL descriptor ids of a request's blocks (vLLM-compatible ``_compute_desc_ids``).

docs/vllm-behaviour.md B.2.3, B.3.4, B.6.4.

A dlist is region-major, block-minor: the attention (FA) descriptors of every region (or of every
transfer layer, under layer-name routing) first, then the SSM descriptors (per SSM region, per conv
piece then temporal state, one per logical block), then one stream for a TP-replicated state page (the
PLE page of CSA-linear models).

Every one of vLLM's orderings is the same computation on different data: an ordered table of
**segments** ``(offset, group, capacity)``; the ids are the concatenation, over segments, of
``offset + block_ids[group]``, and an id must lie below its segment's capacity (else it would address
the next region's descriptors). :func:`desc_segments` builds the table, :func:`segment_ids` applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvgeom.blocks import BlockIds, as_group_ids, check_positive_int
from kvgeom.errors import BlockIdError, GroupMismatchError
from kvgeom.layout.view import SHARED_GROUP

__all__ = ["Segments", "desc_segments", "segment_ids", "apply_segments", "compute_desc_ids"]

"""A region group id meaning "viewed by several groups" (vLLM ``_SHARED_REGION_GROUP_ID``)."""


@dataclass(frozen=True, eq=False)
class Segments:
    """An ordered segment table: segment ``k`` emits ``offset[k] + block_ids[group[k]]``, each id below
    ``capacity[k]`` (``int64`` arrays of equal length). ``grid`` marks vLLM's region-major path (every
    region carries the groups ``grid`` in order), which is applied as one broadcast."""

    offset: np.ndarray
    group: np.ndarray
    capacity: np.ndarray
    grid: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return int(self.offset.size)

    @cached_property
    def limits(self) -> dict[int, int]:
        """Per group its segments carry, the smallest capacity among them (every id must lie below it)."""
        out: dict[int, int] = {}
        for g, cap in zip(self.group.tolist(), self.capacity.tolist()):
            out[g] = min(out.get(g, cap), cap)
        return out

    @cached_property
    def carried(self) -> frozenset[int]:
        """The groups some segment carries."""
        return frozenset(self.limits)

    @cached_property
    def carried_prefix(self) -> int:
        """The number of leading groups ``0..k-1`` that some segment carries."""
        k = 0
        while k in self.carried:
            k += 1
        return k

    @cached_property
    def columns(self) -> tuple[tuple[int, np.ndarray], ...]:
        """Per run of :attr:`runs`, its group and its segments' offsets as a column (what a request adds its
        ids to)."""
        return tuple((g, self.offset[a:b, None]) for g, a, b in self.runs)

    @cached_property
    def grid_offsets(self) -> np.ndarray:
        """Region-major tables (:attr:`grid`): each region's offset, as a column."""
        return self.offset[:: max(len(self.grid or ()), 1), None]

    @cached_property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """``(group, first, end)`` of each run of consecutive segments of one group."""
        if not self.group.size:
            return ()
        cuts = np.flatnonzero(np.diff(self.group)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [self.group.size]])
        return tuple((int(self.group[a]), int(a), int(b)) for a, b in zip(starts, ends))


def _caps(region_num_blocks: Sequence[int] | None, count: int, nb: int, bsr: int, field: str) -> np.ndarray:
    if region_num_blocks is None:
        return np.full(count, nb, dtype=np.int64)
    caps = np.asarray(region_num_blocks, dtype=np.int64).reshape(-1) * bsr
    if caps.size != count:
        raise GroupMismatchError(
            field, f"{caps.size} capacities for {count} regions", value=int(caps.size), expected=count
        )
    if (caps < 0).any():
        raise GroupMismatchError(field, f"capacities must be >= 0, got {list(region_num_blocks)}")
    return caps


def _table(
    offsets: np.ndarray, groups: np.ndarray, caps: np.ndarray, grid: tuple[int, ...] | None = None
) -> Segments:
    return Segments(
        np.asarray(offsets, dtype=np.int64).reshape(-1),
        np.asarray(groups, dtype=np.int64).reshape(-1),
        np.asarray(caps, dtype=np.int64).reshape(-1),
        grid,
    )


def desc_segments(
    num_groups: int,
    dst_num_blocks: int,
    num_regions: int,
    block_size_ratio: int | None,
    physical_blocks_per_logical: int,
    group_is_ssm: Sequence[bool],
    ssm_region_indices: Sequence[int] | None = None,
    num_conv_pieces: int = 3,
    region_num_blocks: Sequence[int] | None = None,
    region_group_ids: Sequence[int] | None = None,
    *,
    uses_region_group_mapping: bool | None = None,
    transfer_layer_group_ids: Sequence[int] | None = None,
    scratch_groups: Sequence[int] = (),
    scratch_region_indices: Sequence[int] = (),
    ple_group: int | None = None,
    group_streams: bool = False,
) -> Segments:
    """The segment table of vLLM's ``_compute_desc_ids``: ``NB' = dst_num_blocks * bsr``; capacities
    ``cap_r * bsr`` (default ``NB'``), ``off_r`` their exclusive prefix sum, ``nfa`` their total. First
    applicable path:

    1. layer-name routing (``transfer_layer_group_ids`` non-empty, one group per transfer layer ``k``):
       ``(off_k, g_k)`` for each ``k``;
    2. no SSM (``ssm_region_indices is None``) and no group mapping: ``(off_r, g)`` region-major, every
       group in every region;
    3. no SSM, group mapping (``uses_region_group_mapping``, default: > 1 distinct ``region_group_ids``):
       per group ``g``, ``(off_r, g)`` for each region whose group id is ``g`` or :data:`SHARED_GROUP`;
    4. SSM present, per group: attention ``(r * NB', g)`` over all ``num_regions`` regions, or over
       ``scratch_region_indices`` for a circular-buffer group (``scratch_groups``), or, with
       ``group_streams`` (kvgeom mode), over the regions whose ``region_group_ids`` entry is ``g``; SSM ``(nfa + s * NBL,
       g)`` over the ``len(ssm_region_indices) * (num_conv_pieces + 1)`` streams, ``NBL = dst_num_blocks
       // ppl``; the replicated-state group ``ple_group`` takes the one stream after them.
    """
    nblocks, bsr, ppl = _checked_sizes(
        num_groups, dst_num_blocks, block_size_ratio, physical_blocks_per_logical, group_is_ssm
    )
    nb = nblocks * bsr
    routed = list(transfer_layer_group_ids or ())
    if routed:
        return _routed_segments(routed, num_groups, region_num_blocks, nb, bsr)
    nregions = check_positive_int(num_regions, "num_regions", minimum=1, error=GroupMismatchError)
    if ssm_region_indices is None:
        return _attention_segments(
            num_groups,
            group_is_ssm,
            nregions,
            region_num_blocks,
            region_group_ids,
            uses_region_group_mapping,
            nb,
            bsr,
        )
    ssm_regions = _checked_ssm_regions(ssm_region_indices, nregions)
    return _hybrid_segments(  # arguments in the order vLLM's checks run
        group_is_ssm,
        nregions,
        len(ssm_regions)
        * (check_positive_int(num_conv_pieces, "num_conv_pieces", error=GroupMismatchError) + 1),
        _caps(region_num_blocks, nregions, nb, bsr, "region_num_blocks"),
        nb,
        nblocks // ppl,
        _checked_scratch(scratch_region_indices, nregions),
        frozenset(scratch_groups),
        _own_groups(region_group_ids, nregions) if group_streams else None,
        ple_group,
    )


def _checked_sizes(
    num_groups: int,
    dst_num_blocks: int,
    block_size_ratio: int | None,
    physical_blocks_per_logical: int,
    group_is_ssm: Sequence[bool],
) -> tuple[int, int, int]:
    """The table's block count, block-size ratio and kernel blocks per logical block, checked."""
    nblocks = check_positive_int(dst_num_blocks, "dst_num_blocks", minimum=0, error=GroupMismatchError)
    bsr = 1 if block_size_ratio is None else check_positive_int(block_size_ratio, "block_size_ratio")
    ppl = check_positive_int(physical_blocks_per_logical, "physical_blocks_per_logical")
    if len(group_is_ssm) != num_groups:
        raise GroupMismatchError(
            "group_is_ssm",
            f"{len(group_is_ssm)} group kinds for {num_groups} groups",
            value=len(group_is_ssm),
            expected=num_groups,
        )
    return nblocks, bsr, ppl


def _checked_ssm_regions(ssm_region_indices: Sequence[int], nregions: int) -> list[int]:
    ssm_regions = [int(r) for r in ssm_region_indices]
    bad = [r for r in ssm_regions if not 0 <= r < nregions]
    if bad or len(set(ssm_regions)) != len(ssm_regions):
        raise GroupMismatchError(
            "ssm_region_indices",
            f"must be distinct regions in [0, {nregions}), got {ssm_regions}",
            value=ssm_regions,
        )
    return ssm_regions


def _routed_segments(
    routed: list[int], num_groups: int, region_num_blocks: Sequence[int] | None, nb: int, bsr: int
) -> Segments:
    """Path 1, layer-name routing: one segment per transfer layer, of its group."""
    caps = _caps(region_num_blocks, len(routed), nb, bsr, "region_num_blocks")
    bad = [g for g in routed if not 0 <= g < num_groups]
    if bad:
        raise GroupMismatchError(
            "transfer_layer_group_ids", f"groups {bad} outside [0, {num_groups})", value=bad
        )
    return _table(np.cumsum(caps) - caps, np.asarray(routed), caps)


def _attention_segments(
    num_groups: int,
    group_is_ssm: Sequence[bool],
    nregions: int,
    region_num_blocks: Sequence[int] | None,
    region_group_ids: Sequence[int] | None,
    uses_region_group_mapping: bool | None,
    nb: int,
    bsr: int,
) -> Segments:
    """Paths 2 and 3, no SSM: region-major over every attention group, or per group over its regions."""
    ssm_groups = [g for g, ssm in enumerate(group_is_ssm) if ssm]
    count = nregions if region_num_blocks is None else len(region_num_blocks)
    if region_group_ids is None and count != nregions:
        raise GroupMismatchError(
            "region_num_blocks", f"{count} capacities for {nregions} regions", value=count, expected=nregions
        )
    caps = _caps(region_num_blocks, count, nb, bsr, "region_num_blocks")
    offs = np.cumsum(caps) - caps
    # without explicit group ids, the worker's own: one group for all of its num_regions regions
    gids = (
        np.zeros(nregions, dtype=np.int64)
        if region_group_ids is None
        else np.asarray(region_group_ids, dtype=np.int64).reshape(-1)
    )
    if gids.size != count:
        raise GroupMismatchError(
            "region_group_ids",
            f"{gids.size} group ids for {count} regions",
            value=int(gids.size),
            expected=count,
        )
    mapped = (
        np.unique(gids).size > 1 if uses_region_group_mapping is None else bool(uses_region_group_mapping)
    )
    attn = [g for g in range(num_groups) if g not in ssm_groups]
    if not mapped:
        grid = np.asarray(attn, dtype=np.int64)
        return _table(
            np.repeat(offs, grid.size), np.tile(grid, count), np.repeat(caps, grid.size), tuple(attn)
        )
    rows = [
        (offs[m], np.full(int(m.sum()), g), caps[m])
        for g in attn
        for m in [(gids == g) | (gids == SHARED_GROUP)]
    ]
    cols = [np.concatenate([np.zeros(0, np.int64)] + [r[i] for r in rows]) for i in range(3)]
    return _table(cols[0], cols[1], cols[2])


def _checked_scratch(scratch_region_indices: Sequence[int], nregions: int) -> np.ndarray:
    scratch = np.asarray(sorted(int(r) for r in scratch_region_indices), dtype=np.int64)
    if scratch.size and (scratch.min() < 0 or scratch.max() >= nregions):
        raise GroupMismatchError(
            "scratch_region_indices", f"must lie in [0, {nregions})", value=scratch.tolist()
        )
    return scratch


def _own_groups(region_group_ids: Sequence[int] | None, nregions: int) -> np.ndarray:
    own = np.asarray(region_group_ids if region_group_ids is not None else (), dtype=np.int64).reshape(-1)
    if own.size != nregions:
        raise GroupMismatchError(
            "region_group_ids",
            f"group streams need one group id per region: {own.size} for {nregions} regions",
            value=int(own.size),
            expected=nregions,
        )
    return own


def _hybrid_segments(
    group_is_ssm: Sequence[bool],
    nregions: int,
    streams: int,
    caps: np.ndarray,
    nb: int,
    nbl: int,
    scratch: np.ndarray,
    scratch_groups: frozenset[int],
    own: np.ndarray | None,
    ple_group: int | None,
) -> Segments:
    """Path 4, SSM present: per group its attention regions' streams, or its ``streams`` SSM streams after
    every attention region."""
    nfa = int(caps.sum())
    starts: list[np.ndarray] = []
    groups: list[np.ndarray] = []
    cap_rows: list[np.ndarray] = []
    for g, ssm in enumerate(group_is_ssm):
        if ssm:
            s = np.asarray([streams]) if g == ple_group else np.arange(streams)
            starts.append(nfa + s * nbl)
            cap_rows.append(np.full(s.size, nbl))
        else:
            r = (
                np.flatnonzero(own == g)
                if own is not None
                else scratch
                if g in scratch_groups
                else np.arange(nregions)
            )
            starts.append(r * nb)
            cap_rows.append(np.full(r.size, nb))
        groups.append(np.full(starts[-1].size, g))
    return _table(np.concatenate(starts), np.concatenate(groups), np.concatenate(cap_rows))


def segment_ids(segments: Segments, block_ids: BlockIds, group_is_ssm: Sequence[bool]) -> np.ndarray:
    """``concat_k(offset[k] + block_ids[group[k]])`` (``int64``); :class:`BlockIdError` for an id at or past
    its segment's capacity, :class:`GroupMismatchError` for ids of a group no segment carries."""
    return apply_segments(segments, as_group_ids(block_ids, group_is_ssm, "block_ids"))


def apply_segments(segments: Segments, groups: Sequence[np.ndarray], checked: bool = False) -> np.ndarray:
    """:func:`segment_ids` on ids that are already one 1-D ``int64`` array per group (a planner's own).
    ``checked``: the caller bounds every id by its pool and checks the descriptor ids it gets against its
    tables, so only groups without segments are refused here."""
    if checked:
        carried = segments.carried
        for g, x in (
            enumerate(groups) if len(groups) > segments.carried_prefix else ()
        ):  # a loop over groups: the checks, then the broadcast
            if x.size and g not in carried:
                _refuse(segments, groups)
    else:
        limits = segments.limits
        for g, x in enumerate(groups):
            if x.size and (g not in limits or int(x.max()) >= limits[g]):
                _refuse(segments, groups)
    if segments.grid is not None:  # region-major: every region carries the same groups, in order
        v = np.concatenate([np.zeros(0, np.int64), *(groups[g] for g in segments.grid)])
        out: np.ndarray = (segments.grid_offsets + v[None, :]).reshape(-1)
        return out
    # one broadcast per run of a group's segments (a loop over groups, never over blocks)
    parts: list[np.ndarray] = [(col + groups[g]).reshape(-1) for g, col in segments.columns if groups[g].size]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _refuse(segments: Segments, groups: Sequence[np.ndarray]) -> None:
    """The error for ids of a group no segment carries, or past a segment's capacity (first in segment order)."""
    sizes = np.asarray([g.size for g in groups], dtype=np.int64)
    used = np.zeros(len(groups), dtype=bool)
    used[segments.group] = True
    orphan = np.flatnonzero(~used & (sizes > 0))
    if orphan.size:
        g = int(orphan[0])
        raise GroupMismatchError(
            f"block_ids[{g}]", f"group {g} has {int(sizes[g])} block ids but no region carries it", value=g
        )
    gmax = np.asarray([int(g.max()) if g.size else -1 for g in groups], dtype=np.int64)
    over = np.flatnonzero(gmax[segments.group] >= segments.capacity)
    if over.size:
        k = int(over[0])
        g = int(segments.group[k])
        raise BlockIdError(
            f"block_ids[{g}]",
            f"block id {int(gmax[g])} out of range [0, {int(segments.capacity[k])})",
            value=int(gmax[g]),
            expected=int(segments.capacity[k]),
        )


def compute_desc_ids(
    block_ids: BlockIds,
    dst_num_blocks: int,
    num_regions: int,
    block_size_ratio: int | None,
    physical_blocks_per_logical: int,
    group_is_ssm: Sequence[bool],
    ssm_region_indices: Sequence[int] | None = None,
    num_conv_pieces: int = 3,
    region_num_blocks: Sequence[int] | None = None,
    region_group_ids: Sequence[int] | None = None,
    *,
    uses_region_group_mapping: bool | None = None,
    transfer_layer_group_ids: Sequence[int] | None = None,
    scratch_groups: Sequence[int] = (),
    scratch_region_indices: Sequence[int] = (),
    ple_group: int | None = None,
) -> np.ndarray:
    """Flat descriptor indices, one per block per region stream, in vLLM's order (``int64``).

    The paths and their data are those of :func:`desc_segments`; ids must lie below their segment's
    capacity (``[0, NB')`` for attention, ``[0, NBL)`` for SSM in the hybrid path), else
    :class:`BlockIdError`. Example (layer-name routing, transfer layers of groups ``(0, 1, 0)``, 4 blocks
    per region): ``[[1], [2]]`` -> ``[1, 6, 9]``.
    """
    if isinstance(block_ids, np.ndarray) and block_ids.ndim == 1 and block_ids.dtype != object:
        raise BlockIdError(
            "block_ids", "must be a list with one id list per KV-cache group, got a flat array"
        )
    segments = desc_segments(
        len(group_is_ssm),
        dst_num_blocks,
        num_regions,
        block_size_ratio,
        physical_blocks_per_logical,
        group_is_ssm,
        ssm_region_indices,
        num_conv_pieces,
        region_num_blocks,
        region_group_ids,
        uses_region_group_mapping=uses_region_group_mapping,
        transfer_layer_group_ids=transfer_layer_group_ids,
        scratch_groups=scratch_groups,
        scratch_region_indices=scratch_region_indices,
        ple_group=ple_group,
    )
    groups = as_group_ids(block_ids, group_is_ssm, "block_ids")
    if ssm_region_indices is None and not transfer_layer_group_ids:
        for g, (ids, ssm) in enumerate(zip(groups, group_is_ssm, strict=True)):
            if ssm and ids.size:
                raise GroupMismatchError(
                    f"block_ids[{g}]",
                    "SSM group has block ids but ssm_region_indices is None (no SSM regions)",
                )
    return apply_segments(segments, groups)
