"""Regions as the handshake advertises them: layer order, layer-name routing of pipeline-parallel
producers, packed (block-outermost) rows, remote blocks read in finer units, and the kernel block size,
answered by :mod:`kvgeom.pair.layerroute` and :mod:`kvgeom.pair.blocksize`.

vLLM rewrites the peer's metadata in place; the adapters do the same with kvgeom's answer
(a :class:`kvgeom.pair.layerroute.RegionTable`), so that vLLM's code after them sees what it always saw.
"""

from __future__ import annotations

import logging
from typing import Any

from kvgeom.pair.blocksize import kernel_blocks_per_logical
from kvgeom.pair.blocksize import remote_block_split as _kv_remote_block_split
from kvgeom.pair.layerroute import RegionTable, align_regions_by_layer, split_packed_rows, transfer_layers
from kvgeom.pair.layerroute import pp_region_offset as _kv_pp_region_offset
from kvgeom.pair.layerroute import region_sort_key as _kv_region_sort_key

logger = logging.getLogger("kvgeom_vllm")


def region_sort_key(layer_name: str) -> tuple[tuple[int, int | str], ...]:
    """``_region_sort_key``: natural layer order (``layers.2`` before ``layers.10``)."""
    return _kv_region_sort_key(layer_name)


def set_region_layers(self: Any, region_layers: list[list[str]]) -> None:
    """``_set_region_layers``: the transfer layers of layer-name routing (every member of every region, in
    region order, with its region and group), from :func:`kvgeom.pair.layerroute.transfer_layers`."""
    by_layer = dict(self.kv_cache_config.transfer_group_index_by_layer)
    routing = self._requires_layer_name_routing()
    # without routing only the one-region-per-layer rule applies: every layer gets a placeholder group
    groups = (
        by_layer
        if routing
        else {name: by_layer.get(name, -1) for members in region_layers for name in members}
    )
    names, regions, group_ids = transfer_layers(region_layers, groups)
    self.region_members = region_layers
    if routing:
        self._transfer_layer_names = names
        self._transfer_layer_region_indices = regions
        self._transfer_layer_group_ids = group_ids


def _table(meta: Any) -> RegionTable:
    return RegionTable(
        bases=tuple(meta.kv_caches_base_addr),
        block_lens=tuple(meta.block_lens),
        block_strides=tuple(meta.block_strides),
        num_blocks=None if meta.region_num_blocks is None else tuple(meta.region_num_blocks),
        group_ids=None if meta.region_group_ids is None else tuple(meta.region_group_ids),
        names=None if meta.region_names is None else tuple(meta.region_names),
        mem_types=None if meta.region_mem_types is None else tuple(meta.region_mem_types),
        members=tuple(tuple(m) for m in (meta.region_members or ())),
        packed=dict(meta.packed_member_layouts or {}),
    )


def _write_back(meta: Any, table: RegionTable) -> None:
    meta.kv_caches_base_addr = list(table.bases)
    meta.block_lens = list(table.block_lens)
    meta.block_strides = list(table.block_strides)
    for attr, value in (
        ("region_num_blocks", table.num_blocks),
        ("region_group_ids", table.group_ids),
        ("region_mem_types", table.mem_types),
        ("region_names", table.names),
    ):
        if getattr(meta, attr) is not None:
            setattr(meta, attr, list(value) if value is not None else None)
    meta.packed_member_layouts = {}


def align_remote_regions_by_layer(self: Any, nixl_agent_meta: Any) -> None:
    """``_align_remote_regions_by_layer``: the peer's regions in this stage's transfer-layer order, a
    packed row narrowed to each layer's page."""
    table = align_regions_by_layer(
        _table(nixl_agent_meta),
        self._transfer_layer_names,
        self._transfer_layer_region_indices,
        self.block_len_per_layer,
    )
    _write_back(nixl_agent_meta, table)
    nixl_agent_meta.region_members = [list(m) for m in table.members]


def split_remote_packed_rows(self: Any, nixl_agent_meta: Any) -> None:
    """``_split_remote_packed_rows``: the peer's packed row read as one virtual region per local layer."""
    table = split_packed_rows(_table(nixl_agent_meta), self.region_names)
    _write_back(nixl_agent_meta, table)


def split_remote_blocks(self: Any, meta: Any) -> None:
    """``_split_remote_blocks``: when the block sizes do not divide, the peer's blocks viewed as
    :func:`kvgeom.pair.blocksize.remote_block_split` finer blocks (its advertised numbers rescaled)."""
    split = _kv_remote_block_split(
        self.block_size,
        meta.block_size,
        meta.block_lens,
        meta.block_strides,
        whole_pages=meta.ple_block_len is not None,
    )
    if split == 1:
        if self.block_size % meta.block_size:
            logger.warning(
                "Not pairing remote %d-token blocks with local %d-token blocks: kvgeom cannot cut them "
                "into common units",
                meta.block_size,
                self.block_size,
            )
        return
    meta.block_size //= split
    meta.physical_blocks_per_logical_kv_block *= split
    meta.num_blocks *= split
    meta.block_lens = [block_len // split for block_len in meta.block_lens]
    meta.block_strides = list(meta.block_lens)
    if meta.region_num_blocks is not None:
        meta.region_num_blocks = [n * split for n in meta.region_num_blocks]


def sync_block_size_with_kernel(self: Any) -> None:
    """``_sync_block_size_with_kernel``: the kernel block vLLM's backends pick (vLLM's choice), and the
    kernel blocks per logical block from :func:`kvgeom.pair.blocksize.kernel_blocks_per_logical`."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw

    backends, specs = bw.get_current_attn_backends_and_specs(
        self.vllm_config, self.kv_cache_config, self.attn_backends
    )
    kernel = bw.select_common_block_size(self.block_size, backends, specs)
    self._logical_num_blocks = self.num_blocks
    ppl = kernel_blocks_per_logical(self.block_size, kernel)
    if ppl > 1:
        logger.info("Logical block size %s is %s kernel blocks of %s tokens", self.block_size, ppl, kernel)
        self._physical_blocks_per_logical_kv_block = ppl
        self.block_size = kernel
        self.num_blocks *= ppl


def pp_region_offset(num_regions: int, start_layer: int, end_layer: int) -> int:
    """The first region of a PP-1 peer that a PP stage holding ``[start_layer, end_layer)`` writes."""
    return _kv_pp_region_offset(num_regions, start_layer, end_layer)
