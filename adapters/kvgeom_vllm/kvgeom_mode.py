"""kvgeom mode (``"compat": "kvgeom"``): kvgeom plans the transfers, so vLLM serves pairs vLLM refuses.

In vLLM-compatible mode vLLM's own per-request code runs, each geometry step answered by kvgeom with
vLLM's answer, so a pair vLLM refuses stays refused. In kvgeom mode both sides send their geometry card
and the pair is judged and planned by kvgeom alone:

* handshake (:func:`add_remote_agent`): :meth:`kvgeom.Pairing.create` on both cards (``compat="kvgeom"``)
  replaces vLLM's handshake asserts; the descriptor lists prepared are kvgeom's tables
  (``pairing.local_table`` / ``pairing.remote_table``, bound to the registered base addresses), one
  local list per kvgeom local key (the whole table, or a remote rank's share of it);
* each request (:func:`read_blocks_for_req` in pull, :func:`xfer_blocks_for_req` in push):
  :func:`kvgeom.plan_request` gives, per remote rank, the local table, the local and remote descriptor ids
  and the notification, the ranks that are only notified, and the post-receive step. In kvgeom mode the
  worker posts each transfer as one descriptor per maximal run contiguous on both sides
  (:func:`kvgeom.layout.runs.merge_runs`, the NIXL adapter's merge), as per-request lists through NIXL's
  ``initialize_xfer``; in vLLM-compatible mode it posts the plan's descriptor ids (vLLM's) into the
  prepared lists with ``make_prepped_xfer``, as vLLM does;
* after the bytes land, vLLM's completion path hands the request's :class:`Receive` (kvgeom's regroups,
  then zero rows) to ``_zero_region_blocks``, which applies it to the cache tensors.

vLLM's threads, side channel, completion tracking, leases and failure handling run unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvgeom import Pairing, plan_request
from kvgeom.errors import IncompatiblePairError, KvgeomError
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.runs import addressed, merge_runs
from kvgeom.plan.requestplan import RequestPlan

from .answers import region_bytes, to_vllm_mapping
from .answers._common import KVI, representative_type
from .devicebytes import regroup_blocks, zero_rows
from .table import REFUSED

__all__ = [
    "Receive",
    "add_remote_agent",
    "make_xfer",
    "read_blocks_for_req",
    "xfer_blocks_for_req",
    "request_tokens",
]


@dataclass(frozen=True)
class Receive:
    """kvgeom's post-receive step of one request on this rank: regroup head-major blocks that arrived as
    finer remote pages, then zero every byte nothing wrote. vLLM carries it in
    ``ReqMeta.region_blocks_to_zero``, so its completion path calls ``_zero_region_blocks`` with it."""

    plan: RequestPlan

    def apply(self, worker: Any) -> None:
        if not self.plan.regroup and not len(self.plan.zero):
            return
        regions = region_bytes(worker)
        strides = worker.block_stride_per_layer
        for step in self.plan.regroup:
            for r in step.regions:
                regroup_blocks(
                    regions[r],
                    step.blocks,
                    int(strides[r]),
                    step.bsr,
                    step.heads,
                    step.tokens,
                    step.head_bytes,
                    step.layout is KVLayout.TOKEN_MAJOR,
                )
        zero_rows(regions, self.plan.zero)


def _pairing(worker: Any, engine_id: str) -> Pairing:
    pairing = getattr(worker, "kvgeom_pairings", {}).get(engine_id)
    if pairing is None:
        raise IncompatiblePairError(
            "kvgeom_card",
            f"no kvgeom pairing with engine {engine_id!r}: kvgeom mode "
            "needs kvgeom_vllm, with a geometry card, on both sides",
            value=engine_id,
        )
    return pairing


def _local_handle(worker: Any, engine_id: str, pairing: Pairing, key: tuple[int, int]) -> int:
    """The prepared NIXL list of the local table ``key`` of this pairing (prepared once)."""
    handles = worker.__dict__.setdefault("kvgeom_local_handles", {})
    if (engine_id, key) not in handles:
        bases = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
        descs = pairing.local_table(key).bind_strided(bases, int(worker.device_id))
        handles[(engine_id, key)] = worker.nixl_wrapper.prep_xfer_dlist(
            "NIXL_INIT_AGENT", descs, mem_type=worker.region_mem_types[0]
        )
    return handles[(engine_id, key)]


def add_remote_agent(
    worker: Any,
    meta: Any,
    pairing: Pairing | None,
    remote_tp_rank: int,
    remote_tp_size: int,
    remote_dcp_size: int,
) -> str:
    """Prepare the pair with remote rank ``remote_tp_rank`` from kvgeom's pairing (``pairing`` was made on
    both cards by the handshake wrapper): vLLM's per-engine bookkeeping, the remote agent, the remote
    table of that rank and the local tables its transfers use."""
    from vllm.distributed.kv_transfer.kv_connector.utils import EngineTransferInfo

    engine_id = meta.engine_id
    if pairing is None:
        pairing = _pairing(worker, engine_id)
    topo = worker.transfer_topo
    info = EngineTransferInfo(
        remote_tp_size=remote_tp_size,
        remote_block_size=meta.block_size,
        remote_block_len=meta.block_lens[0],
        remote_physical_blocks_per_logical=meta.physical_blocks_per_logical_kv_block,
        remote_dcp_size=remote_dcp_size,
    )
    topo.register_remote_engine(engine_id, info)
    worker.tp_mappings[engine_id] = to_vllm_mapping(pairing.mapping)
    agent = worker.nixl_wrapper.add_remote_agent(meta.agent_metadata)
    n = len(meta.kv_caches_base_addr)
    if engine_id not in worker.dst_num_blocks:
        worker.dst_num_blocks[engine_id] = meta.num_blocks
        worker.dst_region_num_blocks[engine_id] = meta.region_num_blocks or [meta.num_blocks] * n
        worker.dst_region_group_ids[engine_id] = meta.region_group_ids or [0] * n
        worker.dst_uses_region_group_mapping[engine_id] = len(set(worker.dst_region_group_ids[engine_id])) > 1
        worker.dst_region_mem_types[engine_id] = meta.region_mem_types or [worker.nixl_memory_type] * n
    worker.kv_caches_base_addr[engine_id][remote_tp_rank] = list(meta.kv_caches_base_addr)
    worker.__dict__.setdefault("kvgeom_remote_devices", {})[(engine_id, remote_tp_rank)] = int(meta.device_id)
    if remote_tp_rank in pairing.transfer_ranks:
        descs = pairing.remote_table(remote_tp_rank).bind_strided(
            list(meta.kv_caches_base_addr), int(meta.device_id)
        )
        mem_type = (meta.region_mem_types or [worker.nixl_memory_type])[0]
        worker.dst_xfer_side_handles[engine_id][remote_tp_rank] = worker.nixl_wrapper.prep_xfer_dlist(
            agent, descs, mem_type=mem_type
        )
        _local_handle(worker, engine_id, pairing, pairing.local_key(remote_tp_rank))
    return agent


def request_tokens(worker: Any, meta: Any) -> int | None:
    """The tokens D holds blocks for, rounded up to its block: a full-attention group's cached blocks plus
    the blocks it pulls (vLLM's request metadata carries the per-group prefix counts, not the prompt
    length; any length in the last block places the lists alike). ``None`` without a full-attention group."""
    full = (KVI.FullAttentionSpec, KVI.MLAAttentionSpec)
    groups = [
        g
        for g, group in enumerate(worker.kv_cache_config.transfer_groups)
        if representative_type(group.kv_cache_spec) in full
    ]
    if not groups or not meta.local_block_ids:
        return None
    cached = meta.local_num_computed_blocks
    ids = worker.kv_cache_config.transfer_group_ids
    totals = [len(meta.local_block_ids[g]) + (int(cached[ids[g]]) if cached else 0) for g in groups]
    return max(totals) * int(worker.block_size) * int(worker._physical_blocks_per_logical_kv_block)


def _plan(worker: Any, pairing: Pairing, req_id: str, meta: Any) -> RequestPlan:
    """kvgeom's plan of one request on this rank (pull: local = D's blocks, remote = P's)."""
    local = meta.local_block_ids if any(len(g) for g in meta.local_block_ids) else []
    return plan_request(
        pairing,
        local,
        meta.remote.block_ids,
        request_id=req_id,
        remote_request_id=meta.remote.request_id,
        num_tokens=request_tokens(worker, meta),
        prefill_tokens=meta.remote.num_tokens,
    )


