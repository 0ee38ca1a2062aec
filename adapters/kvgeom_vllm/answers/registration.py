"""Registration: vLLM's ``register_kv_caches`` with its region discovery answered by
:func:`kvgeom.compat.vllm.registration.discover_regions`, then the rank's geometry card (:mod:`kvgeom_vllm.card`).

The adapter reads each cache tensor's facts (addresses, storage, block stride, first-block contiguity,
the spec's page and its group's pool) and hands them to kvgeom; kvgeom's regions, SSM/scratch/PLE
indices, member layers and packed layouts become the worker's state. Around that it does what vLLM's
method does, in the same order: the transfer topology (kvgeom's class), the compatibility hash and host
buffers (vLLM's functions), the transport registration of every distinct storage, the per-engine
bookkeeping, the local descriptor list and the handshake metadata (with the card).
"""

from __future__ import annotations

import logging
from typing import Any

from kvgeom.compat.vllm.registration import CacheTensor, RegistrationLayout, discover_regions
from kvgeom.errors import ConfigError, KvgeomError, UnsupportedError

from ..calls import counted_call
from ..card import card_of_worker, check_registration
from ..metadata import CARDLESS, CARDLESS_EXAMPLE, KvgeomAgentMetadata
from ..version import profile
from ._common import KVI
from .regions import pp_region_offset, region_sort_key

logger = logging.getLogger("kvgeom_vllm")


def _kind(spec: Any) -> str:
    if spec is None:
        return "none"
    if isinstance(spec, KVI.MambaSpec):
        return "replicated_state" if getattr(spec, "tp_replicated", False) else "state"
    if isinstance(spec, (KVI.MLAAttentionSpec, KVI.SlidingWindowMLASpec)):
        return "mla"
    if isinstance(spec, KVI.CircularBufferSpec):
        return "scratch"
    return "attention"


def cache_tensor(worker: Any, name: str, cache: Any) -> CacheTensor:
    """The facts kvgeom's region discovery needs about one layer's cache tensor."""
    spec = worker._layer_specs.get(name)
    storage = cache.untyped_storage()
    esize = cache.element_size()
    flat = cache.ndim == 1
    first = None
    if not flat and cache.shape[0] > 0 and cache[0].is_contiguous():
        first = int(cache[0].nbytes)
    if spec is None:  # a layer sharing another's cache: only its storage counts (for the shared-row test)
        return CacheTensor(
            name, "none", storage_address=int(storage.data_ptr()), block_stride=int(cache.stride(0)) * esize
        )
    kcc = worker.kv_cache_config
    group_index = kcc.transfer_group_index_by_layer[name]
    group = kcc.transfer_groups[group_index]
    pool = kcc.hisparse_host_num_blocks if group.host_resident else kcc.num_blocks
    on_host = cache.device.type == "cpu"
    return CacheTensor(
        name=name,
        kind=_kind(spec),
        group=int(group_index),
        address=int(cache.data_ptr()),
        nbytes=int(cache.nbytes),
        storage_address=int(storage.data_ptr()),
        storage_bytes=int(storage.nbytes()),
        block_stride=int(cache.stride(0)) * esize,
        flat=flat,
        first_block_bytes=first,
        rows=int(cache.shape[0]),
        page_bytes=int(spec.page_size_bytes),
        pool_blocks=int(pool),
        host_resident=bool(group.host_resident),
        mem_type="DRAM" if on_host else str(worker.nixl_memory_type),
        device=None if on_host else max(cache.get_device(), 0),
    )


