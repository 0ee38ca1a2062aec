"""kvgeom's answers to vLLM 0.33.0's NIXL geometry functions, one adapter per row of
:data:`kvgeom_vllm.table.TABLE`.

Each adapter takes vLLM's arguments (and, for worker methods, the worker as ``self``), reads the worker
state vLLM's own method would read, calls kvgeom, and returns kvgeom's answer in vLLM's types: lists of
lists for block ids, ``np.ndarray`` for descriptor ids, vLLM's ``TPMapping`` and ``MambaConvSplitInfo``,
and NIXL's strided ``(addr, len, dev, stride, count)`` rows for descriptor tables. No adapter computes
geometry itself; where vLLM's input holds a feature kvgeom has no geometry for
(:data:`kvgeom_vllm.table.FEATURES`), the adapter refuses with :class:`kvgeom.UnsupportedError`.

The card-carrying steps (``register_kv_caches``, ``add_remote_agent``) live in
:mod:`kvgeom_vllm.handshake`; they wrap vLLM's own methods.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvgeom.blocks import apply_prefix_caching as _kv_apply_prefix_caching
from kvgeom.blocks import get_mapped_blocks as _kv_get_mapped_blocks
from kvgeom.blocks import logical_to_kernel as _kv_logical_to_kernel
from kvgeom.blocks import map_block_ids_for_block_size_ratio as _kv_map_ratio
from kvgeom.conv import derive_conv_split as _kv_derive_conv_split
from kvgeom.conv import physical_blocks_per_logical as _kv_ppl
from kvgeom.conv import remote_conv_offsets as _kv_remote_conv_offsets
from kvgeom.descids import compute_desc_ids as _kv_compute_desc_ids
from kvgeom.dlist import EngineView, local_dlist, remote_dlist
from kvgeom.errors import ConfigError, PlanError, SpecError, UnsupportedError
from kvgeom.spec import Shard
from kvgeom.splits import build_local_splits as _kv_build_local_splits
from kvgeom.tp import TPMapping as KvTPMapping
from kvgeom.tp import compute_tp_mapping as _kv_compute_tp_mapping
from kvgeom.tp import handshake_targets as _kv_handshake_targets
from kvgeom.tp import head_offset as _kv_head_offset
from kvgeom.tp import needs_split_local_handles as _kv_needs_split
from kvgeom.tp import tp_ratio as _kv_tp_ratio

from .table import FEATURES


def _vllm() -> Any:
    """vLLM's modules the adapters read types from (imported here, never by the core)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import ssm_conv_transfer_utils as ssm
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import tp_mapping
    from vllm.v1 import kv_cache_interface as kvi

    return tp_mapping, ssm, kvi


_TPM, _SSM, _KVI = _vllm()
_ORIGINAL_CONV_SPLIT_INFO = _SSM.MambaConvSplitInfo


def missing(feature: str, field: str, **values: Any) -> UnsupportedError:
    """The refusal for a vLLM input that needs a feature kvgeom has no geometry for yet."""
    return UnsupportedError(field, f"needs {FEATURES[feature]}, which kvgeom has no geometry for yet "
                            f"(kvgeom_vllm feature {feature!r})", **values)


# -- conversions --------------------------------------------------------------------------------------
def is_ssm_type(spec_type: type) -> bool:
    return issubclass(spec_type, _KVI.MambaSpec)


def group_is_ssm(spec_types: Sequence[type], n: int | None = None) -> tuple[bool, ...]:
    kinds = tuple(is_ssm_type(t) for t in spec_types)
    return kinds if n is None else kinds[:n]


def to_kvgeom_mapping(m: Any) -> KvTPMapping:
    """vLLM's ``TPMapping`` (dict of attention slots) as kvgeom's (pairs in the dict's order)."""
    if isinstance(m, KvTPMapping):
        return m
    return KvTPMapping(
        source_ranks_per_group=tuple(tuple(int(r) for r in g) for g in m.source_ranks_per_group),
        all_source_ranks=tuple(int(r) for r in m.all_source_ranks),
        rank_to_attention_slot=tuple((int(r), int(s)) for r, s in dict(m.rank_to_attention_slot).items()),
        rank_offset_factor=int(m.rank_offset_factor),
        local_consumers=int(getattr(m, "local_consumers", 1)),
    )


