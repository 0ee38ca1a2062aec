"""kvgeom_vllm inside real vLLM 0.33.0: loading by configuration, the version policy, the table, and the
geometry card in vLLM's handshake (run by ``make test-vllm`` in the vLLM venv)."""

from __future__ import annotations

import importlib
from typing import Any

import kvgeom_vllm
import msgspec
import numpy as np
import pytest
from _vllm_workers import cpu_runtime, kv_cache_config, make_worker, vllm_config
from kvgeom_vllm.table import ANSWERED, CALLS, TABLE
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import supports_hma
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata as PlainMetadata

from kvgeom import GeometryCard, IncompatiblePairError, KvgeomError
from kvgeom.errors import ConfigError


def _workers() -> object:
    from kvgeom_vllm import worker

    return worker


# -- loading and version -----------------------------------------------------------------------------------
def test_connector_loads_by_module_path_from_the_kv_transfer_config() -> None:
    ktc = vllm_config().kv_transfer_config
    cls = KVConnectorFactory.get_connector_class(ktc)
    from kvgeom_vllm.connector import KvgeomNixlConnector

    assert cls is KvgeomNixlConnector
    assert KVConnectorFactory.supports_hma_config(ktc) and supports_hma(cls)


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_connector_builds_kvgeom_workers_in_the_configured_mode(compat: str) -> None:
    from kvgeom_vllm.connector import KvgeomNixlConnector
    from kvgeom_vllm.worker import KvgeomPullConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = vllm_config(extra={"compat": compat})
    config.kv_transfer_config.engine_id = "D"
    kvc, caches = kv_cache_config(32, 8)
    with cpu_runtime():
        connector = KvgeomNixlConnector(config, KVConnectorRole.WORKER, kvc)
        connector.register_kv_caches(caches)
    worker = connector.connector_worker
    assert isinstance(worker, KvgeomPullConnectorWorker) and worker.kvgeom_compat == compat
    assert (
        worker.kvgeom_card is not None
        and connector.get_handshake_metadata() is worker.xfer_handshake_metadata
    )


def test_unsupported_vllm_version_is_refused_in_one_line() -> None:
    with pytest.raises(kvgeom_vllm.VllmVersionError) as info:
        kvgeom_vllm.check_vllm_version("0.34.0")
    message = str(info.value)
    assert "\n" not in message and "0.34.0" in message and "0.33.0" in message
    assert isinstance(info.value, ImportError) and isinstance(info.value, KvgeomError)
    assert kvgeom_vllm.check_vllm_version() == "0.33.0"


def test_bad_compat_mode_is_refused_naming_the_field() -> None:
    from kvgeom_vllm.connector import compat_of

    with pytest.raises(ConfigError, match="kv_connector_extra_config.compat"):
        compat_of(vllm_config(extra={"compat": "fast"}))
    assert (
        compat_of(vllm_config()) == "vllm" and compat_of(vllm_config(extra={"compat": "kvgeom"})) == "kvgeom"
    )


def test_nixl_agent_settings_reach_the_agent_config_nixl_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kvgeom_vllm.worker import agent_settings
    from nixl._api import nixl_agent, nixl_agent_config

    module = sys.modules[nixl_agent.__module__]
    bind, seen = module.nixlBind, []
    real = bind.nixlAgent

    def recording(name: str, config: object) -> object:
        seen.append((name, config.pthrDelay, config.syncMode, config.useProgThread))  # type: ignore[attr-defined]
        return real(name, config)

    monkeypatch.setattr(bind, "nixlAgent", recording)
    with agent_settings(250, None, module):
        nixl_agent("delayed", nixl_agent_config(backends=[]))
    with agent_settings(None, "rw", module):
        nixl_agent("rw", nixl_agent_config(backends=[]))
    with agent_settings(1000, "strict", module):
        nixl_agent("both", nixl_agent_config(backends=[]))
    assert module.nixlBind.nixlAgent is recording  # restored on exit
    nixl_agent("plain", nixl_agent_config(backends=[]))
    with agent_settings(None, None, module):
        nixl_agent("unset", nixl_agent_config(backends=[]))
    none, rw, strict = bind.NIXL_THREAD_SYNC_NONE, bind.NIXL_THREAD_SYNC_RW, bind.NIXL_THREAD_SYNC_STRICT
    assert seen == [
        ("delayed", 250, none, True),
        ("rw", 0, rw, True),
        ("both", 1000, strict, True),
        ("plain", 0, none, True),
        ("unset", 0, none, True),
    ]


