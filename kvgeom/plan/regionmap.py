"""Region-mapped pulls: P and D that group the same caches differently.

Each engine groups its layers into KV-cache groups and gives each request one block list per group; a
region (one registered tensor) is viewed by one group, or by several (group id
:data:`~kvgeom.layout.view.SHARED_GROUP`). When P and D group the same regions differently (e.g. a HiSparse
decoder splitting host-resident and device-resident layers into separate groups, vLLM PR 40020), block
lists cannot be paired per group. They are paired per **region** instead: each side's lists are first
expanded to one list per region (its own group's list; a shared region all groups concatenated), then
the pages of each region are matched by position (pure MLA, equal kernel block sizes; with decode context
parallelism by global page position, once per remote rank), and the local pages nothing covered are zeroed in
that region only.

vLLM ``_block_ids_by_region``, ``_apply_prefix_caching_by_region`` and the ``region_blocks_to_zero``
bookkeeping of ``_read_blocks_for_req``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from kvgeom.blocks import BlockIds, as_ids
from kvgeom.errors import GroupMismatchError, PlanError
from kvgeom.layout.geometry import Group, RankGeometry
from kvgeom.layout.view import SHARED_GROUP
from kvgeom.pair.dcp import apply_dcp_prefix_caching
from kvgeom.pair.streams import region_group_ids

__all__ = [
    "block_ids_by_region",
    "apply_prefix_caching_by_region",
    "region_zero_ids",
    "region_zero_rows",
    "by_region",
]


def by_region(geom: RankGeometry) -> RankGeometry:
    """``geom`` with one KV-cache group per region: group ``r`` is region ``r``'s layers (the spec of the
    group viewing it; a shared region's, its first member's group's), every region viewed by its own group
    only. A request's lists on it are :func:`block_ids_by_region` of its lists on ``geom``: what the planner
    binds a region-mapped pull on."""
    gids = region_group_ids(geom)
    groups, regions = [], []
    for r, (region, g) in enumerate(zip(geom.regions, gids)):
        spec = geom.groups[g if g >= 0 else region.members[0][0]].spec
        groups.append(Group(r, spec, tuple(dict.fromkeys(n for _, n in region.members))))
        regions.append(replace(region, members=tuple((r, n) for _, n in region.members)))
    return replace(geom, groups=tuple(groups), regions=tuple(regions))


def block_ids_by_region(block_ids: BlockIds, region_group_ids: Sequence[int]) -> list[np.ndarray]:
    """One id list per region: group ``g``'s list for a region of group ``g``, all groups' lists
    concatenated (group order) for a shared region (``-1``)."""
    groups = [as_ids(g, f"block_ids[{i}]") for i, g in enumerate(block_ids)]
    shared = np.concatenate([np.zeros(0, np.int64), *groups])
    out = []
    for r, gid in enumerate(int(g) for g in region_group_ids):
        if gid == SHARED_GROUP:
            out.append(shared.copy())
        elif 0 <= gid < len(groups):
            out.append(groups[gid].copy())
        else:
            raise GroupMismatchError(
                f"region_group_ids[{r}]",
                f"group {gid} of a request with {len(groups)} groups",
                value=gid,
                expected=len(groups),
            )
    return out


def apply_prefix_caching_by_region(
    decode_ids: Sequence[Sequence[int] | np.ndarray],
    prefill_ids: Sequence[Sequence[int] | np.ndarray],
    num_computed_blocks: Sequence[int] | None = None,
    num_remote_blocks: int | None = None,
    remote_rank: int = 0,
    local_dcp_size: int = 1,
    local_dcp_rank: int = 0,
    remote_dcp_size: int = 1,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Pair D's uncached pages with P's, region by region (vLLM ``_apply_prefix_caching_by_region``).

    Nothing on D: empty lists. With ``num_computed_blocks`` (per region, D's cached pages) and
    ``num_remote_blocks`` (the request's pages on P, without allocation padding): each region by global
    page position (:func:`kvgeom.pair.dcp.apply_dcp_prefix_caching`, which also applies without DCP).
    Otherwise each region end-trims P's list to D's count; D holding more pages than P supplied is a
    :class:`PlanError`.
    """
    if len(decode_ids) != len(prefill_ids):
        raise GroupMismatchError(
            "prefill_ids",
            f"{len(prefill_ids)} prefill regions for {len(decode_ids)} decode regions",
            value=len(prefill_ids),
            expected=len(decode_ids),
        )
    dec = [as_ids(x, f"decode_ids[{r}]") for r, x in enumerate(decode_ids)]
    pre = [as_ids(x, f"prefill_ids[{r}]") for r, x in enumerate(prefill_ids)]
    if not any(x.size for x in dec):
        empty = [np.zeros(0, np.int64) for _ in dec]
        return empty, [e.copy() for e in empty]
    if num_computed_blocks is not None:
        return _by_page_position(
            dec,
            pre,
            num_computed_blocks,
            num_remote_blocks,
            remote_rank,
            local_dcp_size,
            local_dcp_rank,
            remote_dcp_size,
        )
    out = []
    for r, (d, p) in enumerate(zip(dec, pre)):
        if d.size > p.size:
            raise PlanError(
                f"decode_ids[{r}]",
                f"D allocated {d.size} pages in region {r} but P supplied {p.size}",
                local=int(d.size),
                remote=int(p.size),
            )
        out.append(p[p.size - d.size :])  # d.size == 0: p[p.size:], empty
    return dec, out