def register_kv_caches(self: Any, kv_caches: dict[str, Any]) -> None:
    """``register_kv_caches`` (see the module doc)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw

    routing = self._requires_layer_name_routing()
    _set_topology(self, kv_caches)
    _set_compat_hash(self, bw)
    buffers = _transfer_buffers(self, kv_caches)
    names = (
        list(buffers)
        if self._is_csa_linear
        else sorted(buffers, key=lambda n: counted_call("_region_sort_key", region_sort_key, n))
    )
    reg = discover_regions([cache_tensor(self, n, buffers[n]) for n in names], _layout(self, routing))
    _adopt_regions(self, reg, routing)
    regions = self._transfer_layer_region_indices or range(self.num_regions)
    transfer_counts = [self.region_num_blocks[i] for i in regions]
    self.num_descs = sum(transfer_counts)
    self._skip_dram_xfer = self._leaves_dram_xfer_to_rank0()
    _register_memory(self, reg)
    _record_engine(self, kv_caches, transfer_counts)
    _attach_card(self)
    _set_handshake_metadata(self, bw)


def _set_topology(self: Any, kv_caches: dict[str, Any]) -> None:
    """The transfer topology (kvgeom_vllm.worker.KvgeomTransferTopology), as vLLM builds its own."""
    self.transfer_topo = self.kvgeom_topology(
        tp_rank=self.transfer_tp_rank,
        tp_size=self.transfer_tp_size,
        block_size=self.block_size,
        engine_id=self.engine_id,
        is_mla=self.use_mla,
        total_num_kv_heads=1 if self.use_mla else self.model_config.get_total_num_kv_heads(),
        attn_backends=self.attn_backends,
        dcp_size=self.dcp_size,
        tensor_shape=next(iter(kv_caches.values())).shape if not self._has_mamba else None,
        is_mamba=self._has_mamba,
    )


def _set_compat_hash(self: Any, bw: Any) -> None:
    """vLLM's compatibility hash over the backend names (sorted for a packed model under PP)."""
    backend_name = self.backend_name
    if (
        self._supports_pp_hma and self._has_packed_cache
    ):  # PP stages may list a packed model's backends in any order
        backend_name = ",".join(sorted({b.get_name() for b in self.attn_backends}))
    self.compat_hash = bw.compute_nixl_compatibility_hash(
        self.vllm_config, backend_name, transfer_mode=self._TRANSFER_MODE
    )


def _transfer_buffers(self: Any, kv_caches: dict[str, Any]) -> dict[str, Any]:
    """The tensors the transport moves: the caches, or the host staging buffers vLLM allocates."""
    if self._is_csa_linear and self.use_host_buffer:
        raise UnsupportedError(
            "use_host_buffer", "NIXL host staging does not preserve CSA-linear shared tensors", value=True
        )
    if self.use_host_buffer:
        self.initialize_host_xfer_buffer(kv_caches=kv_caches)
        buffers: dict[str, Any] = self.host_xfer_buffers
        return buffers
    return kv_caches


def _layout(self: Any, routing: bool) -> RegistrationLayout:
    return RegistrationLayout(
        ppl=int(self._physical_blocks_per_logical_kv_block),
        has_ssm=bool(self._has_mamba),
        mla=bool(self.use_mla),
        csa_linear=bool(self._is_csa_linear),
        block_outermost=bool(self._has_packed_cache),
        route_by_layer=routing,
        pp_size=int(self.pp_size),
        track_members=bool(self._tracks_region_layers()),
        kernel_blocks=int(self.num_blocks),
    )


def _adopt_regions(self: Any, reg: Any, routing: bool) -> None:
    """kvgeom's regions become the worker's per-region state."""
    if reg.device is not None:
        self.device_id = reg.device
    self.block_len_per_layer = list(reg.block_lens)
    self.block_stride_per_layer = list(reg.block_strides)
    self.region_group_ids = list(reg.group_ids)
    self.region_names = list(reg.names)
    self.region_num_blocks = list(reg.num_blocks)
    self._region_is_mla = list(reg.is_mla)
    self._ssm_region_indices = list(reg.ssm_region_indices)
    self._scratch_region_indices = list(reg.scratch_region_indices)
    self._ple_region_index, self._ple_block_len = reg.ple_region_index, reg.ple_block_len
    # vLLM 0.32.0 has no head-sharded draft regions (docs/vllm-versions.md)
    self._head_sharded_draft_regions = (
        self._get_head_sharded_draft_regions() if profile().draft_regions else set()
    )
    self.kv_caches_base_addr[self.engine_id][self.tp_rank] = list(reg.bases)
    self.num_regions = reg.num_regions
    self.region_mem_types = list(reg.mem_types)
    self._uses_region_group_mapping = len(set(self.region_group_ids)) > 1
    self._mixed_mem_types = len(set(self.region_mem_types)) > 1
    self._set_region_layers([list(m) for m in reg.members])
    self._packed_member_layouts = dict(reg.packed_layouts)
    if self.pp_size > 1 and not routing:
        start, end = self.model_config.get_layers_start_end_indices(self.vllm_config.parallel_config)
        self._remote_region_offset = pp_region_offset(self.num_regions, start, end)


