"""kvgeom_vllm: vLLM 0.33.0's NIXL connector with every geometry step answered by kvgeom.

A vLLM user turns it on with vLLM's kv-transfer config::

    --kv-transfer-config '{"kv_connector": "KvgeomNixlConnector", "kv_connector_module_path": "kvgeom_vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {"compat": "vllm"}}'

(``KvgeomNixlPushConnector`` for push; ``"compat": "kvgeom"`` for kvgeom mode.) ``import kvgeom_vllm``
alone needs neither vLLM nor torch: the table (:mod:`kvgeom_vllm.table`) and the version policy
(:mod:`kvgeom_vllm.version`) are plain data. The connector classes load vLLM on first access, and refuse
any vLLM other than the supported version with a one-line :class:`VllmVersionError`.
"""

from __future__ import annotations

from typing import Any

from .table import CALLS, REFUSED, TABLE, Entry, counts
from .version import SUPPORTED_VLLM_VERSIONS, VllmVersionError, check_vllm_version

__all__ = [
    "CALLS",
    "REFUSED",
    "TABLE",
    "Entry",
    "counts",
    "SUPPORTED_VLLM_VERSIONS",
    "VllmVersionError",
    "check_vllm_version",
    "KvgeomNixlConnector",
    "KvgeomNixlPushConnector",
]

_LAZY = {"KvgeomNixlConnector": "connector", "KvgeomNixlPushConnector": "connector"}


def __getattr__(name: str) -> Any:  # the connectors import vLLM: only when vLLM's factory asks for them
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
