"""A P/D pair of real vLLM 0.33.0 NIXL workers (kvgeom_vllm's, any ``compat`` mode) with real NIXL agents,
one process per engine, for the byte-checked end-to-end tests of ``test_kvgeom_mode.py``.

Each engine process builds one vLLM worker per TP rank exactly as vLLM's connector does (``__init__``,
``register_kv_caches`` on CPU tensors of facebook/opt-125m's KV cache, the real ``NixlWrapper``), and
talks to the parent through queues:

1. it sends the workers' geometry cards and handshake metadata;
2. it receives the bytes to put in its caches (the parent derives them from kvgeom's byte oracle: every
   byte encodes the coordinate or location the oracle gives it);
3. P marks the request as one to send and waits until every reader has notified it; D handshakes with
   its P ranks (vLLM's ``add_remote_agent`` on the metadata P sent), pulls the request through vLLM's
   ``start_load_kv`` and waits for ``get_transfer_results`` to report it; both within a deadline;
4. D returns its cache bytes, the descriptor pairs its NIXL wrapper was asked to move (resolved to
   ``(rank, region, offset, length)``) and kvgeom's post-receive step, for the parent's oracle.

Nothing here computes geometry; the only stand-in is the distributed runtime's TP rank query.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any
from unittest.mock import patch

import numpy as np

MODEL = "facebook/opt-125m"  # 12 layers, 12 KV heads of 64, float16 (config.json in tests/data/vllm)
LAYERS = [f"model.decoder.layers.{i}.self_attn.attn" for i in range(12)]
HEADS, HEAD_BYTES = 12, 128 * 2  # K and V packed: 2 x 64 float16 per head and token
TIMEOUT_S = 60.0


def vllm_config(tp: int, block_size: int, layout: str, compat: str, permute: bool = False) -> Any:
    from vllm.config import (
        AttentionConfig,
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    cache = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    cache.kv_cache_layout = layout
    return VllmConfig(
        model_config=ModelConfig(model=MODEL, dtype="float16", seed=42),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=64, max_model_len=10000, is_encoder_decoder=False
        ),
        cache_config=cache,
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvgeomNixlConnector",
            kv_connector_module_path="kvgeom_vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"compat": compat},
            enable_permute_local_kv=permute,
        ),
        device_config=DeviceConfig("cpu"),
        attention_config=AttentionConfig(),
    )


def kv_caches(tp: int, block_size: int, num_blocks: int, layout: str) -> tuple[Any, dict[str, Any]]:
    """vLLM's KV-cache config and one ``[blocks, heads, tokens, head bytes / 2]`` float16 cache per layer,
    head-major (LBHNC) or token-major (LBNHC) in memory."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    heads = HEADS // tp
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=64, dtype=torch.float16)
    caches = {}
    for name in LAYERS:
        if layout == "LBHNC":
            caches[name] = torch.zeros((num_blocks, heads, block_size, 128), dtype=torch.float16)
        else:  # token-major bytes, seen [blocks, heads, tokens, C] like every attention cache
            caches[name] = torch.zeros((num_blocks, block_size, heads, 128), dtype=torch.float16).permute(
                0, 2, 1, 3
            )
    page = block_size * heads * HEAD_BYTES
    tensors = [
        KVCacheTensor(size=num_blocks * page, layers=[n], layer_stride=page, block_stride=page)
        for n in LAYERS
    ]
    return KVCacheConfig(num_blocks, tensors, [KVCacheGroupSpec(list(LAYERS), spec)]), caches


