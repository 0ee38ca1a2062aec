"""The recording NIXL double: NIXL's validations, notifications, and connector-like call sequences whose
recorded transfers the oracle checks."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom.layout.engine import EngineConfig
from kvgeom.model.layers import AttentionSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.receive import receive_step
from kvgeom.plan.request import plan_request
from kvgeom.testing import NixlFabric, Request, check_moves, engine_geometries, fake_bases
from kvgeom.testing.nixl_double import RecordingAgent, nixlInvalidParamError, nixlNotFoundError

MB = 1 << 20


def _pair() -> tuple[RecordingAgent, RecordingAgent]:
    fabric = NixlFabric()
    p, d = fabric.agent("P0", "P", 0), fabric.agent("D0", "D", 0)
    p.register_memory(np.array([[0x10000, MB, 0]], dtype=np.uint64), "DRAM")
    d.register_memory([(0x90000, MB, 0, "")], "DRAM")
    d.add_remote_agent(p.get_agent_metadata())
    return p, d


def test_descriptors_outside_registered_memory_are_not_found() -> None:
    p, d = _pair()
    with pytest.raises(nixlNotFoundError, match="NIXL_ERR_NOT_FOUND"):
        d.prep_xfer_dlist("", np.array([[0x90000 + MB - 8, 16, 0]], dtype=np.uint64), "DRAM")  # tail outside
    with pytest.raises(nixlNotFoundError):
        d.prep_xfer_dlist("P0", np.array([[0x10000, 16, 1]], dtype=np.uint64), "DRAM")  # wrong device
    with pytest.raises(nixlNotFoundError):
        d.prep_xfer_dlist("P0", np.array([[0x10000, 16, 0]], dtype=np.uint64), "VRAM")  # wrong memory type
    with pytest.raises(nixlNotFoundError, match="metadata for remote agent"):
        d.prep_xfer_dlist("Q9", np.array([[0x10000, 16, 0]], dtype=np.uint64), "DRAM")
    with pytest.raises(nixlNotFoundError):  # P never loaded D's metadata
        p.prep_xfer_dlist("D0", np.array([[0x90000, 16, 0]], dtype=np.uint64), "DRAM")
    with pytest.raises(KeyError):
        d.prep_xfer_dlist("", np.array([[0x90000, 16, 0]], dtype=np.uint64), "HBM")


def test_bad_indices_and_unequal_lengths_are_invalid_params() -> None:
    _, d = _pair()
    local = d.prep_xfer_dlist("", np.array([[0x90000, 16, 0], [0x90010, 32, 0]], dtype=np.uint64), "DRAM")
    remote = d.prep_xfer_dlist("P0", np.array([[0x10000, 16, 0], [0x10010, 16, 0]], dtype=np.uint64), "DRAM")
    for li, ri, what in (
        ([2], [0], "out of range"),
        ([-1], [0], "out of range"),
        ([0, 1], [0], "different number"),
        ([], [], "different number"),
        ([1], [1], "length mismatch"),
    ):
        with pytest.raises(nixlInvalidParamError, match=what):
            d.make_prepped_xfer("READ", local, li, remote, ri)
    with pytest.raises(nixlInvalidParamError, match="local side"):
        d.make_prepped_xfer("READ", remote, [0], local, [0])
    with pytest.raises(KeyError):
        d.make_prepped_xfer("COPY", local, [0], remote, [0])
    d.release_dlist_handle(remote)
    with pytest.raises(nixlInvalidParamError, match="released"):
        d.make_prepped_xfer("READ", local, [0], remote, [0])


def test_transfers_record_moves_and_deliver_notifications() -> None:
    p, d = _pair()
    local = d.prep_xfer_dlist("", np.array([[0x90000, 16, 0], [0x90010, 16, 0]], dtype=np.uint64), "DRAM")
    remote = d.prep_xfer_dlist("P0", np.array([[0x10000, 16, 0], [0x10040, 16, 0]], dtype=np.uint64), "DRAM")
    h = d.make_prepped_xfer("READ", local, np.array([1, 0], dtype=np.int32), remote, [0, 1], b"req-1:1")
    assert d.transfer(h) == "DONE" and d.check_xfer_state(h) == "DONE"
    assert p.get_new_notifs() == {"D0": [b"req-1:1"]} and p.get_new_notifs() == {}
    assert d.get_xfer_telemetry(h).descCount == 2 and d.get_xfer_telemetry(h).totalBytes == 32
    moves = d.fabric.moves("P", "D")
    assert moves.tolist() == [[0, 0, 0, 0, 0, 16, 16], [0, 0, 0x40, 0, 0, 0, 16]]
    d.add_remote_agent(p.get_agent_metadata())  # reloading adds nothing new
    p.add_remote_agent(d.get_agent_metadata())
    p.send_notif("D0", "bye")
    assert d.check_remote_xfer_done("P0", b"by") and not d.check_remote_xfer_done("P0", b"by")
    d.release_xfer_handle(h)
    with pytest.raises(nixlInvalidParamError):
        d.transfer(h)


def test_strided_descriptors_expand_like_nixl() -> None:
    _, d = _pair()
    strided = d.prep_xfer_dlist("", np.array([[0x90000, 8, 0, 32, 3]], dtype=np.uint64), "DRAM")
    assert strided.dlist.descs.tolist() == [[0x90000, 8, 0], [0x90020, 8, 0], [0x90040, 8, 0]]
    with pytest.raises(ValueError, match="mem type"):
        d.prep_xfer_dlist("", np.array([[0x90000, 8, 0, 32, 3]], dtype=np.uint64))


def test_initialize_xfer_write_and_merge_count() -> None:
    p, d = _pair()
    p.add_remote_agent(d.get_agent_metadata())
    local = p.get_xfer_descs(np.array([[0x10000, 64, 0], [0x10040, 64, 0]], dtype=np.uint64), "DRAM")
    remote = p.get_xfer_descs([(0x90100, 64, 0), (0x90140, 64, 0)], "DRAM")
    h = p.initialize_xfer("WRITE", local, remote, "D0", "done")
    assert p.get_xfer_telemetry(h).descCount == 1  # contiguous on both sides: merged
    p.transfer(h)
    assert d.get_new_notifs() == {"P0": [b"done"]}
    assert p.fabric.moves("P", "D").tolist() == [[0, 0, 0, 0, 0, 0x100, 64], [0, 0, 0x40, 0, 0, 0x140, 64]]
    with pytest.raises(ValueError, match="moves bytes from"):
        p.fabric.moves("D", "P")
    bad = p.get_xfer_descs(np.array([[0x90000 + MB, 8, 0]], dtype=np.uint64), "DRAM")
    with pytest.raises(nixlNotFoundError):
        p.initialize_xfer(
            "WRITE", p.get_xfer_descs(np.array([[0x10000, 8, 0]], dtype=np.uint64), "DRAM"), bad, "D0"
        )


def test_named_regions_split_one_registration() -> None:
    p, d = _pair()
    d.fabric.set_regions("P0", [(0x10000, MB // 2), (0x10000 + MB // 2, MB // 2)])
    assert d.fabric.locate("P0", 0x10000 + MB // 2 + 8, 8) == (1, 8)
    with pytest.raises(ValueError, match="none of its regions"):
        d.fabric.locate("P0", 0x10000 + MB // 2 - 4, 8)


# -- connector-like sequences, checked by the oracle -------------------------------------------------
GQA = ModelSpec.from_layers("gqa", [AttentionSpec(4, 8, "bfloat16")] * 2)


def _register(
    fabric: NixlFabric, side: str, geoms, slot0: int
) -> dict[int, tuple[RecordingAgent, list[int]]]:
    out = {}
    for g in geoms:
        agent = fabric.agent(f"{side}{g.tp_rank}", side, g.tp_rank)
        bases = fake_bases([r.nbytes for r in g.regions], slot0 + g.tp_rank)
        agent.register_memory(
            np.array([[b, r.nbytes, 0] for b, r in zip(bases, g.regions)], dtype=np.uint64), "DRAM"
        )
        out[g.tp_rank] = (agent, bases)
    return out


def _connector_pull(
    p_engine: EngineConfig, d_engine: EngineConfig, request: Request, wrong_split: bool = False
):
    fabric = NixlFabric()
    p_geoms, d_geoms = engine_geometries(GQA, p_engine), engine_geometries(GQA, d_engine)
    p_side, d_side = _register(fabric, "P", p_geoms, 0), _register(fabric, "D", d_geoms, 16)
    zero = {}
    for d in d_geoms:
        agent, bases = d_side[d.tp_rank]
        for p_agent, _ in p_side.values():
            agent.add_remote_agent(p_agent.get_agent_metadata())
        pairing = Pairing.create(d, p_geoms, "pull")
        plan = plan_request(pairing, request.d_ids, request.p_ids, num_tokens=request.num_tokens)
        for t in plan.transfers:
            key = (t.local_table[0], 0) if wrong_split and t.local_table[1] >= 0 else t.local_table
            local = agent.prep_xfer_dlist("", pairing.local_table(key).bind(bases), "DRAM")
            remote = agent.prep_xfer_dlist(
                f"P{t.remote_rank}",
                pairing.remote_table(t.remote_rank).bind(p_side[t.remote_rank][1]),
                "DRAM",
            )
            agent.transfer(agent.make_prepped_xfer("READ", local, t.local_ids, remote, t.remote_ids, t.notif))
        zero[d.tp_rank] = plan.zero
    notified = {name: a.get_new_notifs() for name, (a, _) in ((f"P{r}", v) for r, v in p_side.items())}
    return check_moves(GQA, p_engine, d_engine, request, fabric.moves("P", "D"), zero=zero), notified


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (4, 1), (2, 2)])
def test_connector_pull_through_the_double_passes_the_oracle(p_tp: int, d_tp: int) -> None:
    p = EngineConfig(tp_size=p_tp, block_size=8, num_blocks=6)
    d = EngineConfig(tp_size=d_tp, block_size=8, num_blocks=6)
    request = Request(13, [[4, 1]], [[2, 5]])
    report, notified = _connector_pull(p, d, request)
    assert report.ok, report
    assert report.descriptors == 2 * 2 * max(d_tp, p_tp)  # layers * blocks * (D ranks or P sources)
    assert all(msgs for msgs in notified.values())  # every P rank was read and notified


def test_connector_using_the_wrong_split_table_is_caught() -> None:
    p, d = (
        EngineConfig(tp_size=2, block_size=8, num_blocks=6),
        EngineConfig(tp_size=1, block_size=8, num_blocks=6),
    )
    request = Request(13, [[4, 1]], [[2, 5]])
    report, _ = _connector_pull(p, d, request, wrong_split=True)
    assert {"I2", "I5"} <= report.invariants  # P rank 1's heads land on rank 0's slot; rank 1's slot: poison
    assert "I3" in report.invariants


def test_connector_push_with_receive_step_through_the_double() -> None:
    p_engine = EngineConfig(tp_size=2, block_size=8, num_blocks=6)
    d_engine = EngineConfig(tp_size=1, block_size=16, num_blocks=6, kernel_block_size=8)
    request = Request(13, [[4, 1]], [[2]])
    fabric = NixlFabric()
    p_geoms, d_geoms = engine_geometries(GQA, p_engine), engine_geometries(GQA, d_engine)
    p_side, d_side = _register(fabric, "P", p_geoms, 0), _register(fabric, "D", d_geoms, 16)
    for p in p_geoms:
        agent, bases = p_side[p.tp_rank]
        pairing = Pairing.create(p, d_geoms, "push")
        plan = plan_request(pairing, request.p_ids, request.d_ids, num_tokens=request.num_tokens)
        for t in plan.transfers:
            d_agent, d_bases = d_side[t.remote_rank]
            agent.add_remote_agent(d_agent.get_agent_metadata())
            local = agent.get_xfer_descs(pairing.local_table(t.local_table).bind(bases)[t.local_ids], "DRAM")
            remote = agent.get_xfer_descs(
                pairing.remote_table(t.remote_rank).bind(d_bases)[t.remote_ids], "DRAM"
            )
            agent.transfer(agent.initialize_xfer("WRITE", local, remote, f"D{t.remote_rank}", t.notif))
    zero, regroup = {}, {}
    for d in d_geoms:
        regroup[d.tp_rank], zero[d.tp_rank] = receive_step(
            d, p_geoms[0], request.d_ids, request.p_ids, request.num_tokens
        )
    report = check_moves(GQA, p_engine, d_engine, request, fabric.moves("P", "D"), zero=zero, regroup=regroup)
    assert report.ok, report
    assert report.descriptors == 2 * 2 * 2  # P ranks * layers * kernel blocks


def test_agent_names_are_unique_per_fabric() -> None:
    fabric = NixlFabric()
    fabric.agent("A")
    with pytest.raises(ValueError, match="already exists"):
        fabric.agent("A")
    with pytest.raises(ValueError, match="empty"):
        RecordingAgent("")