def _register_memory(self: Any, reg: Any) -> None:
    """The transport registration of every distinct storage, one call per memory type."""
    if self._mixed_mem_types and (not self.use_mla or self._has_mamba):
        raise UnsupportedError(
            "region_mem_types",
            "mixed-device KV registration is only supported for MLA models without Mamba layers",
            value=sorted(set(self.region_mem_types)),
        )
    for mem_type in sorted(set(self.region_mem_types)):
        if mem_type == "DRAM" and self._skip_dram_xfer:
            continue
        ranges = [(start, length, device, "") for start, length, device, m in reg.ranges if m == mem_type]
        descs = self.nixl_wrapper.get_reg_descs(ranges, mem_type)
        self.nixl_wrapper.register_memory(descs, backends=self.nixl_backends)
        self._registered_descs.append(descs)


def _record_engine(self: Any, kv_caches: dict[str, Any], transfer_counts: list[int]) -> None:
    """The per-engine bookkeeping and the local descriptor list."""
    self.device_kv_caches = kv_caches
    self.dst_num_blocks[self.engine_id] = self.num_blocks
    self.dst_region_num_blocks[self.engine_id] = transfer_counts
    self.dst_region_group_ids[self.engine_id] = self.region_group_ids
    self.dst_uses_region_group_mapping[self.engine_id] = self._uses_region_group_mapping
    self.dst_region_mem_types[self.engine_id] = self.region_mem_types
    self.src_xfer_handles_by_block_size[self.block_size], self.src_blocks_data = (
        self.register_local_xfer_handler(self.block_size)
    )


def _attach_card(self: Any) -> None:
    """The rank's geometry card, or the reason kvgeom cannot describe it (fatal in kvgeom mode)."""
    self.kvgeom_card = self.kvgeom_card_error = None
    try:
        card = card_of_worker(self)
        check_registration(card, self)
        self.kvgeom_card = card
    except KvgeomError as exc:
        CARDLESS[exc.field] += 1
        CARDLESS_EXAMPLE.setdefault(exc.field, str(exc))
        self.kvgeom_card_error = exc
        if self.kvgeom_compat == "kvgeom":
            raise ConfigError(
                "compat",
                f"kvgeom mode needs this rank's geometry card, and kvgeom cannot describe it: {exc}",
                value="kvgeom",
            ) from exc
        logger.info(
            "kvgeom_vllm: no geometry card for this rank (%s); it pairs on the numbers it advertises", exc
        )


def _set_handshake_metadata(self: Any, bw: Any) -> None:
    """The handshake payload: vLLM's metadata fields, plus the card."""
    meta = KvgeomAgentMetadata(
        engine_id=self.engine_id,
        agent_metadata=self.nixl_wrapper.get_agent_metadata(),
        device_id=self.device_id,
        kv_caches_base_addr=self.kv_caches_base_addr[self.engine_id][self.tp_rank],
        num_blocks=self.num_blocks,
        block_lens=self.block_len_per_layer,
        block_strides=self.block_stride_per_layer,
        kv_cache_layout=self.kv_cache_layout
        if not self.use_host_buffer
        else self.host_buffer_kv_cache_layout,
        block_size=self.block_size,
        ssm_sizes=self._mamba_ssm_size,
        ple_block_len=self._ple_block_len,
        attn_backend_name=self.backend_name,
        physical_blocks_per_logical_kv_block=self._physical_blocks_per_logical_kv_block,
        region_num_blocks=self.region_num_blocks,
        region_group_ids=self.region_group_ids,
        region_names=self.region_names,
        region_mem_types=self.region_mem_types,
        dcp_size=self.dcp_size,
        pcp_size=self.pcp_size,
        region_members=self.region_members,
        packed_member_layouts=self._packed_member_layouts,
        kvgeom_card=self.kvgeom_card.dumps() if self.kvgeom_card is not None else None,
    )
    import msgspec

    self.xfer_handshake_metadata = bw.NixlHandshakePayload(
        compatibility_hash=self.compat_hash, agent_metadata_bytes=msgspec.msgpack.encode(meta)
    )
