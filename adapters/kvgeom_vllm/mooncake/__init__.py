"""kvgeom_vllm.mooncake: vLLM 0.33.0's Mooncake connector with its geometry answered by kvgeom.

A vLLM user turns it on with vLLM's kv-transfer config::

    --kv-transfer-config '{"kv_connector": "KvgeomMooncakeConnector",
                           "kv_connector_module_path": "kvgeom_vllm.mooncake", "kv_role": "kv_producer"}'

(``kv_consumer`` on D; the rest of the configuration is vLLM's ``MooncakeConnector``'s: ``mooncake_protocol``,
the bootstrap server.) ``import kvgeom_vllm.mooncake`` alone needs neither vLLM nor torch: the table
(:mod:`kvgeom_vllm.mooncake.table`) is data. The connector class loads vLLM (and refuses any vLLM but
0.33.0) on first access. docs/mooncake.md describes what it answers and what it refuses.
"""

from __future__ import annotations

from typing import Any

from .table import CALLS, REFUSED, TABLE, counts

__all__ = ["CALLS", "REFUSED", "TABLE", "counts", "KvgeomMooncakeConnector"]


def __getattr__(name: str) -> Any:  # the connector imports vLLM: only when vLLM's factory asks for it
    if name == "KvgeomMooncakeConnector":
        import importlib

        return importlib.import_module(".connector", __name__).KvgeomMooncakeConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
