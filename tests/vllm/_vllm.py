"""Calls into vLLM 0.33.0's own NIXL geometry functions, with plain inputs and outputs.

vLLM's geometry lives in methods of its connector worker that read the worker's state; as vLLM's own
unit tests do, each call here builds a bare worker (``object.__new__``) holding only the state that
method reads, then calls vLLM's real method. Outputs are returned as plain lists / numpy arrays; an
exception vLLM raises is returned as :class:`Raised` (so the tests can require a kvgeom refusal).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology, clip_ssm_state_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import NixlConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import TPMapping as VTPMapping
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

SPEC_TYPES: dict[str, type] = {
    "fa": FullAttentionSpec,
    "swa": SlidingWindowSpec,
    "mla": MLAAttentionSpec,
    "ssm": MambaSpec,
    "ring": CircularBufferSpec,
}


@dataclass(frozen=True)
class Raised:
    """vLLM raised ``kind`` (its class name) with ``message``."""

    kind: str
    message: str


def call(fn: Callable[[], Any]) -> Any:
    """``fn()``, or :class:`Raised` if vLLM raised."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - any vLLM failure is a refusal to compare against
        return Raised(type(exc).__name__, str(exc))


def worker(**state: Any) -> NixlConnectorWorker:
    """A bare vLLM worker holding ``state``."""
    w = object.__new__(NixlConnectorWorker)
    for key, value in state.items():
        setattr(w, key, value)
    return w


def spec_types(kinds: Sequence[str]) -> tuple[type, ...]:
    return tuple(SPEC_TYPES[k] for k in kinds)


def _transfer_groups(kinds: Sequence[str]) -> SimpleNamespace:
    return SimpleNamespace(
        transfer_groups=[SimpleNamespace(kv_cache_spec=object.__new__(SPEC_TYPES[k])) for k in kinds]
    )


# -- TP mapping and DCP -------------------------------------------------------------------------------
def topology(rank: int, tp: int, heads: int, is_mla: bool, dcp: int = 1) -> TransferTopology:
    topo = object.__new__(TransferTopology)
    topo.tp_rank, topo.tp_size, topo.is_mla, topo.total_num_kv_heads, topo.dcp_size = (
        rank,
        tp,
        is_mla,
        heads,
        dcp,
    )
    return topo


def mapping_json(m: VTPMapping) -> dict[str, Any]:
    return {
        "source_ranks_per_group": [list(g) for g in m.source_ranks_per_group],
        "all_source_ranks": list(m.all_source_ranks),
        "rank_to_attention_slot": [[int(r), int(s)] for r, s in m.rank_to_attention_slot.items()],
        "rank_offset_factor": int(m.rank_offset_factor),
        "local_consumers": int(m.local_consumers),
    }


def tp_mapping(
    rank: int,
    tp: int,
    remote_tp: int,
    heads: int,
    is_mla: bool,
    kinds: Sequence[str],
    dcp: int = 1,
    remote_dcp: int = 1,
    draft_heads: int | None = None,
) -> Any:
    return call(
        lambda: mapping_json(
            compute_tp_mapping(
                topology(rank, tp, heads, is_mla, dcp), remote_tp, spec_types(kinds), remote_dcp, draft_heads
            )
        )
    )


def handshake_targets(rank: int, tp: int, remote_tp: int, dcp: int, remote_dcp: int) -> Any:
    return call(lambda: list(topology(rank, tp, 1, True, dcp).handshake_target_ranks(remote_tp, remote_dcp)))


def consumer_count(tp: int, dcp: int, remote_tp: int, remote_dcp: int) -> Any:
    return call(lambda: int(topology(0, tp, 1, True, dcp).dcp_consumer_count(remote_tp, remote_dcp)))


def as_vllm_mapping(m: Any) -> VTPMapping:
    """A kvgeom :class:`~kvgeom.pair.tp.TPMapping` as vLLM's (its slots as a dict)."""
    return VTPMapping(
        m.source_ranks_per_group,
        m.all_source_ranks,
        dict(m.rank_to_attention_slot),
        m.rank_offset_factor,
        m.local_consumers,
    )


