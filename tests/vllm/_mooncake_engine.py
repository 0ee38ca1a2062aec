"""One rank of a vLLM P/D pair in its own process: kvgeom_vllm.mooncake's worker
(``KvgeomMooncakeConnectorWorker``, vLLM 0.33.0's Mooncake worker with kvgeom's geometry) on CPU tensors,
over the REAL ``mooncake.engine.TransferEngine`` (TCP, loopback). vLLM's bootstrap server (P), its HTTP
registration and query, its ZMQ side channel and its sender and receiver threads all run as in vLLM; what a
CPU process without a cluster lacks is patched, as vLLM's own Mooncake tests patch it: the host address
(loopback), the TP rank queries (TP1, rank 0) and the pipeline group (rank 0).

Driven by the parent through queues: ``("send", {...})`` on P (the request is ready: vLLM's two
``reqs_to_send`` steps, from ``update_state_after_alloc`` then ``request_finished``), ``("recv", {...})`` on
D (``reqs_to_recv``, as the scheduler's metadata carries it), then ``("finished", request_id)`` until the
worker's ``get_finished`` reports it, and ``("blocks", ids)``: the bytes of those blocks of every layer (``ids``: per group kind)."""

from __future__ import annotations

import os
import queue
import time
import traceback
from contextlib import ExitStack
from typing import Any
from unittest.mock import MagicMock, patch

LAYERS = [f"model.decoder.layers.{i}.self_attn.attn" for i in range(12)]  # facebook/opt-125m
GDN_LAYER = "model.decoder.layers.12.linear_attn"  # the hybrid's recurrent layer (vLLM's GDN is a MambaSpec)
GDN_PAD = 64  # bytes after each GDN page in its block (vLLM's own hybrid tests pad the same way)
HEADS, HEAD_SIZE = 12, 64
POISON = 0xA5


def _config(role: str, block_size: int, bootstrap_port: int) -> Any:
    from vllm.config import (
        AttentionConfig,
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    return VllmConfig(
        model_config=ModelConfig(model="facebook/opt-125m", dtype="float16", seed=42),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=64, max_model_len=10000, is_encoder_decoder=False
        ),
        cache_config=cache_config,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvgeomMooncakeConnector",
            kv_connector_module_path="kvgeom_vllm.mooncake",
            kv_role=role,
            engine_id="prefill" if role == "kv_producer" else "decode",
            kv_connector_extra_config={"mooncake_protocol": "tcp", "num_workers": 2},
        ),
        device_config=DeviceConfig("cpu"),
        attention_config=AttentionConfig(),
    )