def test_a_sync_mode_this_nixl_lacks_is_refused_naming_the_field() -> None:
    import types

    from kvgeom_vllm.worker import agent_settings

    class Bindings:  # a NIXL built before NIXL_THREAD_SYNC_RW
        NIXL_THREAD_SYNC_NONE, NIXL_THREAD_SYNC_STRICT = 0, 1

        @staticmethod
        def nixlAgent(name: str, config: object) -> object:  # noqa: N802 - NIXL's name
            pytest.fail("no agent is built after a refusal")

    with pytest.raises(ConfigError) as err:
        with agent_settings(None, "rw", types.SimpleNamespace(nixlBind=Bindings)):
            pass
    assert err.value.field == "kv_connector_extra_config.nixl_sync_mode"
    assert err.value.values["value"] == "rw" and err.value.values["expected"] == ["none", "strict"]


def _refused_naming_the_field(of: Any, worker_cls: type, role: str, key: str, value: object) -> None:
    """``of`` refuses ``kv_connector_extra_config[key] = value`` with a ``ConfigError`` naming the field and
    the value, and so does a worker at its start, before vLLM builds anything; unset is ``None``."""
    with pytest.raises(ConfigError) as err:
        of(vllm_config(extra={key: value}))
    assert err.value.field == f"kv_connector_extra_config.{key}"
    assert err.value.values["value"] == value
    with pytest.raises(ConfigError):
        make_worker(worker_cls, role, extra={key: value})
    assert of(vllm_config()) is None


@pytest.mark.parametrize("value", ["1000", -1, True, 1_000_001, 2.5])
def test_bad_nixl_progress_delay_is_refused_naming_the_field(value: object) -> None:
    from kvgeom_vllm.worker import KvgeomPullConnectorWorker, progress_delay_of

    _refused_naming_the_field(
        progress_delay_of, KvgeomPullConnectorWorker, "D", "nixl_progress_delay_us", value
    )
    assert progress_delay_of(vllm_config(extra={"nixl_progress_delay_us": 1000})) == 1000


@pytest.mark.parametrize("value", ["RW", "locked", 1, True, ""])
def test_bad_nixl_sync_mode_is_refused_naming_the_field(value: object) -> None:
    from kvgeom_vllm.worker import KvgeomPushConnectorWorker, sync_mode_of

    _refused_naming_the_field(sync_mode_of, KvgeomPushConnectorWorker, "P", "nixl_sync_mode", value)
    modes = [sync_mode_of(vllm_config(extra={"nixl_sync_mode": m})) for m in ("none", "rw", "strict")]
    assert modes == ["none", "rw", "strict"]


def test_every_table_row_names_a_vllm_0_33_function_and_an_adapter() -> None:
    import inspect

    from kvgeom_vllm import answers, handshake, kvgeom_mode

    for e in TABLE:
        obj = importlib.import_module(e.module)
        if e.kind == "attribute":  # computed in vLLM's constructor: the class names it there
            cls = getattr(obj, e.owner)
            init = inspect.getsource(cls.__post_init__ if hasattr(cls, "__post_init__") else cls.__init__)
            assert f"self.{e.attr} =" in init, e.qualname
        else:
            for part in e.qualname.split("."):
                obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
            assert callable(obj) or isinstance(obj, (property, staticmethod)), e.qualname
        where = [m for m in (answers, handshake, kvgeom_mode) if callable(getattr(m, e.answer, None))]
        assert where, e.answer