def to_vllm_mapping(m: KvTPMapping) -> Any:
    return _TPM.TPMapping(
        source_ranks_per_group=m.source_ranks_per_group,
        all_source_ranks=m.all_source_ranks,
        rank_to_attention_slot=dict(m.rank_to_attention_slot),
        rank_offset_factor=m.rank_offset_factor,
        local_consumers=m.local_consumers,
    )


def _lists(groups: Sequence[np.ndarray]) -> list[list[int]]:
    return [np.asarray(g).tolist() for g in groups]


def pack_runs(descs: np.ndarray, unit: int, stride: int) -> np.ndarray:
    """One segment of ``(addr, len, dev)`` rows as NIXL strided rows ``(addr, len, dev, stride, count)``:
    the whole segment as one run when its rows are evenly spaced, else one run per ``unit`` rows (a
    padded block's sub-blocks). ``stride`` is the stride a single row is given (vLLM's block stride)."""
    n = int(descs.shape[0])
    out_dtype = np.uint64
    if n == 0:
        return np.zeros((0, 5), dtype=out_dtype)
    addr = descs[:, 0].astype(np.int64)
    lens = descs[:, 1].astype(np.int64)
    if n == 1 or ((np.diff(addr) == addr[1] - addr[0]).all() and (lens == lens[0]).all()):
        step = stride if n == 1 else int(addr[1] - addr[0])
        return np.array([[int(descs[0, 0]), int(lens[0]), int(descs[0, 2]), step, n]], dtype=out_dtype)
    if unit < 2 or n % unit:
        raise PlanError("descs", f"{n} rows are not evenly spaced and do not split into runs of {unit}",
                        value=n, expected=unit)
    chunks = addr.reshape(-1, unit)
    steps = chunks[:, 1] - chunks[:, 0]
    if not (np.diff(chunks, axis=1) == steps[:, None]).all():
        raise PlanError("descs", f"runs of {unit} rows are not evenly spaced", value=unit)
    runs = np.empty((chunks.shape[0], 5), dtype=np.int64)
    runs[:, 0] = chunks[:, 0]
    runs[:, 1] = lens.reshape(-1, unit)[:, 0]
    runs[:, 2] = descs[::unit, 2].astype(np.int64)
    runs[:, 3] = steps
    runs[:, 4] = unit
    return runs.astype(out_dtype)


def _view(num_blocks: int, lens: Sequence[int], strides: Sequence[int], is_mla: Sequence[bool] | None = None,
          ppl: int = 1, ssm_regions: Sequence[int] = (), ssm_sizes: Sequence[int] | None = None,
          conv_offsets: Sequence[tuple[int, int]] | None = None) -> EngineView:
    """An address-free :class:`EngineView` of registered regions as vLLM's worker describes them."""
    return EngineView(
        tp_size=1, tp_rank=0, block_size=1, ppl=int(ppl), num_blocks=int(num_blocks),
        block_lens=tuple(int(x) for x in lens), block_strides=tuple(int(x) for x in strides),
        region_is_mla=tuple(bool(x) for x in (is_mla if is_mla is not None else [False] * len(lens))),
        ssm_region_indices=tuple(int(r) for r in ssm_regions),
        ssm_sizes=None if ssm_sizes is None else (int(ssm_sizes[0]), int(ssm_sizes[1])),
        conv_offsets=None if conv_offsets is None else tuple((int(o), int(s)) for o, s in conv_offsets),
    )


# -- TP mapping ------------------------------------------------------------------------------------------
def compute_tp_mapping(transfer_topology: Any, remote_tp_size: int, group_spec_types: Sequence[type],
                       remote_dcp_size: int = 1, head_sharded_kv_heads: int | None = None) -> Any:
    """``tp_mapping.compute_tp_mapping``. A GQA draft under an MLA target (``head_sharded_kv_heads``) is
    mapped as attention with the draft's head count, which is what vLLM's rule reduces to."""
    dcp = int(getattr(transfer_topology, "dcp_size", 1) or 1)
    if dcp > 1 or remote_dcp_size > 1:
        raise missing("dcp", "dcp_size", local=dcp, remote=remote_dcp_size)
    is_mla = bool(transfer_topology.is_mla) and head_sharded_kv_heads is None
    heads = head_sharded_kv_heads or transfer_topology.total_num_kv_heads
    m = _kv_compute_tp_mapping(transfer_topology.tp_rank, transfer_topology.tp_size, remote_tp_size, heads,
                               is_mla, group_is_ssm(group_spec_types))
    return to_vllm_mapping(m)


