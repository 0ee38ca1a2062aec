"""Block ids and descriptor ids: vLLM's block-id algebra, DCP page matching, region-mapped pulls and
descriptor-id layout, answered by :mod:`kvgeom.blocks`, :mod:`kvgeom.pair.dcp`, :mod:`kvgeom.plan.regionmap` and
:mod:`kvgeom.plan.descids`."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvgeom.blocks import apply_prefix_caching as _kv_apply_prefix_caching
from kvgeom.blocks import get_mapped_blocks as _kv_get_mapped_blocks
from kvgeom.blocks import logical_to_kernel as _kv_logical_to_kernel
from kvgeom.blocks import map_block_ids_for_block_size_ratio as _kv_map_ratio
from kvgeom.errors import SpecError
from kvgeom.pair.dcp import apply_dcp_prefix_caching as _kv_apply_dcp_prefix_caching
from kvgeom.plan.descids import compute_desc_ids as _kv_compute_desc_ids
from kvgeom.plan.regionmap import apply_prefix_caching_by_region as _kv_prefix_by_region
from kvgeom.plan.regionmap import block_ids_by_region as _kv_block_ids_by_region

from ._common import KVI, group_is_ssm, is_ssm_type, lists, representative_type


def get_mapped_blocks(self: Any, block_ids: Any, block_size_ratio: int) -> np.ndarray:
    return _kv_get_mapped_blocks(np.asarray(block_ids), int(block_size_ratio))


def map_block_ids_for_block_size_ratio(
    self: Any, local_block_ids: Any, remote_block_ids: Any, block_size_ratio: int
) -> tuple[list, list]:
    kinds = group_is_ssm(self._group_spec_types, len(remote_block_ids))
    local, remote = _kv_map_ratio(local_block_ids, remote_block_ids, int(block_size_ratio), kinds)
    return lists(local), lists(remote)


def _transfer_group_kinds(self: Any, n: int) -> tuple[bool, ...]:
    groups = self.kv_cache_config.transfer_groups
    return tuple(is_ssm_type(representative_type(groups[i].kv_cache_spec)) for i in range(n))


def logical_to_kernel_block_ids(self: Any, block_ids: Any, ratio: int) -> Any:
    if int(ratio) == 1:
        return block_ids  # vLLM hands the very same lists back (its callers may mutate them)
    return lists(_kv_logical_to_kernel(block_ids, int(ratio), _transfer_group_kinds(self, len(block_ids))))


def apply_prefix_caching(
    self: Any,
    decode_block_ids: Any,
    prefill_block_ids: Any,
    decode_physical_per_logical: int,
    prefill_physical_per_logical: int,
) -> tuple[list, list]:
    kinds = group_is_ssm(self._group_spec_types, len(prefill_block_ids))
    dec, pre = _kv_apply_prefix_caching(
        decode_block_ids,
        prefill_block_ids,
        int(decode_physical_per_logical),
        int(prefill_physical_per_logical),
        kinds,
        has_mamba=bool(self._has_mamba),
    )
    return lists(dec), lists(pre)


def apply_dcp_prefix_caching(
    self: Any,
    local_ids: Any,
    remote_ids: Any,
    remote_rank: int,
    local_dcp_size: int,
    local_dcp_rank: int,
    remote_dcp_size: int,
    local_num_computed_blocks: int,
    num_remote_blocks: int | None = None,
) -> tuple[list[int], list[int]]:
    """``_apply_dcp_prefix_caching``: one group's pages paired by global DCP position."""
    lo, ro = _kv_apply_dcp_prefix_caching(
        local_ids,
        remote_ids,
        remote_rank,
        local_dcp_size,
        local_dcp_rank,
        remote_dcp_size,
        local_num_computed_blocks,
        num_remote_blocks,
    )
    return lo.tolist(), ro.tolist()


def block_ids_by_region(block_ids: Any, region_group_ids: list[int]) -> list[list[int]]:
    """``_block_ids_by_region`` (a static method): one id list per region."""
    return lists(_kv_block_ids_by_region(block_ids, region_group_ids))


