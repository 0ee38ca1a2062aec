"""Who reads whom: vLLM's TP mapping, its ``TransferTopology`` arithmetic and decode context parallelism,
answered by :mod:`kvgeom.pair.tp`, :mod:`kvgeom.pair.dcp` and :mod:`kvgeom.pair.blocksize`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvgeom.model.layers import Shard
from kvgeom.pair.blocksize import block_size_ratio as _kv_block_size_ratio
from kvgeom.pair.dcp import dcp_consumer_count as _kv_dcp_consumer_count
from kvgeom.pair.dcp import dcp_rank as _kv_dcp_rank
from kvgeom.pair.dcp import dcp_source_ranks as _kv_dcp_source_ranks
from kvgeom.pair.tp import compute_tp_mapping as _kv_compute_tp_mapping
from kvgeom.pair.tp import dcp_handshake_targets as _kv_dcp_handshake_targets
from kvgeom.pair.tp import handshake_targets as _kv_handshake_targets
from kvgeom.pair.tp import head_offset as _kv_head_offset
from kvgeom.pair.tp import needs_split_local_handles as _kv_needs_split
from kvgeom.pair.tp import tp_ratio as _kv_tp_ratio

from ._common import group_is_ssm, to_kvgeom_mapping, to_vllm_mapping


def compute_tp_mapping(
    transfer_topology: Any,
    remote_tp_size: int,
    group_spec_types: Sequence[type],
    remote_dcp_size: int = 1,
    head_sharded_kv_heads: int | None = None,
) -> Any:
    """``tp_mapping.compute_tp_mapping``: sources per group, attention slots, head offset and consumer
    count from :func:`kvgeom.pair.tp.compute_tp_mapping` (DCP sources and a GQA draft under an MLA target
    included)."""
    t = transfer_topology
    m = _kv_compute_tp_mapping(
        int(t.tp_rank),
        int(t.tp_size),
        int(remote_tp_size),
        int(t.total_num_kv_heads),
        bool(t.is_mla),
        group_is_ssm(group_spec_types),
        int(t.dcp_size or 1),
        int(remote_dcp_size),
        head_sharded_kv_heads,
    )
    return to_vllm_mapping(m)


def compute_head_offset(tp_rank: int, tp_size: int, remote_tp_size: int, total_num_kv_heads: int) -> int:
    return _kv_head_offset(tp_rank, tp_size, remote_tp_size, total_num_kv_heads)


def topology_tp_ratio(self: Any, remote_tp_size: int) -> int:
    return _kv_tp_ratio(self.tp_size, remote_tp_size)


def topology_block_size_ratio(self: Any, remote_block_size: int) -> int:
    return _kv_block_size_ratio(self.block_size, remote_block_size)


def topology_dcp_rank(self: Any) -> int:
    return _kv_dcp_rank(self.tp_rank, self.dcp_size)


def topology_local_physical_heads(self: Any) -> int:
    """KV heads a rank holds: ``max(1, heads // tp)`` (a rank past the head count holds one replica)."""
    return Shard(int(self.total_num_kv_heads), 1).units_per_rank(int(self.tp_size))


def dcp_source_ranks(self: Any, remote_tp_size: int, remote_dcp_size: int) -> list[int]:
    return list(_kv_dcp_source_ranks(topology_dcp_rank(self), self.dcp_size, remote_tp_size, remote_dcp_size))


def dcp_consumer_count(self: Any, remote_tp_size: int, remote_dcp_size: int) -> int:
    return _kv_dcp_consumer_count(self.tp_size, self.dcp_size, remote_tp_size, remote_dcp_size)


def handshake_target_ranks(self: Any, remote_tp_size: int, remote_dcp_size: int = 1) -> list[int]:
    return list(
        _kv_dcp_handshake_targets(self.tp_rank, self.tp_size, self.dcp_size, remote_tp_size, remote_dcp_size)
    )


def target_remote_ranks(self: Any, remote_engine_id: str, remote_pp_rank: int = 0) -> list[int]:
    info = self._engines[(remote_engine_id, remote_pp_rank)]
    return list(_kv_handshake_targets(self.tp_rank, self.tp_size, info.remote_tp_size))


def is_kv_replicated(self: Any, remote_engine_id: str, remote_pp_rank: int = 0) -> bool:
    """The remote replicates KV heads when its TP exceeds the model's KV heads (kvgeom's shard rule)."""
    remote_tp = self._engines[(remote_engine_id, remote_pp_rank)].remote_tp_size
    return Shard(int(self.total_num_kv_heads), 1).replicated(int(remote_tp))


def replicates_kv_cache(self: Any, remote_engine_id: str, remote_pp_rank: int = 0) -> bool:
    """MLA latents are replicated on every rank; otherwise the remote's shard rule decides."""
    return bool(self.is_mla) or is_kv_replicated(self, remote_engine_id, remote_pp_rank)


def topology_local_replicates_kv_cache(self: Any) -> bool:
    return bool(self.is_mla) or Shard(int(self.total_num_kv_heads), 1).replicated(int(self.tp_size))


def needs_split_local_xfer_handles(self: Any, tp_ratio: int, plan: Any) -> bool:
    return _kv_needs_split(tp_ratio, to_kvgeom_mapping(plan), bool(self.use_mla))