# -- the module-function dispatchers keep plain vLLM workers on vLLM's code ------------------------------
def test_module_functions_answer_with_kvgeom_only_inside_kvgeom_workers() -> None:
    worker = _workers()
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    topo = object.__new__(TransferTopology)
    topo.tp_rank, topo.tp_size, topo.is_mla, topo.total_num_kv_heads, topo.dcp_size = 1, 4, False, 8, 1
    before = CALLS["compute_tp_mapping"]
    plain = bw.compute_tp_mapping(topo, 2, (FullAttentionSpec,))
    assert CALLS["compute_tp_mapping"] == before  # a plain vLLM worker's call: vLLM's function
    with worker._active():
        ours = bw.compute_tp_mapping(topo, 2, (FullAttentionSpec,))
    assert CALLS["compute_tp_mapping"] == before + 1
    assert ours == plain  # D TP4 rank 1 reads P TP2 rank 0, second half of its heads
    assert ours.all_source_ranks == (0,) and ours.rank_offset_factor == 1
    names = ["model.layers.10.attn", "model.layers.2.attn", "model.embed"]
    with worker._active():
        assert sorted(names, key=bw._region_sort_key) == [
            "model.embed",
            "model.layers.2.attn",
            "model.layers.10.attn",
        ]
    assert CALLS["_region_sort_key"] >= 3


def test_kvgeom_workers_mark_the_methods_that_call_module_functions() -> None:
    before = {k: CALLS[k] for k in ("_region_sort_key", "compute_tp_mapping")}
    d = make_worker(
        _workers().KvgeomPullConnectorWorker, "D"
    )  # registration sorts its 12 layers through kvgeom
    assert CALLS["_region_sort_key"] >= before["_region_sort_key"] + 12
    p = make_worker(_workers().KvgeomPullConnectorWorker, "P")
    plain = msgspec.msgpack.decode(p.xfer_handshake_metadata.agent_metadata_bytes, type=PlainMetadata)
    d.add_remote_agent(plain, 0, 1)  # a peer without a card: vLLM's handshake code, asking kvgeom by name
    assert CALLS["compute_tp_mapping"] == before["compute_tp_mapping"] + 1


# -- registration: the card ----------------------------------------------------------------------------------
def test_registration_builds_a_card_matching_vllms_regions_and_sends_it() -> None:
    w = make_worker(_workers().KvgeomPullConnectorWorker, "D")
    card = w.kvgeom_card
    assert card is not None and w.kvgeom_card_error is None
    geom = card.geometry
    assert [r.block_len for r in geom.regions] == w.block_len_per_layer == [32 * 12 * 128 * 2] * 12
    assert geom.num_blocks == w.num_blocks == 8
    payload = w.xfer_handshake_metadata.agent_metadata_bytes
    # a plain vLLM peer decodes our metadata (the extra field is ignored) ...
    plain = msgspec.msgpack.decode(payload, type=PlainMetadata)
    assert plain.block_lens == w.block_len_per_layer and not hasattr(plain, "kvgeom_card")
    # ... and a kvgeom peer reads the card back, checked against itself
    ours = msgspec.msgpack.decode(payload, type=bw.NixlAgentMetadata)
    assert GeometryCard.from_json(ours.kvgeom_card).digest == card.digest


def _metadata(worker: object) -> object:
    return msgspec.msgpack.decode(
        worker.xfer_handshake_metadata.agent_metadata_bytes, type=bw.NixlAgentMetadata
    )


def _descs(prepared: np.ndarray) -> list[tuple[int, int]]:
    """``(addr, len)`` of every descriptor of a prepared list (N x 3 rows, or N x 5 strided rows)."""
    rows = np.asarray(prepared, dtype=np.int64)
    if rows.shape[1] == 5:
        rows = np.concatenate(
            [np.stack([r[0] + r[3] * np.arange(r[4]), np.full(r[4], r[1])], axis=1) for r in rows]
        )
    return sorted(map(tuple, rows[:, :2].tolist()))