def make_xfer(worker: Any, op: str, engine_id: str, pairing: Pairing, t: Any) -> Any:
    """The NIXL transfer handle of plan transfer ``t`` (``op`` ``"READ"`` in pull, ``"WRITE"`` in push). In
    kvgeom mode: the transfer's descriptor pairs merged into one pair per maximal run contiguous on both
    sides (:func:`kvgeom.layout.runs.merge_runs`; a run never crosses a region and never ends past one), as
    per-request lists given to ``initialize_xfer`` (NIXL checks them against both registrations). In
    vLLM-compatible mode: the plan's descriptor ids (vLLM's) into the prepared lists, as vLLM posts them."""
    nixl = worker.nixl_wrapper
    notif = t.notif.encode()
    if not pairing.policy.routed:
        return nixl.make_prepped_xfer(
            op,
            _local_handle(worker, engine_id, pairing, t.local_table),
            np.asarray(t.local_ids),
            worker.dst_xfer_side_handles[engine_id][t.remote_rank],
            np.asarray(t.remote_ids),
            notif_msg=notif,
        )
    loc, rem = merge_runs(
        pairing.local_table(t.local_table).take(t.local_ids),
        pairing.remote_table(t.remote_rank).take(t.remote_ids),
        [r.nbytes for r in worker.kvgeom_card.geometry.regions],
        [r.nbytes for r in pairing.remotes[t.remote_rank].regions],
        "local" if op == "WRITE" else "remote",  # ordered by the source side, as contiguous_runs counts
    )
    local_bases = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
    remote_bases = worker.kv_caches_base_addr[engine_id][t.remote_rank]
    device = worker.__dict__.get("kvgeom_remote_devices", {}).get((engine_id, t.remote_rank), 0)
    remote_mem = (worker.dst_region_mem_types.get(engine_id) or [worker.nixl_memory_type])[0]
    return nixl.initialize_xfer(
        op,
        nixl.get_xfer_descs(addressed(loc, local_bases, int(worker.device_id)), worker.region_mem_types[0]),
        nixl.get_xfer_descs(addressed(rem, remote_bases, device), remote_mem),
        worker._remote_agents[engine_id][(0, t.remote_rank)],
        notif,
    )