def compute_head_offset(tp_rank: int, tp_size: int, remote_tp_size: int, total_num_kv_heads: int) -> int:
    return _kv_head_offset(tp_rank, tp_size, remote_tp_size, total_num_kv_heads)


def topology_tp_ratio(self: Any, remote_tp_size: int) -> int:
    return _kv_tp_ratio(self.tp_size, remote_tp_size)


def _check_no_dcp(self: Any, remote_dcp_size: int) -> None:
    dcp = int(getattr(self, "dcp_size", 1) or 1)
    if dcp > 1 or remote_dcp_size > 1:
        raise missing("dcp", "dcp_size", local=dcp, remote=remote_dcp_size)


def handshake_target_ranks(self: Any, remote_tp_size: int, remote_dcp_size: int = 1) -> list[int]:
    _check_no_dcp(self, remote_dcp_size)
    return list(_kv_handshake_targets(self.tp_rank, self.tp_size, remote_tp_size))


def target_remote_ranks(self: Any, remote_engine_id: str, remote_pp_rank: int = 0) -> list[int]:
    info = self._engines[(remote_engine_id, remote_pp_rank)]
    _check_no_dcp(self, getattr(info, "remote_dcp_size", 1))
    return list(_kv_handshake_targets(self.tp_rank, self.tp_size, info.remote_tp_size))


def is_kv_replicated(self: Any, remote_engine_id: str, remote_pp_rank: int = 0) -> bool:
    """The remote replicates KV heads when its TP exceeds the model's KV heads (kvgeom's shard rule)."""
    remote_tp = self._engines[(remote_engine_id, remote_pp_rank)].remote_tp_size
    return Shard(int(self.total_num_kv_heads), 1).replicated(int(remote_tp))


def needs_split_local_xfer_handles(self: Any, tp_ratio: int, plan: Any) -> bool:
    return _kv_needs_split(tp_ratio, to_kvgeom_mapping(plan), bool(self.use_mla))


# -- block ids -------------------------------------------------------------------------------------------
def get_mapped_blocks(self: Any, block_ids: Any, block_size_ratio: int) -> np.ndarray:
    return _kv_get_mapped_blocks(np.asarray(block_ids), int(block_size_ratio))


def map_block_ids_for_block_size_ratio(self: Any, local_block_ids: Any, remote_block_ids: Any,
                                       block_size_ratio: int) -> tuple[list, list]:
    kinds = group_is_ssm(self._group_spec_types, len(remote_block_ids))
    local, remote = _kv_map_ratio(local_block_ids, remote_block_ids, int(block_size_ratio), kinds)
    return _lists(local), _lists(remote)


def _transfer_group_kinds(self: Any, n: int) -> tuple[bool, ...]:
    groups = self.kv_cache_config.transfer_groups
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_representative_spec_type

    return tuple(is_ssm_type(get_representative_spec_type(groups[i].kv_cache_spec)) for i in range(n))


def logical_to_kernel_block_ids(self: Any, block_ids: Any, ratio: int) -> list[list[int]]:
    kinds = _transfer_group_kinds(self, len(block_ids))
    return _lists(_kv_logical_to_kernel(block_ids, int(ratio), kinds))


def apply_prefix_caching(self: Any, decode_block_ids: Any, prefill_block_ids: Any,
                         decode_physical_per_logical: int, prefill_physical_per_logical: int) -> tuple[list, list]:
    kinds = group_is_ssm(self._group_spec_types, len(prefill_block_ids))
    dec, pre = _kv_apply_prefix_caching(decode_block_ids, prefill_block_ids, int(decode_physical_per_logical),
                                        int(prefill_physical_per_logical), kinds, has_mamba=bool(self._has_mamba))
    return _lists(dec), _lists(pre)