def _caches(block_size: int, num_blocks: int, fill: str, hybrid: bool) -> tuple[Any, dict[str, Any]]:
    """vLLM's cache config for opt-125m's 12 attention layers and one tensor per layer (blocks first, then
    heads, tokens, K and V of a head: the shape tests/vllm/_vllm_workers.py gives vLLM's NIXL worker).
    ``fill``: ``"known"`` (each byte from a seeded generator, different per layer) or ``"poison"``. ``hybrid``:
    also one GDN layer in a second group (one state page per block, padded in its block stride)."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )

    def filled(t: Any, seed: int) -> Any:
        raw = t.view(torch.uint8).view(-1)
        if fill == "known":
            g = torch.Generator().manual_seed(seed)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        else:
            raw.fill_(POISON)
        return t

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float16
    )
    caches = {}
    for i, name in enumerate(LAYERS):
        t = torch.empty((num_blocks, HEADS, block_size, 2 * HEAD_SIZE), dtype=torch.float16)
        caches[name] = filled(t, 1000 + i)
    page = block_size * HEADS * HEAD_SIZE * 2 * 2
    tensors = [
        KVCacheTensor(size=caches[n].nbytes, layers=[n], layer_stride=page, block_stride=page) for n in LAYERS
    ]
    groups = [KVCacheGroupSpec(list(LAYERS), spec)]
    if hybrid:
        gdn = MambaSpec(
            block_size=block_size,
            shapes=((6, 3), (1, 2, 2)),
            dtypes=(torch.float16, torch.float16),
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        )
        stride = gdn.page_size_bytes + GDN_PAD
        raw = filled(torch.empty((num_blocks, stride), dtype=torch.int8), 2000)
        caches[GDN_LAYER] = raw[:, : gdn.page_size_bytes]
        tensors.append(
            KVCacheTensor(size=raw.nbytes, layers=[GDN_LAYER], layer_stride=stride, block_stride=stride)
        )
        groups.append(KVCacheGroupSpec([GDN_LAYER], gdn))
    return KVCacheConfig(num_blocks, tensors, groups), caches


def _cpu_runtime() -> ExitStack:
    mc = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"
    pp = MagicMock()
    pp.rank_in_group = 0
    stack = ExitStack()
    stack.enter_context(patch(f"{mc}.get_ip", return_value="127.0.0.1"))
    stack.enter_context(patch(f"{mc}.get_tensor_model_parallel_rank", return_value=0))
    stack.enter_context(patch(f"{mc}.get_tensor_model_parallel_world_size", return_value=1))
    stack.enter_context(patch(f"{mc}.get_pp_group", return_value=pp))
    return stack


def rank_main(
    role: str, block_size: int, num_blocks: int, bootstrap_port: int, hybrid: bool, inbox: Any, outbox: Any
) -> None:
    os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap_port)
    os.environ.setdefault("GLOG_minloglevel", "2")
    try:
        import kvgeom_vllm
        from kvgeom_vllm.mooncake.connector import KvgeomMooncakeConnectorWorker
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
            MooncakeConnectorMetadata,
        )

        config = _config(role, block_size, bootstrap_port)
        kvc, caches = _caches(block_size, num_blocks, "known" if role == "kv_producer" else "poison", hybrid)
        with set_current_vllm_config(config), _cpu_runtime():
            worker = KvgeomMooncakeConnectorWorker(config, config.kv_transfer_config.engine_id, kvc)
            worker.register_kv_caches(caches)
            outbox.put(
                ("ready", {"engine": type(worker.engine).__module__, "kvgeom_vllm": kvgeom_vllm.__file__})
            )
            try:
                _serve(worker, caches, MooncakeConnectorMetadata, inbox, outbox)
            finally:
                worker.shutdown()
    except Exception as exc:
        outbox.put(("err", type(exc).__name__, str(exc), traceback.format_exc()[-3000:]))


def _serve(worker: Any, caches: dict[str, Any], metadata_cls: Any, inbox: Any, outbox: Any) -> None:
    finished: set[str] = set()
    while True:
        try:
            cmd, kw = inbox.get(timeout=120)
        except queue.Empty:
            raise TimeoutError("no command for 120 s") from None
        if cmd == "stop":
            outbox.put(("ok", None))
            return
        if cmd == "send":  # vLLM's scheduler: update_state_after_alloc (no blocks), then request_finished
            for ids in ([], kw["block_ids"]):
                meta = metadata_cls()
                meta.reqs_to_send[kw["request_id"]] = (kw["transfer_id"], ids)
                worker.start_load_kv(meta)
            out: Any = None
        elif cmd == "recv":
            meta = metadata_cls()
            meta.add_new_req(
                kw["request_id"],
                kw["block_ids"],
                {
                    "transfer_id": kw["transfer_id"],
                    "remote_engine_id": "prefill",
                    "remote_bootstrap_addr": f"http://127.0.0.1:{kw['bootstrap_port']}",
                },
            )
            worker.start_load_kv(meta)
            out = None
        elif cmd == "finished":  # bounded poll of the worker's get_finished (as vLLM's model runner calls it)
            end = time.monotonic() + float(kw["timeout_s"])
            while kw["request_id"] not in finished and time.monotonic() < end:
                sending, recving = worker.get_finished()
                finished |= set(sending or ()) | set(recving or ())
                time.sleep(0.01)
            out = {
                "done": kw["request_id"] in finished,
                "failed": sorted(worker.get_block_ids_with_load_errors()),
            }
        elif (
            cmd == "blocks"
        ):  # per layer the bytes of its group's blocks, in order (kw: {"attn": ids, "gdn": ids})
            out = {name: _bytes(t[_ids(name, kw)]) for name, t in caches.items()}
        elif cmd == "untouched":  # whether every block of every layer outside these is still poison
            out = all(
                bool((_flat(t[b]) == POISON).all())
                for name, t in caches.items()
                for b in range(t.shape[0])
                if b not in set(_ids(name, kw))
            )
        else:
            raise ValueError(f"unknown command {cmd!r}")
        outbox.put(("ok", out))


def _ids(name: str, ids: dict[str, list[int]]) -> list[int]:
    return ids["gdn"] if name == GDN_LAYER else ids["attn"]


def _flat(t: Any) -> Any:
    import torch

    return t.contiguous().view(-1).view(torch.uint8)


def _bytes(t: Any) -> bytes:
    return bytes(_flat(t).numpy())