def _notify(worker: Any, engine_id: str, rank: int, notif: bytes, req_id: str) -> None:
    agent = worker._remote_agents[engine_id][(0, rank)]
    try:
        worker.nixl_wrapper.send_notif(agent, notif_msg=notif)
    except Exception as e:  # noqa: BLE001 - vLLM's policy: a lost notification is logged, the lease frees it
        worker._log_failure(
            failure_type="notification_failed",
            msg="Remote rank will not update request state.",
            req_id=req_id,
            error=e,
            dst_engine_id=engine_id,
            remote_rank=rank,
            remote_agent_name=agent,
        )
        worker.xfer_stats.record_failed_notification()


def read_blocks_for_req(worker: Any, req_id: str, meta: Any) -> None:
    """The pull of one request planned by kvgeom: vLLM's admission checks (invalid or re-registered
    engine, pending handshake, expired readback), then kvgeom's plan posted as READs; the ranks nothing is
    read from are notified; the post-receive step travels with the request to its completion. A request
    kvgeom refuses to plan (in vLLM-compatible mode: one vLLM would move to the wrong tokens) fails like a
    failed transfer (vLLM recomputes it), never with wrong bytes."""
    engine_id = meta.remote.engine_id
    if not _admitted(worker, req_id, engine_id, meta):
        return
    try:
        plan = _plan(worker, _pairing(worker, engine_id), req_id, meta)
    except (
        KvgeomError
    ) as e:  # this request cannot be moved right (e.g. vLLM's pairing would move wrong tokens)
        REFUSED["NixlPullConnectorWorker._read_blocks_for_req"] += 1
        worker._log_failure(
            failure_type="plan_refused",
            req_id=req_id,
            error=e,
            dst_engine_id=engine_id,
            msg="kvgeom refused to plan this request; D recomputes it",
        )
        worker._handle_failed_transfer(req_id, None, worker._recv_failures)
        return
    if any(len(g) for g in meta.local_block_ids) or (meta.awaiting_kvs and not plan.transfers):
        worker._recving_transfers.setdefault(req_id, [])
    meta.region_blocks_to_zero = Receive(plan)
    if not _post_reads(worker, req_id, engine_id, plan):
        return
    notif = f"{meta.remote.request_id}:{plan.expected_notifications}".encode()
    for rank in plan.notify_only:
        _notify(worker, engine_id, rank, notif, req_id)


