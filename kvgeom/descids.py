"""NIXL descriptor ids of a request's blocks (vLLM-compatible ``_compute_desc_ids``).

Primer B.2.3, B.3.4, B.6.4.

A dlist is region-major, block-minor: attention (FA) descriptors of every region first, then the SSM
descriptors (per SSM region, per conv piece then temporal state, one per logical block).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .blocks import BlockIds, as_group_ids, check_positive_int
from .errors import BlockIdError, GroupMismatchError

__all__ = ["compute_desc_ids"]


def _region_offsets(
    region_num_blocks: Sequence[int] | None, num_regions: int, nb: int, bsr: int
) -> tuple[np.ndarray, int]:
    """Start of each attention region's descriptors and their total ``nfa``: capacities ``cap_r*bsr``
    (default ``nb`` each), exclusive prefix sum."""
    if region_num_blocks is None:
        caps = np.full(num_regions, nb, dtype=np.int64)
    else:
        if len(region_num_blocks) != num_regions:
            raise GroupMismatchError(
                "region_num_blocks",
                f"{len(region_num_blocks)} capacities for {num_regions} regions",
                value=len(region_num_blocks),
                expected=num_regions,
            )
        caps = np.asarray(region_num_blocks, dtype=np.int64).reshape(-1) * bsr
        if (caps < 0).any():
            raise GroupMismatchError(
                "region_num_blocks", f"capacities must be >= 0, got {list(region_num_blocks)}"
            )
    ends = np.cumsum(caps)
    return ends - caps, int(ends[-1]) if caps.size else 0


def _check_range(ids: np.ndarray, limit: int, field: str) -> None:
    if ids.size and int(ids.max()) >= limit:
        raise BlockIdError(
            field,
            f"block id {int(ids.max())} out of range [0, {limit})",
            value=int(ids.max()),
            expected=limit,
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
) -> np.ndarray:
    """Flat descriptor indices, one per block per region, in vLLM's order (``int64``).

    ``NB' = dst_num_blocks * bsr`` (``bsr = block_size_ratio or 1``); region capacities ``cap_r*bsr``
    (default ``NB'``), ``off_r`` their exclusive prefix sum, ``nfa`` their total. First applicable path:

    - pure attention (``ssm_region_indices is None``), at most one distinct region group id:
      ``v`` = all groups concatenated; ``[off_r + v_j for r for j]`` (B.3.4: ``r*NB' + v_j``).
    - pure attention with region group mapping (> 1 distinct ``region_group_ids``): per group ``g`` with
      ids, per region ``r`` (ascending) whose group id is ``g`` or ``-1`` (shared), ``off_r + b`` for its
      ids ``b``; a group with ids and no region is a :class:`GroupMismatchError`.
    - hybrid (``ssm_region_indices`` given), per group in order: attention ``r*NB' + b`` over all
      ``num_regions`` regions (vLLM does not use the capacities here); SSM ``nfa + s*NBL + b`` over the
      ``S = len(ssm_region_indices) * (num_conv_pieces + 1)`` streams, ``NBL = dst_num_blocks // ppl``.

    Ids must lie in ``[0, NB')`` (attention) or ``[0, NBL)`` (SSM, hybrid), else :class:`BlockIdError`.
    """
    groups = as_group_ids(block_ids, group_is_ssm, "block_ids")
    nblocks = check_positive_int(dst_num_blocks, "dst_num_blocks", minimum=0, error=GroupMismatchError)
    nregions = check_positive_int(num_regions, "num_regions", minimum=1, error=GroupMismatchError)
    bsr = 1 if block_size_ratio is None else check_positive_int(block_size_ratio, "block_size_ratio")
    ppl = check_positive_int(physical_blocks_per_logical, "physical_blocks_per_logical")
    nb = nblocks * bsr
    offs, nfa = _region_offsets(region_num_blocks, nregions, nb, bsr)
    if ssm_region_indices is None:
        for g, (ids, ssm) in enumerate(zip(groups, group_is_ssm, strict=True)):
            if ssm and ids.size:
                raise GroupMismatchError(
                    f"block_ids[{g}]",
                    "SSM group has block ids but ssm_region_indices is None (no SSM regions)",
                )
            _check_range(ids, nb, f"block_ids[{g}]")
        return _attention_ids(groups, offs, region_group_ids, nregions)
    return _hybrid_ids(
        groups, group_is_ssm, ssm_region_indices, nregions, nb, nfa, nblocks // ppl, num_conv_pieces
    )


def _attention_ids(
    groups: list[np.ndarray], offs: np.ndarray, region_group_ids: Sequence[int] | None, nregions: int
) -> np.ndarray:
    """Pure-attention paths: region-major over all groups, or per group over its own regions."""
    gids = None if region_group_ids is None else np.asarray(region_group_ids, dtype=np.int64).reshape(-1)
    if gids is not None and gids.size != nregions:
        raise GroupMismatchError(
            "region_group_ids",
            f"{gids.size} group ids for {nregions} regions",
            value=gids.size,
            expected=nregions,
        )
    if gids is None or np.unique(gids).size <= 1:
        v = np.concatenate([np.zeros(0, dtype=np.int64), *groups])
        return (offs[:, None] + v[None, :]).reshape(-1)
    parts = [np.zeros(0, dtype=np.int64)]
    for g, ids in enumerate(groups):
        if not ids.size:
            continue
        region_offs = offs[(gids == g) | (gids == -1)]
        if not region_offs.size:
            raise GroupMismatchError(
                f"block_ids[{g}]",
                f"group {g} has {ids.size} block ids but no region (region_group_ids={gids.tolist()})",
                value=g,
            )
        parts.append((region_offs[:, None] + ids[None, :]).reshape(-1))
    return np.concatenate(parts)


def _hybrid_ids(
    groups: list[np.ndarray],
    group_is_ssm: Sequence[bool],
    ssm_region_indices: Sequence[int],
    nregions: int,
    nb: int,
    nfa: int,
    nbl: int,
    num_conv_pieces: int,
) -> np.ndarray:
    """Hybrid (Mamba) path: attention groups over all regions, SSM groups over the SSM streams."""
    ssm_regions = [int(r) for r in ssm_region_indices]
    bad = [r for r in ssm_regions if not 0 <= r < nregions]
    if bad or len(set(ssm_regions)) != len(ssm_regions):
        raise GroupMismatchError(
            "ssm_region_indices",
            f"must be distinct regions in [0, {nregions}), got {ssm_regions}",
            value=ssm_regions,
        )
    pieces = check_positive_int(num_conv_pieces, "num_conv_pieces", error=GroupMismatchError)
    attn_offs = np.arange(nregions, dtype=np.int64) * nb
    ssm_offs = nfa + np.arange(len(ssm_regions) * (pieces + 1), dtype=np.int64) * nbl
    parts = [np.zeros(0, dtype=np.int64)]
    for g, (ids, ssm) in enumerate(zip(groups, group_is_ssm, strict=True)):
        if not ids.size:
            continue
        _check_range(ids, nbl if ssm else nb, f"block_ids[{g}]")
        stream_offs = ssm_offs if ssm else attn_offs
        if not stream_offs.size:
            raise GroupMismatchError(
                f"block_ids[{g}]", f"SSM group {g} has block ids but there are no SSM regions"
            )
        parts.append((stream_offs[:, None] + ids[None, :]).reshape(-1))
    return np.concatenate(parts)
