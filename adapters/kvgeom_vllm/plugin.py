"""vLLM's general plugin of kvgeom_vllm (entry point ``vllm.general_plugins``): the SSM conv-state layout.

vLLM's NIXL Mamba transfer needs the conv state stored dim-first (``VLLM_SSM_CONV_STATE_LAYOUT=DS``). vLLM's
CPU platform selects DS by itself only for connectors named ``NixlConnector``, ``NixlPullConnector`` or
``NixlPushConnector`` (vllm/platforms/cpu.py, ``check_and_update_config``), and picks SD for any other on a
CPU with AVX-512 BF16, before the cache shapes exist; kvgeom_vllm's connectors have other names. vLLM loads
general plugins before it builds the engine configuration, so :func:`register` wraps the platform's
``check_and_update_config``: when the kv-transfer config names a kvgeom_vllm connector and the variable is
not set, it is set to DS first (in the API server's process, so the engine processes inherit it). An
explicit setting is kept; the worker refuses one other than DS for a model with Mamba state
(:func:`check_conv_state_layout`). Without this plugin (``VLLM_PLUGINS`` naming others) set the variable by
hand. Importing this module needs neither vLLM nor torch.
"""

from __future__ import annotations

import os
from typing import Any

from kvgeom.errors import ConfigError

__all__ = ["CONNECTORS", "ENV", "register", "select_conv_state_layout", "check_conv_state_layout"]

ENV = "VLLM_SSM_CONV_STATE_LAYOUT"
CONNECTORS = ("KvgeomNixlConnector", "KvgeomNixlPushConnector")


def _names_kvgeom(vllm_config: Any) -> bool:
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None:
        return False
    module = str(getattr(ktc, "kv_connector_module_path", None) or "")
    return ktc.kv_connector in CONNECTORS and module.split(".")[0] == "kvgeom_vllm"


def select_conv_state_layout(vllm_config: Any, environ: Any = os.environ) -> str | None:
    """Set ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` when ``vllm_config`` names a kvgeom_vllm connector and the
    variable is unset; return the layout then in force (``None``: not set, another connector)."""
    if _names_kvgeom(vllm_config) and ENV not in environ:
        environ[ENV] = "DS"
    return environ.get(ENV)


def check_conv_state_layout(has_mamba: bool, dim_first: bool, environ: Any = os.environ) -> None:
    """Refuse (:class:`~kvgeom.errors.ConfigError`) a Mamba model whose conv state is not stored DS."""
    if has_mamba and not dim_first:
        raise ConfigError(
            ENV,
            "vLLM's NIXL Mamba transfer needs the conv state stored dim-first: set "
            f"{ENV}=DS on P and D (kvgeom_vllm's vLLM plugin sets it when the variable is unset)",
            value=environ.get(ENV),
            expected="DS",
        )


def register() -> None:
    """The plugin's entry: wrap the current platform's ``check_and_update_config`` (idempotent)."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    if getattr(cls, "_kvgeom_conv_layout", False):
        return
    original = cls.__dict__.get("check_and_update_config")
    func = getattr(original, "__func__", None)
    if func is None:  # the platform inherits it: wrap what it inherits
        func = cls.check_and_update_config.__func__

    def check_and_update_config(klass: Any, vllm_config: Any) -> Any:
        select_conv_state_layout(vllm_config)
        return func(klass, vllm_config)

    cls.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[assignment]
    cls._kvgeom_conv_layout = True  # type: ignore[attr-defined]
