"""Real vLLM 0.33.0 NIXL workers on CPU tensors for kvgeom_vllm's tests (collected only in the vLLM venv).

The worker, its registration and its handshake code are vLLM's (with kvgeom_vllm's geometry); what is
replaced is what a CPU process without a cluster lacks: NIXL's agent (a minimal recording stand-in, as
vLLM's own connector tests use) and the distributed runtime's TP rank queries.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any
from unittest.mock import patch

import numpy as np
import torch
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

MODEL = "facebook/opt-125m"  # 12 layers, 12 KV heads of 64, float16 (config.json in tests/data/hf)
LAYERS = [f"model.decoder.layers.{i}.self_attn.attn" for i in range(12)]


class RecordingNixl:
    """NIXL agent stand-in: records prepared descriptor lists, transfers and notifications; never moves
    bytes (every transfer reports done at once)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.dlists: dict[int, np.ndarray] = {}
        self.remote_agents: list[bytes] = []
        self.xfers: list[tuple[str, int, np.ndarray, int, np.ndarray, bytes]] = []
        self.notifs: list[tuple[str, bytes]] = []
        self._next = 1

    def make_prepped_xfer(
        self, op: str, local: int, local_ids: Any, remote: int, remote_ids: Any, notif_msg: bytes = b""
    ) -> int:
        self.xfers.append((op, local, np.asarray(local_ids), remote, np.asarray(remote_ids), notif_msg))
        handle, self._next = self._next, self._next + 1
        return handle

    def get_xfer_descs(self, descs: Any, mem_type: Any = None) -> Any:
        return np.asarray(descs, dtype=np.uint64)

    def initialize_xfer(self, op: str, local: Any, remote: Any, agent: str, notif_msg: bytes = b"") -> int:
        """A per-request transfer (kvgeom mode's merged runs): both lists kept as prepared lists, and the
        transfer recorded as one of all their rows."""
        lh, rh = -2 * len(self.xfers) - 1, -2 * len(self.xfers) - 2
        self.dlists[lh], self.dlists[rh] = np.asarray(local), np.asarray(remote)
        ids = np.arange(len(local))
        self.xfers.append((op, lh, ids, rh, ids.copy(), notif_msg))
        handle, self._next = self._next, self._next + 1
        return handle

    def transfer(self, handle: int) -> str:
        return "PROC"

    def check_xfer_state(self, handle: int) -> str:
        return "DONE"

    def release_xfer_handle(self, handle: int) -> None:
        pass

    def send_notif(self, agent: str, notif_msg: bytes = b"") -> None:
        self.notifs.append((agent, notif_msg))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def get_reg_descs(self, caches_data: Any, mem_type: Any) -> Any:
        return caches_data

    def register_memory(self, descs: Any, backends: Any = None) -> None:
        pass

    def deregister_memory(self, descs: Any) -> None:
        pass

    def get_agent_metadata(self) -> bytes:
        return b"agent-meta"

    def prep_xfer_dlist(self, agent: Any, descs: Any, mem_type: Any = None) -> int:
        handle, self._next = self._next, self._next + 1
        self.dlists[handle] = np.asarray(descs, dtype=np.uint64)
        return handle

    def add_remote_agent(self, metadata: bytes) -> str:
        self.remote_agents.append(metadata)
        return f"remote-{len(self.remote_agents)}"

    def release_dlist_handle(self, handle: int) -> None:
        pass

    def remove_remote_agent(self, agent: str) -> None:
        pass


def vllm_config(
    block_size: int = 32, extra: dict[str, Any] | None = None, kv_role: str = "kv_both"
) -> VllmConfig:
    model_config = ModelConfig(model=MODEL, dtype="float16", seed=42)
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    cache_config.kv_cache_layout = "LBHNC"
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=64, max_model_len=10000, is_encoder_decoder=False
        ),
        cache_config=cache_config,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvgeomNixlConnector",
            kv_connector_module_path="kvgeom_vllm",
            kv_role=kv_role,
            kv_connector_extra_config=extra or {},
        ),
        device_config=DeviceConfig("cpu"),
        attention_config=AttentionConfig(),
    )


def kv_cache_config(block_size: int, num_blocks: int) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=12, head_size=64, dtype=torch.float16)
    caches = {name: torch.zeros((num_blocks, 12, block_size, 128), dtype=torch.float16) for name in LAYERS}
    page = block_size * 12 * 128 * 2
    tensors = [
        KVCacheTensor(size=caches[name].nbytes, layers=[name], layer_stride=page, block_stride=page)
        for name in LAYERS
    ]
    return KVCacheConfig(num_blocks, tensors, [KVCacheGroupSpec(list(LAYERS), spec)]), caches


def cpu_runtime() -> ExitStack:
    """What a CPU process without a cluster lacks: NIXL's agent and the TP rank queries (TP1, rank 0)."""
    stack = ExitStack()
    stack.enter_context(patch.object(bw, "NixlWrapper", RecordingNixl))
    stack.enter_context(patch.object(bw, "get_tensor_model_parallel_rank", return_value=0))
    stack.enter_context(patch.object(bw, "get_tensor_model_parallel_world_size", return_value=1))
    stack.enter_context(patch("threading.Thread"))
    return stack


def make_worker(
    worker_cls: type,
    engine_id: str,
    block_size: int = 32,
    num_blocks: int = 8,
    extra: dict[str, Any] | None = None,
) -> Any:
    """A registered worker of ``worker_cls`` (TP1) for opt-125m with ``num_blocks`` blocks."""
    config = vllm_config(block_size, extra)
    kvc, caches = kv_cache_config(block_size, num_blocks)
    with cpu_runtime():
        worker = worker_cls(config, engine_id, kvc)
        worker.register_kv_caches(caches)
    return worker