# -- descriptor ids, split handles, strided rows --------------------------------------------------------
def desc_ids(
    block_ids: list[list[int]],
    dst_num_blocks: int,
    bsr: int | None,
    ppl: int,
    *,
    kinds: Sequence[str],
    num_regions: int,
    ssm_regions: Sequence[int],
    pieces: int,
    region_num_blocks: list[int] | None,
    region_group_ids: list[int] | None,
    own_group_ids: list[int],
    routing: Sequence[int] = (),
    scratch_regions: Sequence[int] = (),
    ple_group: int | None = None,
) -> Any:
    """``_compute_desc_ids`` of a worker with ``num_regions`` regions (own group ids ``own_group_ids``)."""
    has_mamba = "ssm" in kinds
    w = worker(
        _has_mamba=has_mamba,
        _conv_decomp=SimpleNamespace(local_conv_offsets=[(0, 1)] * pieces),
        _ssm_region_indices=list(ssm_regions),
        block_len_per_layer=[1] * num_regions,
        _transfer_layer_group_ids=tuple(routing),
        num_regions=num_regions,
        region_group_ids=list(own_group_ids),
        _uses_region_group_mapping=len(set(own_group_ids)) > 1,
        _group_spec_types=spec_types(kinds),
        _scratch_region_indices=list(scratch_regions),
        _ple_group_index=ple_group,
    )
    return call(
        lambda: np.asarray(
            w._compute_desc_ids(block_ids, dst_num_blocks, bsr, ppl, region_num_blocks, region_group_ids),
            dtype=np.int64,
        )
    )


def local_splits(
    mapping: Any,
    rows: np.ndarray,
    num_fa: int,
    bsr: int,
    *,
    kinds: Sequence[str],
    region_is_mla: Sequence[bool],
    region_num_blocks: Sequence[int],
    ple: bool,
    logical_num_blocks: int,
) -> Any:
    w = worker(
        _group_spec_types=spec_types(kinds),
        transfer_topo=SimpleNamespace(),
        block_len_per_layer=[1] * len(region_is_mla),
        num_regions=len(region_is_mla),
        _region_is_mla=list(region_is_mla),
        region_num_blocks=list(region_num_blocks),
        _transfer_layer_region_indices=(),
        _ple_region_index=0 if ple else None,
        _logical_num_blocks=logical_num_blocks,
    )
    return call(
        lambda: [
            np.asarray(h, dtype=np.int64)
            for h in w._build_local_splits_from_plan(
                as_vllm_mapping(mapping), rows.astype(np.uint64), num_fa, bsr
            )
        ]
    )


def fa_local(
    bases: Sequence[int],
    lens: Sequence[int],
    strides: Sequence[int],
    caps: Sequence[int],
    bsr: int,
    routing_regions: Sequence[int] = (),
) -> Any:
    w = worker(
        transfer_topo=SimpleNamespace(),
        device_id=0,
        _transfer_layer_region_indices=tuple(routing_regions),
        block_len_per_layer=list(lens),
        block_stride_per_layer=list(strides),
        region_num_blocks=list(caps),
    )
    return call(lambda: w._build_fa_local(list(bases), bsr).astype(np.int64))


def fa_remote(
    mapping: Any,
    *,
    remote_bases: Sequence[int],
    remote_strides: Sequence[int],
    remote_caps: Sequence[int] | None,
    remote_num_blocks: int,
    local_lens: Sequence[int],
    region_is_mla: Sequence[bool],
    kinds: Sequence[str],
    bsr: int,
    routing_regions: Sequence[int] = (),
    draft_mapping: Any = None,
    draft_regions: Sequence[int] = (),
) -> Any:
    meta = SimpleNamespace(
        kv_caches_base_addr=list(remote_bases),
        region_num_blocks=None if remote_caps is None else list(remote_caps),
        num_blocks=remote_num_blocks,
        device_id=0,
        block_strides=list(remote_strides),
        engine_id="remote",
    )
    w = worker(
        transfer_topo=SimpleNamespace(),
        _group_spec_types=spec_types(kinds),
        _transfer_layer_region_indices=tuple(routing_regions),
        _region_is_mla=list(region_is_mla),
        block_len_per_layer=list(local_lens),
        _head_sharded_draft_regions=set(draft_regions),
        draft_tp_mappings={"remote": as_vllm_mapping(draft_mapping)} if draft_mapping is not None else {},
    )
    return call(lambda: w._build_fa_remote(as_vllm_mapping(mapping), meta, bsr).astype(np.int64))