def _by_page_position(
    dec: list[np.ndarray],
    pre: list[np.ndarray],
    num_computed_blocks: Sequence[int],
    num_remote_blocks: int | None,
    remote_rank: int,
    local_dcp_size: int,
    local_dcp_rank: int,
    remote_dcp_size: int,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each region paired by global page position, from D's cached pages and the request's pages on P."""
    if num_remote_blocks is None:
        raise PlanError(
            "num_remote_blocks",
            "matching regions by page position needs the request's remote page count",
            value=None,
        )
    if len(num_computed_blocks) != len(dec):
        raise GroupMismatchError(
            "num_computed_blocks",
            f"{len(num_computed_blocks)} counts for {len(dec)} regions",
            value=len(num_computed_blocks),
            expected=len(dec),
        )
    pairs = [
        apply_dcp_prefix_caching(
            d, p, remote_rank, local_dcp_size, local_dcp_rank, remote_dcp_size, int(c), num_remote_blocks
        )
        for d, p, c in zip(dec, pre, num_computed_blocks)
    ]
    return [a for a, _ in pairs], [b for _, b in pairs]


def region_zero_ids(
    local_by_region: Sequence[np.ndarray], matched_by_rank: Sequence[Sequence[np.ndarray]]
) -> list[np.ndarray]:
    """D's pages to zero per region after a region-mapped pull: region ``r``'s list past the pages matched
    over all source ranks (``matched_by_rank[k][r]``, the local pages rank ``k`` covered)."""
    out = []
    for r, ids in enumerate(local_by_region):
        covered = sum(int(np.asarray(spec[r]).size) for spec in matched_by_rank)
        out.append(np.asarray(ids, dtype=np.int64)[covered:].copy())
    return out


def region_zero_rows(
    block_ids_by_region: Sequence[Sequence[int] | np.ndarray],
    block_lens: Sequence[int],
    block_strides: Sequence[int],
) -> np.ndarray:
    """``(region, offset, length)`` rows clearing pages ``block_ids_by_region[r]`` of each region ``r``
    (page ``b`` of region ``r`` is ``[b * stride_r, b * stride_r + len_r)``), region by region."""
    if len(block_ids_by_region) > len(block_lens) or len(block_lens) != len(block_strides):
        raise GroupMismatchError(
            "block_ids_by_region",
            f"{len(block_ids_by_region)} id lists for {len(block_lens)} "
            f"regions ({len(block_strides)} strides)",
            value=len(block_ids_by_region),
            expected=len(block_lens),
        )
    ids = [as_ids(x, f"block_ids_by_region[{r}]") for r, x in enumerate(block_ids_by_region)]
    region = np.repeat(np.arange(len(ids), dtype=np.int64), [x.size for x in ids])
    flat = np.concatenate([np.zeros(0, np.int64), *ids])
    strides = np.asarray(block_strides, dtype=np.int64)
    lens = np.asarray(block_lens, dtype=np.int64)
    return np.stack([region, flat * strides[region], lens[region]], axis=1)