def test_card_pairs_are_prepared_by_kvgeom_and_describe_the_bytes_vllms_code_does() -> None:
    wk = _workers()
    p = make_worker(wk.KvgeomPullConnectorWorker, "P", num_blocks=6)
    with_card = make_worker(wk.KvgeomPullConnectorWorker, "D", num_blocks=8)
    without = make_worker(wk.KvgeomPullConnectorWorker, "D", num_blocks=8)
    before = CALLS["NixlBaseConnectorWorker.add_remote_agent"]
    with_card.add_remote_agent(_metadata(p), remote_tp_rank=0, remote_tp_size=1)
    plain = msgspec.msgpack.decode(p.xfer_handshake_metadata.agent_metadata_bytes, type=PlainMetadata)
    without.add_remote_agent(plain, remote_tp_rank=0, remote_tp_size=1)  # vLLM's code on kvgeom's answers
    assert CALLS["NixlBaseConnectorWorker.add_remote_agent"] == before + 2
    pairing = with_card.kvgeom_pairings["P"]
    assert pairing.remote_tp == 1 and pairing.bsr == 1 and not getattr(without, "kvgeom_pairings", {})
    ours = with_card.nixl_wrapper.dlists[with_card.dst_xfer_side_handles["P"][0]]
    theirs = without.nixl_wrapper.dlists[without.dst_xfer_side_handles["P"][0]]
    assert _descs(ours) == _descs(theirs) and len(_descs(ours)) == 12 * 6  # every block of P's 12 layers


def test_handshake_refuses_an_incompatible_peer_before_preparing_anything() -> None:
    wk = _workers()
    p = make_worker(wk.KvgeomPullConnectorWorker, "P", block_size=96)
    d = make_worker(wk.KvgeomPullConnectorWorker, "D", block_size=64)
    prepared = len(d.nixl_wrapper.dlists)
    with pytest.raises(RuntimeError) as info:
        d.add_remote_agent(_metadata(p), remote_tp_rank=0, remote_tp_size=1)
    assert isinstance(info.value, KvgeomError) and info.value.field == "block_size"
    assert "64" in str(info.value) and "96" in str(info.value)
    assert len(d.nixl_wrapper.dlists) == prepared and "P" not in d.dst_num_blocks


def test_kvgeom_mode_refuses_a_peer_without_a_card() -> None:
    wk = _workers()
    p = make_worker(wk.KvgeomPullConnectorWorker, "P")
    d = make_worker(wk.KvgeomPullConnectorWorker, "D", extra={"compat": "kvgeom"})
    d.kvgeom_compat = "kvgeom"
    plain = msgspec.msgpack.decode(p.xfer_handshake_metadata.agent_metadata_bytes, type=PlainMetadata)
    with pytest.raises(IncompatiblePairError, match="kvgeom mode needs kvgeom_vllm on both sides"):
        d.add_remote_agent(plain, remote_tp_rank=0, remote_tp_size=1)


def test_every_answered_row_is_installed_on_the_workers() -> None:
    wk = _workers()
    for e in ANSWERED:
        if e.owner == "NixlBaseConnectorWorker" and e.attr not in ("register_kv_caches", "add_remote_agent"):
            for cls in (wk.KvgeomPullConnectorWorker, wk.KvgeomPushConnectorWorker):
                assert getattr(cls, e.attr).__kvgeom_entry__ is e


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_a_set_up_kvgeom_does_not_plan_takes_vllms_path_or_is_refused_in_kvgeom_mode(compat: str) -> None:
    # D's CPU attention backend paired with another backend needs vLLM's repacking after each receive
    wk = _workers()
    p = make_worker(wk.KvgeomPullConnectorWorker, "P")
    d = make_worker(wk.KvgeomPullConnectorWorker, "D")
    d.kvgeom_compat, d.backend_name = compat, "CPU_ATTN"
    meta = _metadata(p)
    meta.attn_backend_name = "FLASH_ATTN"
    if compat == "kvgeom":
        with pytest.raises(IncompatiblePairError, match="repacking between attention backends"):
            d.add_remote_agent(meta, remote_tp_rank=0, remote_tp_size=1)
        return
    d.add_remote_agent(meta, remote_tp_rank=0, remote_tp_size=1)
    assert "P" not in getattr(d, "kvgeom_pairings", {}) and d.enable_heterogeneous_attn_post_process