def compute_desc_ids(self: Any, block_ids: Any, dst_num_blocks: int, block_size_ratio: float | None,
                     physical_blocks_per_logical: int, region_num_blocks: list[int] | None = None,
                     region_group_ids: list[int] | None = None,
                     uses_region_group_mapping: bool | None = None) -> np.ndarray:
    """``_compute_desc_ids``: the worker's regions, SSM streams and group mapping, read as vLLM reads
    them, handed to :func:`kvgeom.descids.compute_desc_ids`."""
    if getattr(self, "_transfer_layer_group_ids", ()):
        raise missing("pp_routing", "transfer_layer_group_ids", value=list(self._transfer_layer_group_ids))
    bsr = None if block_size_ratio is None else int(block_size_ratio)
    kinds = group_is_ssm(self._group_spec_types, len(block_ids)) if self._has_mamba else tuple(
        False for _ in block_ids)
    if self._has_mamba:
        if any(t is _KVI.CircularBufferSpec for t in self._group_spec_types) or \
                getattr(self, "_ple_group_index", None) is not None:
            raise missing("csa", "group_spec_types", value=[t.__name__ for t in self._group_spec_types])
        assert_conv = self._conv_decomp
        if assert_conv is None:
            raise SpecError("conv_decomp", "a Mamba hybrid worker without its conv split", value=None)
        ssm_regions = list(self._ssm_region_indices or range(len(self.block_len_per_layer)))
        return _kv_compute_desc_ids(block_ids, dst_num_blocks, self.num_regions, bsr, physical_blocks_per_logical,
                                    kinds, ssm_regions, len(assert_conv.local_conv_offsets), region_num_blocks)
    num_regions = self.num_regions or len(self.block_len_per_layer)
    if region_num_blocks:
        num_regions = len(region_num_blocks)
    if region_group_ids is None:
        region_group_ids = self.region_group_ids
        if uses_region_group_mapping is None:
            uses_region_group_mapping = self._uses_region_group_mapping
    if not region_group_ids and num_regions == 1:
        region_group_ids = [0]
    if region_group_ids is not None and len(region_group_ids) != num_regions:
        raise PlanError("region_group_ids", f"{len(region_group_ids)} group ids for {num_regions} regions",
                        value=len(region_group_ids), expected=num_regions)
    if uses_region_group_mapping is None:
        uses_region_group_mapping = len(set(region_group_ids)) > 1
    gids = list(region_group_ids) if uses_region_group_mapping else None
    return _kv_compute_desc_ids(block_ids, dst_num_blocks, num_regions, bsr, physical_blocks_per_logical, kinds,
                                None, 3, region_num_blocks or None, gids)


# -- SSM state pages ---------------------------------------------------------------------------------------
_MAMBA_TYPES = {"MAMBA1": "mamba1", "MAMBA2": "mamba2", "GDN_ATTN": "gdn"}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class KvgeomConvSplitInfo(_ORIGINAL_CONV_SPLIT_INFO):
    """vLLM's ``MambaConvSplitInfo`` whose remote conv offsets come from kvgeom."""

    def remote_conv_offsets(self, local_rank_offset: int, tp_ratio: int) -> list[tuple[int, int]]:
        from .worker import counted_call

        return counted_call("MambaConvSplitInfo.remote_conv_offsets", remote_conv_offsets, self,
                            local_rank_offset, tp_ratio)


def remote_conv_offsets(self: Any, local_rank_offset: int, tp_ratio: int) -> list[tuple[int, int]]:
    return list(_kv_remote_conv_offsets(self.local_proj_dims, self.conv_rows, self.conv_dtype_size,
                                        local_rank_offset, tp_ratio))


