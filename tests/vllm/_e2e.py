"""One request pulled through vLLM 0.33.0's own connector code, resolved into byte moves for the oracle.

For each D rank a bare vLLM worker is given the registration state vLLM's ``register_kv_caches`` would
record for that rank's kvgeom geometry (region lengths, strides, block counts, group ids, SSM regions,
the conv split from vLLM's own ``derive_mamba_conv_split``); from there everything is vLLM's code:
``register_local_xfer_handler``, ``handshake_target_ranks``, ``add_remote_agent`` (validation, TP
mapping, split handles, remote tables), ``_read_blocks_for_req`` (pairing, prefix trimming, descriptor
ids, handle choice) and ``get_transfer_results`` with its ``post_process_device_kv_on_receive``. A
recording NIXL wrapper keeps every prepared descriptor list and transfer. Addresses encode (side, rank,
region, offset), so each descriptor pair resolves to a byte move; the receive post-process runs on
probe tensors (byte ``i`` holds ``i + 1``), so its permutation and zeroing are read back and applied
to the oracle's destination bytes.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from queue import Queue
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata, RemoteMeta, ReqMeta
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import derive_mamba_conv_split
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from kvgeom.dtypes import dtype_size
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.geometry import RankGeometry
from kvgeom.layout.view import unpseudo
from kvgeom.model.layers import AttentionSpec, LayerKind, MLASpec
from kvgeom.model.stages import stage_range
from kvgeom.pair.streams import Registration, hma_required, registration
from kvgeom.testing import Oracle
from kvgeom.testing._coords import ZERO

D_SIDE, P_SIDE = 1, 0
_OFF, _REG, _RANK = 36, 12, 8
HARNESS_ERRORS = (AttributeError, KeyError, TypeError, IndexError, NameError)
"""Exceptions that mean this harness set vLLM's state up wrong, never a vLLM refusal."""


def address(side: int, rank: int, region: int, offset: int = 0) -> int:
    return (((side << _RANK | rank) << _REG | region) << _OFF) + offset


def resolve(addr: np.ndarray) -> np.ndarray:
    """``(side, rank, region, offset)`` columns of encoded addresses."""
    a = addr.astype(np.int64)
    return np.stack(
        [
            a >> (_OFF + _REG + _RANK),
            (a >> (_OFF + _REG)) & ((1 << _RANK) - 1),
            (a >> _OFF) & ((1 << _REG) - 1),
            a & ((1 << _OFF) - 1),
        ],
        axis=1,
    )


def expand(rows: np.ndarray) -> np.ndarray:
    """One ``(addr, len, dev)`` row per descriptor of N x 5 strided rows."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
    counts = rows[:, 4]
    rep = np.repeat(rows, counts, axis=0)
    k = np.arange(rep.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([rep[:, 0] + k * rep[:, 3], rep[:, 1], rep[:, 2]], axis=1)


class RecordingNixl:
    """The part of vLLM's NIXL wrapper a pull uses: prepared lists are kept expanded; transfers recorded."""

    def __init__(self) -> None:
        self.dlists: dict[int, np.ndarray] = {}
        self.xfers: list[tuple[str, int, np.ndarray, int, np.ndarray]] = []
        self.notified: list[tuple[str, bytes]] = []
        self._next = 1

    def prep_xfer_dlist(self, agent: str, descs: np.ndarray, mem_type: str | None = None) -> int:
        handle, self._next = self._next, self._next + 1
        self.dlists[handle] = expand(descs)
        return handle

    def add_remote_agent(self, metadata: bytes) -> str:
        return f"agent-{self._next}"

    def make_prepped_xfer(
        self,
        op: str,
        local: int,
        local_ids: Any,
        remote: int,
        remote_ids: Any,
        notif_msg: bytes | None = None,
    ) -> int:
        self.xfers.append(
            (op, local, np.asarray(local_ids, dtype=np.int64), remote, np.asarray(remote_ids, dtype=np.int64))
        )
        handle, self._next = self._next, self._next + 1
        return handle

    def transfer(self, handle: int) -> str:
        return "PROC"

    def send_notif(self, agent: str, notif_msg: bytes | None = None) -> None:
        self.notified.append((agent, notif_msg or b""))


