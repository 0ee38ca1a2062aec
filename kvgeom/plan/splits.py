"""Local split handles for P_TP > D_TP (vLLM-compatible ``_build_local_splits_from_plan``, B.3.3, B.6.9).

Descriptors are strided rows ``(addr, len, dev, stride, count)``: a row stands for the ``count``
descriptors ``(addr + k*stride, len, dev)``; a 3-column row ``(addr, len, dev)`` is one block, read as
``(addr, len, dev, len, 1)``. Arrays are ``int64``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvgeom.blocks import check_positive_int
from kvgeom.errors import GroupMismatchError, PlanError, UnsupportedError
from kvgeom.pair.tp import TPMapping

__all__ = ["as_strided", "expand_strided", "build_local_splits"]

ADDR, LEN, DEV, STRIDE, COUNT = range(5)


def as_strided(descs: np.ndarray | Sequence[Sequence[int]]) -> np.ndarray:
    """``descs`` as an Nx5 ``int64`` strided array (Nx3 rows become count-1 runs with ``stride = len``)."""
    arr = np.asarray(descs, dtype=np.int64)
    if arr.size == 0:
        return np.zeros((0, 5), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] not in (3, 5):
        raise PlanError("descs", f"must be an Nx3 or Nx5 descriptor array, got shape {arr.shape}")
    if arr.shape[1] == 3:
        arr = np.column_stack([arr, arr[:, LEN], np.ones(len(arr), dtype=np.int64)])
    if (arr[:, COUNT] < 0).any() or (arr[:, LEN] < 0).any():
        raise PlanError("descs", "descriptor lengths and counts must be >= 0")
    return arr


def expand_strided(rows: np.ndarray) -> np.ndarray:
    """Expand strided rows to one ``(addr + k*stride, len, dev)`` row per descriptor (``k < count``),
    in row order: ``M = sum(count)`` rows (vectorised with ``np.repeat``)."""
    arr = as_strided(rows)
    counts = arr[:, COUNT]
    rep = np.repeat(arr, counts, axis=0)
    first = np.cumsum(counts) - counts
    k = np.arange(rep.shape[0], dtype=np.int64) - np.repeat(first, counts)
    return np.column_stack([rep[:, ADDR] + k * rep[:, STRIDE], rep[:, LEN], rep[:, DEV]])


def _first_list(mapping: TPMapping, group_is_ssm: Sequence[bool], want_ssm: bool) -> tuple[int, ...] | None:
    for ranks, ssm in zip(mapping.source_ranks_per_group, group_is_ssm, strict=True):
        if bool(ssm) == want_ssm:
            return ranks
    return None


def _replicated_fa_rows(
    starts: np.ndarray,
    bsr: int,
    region_is_mla: Sequence[bool] | None,
    region_num_blocks: Sequence[int] | None,
    num_fa_descs: int,
) -> np.ndarray:
    """REPLICATE flag of each FA row: the region owning the row's first descriptor is MLA (regions end at
    the cumulative ``cap_r*bsr``). Without region info every FA row is SPLIT."""
    if region_is_mla is None and region_num_blocks is None:
        return np.zeros(starts.size, dtype=bool)
    if region_is_mla is None or region_num_blocks is None or len(region_is_mla) != len(region_num_blocks):
        raise GroupMismatchError(
            "region_is_mla",
            "region_is_mla and region_num_blocks must both be given, one entry per FA region",
            value=None if region_is_mla is None else len(region_is_mla),
            expected=None if region_num_blocks is None else len(region_num_blocks),
        )
    ends = np.cumsum(np.asarray(region_num_blocks, dtype=np.int64).reshape(-1) * bsr)
    total = int(ends[-1]) if ends.size else 0
    if total != num_fa_descs:
        raise GroupMismatchError(
            "region_num_blocks",
            f"FA region blocks {total} != num_fa_descs {num_fa_descs}",
            value=total,
            expected=num_fa_descs,
        )
    region = np.searchsorted(ends, starts, side="right")
    # every start lies below num_fa_descs = ends[-1], so every region index is below len(ends)
    return np.asarray(region_is_mla, dtype=bool)[region]


def build_local_splits(
    descs: np.ndarray | Sequence[Sequence[int]],
    mapping: TPMapping,
    num_fa_descs: int,
    block_size_ratio: int,
    group_is_ssm: Sequence[bool],
    region_is_mla: Sequence[bool] | None = None,
    region_num_blocks: Sequence[int] | None = None,
    allow_sharded_ratio: bool = False,
    num_replicated_tail: int = 0,
) -> list[np.ndarray]:
    """One Nx5 strided dlist per source rank, in ``mapping.all_source_ranks`` order (index ``p``).

    Rows starting (flat index of their first descriptor) below ``num_fa_descs`` are FA, the rest SSM (a row
    straddling the boundary is FA as a whole, as in vLLM), except the last ``num_replicated_tail``
    descriptors: a TP-replicated state page (the PLE page of CSA-linear models, one per logical block),
    copied whole to every source rank.
    ``fa_splits = len(sources of the first attention group)``, ``ssm_splits = len(sources of the first SSM
    group)``. Per source rank: SPLIT FA rows ``len //= fa_splits, addr += slot_of(rank)*len``; SSM rows
    ``len //= ssm_splits, addr += p*len``; REPLICATE (MLA-region) FA rows untouched. Counts and strides never
    change, so every split handle shares the full handle's descriptor ids.

    Refusals: ``num_fa_descs`` beyond the descriptors (:class:`PlanError`); region capacities that do not
    add up to ``num_fa_descs`` (:class:`GroupMismatchError`); head-sharded FA with ``block_size_ratio > 1``
    and ``fa_splits > 1`` (:class:`UnsupportedError`, vLLM's guard, unless ``allow_sharded_ratio``).
    """
    rows = as_strided(descs)
    bsr = check_positive_int(block_size_ratio, "block_size_ratio")
    nfa = check_positive_int(num_fa_descs, "num_fa_descs", minimum=0, error=PlanError)
    n_groups = len(mapping.source_ranks_per_group)
    if len(group_is_ssm) != n_groups:
        raise GroupMismatchError(
            "group_is_ssm",
            f"{len(group_is_ssm)} group kinds but the mapping has {n_groups} groups",
            value=len(group_is_ssm),
            expected=n_groups,
        )
    starts, tail = _boundaries(rows, nfa, num_replicated_tail)
    total = int(rows[:, COUNT].sum())
    is_fa = starts < nfa  # by first descriptor, as vLLM: a row straddling the boundary counts as FA
    replicated = _replicated_fa_rows(starts[is_fa], bsr, region_is_mla, region_num_blocks, nfa)
    split_fa = np.zeros(rows.shape[0], dtype=bool)
    split_fa[np.flatnonzero(is_fa)[~replicated]] = True
    is_ssm = ~is_fa & (starts < total - tail)
    fa_splits, ssm_splits = _split_counts(
        mapping, group_is_ssm, split_fa, is_ssm, rows[:, COUNT], bsr, allow_sharded_ratio
    )
    fa_len = rows[:, LEN] // fa_splits
    ssm_len = rows[:, LEN] // ssm_splits
    out: list[np.ndarray] = []
    for p, rank in enumerate(mapping.all_source_ranks):
        split = rows.copy()
        slot = mapping.slot_of(rank)
        split[split_fa, LEN] = fa_len[split_fa]
        split[split_fa, ADDR] += slot * fa_len[split_fa]
        split[is_ssm, LEN] = ssm_len[is_ssm]
        split[is_ssm, ADDR] += p * ssm_len[is_ssm]
        out.append(split)
    return out


def _boundaries(rows: np.ndarray, nfa: int, num_replicated_tail: int) -> tuple[np.ndarray, int]:
    """Each row's first flat descriptor index, and the replicated tail, both checked against the FA/SSM
    boundary ``nfa``."""
    counts = rows[:, COUNT]
    starts = np.cumsum(counts) - counts
    total = int(counts.sum())
    if nfa > total:
        raise PlanError(
            "num_fa_descs",
            f"FA/SSM boundary {nfa} lies past the {total} local descriptors",
            value=nfa,
            expected=total,
        )
    tail = check_positive_int(num_replicated_tail, "num_replicated_tail", minimum=0, error=PlanError)
    if nfa > total - tail:
        raise PlanError(
            "num_replicated_tail",
            f"{tail} replicated descriptors overlap the {nfa} FA descriptors of {total}",
            value=tail,
            expected=total - nfa,
        )
    return starts, tail


def _split_counts(
    mapping: TPMapping,
    group_is_ssm: Sequence[bool],
    split_fa: np.ndarray,
    is_ssm: np.ndarray,
    counts: np.ndarray,
    bsr: int,
    allow_sharded_ratio: bool,
) -> tuple[int, int]:
    """How many source ranks split an FA row and an SSM row (the first attention and SSM group's sources)."""
    fa_ranks = _first_list(mapping, group_is_ssm, want_ssm=False)
    ssm_ranks = _first_list(mapping, group_is_ssm, want_ssm=True)
    fa_splits = len(fa_ranks) if fa_ranks else 1
    if split_fa.any() and not fa_ranks:
        raise GroupMismatchError(
            "group_is_ssm", "FA descriptors to split but no attention group in the mapping"
        )
    if is_ssm.any() and not ssm_ranks:
        raise GroupMismatchError(
            "num_fa_descs", f"{int(counts[is_ssm].sum())} SSM descriptors but no SSM group in the mapping"
        )
    ssm_splits = len(ssm_ranks) if ssm_ranks else 1
    if bsr > 1 and fa_splits > 1 and split_fa.any() and not allow_sharded_ratio:
        raise UnsupportedError(
            "block_size_ratio",
            f"Head-sharded attention reads with P_TP > D_TP and heterogeneous block sizes are not supported "
            f"(block_size_ratio={bsr}, {fa_splits} attention source ranks)",
            value=bsr,
        )
    return fa_splits, ssm_splits