def _admitted(worker: Any, req_id: str, engine_id: str, meta: Any) -> bool:
    """vLLM's admission checks of a pull (invalid or re-registered engine, pending handshake, expired
    readback): whether the request goes on to be planned (if not, it was failed or deferred here)."""
    if engine_id in worker._invalid_remote_engines:
        worker._handle_failed_transfer(req_id, None, worker._recv_failures, record_failed_transfer=False)
        return False
    # P's re-registrations (vLLM 0.33.0; 0.32.0 has no registration generations)
    generation = getattr(meta.remote, "registration_generation", 0)
    seen = getattr(worker, "_remote_registration_generations", None)
    if seen is not None and seen.get(engine_id, 0) < generation:
        if engine_id in worker._remote_agents:
            worker._cleanup_remote_engine(engine_id, log_eviction=False)
        seen[engine_id] = generation
    if engine_id not in worker._remote_agents:
        worker._background_nixl_handshake(req_id, engine_id, meta)
        return False
    worker._engine_last_active[engine_id] = time.perf_counter()
    if worker._bidirectional_kv_xfer_enabled and worker._is_turn2_read_expired(meta):
        worker.xfer_stats.record_kv_expired_req()
        worker._handle_failed_transfer(req_id, None, worker._recv_failures, record_failed_transfer=False)
        return False
    return True


def _post_reads(worker: Any, req_id: str, engine_id: str, plan: Any) -> bool:
    """Post the plan's READs; on a failed post, vLLM's failure path (report, release, post nothing more)
    and ``False``."""
    for t in plan.transfers:
        handle = None
        try:
            handle = make_xfer(worker, "READ", engine_id, worker.kvgeom_pairings[engine_id], t)
            worker.nixl_wrapper.transfer(handle)
            worker._recving_transfers[req_id].append(handle)
        except Exception as e:  # noqa: BLE001 - vLLM's failure path: report, release, post nothing more
            worker._log_failure(
                failure_type="transfer_setup_failed",
                req_id=req_id,
                error=e,
                msg="Deferring failure reporting until outstanding transfers finish",
                dst_engine_id=engine_id,
                remote_rank=t.remote_rank,
            )
            if not worker._handle_failed_transfer(req_id, handle, worker._recv_failures):
                worker._recving_transfers[req_id].append(handle)
            return False
    return True


def xfer_blocks_for_req(worker: Any, req_id: str, meta: Any) -> None:
    """The push of one request planned by kvgeom (P writes D's blocks): kvgeom's plan posted as WRITEs; the
    D ranks nothing is written to are notified, so every D rank counts its producers' notifications. D's
    token count comes with D's registration (kvgeom's push scheduler adds it), placing D's list when a
    prefix hit on D skipped blocks."""
    engine_id = meta.remote.engine_id
    pairing = _pairing(worker, engine_id)
    tokens = worker.__dict__.get("_kvgeom_push_tokens", {}).pop(req_id, None)
    plan = plan_request(
        pairing,
        meta.local_block_ids,
        meta.remote.block_ids,
        request_id=req_id,
        remote_request_id=meta.remote.request_id,
        num_tokens=tokens,
    )
    handles = []
    for t in plan.transfers:
        handle = None
        try:
            handle = make_xfer(worker, "WRITE", engine_id, pairing, t)
            worker.nixl_wrapper.transfer(handle)
            handles.append(handle)
        except Exception as e:  # noqa: BLE001 - vLLM's failure path for a WRITE
            worker._log_failure(
                failure_type="transfer_setup_failed",
                req_id=req_id,
                error=e,
                msg="Push WRITE submission failed; releasing handle",
                dst_engine_id=engine_id,
                remote_rank=t.remote_rank,
            )
            with worker._sending_transfers_lock:
                worker._send_failures.add(req_id)
            if not worker._handle_failed_transfer(req_id, handle) and handle is not None:
                handles.append(handle)
            break
    if handles:
        with worker._sending_transfers_lock:
            worker._sending_transfers[req_id].extend(handles)
    notif = f"{meta.remote.request_id}:{worker.world_size}".encode()
    for rank in plan.notify_only:
        _notify(worker, engine_id, rank, notif, req_id)