# -- vLLM's view of a kvgeom rank ------------------------------------------------------------------------
def _spec_type(group: Any) -> type:
    spec = group.spec
    if group.is_ring:
        return CircularBufferSpec
    if isinstance(spec, MLASpec):
        return SlidingWindowMLASpec if spec.sliding_window else MLAAttentionSpec
    if isinstance(spec, AttentionSpec):
        return SlidingWindowSpec if spec.sliding_window else FullAttentionSpec
    return MambaSpec


_MAMBA_TYPES = {
    LayerKind.MAMBA1: MambaAttentionBackendEnum.MAMBA1,
    LayerKind.MAMBA2: MambaAttentionBackendEnum.MAMBA2,
    LayerKind.GDN: MambaAttentionBackendEnum.GDN_ATTN,
    LayerKind.KDA: MambaAttentionBackendEnum.GDN_ATTN,
}


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def conv_split(geom: RankGeometry) -> Any:
    """vLLM's own conv decomposition of this rank's SSM state (its MambaSpec shapes from the spec)."""
    spec, tp = geom.ssm.spec, geom.tp_size
    conv = spec.conv_shape(tp)
    t = spec.temporal
    if spec.kind is LayerKind.MAMBA1:
        temporal = (spec.conv_pieces[0].elems_per_rank(tp), t.unit_elems)
    elif spec.kind is LayerKind.MAMBA2:
        temporal = (
            t.units_per_rank(tp),
            spec.conv_pieces[0].unit_elems,
            t.unit_elems // spec.conv_pieces[0].unit_elems,
        )
    else:  # GDN / KDA: (v heads, v dim, k dim)
        v = spec.conv_pieces[2]
        temporal = (v.units_per_rank(tp), v.unit_elems, t.unit_elems // v.unit_elems)
    mamba = MambaSpec(
        block_size=geom.logical_block_size,
        shapes=(conv, temporal),
        dtypes=(_torch_dtype(spec.conv_dtype), _torch_dtype(spec.ssm_dtype)),
        mamba_type=_MAMBA_TYPES[spec.kind],
    )
    return derive_mamba_conv_split(mamba, tp)


def layout_name(geom: RankGeometry) -> str:
    if geom.engine.packed_rows:
        return "BLHNC"
    return "LBNHC" if geom.engine.kv_layout is KVLayout.TOKEN_MAJOR else "LBHNC"


@dataclass(frozen=True)
class Registered:
    """What ``register_kv_caches`` records for a kvgeom rank (kvgeom's model of it: :func:`registration`),
    with addresses that encode (side, global rank, region, offset)."""

    reg: Registration
    bases: list[int]

    @classmethod
    def of(cls, geom: RankGeometry, mode: str, side: int) -> Registered:
        reg = registration(geom, mode)
        return cls(reg, [address(side, geom.global_rank, *unpseudo(b)) for b in reg.table.bases])


def agent_metadata(
    geom: RankGeometry, mode: str = "pull", side: int = P_SIDE, engine_id: str = "P"
) -> NixlAgentMetadata:
    """The handshake metadata a rank of this geometry advertises."""
    r = Registered.of(geom, mode, side)
    t = r.reg.table
    return NixlAgentMetadata(
        engine_id=engine_id,
        agent_metadata=b"",
        device_id=0,
        kv_caches_base_addr=list(r.bases),
        num_blocks=geom.num_blocks,
        block_lens=list(t.block_lens),
        block_strides=list(t.block_strides),
        kv_cache_layout=layout_name(geom),
        block_size=geom.block_size,
        ssm_sizes=tuple(conv_split(geom).ssm_sizes) if geom.has_ssm else (0, 0),
        attn_backend_name="KVGEOM",
        physical_blocks_per_logical_kv_block=geom.ppl,
        ple_block_len=geom.ple.length // geom.ppl if geom.ple else None,
        region_num_blocks=list(t.num_blocks),
        region_group_ids=list(t.group_ids),
        region_names=list(t.names),
        dcp_size=geom.dcp_size,
        pcp_size=1,
        region_members=[list(m) for m in t.members],
        packed_member_layouts=dict(t.packed),
    )


def worker(geom: RankGeometry, mode: str, prefix_caching: bool, engine_id: str, side: int) -> Any:
    """A vLLM pull or push worker for rank ``geom``, registered as ``register_kv_caches`` would have."""
    w = object.__new__(NixlPullConnectorWorker if mode == "pull" else NixlPushConnectorWorker)
    r = Registered.of(geom, mode, side)
    reg, t = r.reg, r.reg.table
    n = len(t.bases)
    gids = list(t.group_ids)
    heads = 1 if geom.is_mla else geom.num_kv_heads
    conv = conv_split(geom) if geom.has_ssm else None
    layers = {g.index: list(g.layers) for g in geom.groups}
    caps = [geom.num_blocks] * n
    xfer_caps = [caps[i] for i in reg.transfer_regions] if reg.transfer_regions else caps
    remote_offset = 0
    if geom.pp_size > 1 and not reg.transfer_regions:
        start, end = stage_range(geom.model.num_hidden_layers, geom.pp_rank, geom.pp_size)
        remote_offset = n // (end - start) * start
    state: dict[str, Any] = dict(
        engine_id=engine_id,
        tp_rank=geom.tp_rank,
        world_size=geom.tp_size,
        block_size=geom.block_size,
        num_blocks=geom.num_blocks,
        _logical_num_blocks=geom.logical_num_blocks,
        _physical_blocks_per_logical_kv_block=geom.ppl,
        use_mla=geom.is_mla,
        _has_mamba=geom.has_ssm,
        _is_csa_linear=geom.is_csa_linear,
        dcp_size=geom.dcp_size,
        dcp_rank=geom.dcp_rank,
        pcp_size=1,
        pcp_rank=0,
        transfer_topo=TransferTopology(
            tp_rank=geom.tp_rank,
            tp_size=geom.tp_size,
            block_size=geom.block_size,
            engine_id=engine_id,
            is_mla=geom.is_mla,
            is_mamba=geom.has_ssm,
            total_num_kv_heads=heads,
            attn_backends=[],
            dcp_size=geom.dcp_size,
        ),
        block_len_per_layer=list(t.block_lens),
        block_stride_per_layer=list(t.block_strides),
        region_num_blocks=list(caps),
        region_group_ids=gids,
        _uses_region_group_mapping=len(set(gids)) > 1,
        region_names=list(t.names),
        region_mem_types=["VRAM"] * n,
        _region_is_mla=list(reg.is_mla),
        _ssm_region_indices=list(geom.ssm_region_indices),
        _scratch_region_indices=list(geom.scratch_region_indices),
        _ple_region_index=geom.ple.region if geom.ple else None,
        _ple_group_index=geom.ple.group if geom.ple else None,
        _ple_block_len=geom.ple.length // geom.ppl if geom.ple else None,
        _conv_decomp=conv,
        _mamba_ssm_size=tuple(conv.ssm_sizes) if conv is not None else (0, 0),
        _group_spec_types=tuple(_spec_type(g) for g in geom.groups),
        kv_cache_config=SimpleNamespace(
            transfer_groups=[
                SimpleNamespace(kv_cache_spec=object.__new__(_spec_type(g)), layer_names=layers[g.index])
                for g in geom.groups
            ],
            transfer_group_ids=list(range(len(geom.groups))),
        ),
        num_regions=n,
        num_descs=sum(xfer_caps),
        region_members=[list(m) for m in t.members],
        _transfer_layer_region_indices=reg.transfer_regions,
        _transfer_layer_names=reg.transfer_names,
        _transfer_layer_group_ids=reg.transfer_groups,
        _packed_member_layouts=dict(t.packed),
        _has_packed_cache=geom.engine.packed_rows,
        pp_size=geom.pp_size,
        _remote_region_offset=remote_offset,
        _head_sharded_draft_regions={k for k, mla in enumerate(reg.is_mla) if not mla}
        if geom.has_draft
        else set(),
        _head_sharded_draft_kv_heads=geom.model.attention_spec.num_kv_heads if geom.has_draft else None,
        draft_tp_mappings={},
        device_id=0,
        _mixed_mem_types=False,
        _skip_dram_xfer=False,
        nixl_wrapper=RecordingNixl(),
        nixl_memory_type="VRAM",
        kv_caches_base_addr=defaultdict(dict),
        src_xfer_handles_by_block_size={},
        src_blocks_data_by_block_size={},
        src_xfer_handles_by_tp_ratio={},
        _dram_src_handles_by_tp_ratio={},
        _desc_is_dram_by_block_size={},
        _desc_pos_by_block_size={},
        _dram_src_handles_by_block_size={},
        dst_num_blocks={engine_id: geom.num_blocks},
        dst_region_num_blocks={engine_id: xfer_caps},
        dst_region_group_ids={engine_id: gids},
        dst_uses_region_group_mapping={engine_id: len(set(gids)) > 1},
        dst_region_mem_types={engine_id: ["VRAM"] * n},
        tp_mappings={},
        _remote_agents=defaultdict(dict),
        dst_xfer_side_handles=defaultdict(dict),
        use_host_buffer=False,
        kv_cache_layout=layout_name(geom),
        host_buffer_kv_cache_layout=layout_name(geom),
        kv_transfer_config=SimpleNamespace(enable_permute_local_kv=geom.engine.permute_local_kv),
        enable_permute_local_kv=False,
        enable_heterogeneous_attn_post_process=False,
        backend_name="KVGEOM",
        _is_hma_required=hma_required(geom),
        _layer_specs={},
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching)),
        _remote_registration_generations={},
        _invalid_remote_engines=set(),
        _engine_last_active={},
        _bidirectional_kv_xfer_enabled=False,
        _recving_transfers=defaultdict(list),
        _recving_metadata={},
        _sending_transfers=defaultdict(list),
        _sending_transfers_lock=threading.Lock(),
        _send_failures=set(),
    )
    for key, value in state.items():
        setattr(w, key, value)
    w.kv_caches_base_addr[engine_id][geom.tp_rank] = list(r.bases)
    w.src_xfer_handles_by_block_size[geom.block_size], w.src_blocks_data = w.register_local_xfer_handler(
        geom.block_size
    )
    return w


