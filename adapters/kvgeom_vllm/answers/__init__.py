"""kvgeom's answers to vLLM 0.33.0's NIXL geometry functions, one adapter per row of
:data:`kvgeom_vllm.table.TABLE`.

Each adapter takes vLLM's arguments (and, for methods, vLLM's object as ``self``), reads the state vLLM's
own function would read, calls kvgeom, and returns kvgeom's answer in vLLM's types: lists of lists for
block ids, ``np.ndarray`` for descriptor ids, vLLM's ``TPMapping`` and ``MambaConvSplitInfo``, NIXL's
strided ``(addr, len, dev, stride, count)`` rows (``uint64``) for descriptor tables; where vLLM rewrites a
peer's metadata or zeroes cache bytes, the adapter does the same with kvgeom's answer. No adapter
computes geometry itself. The modules follow the data: who reads whom (:mod:`.topology`), block and
descriptor ids (:mod:`.blockids`), SSM state pages (:mod:`.ssm`), descriptor tables (:mod:`.tables`),
advertised regions (:mod:`.regions`), handshake validation (:mod:`.validate`), the post-receive step
(:mod:`.receive`) and the scheduler (:mod:`.scheduler`).
"""

from __future__ import annotations

from ._common import ORIGINAL_CONV_SPLIT_INFO, group_is_ssm, is_ssm_type, to_kvgeom_mapping, to_vllm_mapping
from .blockids import (
    apply_dcp_prefix_caching,
    apply_prefix_caching,
    apply_prefix_caching_by_region,
    block_ids_by_region,
    compute_desc_ids,
    get_mapped_blocks,
    logical_to_kernel_block_ids,
    map_block_ids_for_block_size_ratio,
)
from .receive import post_process_device_kv_on_receive, region_bytes, zero_region_blocks
from .regions import (
    align_remote_regions_by_layer,
    pp_region_offset,
    region_sort_key,
    set_region_layers,
    split_remote_blocks,
    split_remote_packed_rows,
    sync_block_size_with_kernel,
)
from .registration import register_kv_caches
from .scheduler import (
    blocks_per_window,
    clip_ssm_state_blocks,
    get_exchange_clipped_blocks,
    get_remote_prefill_token_count,
    prefill_backoff,
)
from .ssm import (
    KvgeomConvSplitInfo,
    compute_physical_blocks_per_logical,
    derive_mamba_conv_split,
    remote_conv_offsets,
)
from .tables import (
    block_strided_descs,
    build_fa_local,
    build_fa_remote,
    build_local_splits_from_plan,
    build_mamba_local,
    build_mamba_remote,
    strided_desc_starts,
)
from .topology import (
    compute_head_offset,
    compute_tp_mapping,
    dcp_consumer_count,
    dcp_source_ranks,
    handshake_target_ranks,
    is_kv_replicated,
    needs_split_local_xfer_handles,
    replicates_kv_cache,
    target_remote_ranks,
    topology_block_size_ratio,
    topology_dcp_rank,
    topology_local_physical_heads,
    topology_local_replicates_kv_cache,
    topology_tp_ratio,
)
from .validate import (
    validate_csa_linear_tp_layout,
    validate_remote_agent_handshake,
    validate_remote_parallel_config,
)

__all__ = [
    "ORIGINAL_CONV_SPLIT_INFO",
    "KvgeomConvSplitInfo",
    "group_is_ssm",
    "is_ssm_type",
    "to_kvgeom_mapping",
    "to_vllm_mapping",
    "apply_dcp_prefix_caching",
    "apply_prefix_caching",
    "apply_prefix_caching_by_region",
    "block_ids_by_region",
    "compute_desc_ids",
    "get_mapped_blocks",
    "logical_to_kernel_block_ids",
    "map_block_ids_for_block_size_ratio",
    "post_process_device_kv_on_receive",
    "region_bytes",
    "zero_region_blocks",
    "align_remote_regions_by_layer",
    "pp_region_offset",
    "region_sort_key",
    "set_region_layers",
    "split_remote_blocks",
    "split_remote_packed_rows",
    "sync_block_size_with_kernel",
    "blocks_per_window",
    "clip_ssm_state_blocks",
    "get_exchange_clipped_blocks",
    "get_remote_prefill_token_count",
    "prefill_backoff",
    "compute_physical_blocks_per_logical",
    "derive_mamba_conv_split",
    "remote_conv_offsets",
    "block_strided_descs",
    "build_fa_local",
    "build_fa_remote",
    "build_local_splits_from_plan",
    "build_mamba_local",
    "build_mamba_remote",
    "strided_desc_starts",
    "compute_head_offset",
    "compute_tp_mapping",
    "dcp_consumer_count",
    "dcp_source_ranks",
    "handshake_target_ranks",
    "is_kv_replicated",
    "needs_split_local_xfer_handles",
    "replicates_kv_cache",
    "target_remote_ranks",
    "topology_block_size_ratio",
    "topology_dcp_rank",
    "topology_local_physical_heads",
    "topology_local_replicates_kv_cache",
    "topology_tp_ratio",
    "validate_csa_linear_tp_layout",
    "validate_remote_agent_handshake",
    "validate_remote_parallel_config",
    "register_kv_caches",
]
