"""Descriptor tables: vLLM's N x 5 strided rows (local and remote, attention and SSM state) and the
per-source split of the local table, answered by :mod:`kvgeom.plan.strided` and :mod:`kvgeom.plan.splits`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvgeom.plan.splits import build_local_splits as _kv_build_local_splits
from kvgeom.plan.strided import (
    block_strided_rows,
    expand_rows,
    fa_local_rows,
    fa_remote_rows,
    mamba_local_rows,
    mamba_remote_rows,
    to_strided,
)
from kvgeom.plan.strided import strided_starts as _kv_strided_starts

from ..version import profile
from ._common import group_is_ssm, is_attention_type, rows, to_kvgeom_mapping


def block_strided_descs(
    base_addr: int, block_len: int, block_stride: int, num_blocks: int, block_size_ratio: int, device_id: int
) -> np.ndarray:
    """``_block_strided_descs`` (a static method)."""
    return rows(
        block_strided_rows(base_addr, block_len, block_stride, num_blocks, block_size_ratio, device_id)
    )


def strided_desc_starts(strided_descs: np.ndarray) -> np.ndarray:
    """``_strided_desc_starts`` (a static method)."""
    return _kv_strided_starts(np.asarray(strided_descs, dtype=np.int64)).astype(np.uint64)


def build_fa_local(self: Any, base_addresses: Sequence[int], block_size_ratio: int) -> np.ndarray:
    """``_build_fa_local``: every region's (or transfer layer's) blocks as strided rows."""
    return rows(
        fa_local_rows(
            base_addresses,
            self.block_len_per_layer,
            self.block_stride_per_layer,
            self.region_num_blocks,
            int(block_size_ratio),
            int(self.device_id),
            self._transfer_layer_region_indices or None,
        )
    )


def build_fa_remote(self: Any, plan: Any, nixl_agent_meta: Any, block_size_ratio: int) -> np.ndarray:
    """``_build_fa_remote``: one row per remote region, cut to what this rank reads (its TP plan, or the
    draft's for a GQA draft region under an MLA target)."""
    meta = nixl_agent_meta
    fa_group = next(i for i, t in enumerate(self._group_spec_types) if is_attention_type(t))
    n = len(meta.kv_caches_base_addr)
    caps = meta.region_num_blocks or [meta.num_blocks] * n
    draft_regions = sorted(self._head_sharded_draft_regions)
    draft = self.draft_tp_mappings[meta.engine_id] if draft_regions else None
    n_regions = len(self.block_len_per_layer)
    replicated = [self._is_region_replicated(i) for i in range(n_regions)]
    return rows(
        fa_remote_rows(
            meta.kv_caches_base_addr,
            meta.block_strides,
            caps,
            self.block_len_per_layer,
            replicated,
            int(block_size_ratio),
            len(plan.source_ranks_per_group[fa_group]),
            int(plan.rank_offset_factor),
            int(meta.device_id),
            self._transfer_layer_region_indices or None,
            draft_regions,
            len(draft.source_ranks_per_group[fa_group]) if draft is not None else 1,
            int(draft.rank_offset_factor) if draft is not None else 0,
        )
    )


def build_mamba_local(self: Any, base_addresses: Sequence[int]) -> np.ndarray:
    """``_build_mamba_local``: per SSM region the conv pieces and the temporal state, then the PLE page."""
    ple = self._ple_region_index
    return rows(
        mamba_local_rows(
            base_addresses,
            self.block_stride_per_layer,
            self._ssm_region_indices,
            self._conv_decomp.local_conv_offsets,
            self._mamba_ssm_size,
            int(self._physical_blocks_per_logical_kv_block),
            int(self._logical_num_blocks),
            int(self.device_id),
            ple,
            self._ple_block_len if ple is not None else None,
        )
    )


def build_mamba_remote(self: Any, nixl_agent_meta: Any, tp_ratio: int, transfer_info: Any) -> np.ndarray:
    """``_build_mamba_remote``: the remote SSM rows this rank reads (conv reads from
    :func:`kvgeom.layout.conv.remote_conv_offsets`, its temporal slice), then the PLE page read whole."""
    meta = nixl_agent_meta
    local_offset = int(self.tp_rank) % max(int(tp_ratio), 1)
    conv_reads = self._conv_decomp.remote_conv_offsets(local_offset, tp_ratio)
    rppl = int(transfer_info.remote_physical_blocks_per_logical)
    ple = self._ple_region_index
    local_ple = remote_ple = None
    if ple is not None:
        local_ple = int(self._ple_block_len) * int(self._physical_blocks_per_logical_kv_block)
        remote_ple = None if meta.ple_block_len is None else int(meta.ple_block_len) * rppl
    return rows(
        mamba_remote_rows(
            meta.kv_caches_base_addr,
            meta.block_strides,
            int(meta.num_blocks),
            rppl,
            tuple(meta.ssm_sizes),
            self._ssm_region_indices,
            conv_reads,
            int(self._mamba_ssm_size[1]),
            int(tp_ratio),
            int(self.tp_rank),
            int(meta.device_id),
            ple,
            local_ple,
            remote_ple,
        )
    )


def build_local_splits_from_plan(
    self: Any, plan: Any, src_blocks_data: np.ndarray, num_fa_descs: int, block_size_ratio: int = 1
) -> Iterator[np.ndarray]:
    """``_build_local_splits_from_plan``: :func:`kvgeom.plan.splits.build_local_splits` on the worker's strided
    local table, with the per-region (per transfer layer) MLA flags and capacities vLLM reads, and the PLE
    page copied whole."""
    n_regions = len(self.block_len_per_layer)
    region_is_mla = region_num_blocks = None
    if n_regions and self.num_regions:
        regions = self._transfer_layer_region_indices or range(n_regions)
        region_is_mla = [bool(self._is_region_replicated(i)) for i in regions]
        region_num_blocks = [int(self.region_num_blocks[i]) for i in regions]
    tail = int(self._logical_num_blocks) if self._ple_region_index is not None else 0
    splits = _kv_build_local_splits(
        to_strided(src_blocks_data),
        to_kvgeom_mapping(plan),
        int(num_fa_descs),
        int(block_size_ratio),
        group_is_ssm(self._group_spec_types),
        region_is_mla,
        region_num_blocks,
        num_replicated_tail=tail,
    )
    if not profile().strided_descs:  # 0.32.0: each split a list of (addr, len, dev) descriptors
        return iter([[tuple(int(x) for x in r) for r in expand_rows(s)] for s in splits])
    dtype = np.asarray(src_blocks_data).dtype
    return iter([s.astype(dtype) for s in splits])