def mamba_local(
    bases: Sequence[int],
    strides: Sequence[int],
    ssm_regions: Sequence[int],
    conv_offsets: Sequence[tuple[int, int]],
    ssm_sizes: tuple[int, int],
    ppl: int,
    nbl: int,
    ple_region: int | None,
    ple_len: int | None,
) -> Any:
    w = worker(
        _conv_decomp=SimpleNamespace(local_conv_offsets=list(conv_offsets)),
        _mamba_ssm_size=ssm_sizes,
        _logical_num_blocks=nbl,
        _physical_blocks_per_logical_kv_block=ppl,
        device_id=0,
        _ssm_region_indices=list(ssm_regions),
        block_stride_per_layer=list(strides),
        _ple_region_index=ple_region,
        _ple_block_len=ple_len,
    )
    return call(lambda: w._build_mamba_local(list(bases)).astype(np.int64))


def mamba_remote(
    *,
    remote_bases: Sequence[int],
    remote_strides: Sequence[int],
    remote_num_blocks: int,
    remote_ppl: int,
    remote_ssm_sizes: tuple[int, int],
    ssm_regions: Sequence[int],
    conv_reads: Sequence[tuple[int, int]],
    local_ssm_sizes: tuple[int, int],
    tp_ratio: int,
    rank: int,
    local_ppl: int,
    ple_region: int | None,
    local_ple: int | None,
    remote_ple: int | None,
) -> Any:
    conv = SimpleNamespace(remote_conv_offsets=lambda offset, ratio: list(conv_reads))
    meta = SimpleNamespace(
        kv_caches_base_addr=list(remote_bases),
        ssm_sizes=remote_ssm_sizes,
        num_blocks=remote_num_blocks,
        device_id=0,
        block_strides=list(remote_strides),
        ple_block_len=remote_ple,
    )
    w = worker(
        _conv_decomp=conv,
        tp_rank=rank,
        _mamba_ssm_size=local_ssm_sizes,
        _ssm_region_indices=list(ssm_regions),
        _ple_region_index=ple_region,
        _ple_block_len=local_ple,
        _physical_blocks_per_logical_kv_block=local_ppl,
    )
    info = SimpleNamespace(remote_physical_blocks_per_logical=remote_ppl)
    return call(lambda: w._build_mamba_remote(meta, tp_ratio, info).astype(np.int64))


# -- block ids ---------------------------------------------------------------------------------------
def prefix_caching(
    decode: list[list[int]], prefill: list[list[int]], decode_ppl: int, prefill_ppl: int, kinds: Sequence[str]
) -> Any:
    w = worker(_has_mamba="ssm" in kinds, _group_spec_types=spec_types(kinds))
    return call(
        lambda: tuple(
            [list(map(int, g)) for g in side]
            for side in w._apply_prefix_caching(decode, prefill, decode_ppl, prefill_ppl)
        )
    )


def map_ratio(local: list[list[int]], remote: list[list[int]], ratio: int, kinds: Sequence[str]) -> Any:
    w = worker(_group_spec_types=spec_types(kinds))
    return call(
        lambda: tuple(
            [list(map(int, g)) for g in side]
            for side in w._map_block_ids_for_block_size_ratio(local, remote, ratio)
        )
    )


def logical_to_kernel(block_ids: list[list[int]], ppl: int, kinds: Sequence[str]) -> Any:
    w = worker(kv_cache_config=_transfer_groups(kinds))
    return call(lambda: [list(map(int, g)) for g in w._logical_to_kernel_block_ids(block_ids, ppl)])


def dcp_prefix(
    local: list[int],
    remote: list[int],
    remote_rank: int,
    ld: int,
    d: int,
    rd: int,
    cached: int,
    num_remote_blocks: int | None,
) -> Any:
    w = worker()
    return call(
        lambda: tuple(
            list(map(int, x))
            for x in w._apply_dcp_prefix_caching(
                local, remote, remote_rank, ld, d, rd, cached, num_remote_blocks=num_remote_blocks
            )
        )
    )