def init_refusals(geom: RankGeometry, mode: str, role: str) -> None:
    """The pipeline-parallel checks of vLLM's worker constructor (``NixlBaseConnectorWorker.__init__``),
    which this harness does not run: a pull worker in stages of a hybrid-manager model, any worker in
    stages of an SSM hybrid, and a push consumer (D) in stages raise ``NotImplementedError``."""
    if geom.pp_size == 1:
        return
    if mode == "pull" and hma_required(geom):
        raise NotImplementedError("NixlConnector (pull) does not support pipeline_parallel_size > 1 with HMA")
    if geom.has_ssm:
        raise NotImplementedError(
            "NixlPushConnector does not support pipeline_parallel_size > 1 with Mamba/SSM"
        )
    if mode == "push" and role == "kv_consumer":
        raise NotImplementedError(
            "NixlPushConnector consumer (decode) does not support pipeline_parallel_size > 1"
        )


def consumer_worker(geom: RankGeometry, prefix_caching: bool) -> Any:
    """A vLLM pull worker for D rank ``geom``."""
    return worker(geom, "pull", prefix_caching, "D", D_SIDE)


def _moves(nixl: RecordingNixl, op: str, local_side: int) -> np.ndarray:
    """The recorded transfers as N x 8 moves (source P, destination D)."""
    out = [np.zeros((0, 8), dtype=np.int64)]
    for kind, lh, lids, rh, rids in nixl.xfers:
        assert kind == op
        loc, rem = nixl.dlists[lh][lids], nixl.dlists[rh][rids]
        la, ra = resolve(loc[:, 0]), resolve(rem[:, 0])
        assert (la[:, 0] == local_side).all() and (ra[:, 0] == 1 - local_side).all()
        src, dst, slen, dlen = (
            (ra, la, rem[:, 1], loc[:, 1]) if op == "READ" else (la, ra, loc[:, 1], rem[:, 1])
        )
        m = np.stack([src[:, 1], src[:, 2], src[:, 3], dst[:, 1], dst[:, 2], dst[:, 3], slen, dlen], axis=1)
        out.append(m.astype(np.int64))
    return np.concatenate(out)