class RecordingWrapper:
    """The real NIXL wrapper, with a record of the descriptor lists prepared and the transfers asked for
    (prepared ones, and per-request lists given to ``initialize_xfer``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.dlists: dict[int, np.ndarray] = {}
        self.xfers: list[tuple[str, int, np.ndarray, int, np.ndarray, bytes]] = []
        self._descs: dict[int, tuple[Any, np.ndarray]] = {}
        self.per_request: set[int] = set()  # the keys of the lists initialize_xfer was given

    def prep_xfer_dlist(self, agent: Any, descs: Any, *args: Any, **kwargs: Any) -> int:
        handle = self.inner.prep_xfer_dlist(agent, descs, *args, **kwargs)
        self.dlists[handle] = np.asarray(descs, dtype=np.int64)
        return handle

    def make_prepped_xfer(
        self, op: str, local: int, local_ids: Any, remote: int, remote_ids: Any, *args: Any, **kwargs: Any
    ) -> int:
        self.xfers.append(
            (
                op,
                local,
                np.asarray(local_ids, dtype=np.int64),
                remote,
                np.asarray(remote_ids, dtype=np.int64),
                kwargs.get("notif_msg", b""),
            )
        )
        return self.inner.make_prepped_xfer(op, local, local_ids, remote, remote_ids, *args, **kwargs)

    def get_xfer_descs(self, descs: Any, *args: Any, **kwargs: Any) -> Any:
        dlist = self.inner.get_xfer_descs(descs, *args, **kwargs)
        self._descs[id(dlist)] = (dlist, np.asarray(descs, dtype=np.int64))  # kept alive: ids stay unique
        return dlist

    def initialize_xfer(
        self, op: str, local: Any, remote: Any, agent: str, notif_msg: bytes = b"", *args: Any
    ) -> Any:
        """A per-request transfer (kvgeom mode's merged runs), recorded as a transfer of every row of two
        lists kept under fresh negative handles."""
        loc, rem = self._descs[id(local)][1], self._descs[id(remote)][1]
        lh, rh = -2 * len(self.xfers) - 1, -2 * len(self.xfers) - 2
        self.dlists[lh], self.dlists[rh] = loc, rem
        self.per_request.add(lh)
        ids = np.arange(len(loc), dtype=np.int64)
        self.xfers.append((op, lh, ids, rh, ids.copy(), notif_msg))
        return self.inner.initialize_xfer(op, local, remote, agent, notif_msg, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _expand(rows: np.ndarray) -> np.ndarray:
    """``(addr, len)`` per descriptor of N x 3 rows or N x 5 strided rows."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.shape[1] == 3:
        return rows[:, :2]
    counts = rows[:, 4]
    rep = np.repeat(rows, counts, axis=0)
    k = np.arange(rep.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([rep[:, 0] + k * rep[:, 3], rep[:, 1]], axis=1)


def make_worker(
    engine_id: str,
    tp: int,
    rank: int,
    block_size: int,
    num_blocks: int,
    layout: str,
    compat: str,
    nixl_wrapper: Any = None,
    push: bool = False,
    permute: bool = False,
) -> Any:
    """A registered kvgeom worker (pull, or ``push``) for TP rank ``rank`` of ``tp``, with a real NIXL agent
    (or the class ``nixl_wrapper`` in its place; then push's writer thread is not started)."""
    from kvgeom_vllm.worker import KvgeomPullConnectorWorker, KvgeomPushConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw

    config = vllm_config(tp, block_size, layout, compat, permute)
    kvc, caches = kv_caches(tp, block_size, num_blocks, layout)
    base = KvgeomPushConnectorWorker if push else KvgeomPullConnectorWorker
    cls = base if compat == "vllm" else type("W", (base,), {"kvgeom_compat": compat})
    with ExitStack() as stack:
        if push and nixl_wrapper is not None:
            stack.enter_context(patch("threading.Thread"))
        stack.enter_context(patch.object(bw, "get_tensor_model_parallel_rank", return_value=rank))
        stack.enter_context(patch.object(bw, "get_tensor_model_parallel_world_size", return_value=tp))
        if nixl_wrapper is not None:
            stack.enter_context(patch.object(bw, "NixlWrapper", nixl_wrapper))
        worker = cls(config, engine_id, kvc)
        worker.nixl_wrapper = RecordingWrapper(worker.nixl_wrapper)
        worker.register_kv_caches(caches)
    return worker


def region_views(worker: Any) -> list[Any]:
    """Each registered region of a worker as a flat uint8 tensor over its bytes."""
    from kvgeom_vllm.answers import region_bytes

    out = []
    for r, region in enumerate(region_bytes(worker)):
        n = int(worker.region_num_blocks[r]) * int(worker.block_stride_per_layer[r])
        out.append(region.flat[region.start : region.start + n])
    return out


def _fill(worker: Any, data: list[np.ndarray]) -> None:
    import torch

    for view, arr in zip(region_views(worker), data, strict=True):
        view.copy_(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.uint8)))