def derive_mamba_conv_split(mamba_spec: Any, local_tp: int) -> Any:
    """``derive_mamba_conv_split``: the DS conv state's sub-projections, from kvgeom."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    kind = getattr(mamba_spec.mamba_type, "name", str(mamba_spec.mamba_type))
    if kind not in _MAMBA_TYPES:
        raise SpecError("mamba_type", f"Conv transfer only supports Mamba1, Mamba2 and GDN models, got "
                        f"mamba_type={mamba_spec.mamba_type!r}", value=str(mamba_spec.mamba_type))
    if not is_conv_state_dim_first():
        raise ConfigError("conv_layout", "3-read requires DS conv state layout (VLLM_SSM_CONV_STATE_LAYOUT=DS)",
                          value="SD", expected="DS")
    conv_shape, temporal_shape = mamba_spec.shapes[0], mamba_spec.shapes[1]
    split = _kv_derive_conv_split(_MAMBA_TYPES[kind], conv_shape, temporal_shape, int(local_tp),
                                  _dtype_name(mamba_spec.dtypes[0]), _dtype_name(mamba_spec.dtypes[1]))
    return KvgeomConvSplitInfo(conv_rows=split.conv_rows, local_proj_dims=split.local_proj_dims,
                               conv_dtype_size=split.conv_dtype_size, ssm_sizes=split.ssm_sizes)


def compute_physical_blocks_per_logical(ssm_sizes: Sequence[int], block_len: int) -> int:
    return _kv_ppl(ssm_sizes, int(block_len))


# -- descriptor tables -------------------------------------------------------------------------------------
def _no_routing(self: Any) -> None:
    if getattr(self, "_transfer_layer_region_indices", ()):
        raise missing("pp_routing", "transfer_layer_region_indices",
                      value=list(self._transfer_layer_region_indices))


def build_fa_local(self: Any, base_addresses: Sequence[int], block_size_ratio: int) -> np.ndarray:
    """``_build_fa_local``: each region's table from :func:`kvgeom.dlist.local_dlist` (one region at a
    time: vLLM's regions may hold different block counts), bound to its base address."""
    _no_routing(self)
    if not base_addresses:
        raise PlanError("base_addresses", "Local KV cache base addresses must not be empty.", value=0)
    bsr = int(block_size_ratio)
    parts = []
    for i, base in enumerate(base_addresses):
        view = _view(self.region_num_blocks[i], [self.block_len_per_layer[i]], [self.block_stride_per_layer[i]])
        rows = local_dlist(view, bsr).bind([int(base)], int(self.device_id))
        parts.append(pack_runs(rows, bsr, int(self.block_stride_per_layer[i]) // bsr))
    return np.concatenate(parts)


def _ssm_segments(rows: np.ndarray, nbl: int, stride_of_row: np.ndarray) -> np.ndarray:
    """SSM rows (per region, per piece, one per logical block) packed one run per (region, piece)."""
    if not len(rows):
        return np.zeros((0, 5), dtype=np.uint64)
    segs = rows.reshape(-1, nbl, 3)
    return np.concatenate([pack_runs(seg, nbl, int(stride)) for seg, stride in zip(segs, stride_of_row[::nbl])])


def build_mamba_local(self: Any, base_addresses: Sequence[int]) -> np.ndarray:
    """``_build_mamba_local``: the SSM rows of :func:`kvgeom.dlist.local_dlist` (conv pieces, then the
    temporal state, per SSM region, one per logical block)."""
    if getattr(self, "_ple_region_index", None) is not None:
        raise missing("csa", "ple_region_index", value=self._ple_region_index)
    if not base_addresses:
        raise PlanError("base_addresses", "Local KV cache base addresses must not be empty.", value=0)
    ppl = int(self._physical_blocks_per_logical_kv_block)
    nbl = int(self._logical_num_blocks)
    regions = list(self._ssm_region_indices or range(len(base_addresses)))
    lens = list(self.block_stride_per_layer)[: len(base_addresses)]
    view = _view(nbl * ppl, lens, lens, ppl=ppl, ssm_regions=regions, ssm_sizes=self._mamba_ssm_size,
                 conv_offsets=self._conv_decomp.local_conv_offsets)
    table = local_dlist(view)
    ssm = table.rows[table.num_fa:]
    bound = type(table)(ssm, 0).bind([int(b) for b in base_addresses], int(self.device_id))
    strides = np.asarray(lens, dtype=np.int64)[ssm[:, 0]] * ppl
    return _ssm_segments(bound, nbl, strides)


def build_fa_remote(self: Any, plan: Any, nixl_agent_meta: Any, block_size_ratio: int) -> np.ndarray:
    """``_build_fa_remote``: per remote region, :func:`kvgeom.dlist.remote_dlist` cut to this rank's share
    (the region's own TP plan: a GQA draft under an MLA target has its own), bound to the peer's base."""
    _no_routing(self)
    meta = nixl_agent_meta
    if not meta.kv_caches_base_addr:
        raise PlanError("kv_caches_base_addr", "Remote KV cache base addresses must not be empty.", value=0)
    fa_group = next(i for i, t in enumerate(self._group_spec_types) if issubclass(t, _KVI.AttentionSpec))
    n = len(meta.kv_caches_base_addr)
    region_blocks = meta.region_num_blocks or [meta.num_blocks] * n
    bsr = int(block_size_ratio)
    draft = getattr(self, "_head_sharded_draft_regions", set())
    parts = []
    for i, base in enumerate(meta.kv_caches_base_addr):
        replicated = bool(self._is_region_replicated(i))
        region_plan = self.draft_tp_mappings[meta.engine_id] if i in draft else plan
        reads = len(region_plan.source_ranks_per_group[fa_group])
        local = _view(1, [self.block_len_per_layer[i]], [self.block_len_per_layer[i]], [replicated])
        remote = _view(region_blocks[i], [meta.block_lens[i]], [meta.block_strides[i]], [replicated])
        table = remote_dlist(local, remote, bsr, reads, int(region_plan.rank_offset_factor), None)
        rows = table.bind([int(base)], int(meta.device_id))
        parts.append(pack_runs(rows, max(len(rows), 1), int(meta.block_strides[i])))
    return np.concatenate(parts)


def build_mamba_remote(self: Any, nixl_agent_meta: Any, tp_ratio: int, transfer_info: Any) -> np.ndarray:
    """``_build_mamba_remote``: the SSM rows of :func:`kvgeom.dlist.remote_dlist`, each conv piece at the
    offset :func:`kvgeom.conv.remote_conv_offsets` gives and the temporal slice this rank reads."""
    if getattr(self, "_ple_region_index", None) is not None:
        raise missing("csa", "ple_region_index", value=self._ple_region_index)
    meta = nixl_agent_meta
    if not meta.kv_caches_base_addr:
        raise PlanError("kv_caches_base_addr", "Remote KV cache base addresses must not be empty.", value=0)
    local_offset = int(self.tp_rank) % max(int(tp_ratio), 1)
    conv = self._conv_decomp.remote_conv_offsets(local_offset, tp_ratio)
    ssm_read = int(self._mamba_ssm_size[1]) if tp_ratio >= 1 else int(meta.ssm_sizes[1])
    pieces = [*conv, (int(meta.ssm_sizes[0]) + local_offset * ssm_read, ssm_read)]
    ppl = int(transfer_info.remote_physical_blocks_per_logical)
    n = len(meta.kv_caches_base_addr)
    regions = list(self._ssm_region_indices or range(n))
    nbl = int(meta.num_blocks) // ppl
    lens = [int(x) for x in meta.block_strides]
    local = _view(1, lens, lens, ssm_regions=regions, ssm_sizes=self._mamba_ssm_size,
                  conv_offsets=self._conv_decomp.local_conv_offsets)
    remote = _view(nbl * ppl, lens, lens, ppl=ppl, ssm_regions=regions, ssm_sizes=meta.ssm_sizes,
                   conv_offsets=self._conv_decomp.local_conv_offsets)
    table = remote_dlist(local, remote, 1, 1, 0, pieces)
    ssm = table.rows[table.num_fa:]
    bound = type(table)(ssm, 0).bind([int(b) for b in meta.kv_caches_base_addr], int(meta.device_id))
    strides = np.asarray(lens, dtype=np.int64)[ssm[:, 0]] * ppl
    return _ssm_segments(bound, nbl, strides)


def build_local_splits_from_plan(self: Any, plan: Any, src_blocks_data: np.ndarray, num_fa_descs: int,
                                 block_size_ratio: int = 1) -> Iterator[np.ndarray]:
    """``_build_local_splits_from_plan``: :func:`kvgeom.splits.build_local_splits` on the worker's strided
    local table, with the per-region MLA flags and capacities vLLM reads."""
    if getattr(self, "_ple_region_index", None) is not None:
        raise missing("csa", "ple_region_index", value=self._ple_region_index)
    _no_routing(self)
    n_regions = len(self.block_len_per_layer)
    region_is_mla = region_num_blocks = None
    if n_regions and self.num_regions:
        region_is_mla = [bool(self._is_region_replicated(i)) for i in range(n_regions)]
        region_num_blocks = [int(self.region_num_blocks[i]) for i in range(n_regions)]
    kinds = group_is_ssm(self._group_spec_types)
    splits = _kv_build_local_splits(np.asarray(src_blocks_data).astype(np.int64), to_kvgeom_mapping(plan),
                                    int(num_fa_descs), int(block_size_ratio), kinds, region_is_mla, region_num_blocks)
    dtype = np.asarray(src_blocks_data).dtype
    return iter([s.astype(dtype) for s in splits])