def push(
    p_geom: RankGeometry,
    d_geoms: list[RankGeometry],
    p_ids: list[list[int]],
    d_ids: list[list[int]],
    prefix_caching: bool,
) -> np.ndarray:
    """Run P rank ``p_geom``'s push of one request through vLLM (``_xfer_blocks_for_req``); its moves."""
    for geom in d_geoms:
        init_refusals(geom, "push", "kv_consumer")
    init_refusals(p_geom, "push", "kv_producer")
    w = worker(p_geom, "push", prefix_caching, "P", P_SIDE)
    remote_tp, remote_dcp = d_geoms[0].tp_size, d_geoms[0].dcp_size
    for rank in w.transfer_topo.handshake_target_ranks(remote_tp, remote_dcp):
        meta = agent_metadata(d_geoms[rank], "push", D_SIDE, "D")
        w._remote_agents["D"][(0, rank)] = w.add_remote_agent(
            meta, remote_tp_rank=rank, remote_tp_size=remote_tp, remote_dcp_size=remote_dcp
        )
    local = [list(x) for x in p_ids]
    meta = ReqMeta(
        local_block_ids=local,
        local_physical_block_ids=w._logical_to_kernel_block_ids(local, p_geom.ppl),
        tp_size=p_geom.tp_size,
        remote=RemoteMeta([list(x) for x in d_ids], "", 0, "D", "req-D"),
    )
    w._xfer_blocks_for_req("req", meta)
    return _moves(w.nixl_wrapper, "WRITE", P_SIDE)


