"""kvgeom_vllm's version policy and conv-state plugin, without vLLM (both are plain data and logic):
the supported versions and their profiles (docs/vllm-versions.md), the typed refusal of any other, and the
plugin that gives kvgeom_vllm's connectors the DS conv-state layout vLLM's CPU platform gives only its own
NIXL connectors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvgeom_vllm import plugin
from kvgeom_vllm.version import (
    PROFILES,
    SUPPORTED_VLLM_VERSIONS,
    VllmVersionError,
    check_vllm_version,
    profile,
)

from kvgeom.errors import ConfigError, KvgeomError


def test_the_supported_versions_and_what_differs() -> None:
    assert SUPPORTED_VLLM_VERSIONS == ("0.32.0", "0.33.0")
    old, new = profile("0.32.0"), profile("0.33.0")
    assert (old.strided_descs, old.registration_generations, old.draft_regions) == (False, False, False)
    assert (new.strided_descs, new.registration_generations, new.draft_regions) == (True, True, True)
    assert new.absent == frozenset()
    assert old.absent == {
        "compute_head_offset",
        "NixlBaseConnectorWorker._split_remote_packed_rows",
        "NixlBaseConnectorWorker._split_remote_blocks",
        "NixlBaseConnectorWorker._block_strided_descs",
        "NixlBaseConnectorWorker._strided_desc_starts",
    }
    assert set(PROFILES) == set(SUPPORTED_VLLM_VERSIONS)


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_a_supported_version_is_accepted(version: str) -> None:
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.31.2", "0.32.1", "0.33.1", "0.34.0", "0.33.0+cu130", "unknown"])
def test_any_other_version_is_refused_naming_the_supported_ones(version: str) -> None:
    with pytest.raises(VllmVersionError) as info:
        check_vllm_version(version)
    err = info.value
    assert isinstance(err, ConfigError) and isinstance(err, ImportError) and isinstance(err, KvgeomError)
    assert err.field == "vllm"
    assert err.values == {"value": version, "expected": ("0.32.0", "0.33.0")}
    assert "\n" not in str(err)


def _config(connector: str, module: str | None = "kvgeom_vllm") -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector=connector, kv_connector_module_path=module)
    )


@pytest.mark.parametrize("connector", ["KvgeomNixlConnector", "KvgeomNixlPushConnector"])
def test_the_plugin_sets_ds_for_kvgeoms_connectors(connector: str) -> None:
    env: dict[str, str] = {}
    assert plugin.select_conv_state_layout(_config(connector), env) == "DS"
    assert env == {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}


def test_the_plugin_keeps_an_explicit_setting_and_leaves_other_connectors_alone() -> None:
    env = {"VLLM_SSM_CONV_STATE_LAYOUT": "SD"}
    assert plugin.select_conv_state_layout(_config("KvgeomNixlConnector"), env) == "SD"
    for cfg in (
        _config("NixlConnector", None),
        _config("KvgeomNixlConnector", "other_module"),
        SimpleNamespace(kv_transfer_config=None),
    ):
        empty: dict[str, str] = {}
        assert plugin.select_conv_state_layout(cfg, empty) is None and empty == {}


def test_the_worker_check_refuses_a_mamba_model_without_ds() -> None:
    plugin.check_conv_state_layout(has_mamba=True, dim_first=True)
    plugin.check_conv_state_layout(has_mamba=False, dim_first=False)
    with pytest.raises(ConfigError) as info:
        plugin.check_conv_state_layout(True, False, {"VLLM_SSM_CONV_STATE_LAYOUT": "SD"})
    assert info.value.field == "VLLM_SSM_CONV_STATE_LAYOUT"
    assert info.value.values == {"value": "SD", "expected": "DS"}


def test_strided_rows_expand_in_nixls_order_and_back() -> None:
    """vLLM 0.32.0's tables are one (addr, len, dev) row per block: kvgeom's strided rows expand row by row,
    block k of a row at addr + k * stride (the order NIXL expands 0.33.0's rows in)."""
    import numpy as np

    from kvgeom.plan.strided import block_strided_rows, expand_rows, strided_starts, to_strided

    rows = np.array([[1000, 8, 0, 100, 3], [5000, 4, 1, 10, 2]])
    flat = expand_rows(rows)
    assert flat.tolist() == [[1000, 8, 0], [1100, 8, 0], [1200, 8, 0], [5000, 4, 1], [5010, 4, 1]]
    assert strided_starts(rows).tolist() == [0, 3]
    assert to_strided(flat).tolist() == [[a, n, d, n, 1] for a, n, d in flat.tolist()]
    assert expand_rows(to_strided(flat)).tolist() == flat.tolist()
    # a padded block cut into sub-blocks: vLLM 0.32.0's own order (block by block, sub-block by sub-block)
    padded = expand_rows(block_strided_rows(0, 16, 64, 3, 2, 0))
    assert padded[:, 0].tolist() == [0, 16, 64, 80, 128, 144]
    even = expand_rows(block_strided_rows(0, 16, 32, 3, 2, 0))
    assert even[:, 0].tolist() == [0, 16, 32, 48, 64, 80]
