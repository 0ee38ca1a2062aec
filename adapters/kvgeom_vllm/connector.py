"""The connectors a vLLM user names in ``--kv-transfer-config``: vLLM's NIXL connectors (pull and push)
with kvgeom's workers.

``kv_connector_extra_config.compat`` picks the mode: ``"vllm"`` (default) answers every geometry step
with kvgeom exactly as vLLM 0.33.0 would and refuses what vLLM refuses (and what vLLM would silently
corrupt, when both sides send kvgeom's card); ``"kvgeom"`` lets kvgeom's handshake decide (both sides must
run kvgeom_vllm), which also serves pairs vLLM refuses where kvgeom can plan them.
"""

from __future__ import annotations

from typing import Any

from .version import check_vllm_version

check_vllm_version()

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as _nixl  # noqa: E402

from kvgeom.errors import ConfigError  # noqa: E402

from .worker import (  # noqa: E402
    KvgeomPullConnectorScheduler,
    KvgeomPullConnectorWorker,
    KvgeomPushConnectorScheduler,
    KvgeomPushConnectorWorker,
)

__all__ = ["KvgeomNixlConnector", "KvgeomNixlPushConnector", "COMPAT_MODES", "compat_of"]

COMPAT_MODES = ("vllm", "kvgeom")


def compat_of(vllm_config: Any) -> str:
    """The ``compat`` mode of ``kv_connector_extra_config`` (default ``"vllm"``)."""
    ktc = vllm_config.kv_transfer_config
    value = ktc.get_from_extra_config("compat", "vllm") if ktc is not None else "vllm"
    if value not in COMPAT_MODES:
        raise ConfigError(
            "kv_connector_extra_config.compat",
            f"must be one of {COMPAT_MODES}, got {value!r}",
            value=value,
            expected=COMPAT_MODES,
        )
    return str(value)


def _with_compat(worker_cls: type, vllm_config: Any) -> type:
    mode = compat_of(vllm_config)
    if mode == worker_cls.kvgeom_compat:
        return worker_cls
    return type(
        worker_cls.__name__, (worker_cls,), {"kvgeom_compat": mode, "__module__": worker_cls.__module__}
    )


class KvgeomNixlConnector(_nixl.NixlPullConnector):
    """vLLM's pull (READ) NIXL connector; every geometry step answered by kvgeom."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        worker_cls = _with_compat(KvgeomPullConnectorWorker, vllm_config)
        _nixl.NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvgeomPullConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = worker_cls(vllm_config, self.engine_id, kv_cache_config)


class KvgeomNixlPushConnector(_nixl.NixlPushConnector):
    """vLLM's push (WRITE) NIXL connector; every geometry step answered by kvgeom."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        worker_cls = _with_compat(KvgeomPushConnectorWorker, vllm_config)
        _nixl.NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("NixlPushConnector does not support decode_context_parallel_size > 1.")
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvgeomPushConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = worker_cls(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")