@dataclass
class Pulled:
    """What vLLM did for one D rank: its moves (N x 8) and its post-receive step as a permutation (``-1``:
    unchanged, ``-2``: zeroed, else the source byte) per region."""

    moves: np.ndarray
    post: list[np.ndarray]
    notified: list[tuple[str, bytes]]


def _probe_caches(w: Any, geom: RankGeometry) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Per attention layer a [B, H, N, C] byte view (physical order per the layout) of its region's probe."""
    buffers = [torch.arange(1, r.nbytes + 1, dtype=torch.int64) for r in geom.regions]
    caches: dict[str, torch.Tensor] = {}
    kb = geom.block_size
    for r in geom.regions:
        for _, layer in r.members:
            spec = geom.layer_specs[layer]
            if isinstance(spec, MLASpec):
                h, c = 1, spec.latent_size * dtype_size(spec.dtype)
            elif isinstance(spec, AttentionSpec):
                h, c = (
                    spec.heads_per_rank(geom.tp_size),
                    (spec.head_size + spec.v_size) * dtype_size(spec.dtype),
                )
            else:
                continue
            stride = (
                (r.block_stride, kb * c, c, 1)
                if geom.engine.kv_layout is KVLayout.HEAD_MAJOR or h == 1
                else (r.block_stride, c, h * c, 1)
            )
            caches[layer] = torch.as_strided(
                buffers[r.index], (r.num_blocks, h, kb, c), stride, r.slot(layer)[0]
            )
    return caches, buffers


