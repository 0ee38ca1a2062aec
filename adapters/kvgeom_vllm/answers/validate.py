"""Handshake validation: vLLM's checks of a peer's advertised metadata, answered by
:func:`kvgeom.compat.vllm.advertised.check_advertised_pair`, :func:`kvgeom.pair.dcp.check_parallel_pair` and
:func:`kvgeom.pair.rules.check_csa_linear_tp_layout`. (A peer that also sends kvgeom's geometry card was
already paired by :meth:`kvgeom.Pairing.create` on both cards, see :mod:`kvgeom_vllm.handshake`.)"""

from __future__ import annotations

from typing import Any

from kvgeom.compat.vllm.advertised import Advertised, LocalFacts, check_advertised_pair
from kvgeom.errors import IncompatiblePairError
from kvgeom.pair.dcp import check_parallel_pair
from kvgeom.pair.rules import check_csa_linear_tp_layout

from ._common import KVI


def _opt(values: Any) -> tuple | None:
    return None if values is None else tuple(values)


def _nvfp4(self: Any) -> bool:
    return any(
        isinstance(spec, KVI.AttentionSpec)
        and getattr(getattr(spec, "kv_quant_mode", None), "is_nvfp4", False)
        for spec in getattr(self, "_layer_specs", {}).values()
    )


def _block_contiguous(layout: str) -> bool:
    return bool(KVI.KVCacheLayout[layout].is_block_contiguous)


def _row_offsets(self: Any, bases: Any) -> tuple[int, ...] | None:
    """Packed CSA-linear rows: each region's start in the block row (its base minus the first region's)."""
    if not (getattr(self, "_is_csa_linear", False) and getattr(self, "_has_packed_cache", False)):
        return None
    flat = [int(b) for b in bases]
    return tuple(b - flat[0] for b in flat) if flat else None


def validate_remote_agent_handshake(
    self: Any, nixl_agent_meta: Any, remote_tp_size: int, remote_dcp_size: int = 1
) -> None:
    """``_validate_remote_agent_handshake`` (pull and push): both sides' advertised numbers judged by
    kvgeom's rules; the conversions they call for (LBHNC into LBNHC, CPU_ATTN repacking) switched on."""
    meta = nixl_agent_meta
    topo = self.transfer_topo
    info = topo.get_engine_info(meta.engine_id)
    if (info.remote_tp_size, info.remote_dcp_size) != (remote_tp_size, remote_dcp_size):
        raise IncompatiblePairError(
            "remote_tp_size",
            "the handshake's TP/DCP sizes differ from the registered engine's",
            local=(info.remote_tp_size, info.remote_dcp_size),
            remote=(remote_tp_size, remote_dcp_size),
        )
    layout = self.kv_cache_layout if not self.use_host_buffer else self.host_buffer_kv_cache_layout
    local = _local_advertised(self, str(layout))
    remote = _remote_advertised(self, meta, remote_tp_size, remote_dcp_size)
    facts = _local_facts(self, meta, str(layout))
    pair = check_advertised_pair(local, remote, facts)
    if pair.permute_local_kv:
        self.enable_permute_local_kv = True
    if pair.heterogeneous_attn:
        self.enable_heterogeneous_attn_post_process = True


def _local_advertised(self: Any, layout: str) -> Advertised:
    """This rank's advertised numbers, as the peer sees them."""
    topo = self.transfer_topo
    return Advertised(
        tp_size=int(topo.tp_size),
        block_size=int(topo.block_size),
        num_blocks=int(self.num_blocks),
        block_lens=tuple(self.block_len_per_layer),
        block_strides=tuple(self.block_stride_per_layer),
        kv_layout=layout,
        dcp_size=int(self.dcp_size),
        ppl=int(self._physical_blocks_per_logical_kv_block),
        attn_backend=str(getattr(self, "backend_name", "")),
        row_offsets=_row_offsets(self, self.kv_caches_base_addr[self.engine_id][self.tp_rank]),
    )


def _remote_advertised(self: Any, meta: Any, remote_tp_size: int, remote_dcp_size: int) -> Advertised:
    """The peer's advertised numbers, from its handshake metadata."""
    return Advertised(
        tp_size=int(remote_tp_size),
        block_size=int(meta.block_size),
        num_blocks=int(meta.num_blocks),
        block_lens=tuple(meta.block_lens),
        block_strides=tuple(meta.block_strides),
        kv_layout=str(meta.kv_cache_layout),
        dcp_size=int(remote_dcp_size),
        ppl=int(meta.physical_blocks_per_logical_kv_block),
        num_bases=len(meta.kv_caches_base_addr),
        region_num_blocks=_opt(meta.region_num_blocks),
        region_group_ids=_opt(meta.region_group_ids),
        region_names=_opt(meta.region_names),
        region_mem_types=_opt(meta.region_mem_types),
        attn_backend=str(meta.attn_backend_name),
        row_offsets=_row_offsets(self, meta.kv_caches_base_addr),
    )


def _local_facts(self: Any, meta: Any, layout: str) -> LocalFacts:
    """What the rules need to know of this rank beyond its advertised numbers."""
    topo = self.transfer_topo
    routed_names = tuple(self._transfer_layer_names or ())
    ktc = getattr(self, "kv_transfer_config", None)
    return LocalFacts(
        is_mla=bool(self.use_mla),
        has_ssm=bool(self._has_mamba),
        total_kv_heads=int(topo.total_num_kv_heads),
        regions=tuple(self._transfer_layer_region_indices or range(len(self.block_len_per_layer))),
        region_replicated=tuple(bool(x) for x in self._region_is_mla),
        region_group_ids=tuple(self.region_group_ids or ()),
        expected_region_names=routed_names or tuple(self.region_names),
        draft_regions=frozenset(self._head_sharded_draft_regions),
        draft_kv_heads=self._head_sharded_draft_kv_heads,
        block_contiguous=_block_contiguous(layout),
        host_buffer=bool(self.use_host_buffer),
        permute_allowed=bool(getattr(ktc, "enable_permute_local_kv", False)),
        hma=bool(getattr(self, "_is_hma_required", False)),
        nvfp4=_nvfp4(self),
        prefix_caching=bool(self.vllm_config.cache_config.enable_prefix_caching)
        if self._has_mamba
        else False,
        first_num_blocks=int(self.dst_num_blocks[meta.engine_id]),
        paired_remote_group_ids=tuple(self.dst_region_group_ids.get(meta.engine_id, ())),
        mode=str(self._TRANSFER_MODE),
    )


def validate_remote_parallel_config(self: Any, agent_metadata: Any) -> None:
    """``_validate_remote_parallel_config``: vLLM's context-parallel pairing rules."""
    check_parallel_pair(
        int(self.pcp_size), int(self.dcp_size), int(agent_metadata.pcp_size), int(agent_metadata.dcp_size)
    )


def validate_csa_linear_tp_layout(self: Any, remote_tp_size: int) -> None:
    """``_validate_csa_linear_tp_layout``: both TP sizes on the same side of the KV-head boundary."""
    check_csa_linear_tp_layout(
        int(self.world_size), int(remote_tp_size), int(self.transfer_topo.total_num_kv_heads)
    )