def _await(poll: Any, done: Any, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not done within {TIMEOUT_S}s")
        poll()
        time.sleep(0.01)


def _get(q: Any) -> Any:
    return q.get(timeout=TIMEOUT_S)


def producer_main(side: dict, to_parent: Any, from_parent: Any) -> dict:
    """P engine: every TP rank of ``side`` (``tp``, ``block_size``, ``num_blocks``, ``layout``,
    ``compat``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    workers = [
        make_worker(
            "P", side["tp"], r, side["block_size"], side["num_blocks"], side["layout"], side["compat"]
        )
        for r in range(side["tp"])
    ]
    to_parent.put(
        (
            "P",
            [w.kvgeom_card.dumps() for w in workers],
            [w.xfer_handshake_metadata.agent_metadata_bytes for w in workers],
        )
    )
    contents, req = _get(from_parent)
    for w, data in zip(workers, contents, strict=True):
        _fill(w, data)
        meta = NixlConnectorMetadata()
        meta.reqs_to_send = {req: time.perf_counter() + 2 * TIMEOUT_S}
        meta.reqs_in_batch = {req}
        w.start_load_kv(meta)
    to_parent.put(("P", "filled", None))
    sent = [set() for _ in workers]
    for w, s in zip(workers, sent):
        _await(
            lambda w=w, s=s: s.update(w.get_transfer_results().finished_sending),
            lambda s=s: req in s,
            f"P rank {workers.index(w)}: the readers' notifications",
        )
    return {"finished_sending": [sorted(s) for s in sent]}


def consumer_main(side: dict, to_parent: Any, from_parent: Any) -> dict:
    """D engine: every TP rank of ``side`` pulls the request from P's ranks."""
    import msgspec
    from kvgeom_vllm.handshake import KvgeomAgentMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    workers = [
        make_worker(
            "D",
            side["tp"],
            r,
            side["block_size"],
            side["num_blocks"],
            side["layout"],
            side["compat"],
            permute=side.get("permute", False),
        )
        for r in range(side["tp"])
    ]
    to_parent.put(("D", [w.kvgeom_card.dumps() for w in workers], None))
    contents, p_tp, p_metadata, request = _get(from_parent)
    p_regions = []  # (base, size) of every region of every P rank, as P advertised them
    for payload in p_metadata:
        m = msgspec.msgpack.decode(payload, type=KvgeomAgentMetadata)
        caps = m.region_num_blocks or [m.num_blocks] * len(m.kv_caches_base_addr)
        p_regions.append([(b, n * s) for b, n, s in zip(m.kv_caches_base_addr, caps, m.block_strides)])
    out = []
    for rank, (w, data) in enumerate(zip(workers, contents, strict=True)):
        _fill(w, data)
        refused = None
        try:
            for target in w.transfer_topo.handshake_target_ranks(p_tp):
                meta = msgspec.msgpack.decode(p_metadata[target], type=KvgeomAgentMetadata)
                w._remote_agents["P"][(0, target)] = w.add_remote_agent(
                    meta, remote_tp_rank=target, remote_tp_size=p_tp
                )
        except Exception as e:  # noqa: BLE001 - the verdict is the test's to judge
            refused = f"{type(e).__name__}: {e}"
        if refused is not None:
            out.append({"refused": refused})
            continue
        meta = NixlConnectorMetadata()
        meta.add_new_req_to_recv(
            "req",
            [list(g) for g in request["d_ids"]],
            {
                "remote_block_ids": [list(g) for g in request["p_ids"]],
                "remote_engine_id": "P",
                "remote_request_id": "req-P",
                "remote_host": "localhost",
                "remote_port": 0,
                "tp_size": p_tp,
                "remote_num_tokens": request["p_tokens"],
            },
            local_num_computed_blocks=(request["prefix_blocks"],),
            awaiting_kvs=True,
        )
        req_meta = meta.reqs_to_recv["req"]
        w.start_load_kv(meta)
        done: set[str] = set()
        _await(
            lambda w=w, done=done: done.update(w.get_transfer_results().finished_recving),
            lambda done=done: "req" in done,
            f"D rank {rank}: the pull",
        )
        receive = req_meta.region_blocks_to_zero
        out.append(
            {
                "bytes": [v.numpy().copy() for v in region_views(w)],
                "moves": _moves(w, rank, p_regions),
                "merged": [
                    x[1] in w.nixl_wrapper.per_request for x in w.nixl_wrapper.xfers
                ],  # per transfer: per-request lists
                "regroup": receive.plan.regroup,
                "zero": receive.plan.zero,
            }
        )
    return {"ranks": out}


def _locate(addr: np.ndarray, spans: list[tuple[int, int, int, int]]) -> np.ndarray:
    """``(rank, region, offset)`` of each address, from ``(base, size, rank, region)`` spans."""
    spans = sorted(spans)
    bases = np.asarray([s[0] for s in spans], dtype=np.int64)
    i = np.searchsorted(bases, addr, side="right") - 1
    if (i < 0).any():
        raise ValueError("a descriptor below every registered region")
    table = np.asarray(spans, dtype=np.int64)[i]
    off = addr - table[:, 0]
    if (off >= table[:, 1]).any():
        raise ValueError("a descriptor outside every registered region")
    return np.stack([table[:, 2], table[:, 3], off], axis=1)


def _moves(worker: Any, rank: int, p_regions: list[list[tuple[int, int]]], op: str = "READ") -> np.ndarray:
    """The byte moves of every transfer a worker posted, N x 8 (source rank, region, offset, destination
    rank, region, offset, source length, destination length): D's READs from P's ranks (``p_regions``: the
    peer's regions), or P's WRITEs into D's (``op="WRITE"``, ``p_regions`` then D's)."""
    sizes = [int(n) * int(s) for n, s in zip(worker.region_num_blocks, worker.block_stride_per_layer)]
    mine = [
        (int(b), sizes[r], rank, r) for r, b in enumerate(worker.kv_caches_base_addr[worker.engine_id][rank])
    ]
    theirs = [
        (int(b), int(n), p, r) for p, regions in enumerate(p_regions) for r, (b, n) in enumerate(regions)
    ]
    nixl = worker.nixl_wrapper
    out = [np.zeros((0, 8), dtype=np.int64)]
    for x in nixl.xfers:
        kind, lh, lids, rh, rids = x[:5]
        assert kind == op
        loc, rem = _expand(nixl.dlists[lh])[lids], _expand(nixl.dlists[rh])[rids]
        there, here = _locate(rem[:, 0], theirs), _locate(loc[:, 0], mine)
        if op == "READ":
            out.append(np.concatenate([there, here, rem[:, 1:2], loc[:, 1:2]], axis=1))
        else:
            out.append(np.concatenate([here, there, loc[:, 1:2], rem[:, 1:2]], axis=1))
    return np.concatenate(out)