def pull(
    d_geom: RankGeometry,
    p_geoms: list[RankGeometry],
    d_ids: list[list[int]],
    p_ids: list[list[int]],
    prefix_blocks: int,
    prefill_tokens: int,
    prefix_caching: bool,
) -> Pulled:
    """Run D rank ``d_geom``'s pull of one request through vLLM; vLLM's refusals propagate."""
    init_refusals(d_geom, "pull", "kv_consumer")
    w = consumer_worker(d_geom, prefix_caching)
    remote_tp, remote_dcp = p_geoms[0].tp_size, p_geoms[0].dcp_size
    stages = len(p_geoms) // remote_tp
    for stage in range(stages):  # vLLM's handshake asks every (pp rank, tp rank) of the remote
        for rank in w.transfer_topo.handshake_target_ranks(remote_tp, remote_dcp):
            meta = agent_metadata(p_geoms[stage * remote_tp + rank])
            w._remote_agents["P"][(stage, rank)] = w.add_remote_agent(
                meta, remote_tp_rank=rank, remote_tp_size=remote_tp, remote_dcp_size=remote_dcp
            )
    computed = tuple(prefix_blocks if not g.one_block else 0 for g in d_geom.groups)  # a ring: not cached
    local = [list(x) for x in d_ids]
    meta = ReqMeta(
        local_block_ids=local,
        local_physical_block_ids=w._logical_to_kernel_block_ids(local, d_geom.ppl),
        tp_size=remote_tp,
        local_num_computed_blocks=computed,
        awaiting_kvs=True,
        remote=RemoteMeta([list(x) for x in p_ids], "host", 1, "P", "req-P", num_tokens=prefill_tokens),
    )
    w._recving_metadata["req"] = meta
    w._read_blocks_for_req("req", meta)
    nixl = w.nixl_wrapper
    moves = _moves(nixl, "READ", D_SIDE)
    caches, buffers = _probe_caches(w, d_geom)
    w.device_kv_caches = caches
    w._get_new_notifs = lambda: set()
    w._pop_done_transfers = lambda transfers: ({"req"}, set())
    w._replicated_pcp_done_sending, w._failed_recv_reqs, w._recv_failures = set(), Queue(), set()
    w._send_pending_recv_notifs = lambda req_id: None
    w._sync_device_after_direct_recv = lambda done: None
    w._reap_expired_send_leases = lambda done: None
    w._cleanup_remote_engines = lambda: None
    w._reqs_to_send = {}

    def zero_region_blocks(block_ids: list[list[int]]) -> None:
        # vLLM zeroes page ``block`` of each region's (blocks, block_len) view at its block stride; its own code
        # maps the region's address into the cache's storage, which this harness's encoded addresses are not
        for region, blocks in enumerate(block_ids):
            length, stride = w.block_len_per_layer[region], w.block_stride_per_layer[region]
            for block in blocks:
                buffers[region][block * stride : block * stride + length] = 0

    w._zero_region_blocks = zero_region_blocks
    result = w.get_transfer_results()
    assert result.finished_recving == {"req"}
    post = []
    for buf in buffers:
        v = buf.numpy()
        orig = np.arange(1, v.size + 1)
        p = np.where(v == orig, -1, np.where(v == 0, -2, v - 1))
        post.append(p)
    return Pulled(moves, post, list(nixl.notified))


def apply_post(oracle: Oracle, rank: int, post: list[np.ndarray]) -> None:
    """Apply a post-receive permutation / zeroing read back from vLLM to D rank ``rank``'s oracle bytes."""
    for region, p in enumerate(post):
        arr = oracle.dst[rank][region]
        before = arr.copy()
        moved = p >= 0
        arr[moved] = before[p[moved]]
        arr[p == -2] = ZERO
        oracle.result.bytes_zeroed += int((p == -2).sum())


__all__ = ["HARNESS_ERRORS", "Pulled", "address", "apply_post", "init_refusals", "pull", "push", "resolve"]