def apply_prefix_caching_by_region(
    self: Any,
    decode_block_ids: Any,
    prefill_block_ids: Any,
    *,
    num_computed_blocks: list[int] | None = None,
    num_remote_blocks: int | None = None,
    remote_rank: int = 0,
    remote_dcp_size: int = 1,
) -> tuple[list, list]:
    """``_apply_prefix_caching_by_region``: D's uncached pages paired with P's, region by region (by global
    page position when the request's counts are known)."""
    dec, pre = _kv_prefix_by_region(
        decode_block_ids,
        prefill_block_ids,
        num_computed_blocks,
        num_remote_blocks,
        remote_rank,
        int(self.dcp_size),
        int(self.dcp_rank),
        remote_dcp_size,
    )
    if not any(x.size for x in dec):
        return lists(dec), lists(pre)
    if num_computed_blocks is None:  # vLLM hands D's lists back as given
        return decode_block_ids, lists(pre)
    return lists(dec), lists(pre)


def compute_desc_ids(
    self: Any,
    block_ids: Any,
    dst_num_blocks: int,
    block_size_ratio: float | None,
    physical_blocks_per_logical: int,
    region_num_blocks: list[int] | None = None,
    region_group_ids: list[int] | None = None,
    uses_region_group_mapping: bool | None = None,
) -> np.ndarray:
    """``_compute_desc_ids``: the worker's regions, SSM streams, scratch regions, PLE stream and layer-name
    routing, read as vLLM reads them, handed to :func:`kvgeom.plan.descids.compute_desc_ids`."""
    bsr = None if block_size_ratio is None else int(block_size_ratio)
    routing = tuple(self._transfer_layer_group_ids or ())
    if self._has_mamba and not routing:
        return _ssm_desc_ids(
            self, block_ids, dst_num_blocks, bsr, physical_blocks_per_logical, region_num_blocks
        )
    kinds = tuple(False for _ in block_ids)  # without SSM state every list is addressed like attention
    num_regions = len(routing) if routing else (self.num_regions or len(self.block_len_per_layer))
    if region_num_blocks and not routing:
        num_regions = len(region_num_blocks)
    if routing:
        return _kv_compute_desc_ids(
            block_ids,
            dst_num_blocks,
            num_regions,
            bsr,
            physical_blocks_per_logical,
            kinds,
            None,
            3,
            region_num_blocks or None,
            transfer_layer_group_ids=routing,
        )
    if region_group_ids is None:
        region_group_ids = self.region_group_ids
        if uses_region_group_mapping is None:
            uses_region_group_mapping = self._uses_region_group_mapping
    if not region_group_ids and num_regions == 1:
        region_group_ids = [0]
    return _kv_compute_desc_ids(
        block_ids,
        dst_num_blocks,
        num_regions,
        bsr,
        physical_blocks_per_logical,
        kinds,
        None,
        3,
        region_num_blocks or None,
        list(region_group_ids),
        uses_region_group_mapping=uses_region_group_mapping,
    )


def _ssm_desc_ids(
    self: Any,
    block_ids: Any,
    dst_num_blocks: int,
    bsr: int | None,
    physical_blocks_per_logical: int,
    region_num_blocks: list[int] | None,
) -> np.ndarray:
    """A Mamba hybrid's descriptor ids (no layer-name routing): each group's lists as SSM state or
    attention, with its scratch regions and PLE stream."""
    types = tuple(self._group_spec_types)
    kinds = group_is_ssm(types, len(block_ids))
    if self._conv_decomp is None:
        raise SpecError("conv_decomp", "a Mamba hybrid worker without its conv split", value=None)
    ssm_regions = list(self._ssm_region_indices or range(len(self.block_len_per_layer)))
    scratch = [g for g, t in enumerate(types) if t is KVI.CircularBufferSpec]
    scratch_regions = list(self._scratch_region_indices) if scratch else []
    return _kv_compute_desc_ids(
        block_ids,
        dst_num_blocks,
        int(self.num_regions),
        bsr,
        physical_blocks_per_logical,
        kinds,
        ssm_regions,
        len(self._conv_decomp.local_conv_offsets),
        region_num_blocks or None,
        None,
        scratch_groups=scratch,
        scratch_region_indices=scratch_regions,
        ple_group=self._ple_group_index,
    )