def by_region(block_ids: list[list[int]], region_group_ids: list[int]) -> Any:
    return call(
        lambda: [
            list(map(int, x)) for x in NixlConnectorWorker._block_ids_by_region(block_ids, region_group_ids)
        ]
    )


def prefix_by_region(
    decode: list[list[int]],
    prefill: list[list[int]],
    computed: list[int] | None,
    num_remote_blocks: int | None,
    remote_rank: int,
    dcp: int,
    d: int,
    remote_dcp: int,
) -> Any:
    w = worker(dcp_size=dcp, dcp_rank=d)
    return call(
        lambda: tuple(
            [list(map(int, x)) for x in side]
            for side in w._apply_prefix_caching_by_region(
                decode,
                prefill,
                num_computed_blocks=computed,
                num_remote_blocks=num_remote_blocks,
                remote_rank=remote_rank,
                remote_dcp_size=remote_dcp,
            )
        )
    )


def clip_ssm(blocks: list[int], spec_blocks: int) -> Any:
    return call(lambda: list(map(int, clip_ssm_state_blocks(list(blocks), spec_blocks))))


def exchange_clipped(
    block_ids: list[list[int]], blocks_per_sw: list[int], ssm_spec: list[int | None], clip: bool
) -> Any:
    s = object.__new__(NixlConnectorScheduler)
    s.kv_cache_config = SimpleNamespace(select_transfer_block_ids=lambda ids: ids)
    s._is_hma_required, s.blocks_per_sw, s._ssm_spec_blocks = True, list(blocks_per_sw), list(ssm_spec)
    return call(lambda: [list(map(int, g)) for g in s.get_exchange_clipped_blocks(tuple(block_ids), clip)])


# -- region metadata ----------------------------------------------------------------------------------
def agent_meta(table: Any) -> NixlAgentMetadata:
    """vLLM's handshake metadata of a :class:`kvgeom.pair.layerroute.RegionTable`."""
    return NixlAgentMetadata(
        engine_id="remote",
        agent_metadata=b"",
        device_id=0,
        kv_caches_base_addr=list(table.bases),
        num_blocks=0,
        block_lens=list(table.block_lens),
        block_strides=list(table.block_strides),
        kv_cache_layout="HND",
        block_size=16,
        ssm_sizes=(0, 0),
        attn_backend_name="x",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=None if table.num_blocks is None else list(table.num_blocks),
        region_group_ids=None if table.group_ids is None else list(table.group_ids),
        region_names=None if table.names is None else list(table.names),
        region_mem_types=None if table.mem_types is None else list(table.mem_types),
        region_members=[list(m) for m in table.members],
        packed_member_layouts=dict(table.packed),
    )


def meta_fields(meta: NixlAgentMetadata) -> dict[str, Any]:
    return {
        "bases": list(meta.kv_caches_base_addr),
        "block_lens": list(meta.block_lens),
        "block_strides": list(meta.block_strides),
        "num_blocks": meta.region_num_blocks,
        "group_ids": meta.region_group_ids,
        "names": meta.region_names,
        "members": [list(m) for m in meta.region_members],
    }


def align_by_layer(
    table: Any, names: Sequence[str], regions: Sequence[int], local_lens: Sequence[int]
) -> Any:
    meta = agent_meta(table)
    w = worker(
        _transfer_layer_names=tuple(names),
        _transfer_layer_region_indices=tuple(regions),
        block_len_per_layer=list(local_lens),
    )

    def run() -> dict[str, Any]:
        w._align_remote_regions_by_layer(meta)
        return meta_fields(meta)

    return call(run)


def split_packed(table: Any, local_names: Sequence[str]) -> Any:
    meta = agent_meta(table)

    def run() -> dict[str, Any]:
        bw.NixlBaseConnectorWorker._split_remote_packed_rows(
            SimpleNamespace(region_names=list(local_names)), meta
        )
        return meta_fields(meta)

    return call(run)


def csa_layout(local_tp: int, remote_tp: int, heads: int) -> Any:
    w = worker(
        world_size=local_tp, _is_csa_linear=True, transfer_topo=SimpleNamespace(total_num_kv_heads=heads)
    )
    return call(lambda: w._validate_csa_linear_tp_layout(remote_tp))


__all__ = ["Raised", "call", "worker", "torch"]
