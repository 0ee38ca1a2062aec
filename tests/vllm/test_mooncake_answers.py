"""kvgeom's Mooncake connector for vLLM (``kvgeom_vllm.mooncake``) against vLLM 0.33.0's own Mooncake code.

The sender plan and the region-length check are compared with vLLM's functions on every consistent pair
of TP sizes up to 8 and head counts 1 to 8 (both replication flags, heads passed or not); the module
functions reach kvgeom only inside a kvgeom worker's methods; the connector is chosen by vLLM's factory
from configuration; what it refuses it refuses with typed errors (the start-up checks, a recurrent-state
pair across TP sizes, a vLLM other than 0.33.0). vLLM's own Mooncake tests run through the connector in
``make test-vllm`` (tests/vllm/run.sh).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from kvgeom_vllm.mooncake import answers, connector
from kvgeom_vllm.mooncake.table import CALLS, REFUSED
from kvgeom_vllm.version import VllmVersionError

from kvgeom.errors import ConfigError, GroupMismatchError, SpecError, UnsupportedError
from kvgeom.pair.tp import handshake_targets

MC = connector._mc
VLLM_PLAN = connector.DISPATCHERS["_compute_sender_transfer_plan"].__wrapped__  # type: ignore[attr-defined]
VLLM_VALIDATE = connector.DISPATCHERS["_validate_asymmetric_region_lengths"].__wrapped__  # type: ignore[attr-defined]
VLLM_REGION_IDS = connector.DISPATCHERS["_block_ids_for_region"].__wrapped__  # type: ignore[attr-defined]
SIZES = (1, 2, 4, 8)
HEAD_BYTES = 256


def _pairs():
    """(P TP, D TP, heads) with whole heads per rank or whole ranks per head on both sides."""
    for ptp, dtp, heads in itertools.product(SIZES, SIZES, (1, 2, 4, 8)):
        if all(heads % t == 0 or t % heads == 0 for t in (ptp, dtp)):
            yield ptp, dtp, heads


def _page(heads: int, tp: int) -> int:
    return max(1, heads // tp) * HEAD_BYTES


@pytest.mark.parametrize(("ptp", "dtp", "heads"), list(_pairs()))
def test_the_sender_plan_equals_vllms_for_every_paired_rank(ptp: int, dtp: int, heads: int) -> None:
    checked = 0
    for d in range(dtp):
        for p in handshake_targets(d, dtp, ptp):  # the P ranks D rank d asks
            # heads passed (GQA, either side may replicate); not passed: one replicated latent (MLA), or
            # rank slices (a hybrid's pages, max(P TP, D TP) slices)
            units = max(ptp, dtp)
            for total, replicated, pages in (
                (heads, ptp > heads, (_page(heads, ptp), _page(heads, dtp))),
                (None, True, (HEAD_BYTES, HEAD_BYTES)),
                (None, False, (_page(units, ptp), _page(units, dtp))),
            ):
                args = (p, ptp, d, dtp, *pages, replicated, total)
                assert answers.compute_sender_transfer_plan(*args) == VLLM_PLAN(*args), args
                checked += 1
    assert checked == 3 * sum(len(handshake_targets(d, dtp, ptp)) for d in range(dtp))


@pytest.mark.parametrize(("ptp", "dtp", "heads"), list(_pairs()))
def test_the_region_length_check_agrees_with_vllms(ptp: int, dtp: int, heads: int) -> None:
    region = MC.TransferRegion
    units = max(ptp, dtp)
    for total, replicated, count in ((heads, ptp > heads, heads), (None, False, units)):
        for extra in (0, HEAD_BYTES):  # the consistent lengths, then a consumer page one head too long
            local = [region("layer", 0, 0, _page(count, ptp), _page(count, ptp))]
            remote = [region("layer", 0, 0, _page(count, dtp) + extra, _page(count, dtp) + extra)]
            args = (local, remote, ptp, dtp, replicated, total)
            ours, theirs = answers.validate_asymmetric_region_lengths(*args), VLLM_VALIDATE(*args)
            assert (ours is None) == (theirs is None), args
            assert (ours is None) == (extra == 0), args


def test_a_count_mismatch_is_named_like_vllms() -> None:
    r = MC.TransferRegion("layer", 0, 0, 64, 64)
    ours = answers.validate_asymmetric_region_lengths([r], [r, r], 1, 1, False)
    assert ours is not None and "region counts" in ours


def test_a_shared_region_takes_exactly_its_groups_ids() -> None:
    ids = [[1, 2], [3], [4, 5]]
    for group, shared in ((0, ()), (2, ()), (-1, (0, 2)), (-1, (1,))):
        assert answers.block_ids_for_region(ids, group, shared) == VLLM_REGION_IDS(ids, group, shared)
    with pytest.raises(GroupMismatchError) as err:
        answers.block_ids_for_region(ids, -1, ())
    assert err.value.field == "shared_group_ids"
    with pytest.raises(GroupMismatchError) as err:
        answers.block_ids_for_region(ids, -1, (0, 3))
    assert (err.value.field, err.value.values["value"]) == ("shared_group_ids", 3)


def test_the_module_functions_reach_kvgeom_only_inside_a_kvgeom_worker() -> None:
    from kvgeom_vllm import worker

    name = "_get_tp_ratio"
    before = CALLS[name]
    assert MC._get_tp_ratio(4, 2) == 2  # a plain caller: vLLM's function
    assert CALLS[name] == before
    token = worker._ACTIVE.set(True)
    try:
        assert MC._get_tp_ratio(2, 4) == -2
    finally:
        worker._ACTIVE.reset(token)
    assert CALLS[name] == before + 1


def _kv_transfer_config(**extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KvgeomMooncakeConnector",
        kv_connector_module_path="kvgeom_vllm.mooncake",
        kv_role="kv_producer",
        **extra,
    )


def test_vllms_factory_selects_the_connector_from_the_configuration() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory.get_connector_class(_kv_transfer_config())
    assert cls is connector.KvgeomMooncakeConnector
    assert issubclass(cls, MC.MooncakeConnector)


def _startup_config(dcp: int = 1, pcp: int = 1):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp)
    )


def test_start_up_refuses_context_parallelism_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MC, "TransferEngine", object)  # an engine that loads (this venv has none)
    groups = SimpleNamespace(transfer_groups=[SimpleNamespace(host_resident=False)])
    connector.check_startup(_startup_config(), groups)  # the plain case starts
    for kwargs, field in (
        ({"dcp": 2}, "decode_context_parallel_size"),
        ({"pcp": 2}, "prefill_context_parallel_size"),
    ):
        with pytest.raises(ConfigError) as err:
            connector.check_startup(_startup_config(**kwargs), groups)
        assert (err.value.field, err.value.values) == (field, {"value": 2, "expected": 1})
        assert isinstance(err.value, RuntimeError)  # what vLLM's start-up path raises


def test_start_up_refuses_host_resident_groups_and_a_missing_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MC, "TransferEngine", object)
    hosted = SimpleNamespace(
        transfer_groups=[SimpleNamespace(host_resident=False), SimpleNamespace(host_resident=True)]
    )
    with pytest.raises(SpecError) as err:
        connector.check_startup(_startup_config(), hosted)
    assert (err.value.field, err.value.values["value"]) == ("kv_cache_groups", [1])
    monkeypatch.setattr(MC, "TransferEngine", None)
    with pytest.raises(ConfigError) as err:
        connector.check_startup(_startup_config(), SimpleNamespace(transfer_groups=[]))
    assert err.value.field == "mooncake"


def _worker(tp: int, mamba: bool) -> SimpleNamespace:
    return SimpleNamespace(tp_size=tp, kv_cache_config=SimpleNamespace(has_mamba_layers=mamba))


def test_a_recurrent_state_pair_across_tp_sizes_is_refused_with_both_sizes() -> None:
    with pytest.raises(UnsupportedError) as err:
        answers.refuse_state_across_tp(_worker(2, True), 1)
    assert (err.value.field, err.value.values) == ("remote_tp_size", {"local": 2, "remote": 1})
    assert answers.refuse_state_across_tp(_worker(2, True), 2) is None
    assert answers.refuse_state_across_tp(_worker(2, False), 1) is None


def test_the_worker_answers_a_refused_pair_as_vllm_refuses_one() -> None:
    name = "MooncakeConnectorWorker._prepare_transfer_regions"
    before = REFUSED[name]
    got = connector.KvgeomMooncakeConnectorWorker._prepare_transfer_regions(
        _worker(1, True),  # type: ignore[arg-type]
        SimpleNamespace(remote_tp_size=2),
    )
    local, remote, err = got
    assert (local, remote) == ([], [])
    assert err is not None and err.startswith("kvgeom:")
    assert REFUSED[name] == before + 1


def test_another_vllm_version_is_refused() -> None:
    with pytest.raises(VllmVersionError) as err:
        connector.check_mooncake_vllm_version("0.32.0")
    assert (err.value.field, err.value.values["value"]) == ("vllm", "0.32.0")
