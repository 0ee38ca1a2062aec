"""The recording NIXL double: NIXL's validations, notifications, and connector-like call sequences whose
recorded transfers the oracle checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvgeom import EngineConfig, Pairing
from kvgeom.model.layers import AttentionSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.receive import receive_step
from kvgeom.plan.request import plan_request
from kvgeom.testing import NixlFabric, Request, check_moves, engine_geometries, fake_bases
from kvgeom.testing import nixl_double as nd
from kvgeom.testing.nixl_double import (
    ExecutedTransfer,
    PreppedDList,
    RecordingAgent,
    XferDList,
    XferHandle,
    XferTelemetry,
    nixlInvalidParamError,
    nixlNotFoundError,
)

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


# The recording NIXL double pinned exactly: every accepted descriptor form, each validation (exact error
# class and the detail it names), the recorded transfers resolved into byte moves, telemetry and
# notifications. Addresses are small made-up numbers; expected values are worked out in the comments.


class FakeTensor:
    """Duck-typed tensor: ``numel`` elements of ``esize`` bytes at ``ptr`` on ``device`` (-1: CPU)."""

    def __init__(self, ptr, numel, esize=2, device=None, contiguous=None):
        self.ptr, self.n, self.e = ptr, numel, esize
        if device is not None:
            self.get_device = lambda: device
        if contiguous is not None:
            self.is_contiguous = lambda: contiguous

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.n

    def element_size(self):
        return self.e


def _arr(rows):
    return np.array(rows, dtype=np.uint64)


def _x(rows):
    return XferDList(np.array(rows, dtype=np.uint64).reshape(-1, 3), "DRAM")


# -- small pieces -----------------------------------------------------------------------------------------
def test_error_texts_and_memory_types() -> None:
    assert str(nixlNotFoundError("x y")) == "NIXL_ERR_NOT_FOUND (x y)"
    assert str(nixlInvalidParamError("z")) == "NIXL_ERR_INVALID_PARAM (z)"
    assert nd.MEM_TYPES == {
        "DRAM": "DRAM",
        "VRAM": "VRAM",
        "FILE": "FILE",
        "BLOCK": "BLOCK",
        "OBJ": "OBJ",
        "cpu": "DRAM",
        "cuda": "VRAM",
    }
    assert nd._mem("cuda") == "VRAM" and nd._mem("cpu") == "DRAM" and nd._mem("OBJ") == "OBJ"
    with pytest.raises(ValueError, match="memory type is needed") as err:
        nd._mem(None)
    assert type(err.value) is ValueError
    with pytest.raises(KeyError):
        nd._mem("dram")
    assert nd._op("READ") == "READ" and nd._op("WRITE") == "WRITE"
    for bad in ("read", "COPY", ""):
        with pytest.raises(KeyError):
            nd._op(bad)
    assert nd._as_bytes("ab") == b"ab" and nd._as_bytes(bytearray(b"c")) == b"c"
    assert type(nd._as_bytes(bytearray(b"c"))) is bytes


def test_default_values_of_the_records() -> None:
    h = XferHandle("A")
    assert (h.owner, h.released, h.op, h.remote, h.notif, h.posts) == ("A", False, "READ", "", b"", 0)
    assert h.local_descs.shape == (0, 3) and h.local_descs.dtype == np.uint64
    assert h.remote_descs.shape == (0, 3) and h.remote_descs.dtype == np.uint64
    h.release()
    assert h.released
    p = PreppedDList("A")
    assert p.agent is None and p.dlist is None and not p.released
    t = XferTelemetry(5, 2)
    assert (t.totalBytes, t.descCount, t.startTime, t.postDuration, t.xferDuration) == (5, 2, 0, 0, 0)
    assert len(XferDList(np.zeros((3, 3), np.uint64), "DRAM")) == 3
    assert len(XferDList(np.zeros((0, 3), np.uint64), "DRAM")) == 0


def test_fake_bases() -> None:
    # slot 0: from 1 << 40; each region rounded up to the 4096-byte gap, plus one gap:
    # size 1 -> (1 + 8191) // 4096 * 4096 = 8192; size 4096 -> 12287 // 4096 * 4096 = 8192
    assert fake_bases([1, 4096, 4097], 0) == [1 << 40, (1 << 40) + 8192, (1 << 40) + 16384]
    # slot 2 starts at 3 << 40; gap 16: size 16 -> (16 + 31) // 16 * 16 = 32; size 17 -> 48 // 16 * 16 = 48
    assert fake_bases([16, 17, 1], 2, gap=16) == [3 << 40, (3 << 40) + 32, (3 << 40) + 80]
    assert fake_bases([], 5) == []


def test_tensors_are_duck_typed() -> None:
    assert nd._is_tensor(FakeTensor(0, 1))
    for missing in ("data_ptr", "numel", "element_size"):
        attrs = {a: (lambda: 1) for a in ("data_ptr", "numel", "element_size") if a != missing}
        assert not nd._is_tensor(type("T", (), {k: staticmethod(v) for k, v in attrs.items()})())
    # CPU tensor: get_device() is -1 -> device 0, DRAM; 8 elements of 2 bytes
    assert nd._tensor_desc(FakeTensor(4096, 8, 2, device=-1)) == ((4096, 16, 0), "DRAM")
    assert nd._tensor_desc(FakeTensor(4096, 8, 4, device=0)) == ((4096, 32, 0), "VRAM")
    assert nd._tensor_desc(FakeTensor(64, 3, 1, device=2, contiguous=True)) == ((64, 3, 2), "VRAM")
    assert nd._tensor_desc(FakeTensor(64, 3, 1)) == ((64, 3, 0), "DRAM")  # no get_device: CPU
    with pytest.raises(ValueError, match="contiguous Tensors") as err:
        nd._tensor_desc(FakeTensor(64, 3, 1, contiguous=False))
    assert type(err.value) is ValueError


def test_descriptor_forms() -> None:
    x = XferDList(_arr([[1, 2, 0]]), "VRAM")
    assert nd._descs(x, None) is x
    one = nd._descs(FakeTensor(100, 5, 2, device=1), None)
    assert one.descs.tolist() == [[100, 10, 1]] and one.mem_type == "VRAM" and one.descs.dtype == np.uint64
    many = nd._descs([FakeTensor(100, 5, 2), FakeTensor(200, 1, 8, device=0)], "VRAM")
    assert many.descs.tolist() == [[100, 10, 0], [200, 8, 0]] and many.mem_type == "DRAM"  # the first's type
    assert nd._descs((FakeTensor(7, 1, 1),), None).descs.tolist() == [[7, 1, 0]]
    rows = nd._descs([(1, 2, 3, "meta"), (4, 5, 6, "")], "cpu")
    assert rows.descs.tolist() == [[1, 2, 3], [4, 5, 6]] and rows.mem_type == "DRAM"
    assert rows.descs.dtype == np.uint64 and rows.descs.flags.c_contiguous
    assert nd._descs(((1, 2, 3),), "DRAM").descs.tolist() == [[1, 2, 3]]
    arr = nd._descs(np.array([[9, 8, 7]], dtype=np.int32), "OBJ")
    assert arr.descs.tolist() == [[9, 8, 7]] and arr.descs.dtype == np.uint64 and arr.mem_type == "OBJ"
    empty = nd._descs(np.zeros((0, 3)), "DRAM")  # an empty float array is fine
    assert empty.descs.shape == (0, 3) and empty.descs.dtype == np.uint64
    fortran = nd._descs(np.asfortranarray(np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint64)), "DRAM")
    assert fortran.descs.flags.c_contiguous


def test_large_addresses_stay_exact() -> None:
    # 2**60 + 1 is not a float64: the descriptor must keep every bit
    big = (1 << 60) + 1
    assert nd._descs(_arr([[big, 8, 0]]), "DRAM").descs.tolist() == [[big, 8, 0]]
    assert nd._descs(_arr([[big, 8, 0, 16, 2]]), "DRAM").descs.tolist() == [[big, 8, 0], [big + 16, 8, 0]]


def test_strided_descriptors_expand() -> None:
    # (addr, len, dev, stride, count): row 0 -> 100, 110; row 1 -> 500, 507, 514
    d = nd._descs(_arr([[100, 4, 1, 10, 2], [500, 3, 0, 7, 3]]), "DRAM")
    assert d.descs.tolist() == [[100, 4, 1], [110, 4, 1], [500, 3, 0], [507, 3, 0], [514, 3, 0]]
    assert nd._descs(_arr([[100, 4, 1, 10, 1]]), "DRAM").descs.tolist() == [[100, 4, 1]]
    assert nd._descs(_arr([[100, 4, 1, 10, 0], [1, 1, 0, 1, 1]]), "DRAM").descs.tolist() == [[1, 1, 0]]


@pytest.mark.parametrize(
    "bad",
    [
        np.array([1, 2, 3]),
        np.zeros((2, 4), dtype=np.int64),
        np.zeros((1, 6), dtype=np.int64),
        np.zeros((1, 3, 1), dtype=np.int64),
        np.array([[1.0, 2.0, 3.0]]),
        np.array([[True, True, False]]),
    ],
)
def test_descriptor_shapes_and_kinds_are_checked(bad) -> None:
    with pytest.raises(ValueError, match="descriptors must be N x 3") as err:
        nd._descs(bad, "DRAM")
    assert type(err.value) is ValueError


def test_descriptor_fields_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        nd._descs(np.array([[0, -1, 0]]), "DRAM")
    assert nd._descs(np.array([[0, 0, 0]]), "DRAM").descs.tolist() == [[0, 0, 0]]
    with pytest.raises(ValueError, match="memory type is needed"):
        nd._descs(np.array([[0, 1, 0]]), None)


def test_registration_covers_its_bytes_only() -> None:
    r = nd._Registration(100, 50, 1, "VRAM")
    assert r.covers(100, 50, 1, "VRAM") and r.covers(149, 1, 1, "VRAM") and r.covers(120, 0, 1, "VRAM")
    assert not r.covers(99, 1, 1, "VRAM")
    assert not r.covers(100, 51, 1, "VRAM")
    assert not r.covers(149, 2, 1, "VRAM")
    assert not r.covers(100, 10, 0, "VRAM")
    assert not r.covers(100, 10, 1, "DRAM")


def test_check_covered_names_the_descriptor() -> None:
    regs = [nd._Registration(0, 16, 0, "DRAM"), nd._Registration(32, 16, 0, "DRAM")]
    nd._check_covered(XferDList(_arr([[0, 16, 0], [40, 8, 0]]), "DRAM"), regs, "me")
    with pytest.raises(nixlNotFoundError) as err:
        nd._check_covered(XferDList(_arr([[0, 16, 0], [8, 16, 0]]), "DRAM"), regs, "me")
    assert str(err.value) == (
        "NIXL_ERR_NOT_FOUND (descriptor 1 (0x8, 16, dev 0, DRAM) is not inside one memory region "
        "registered by me)"
    )


# -- the fabric -------------------------------------------------------------------------------------------
def _agents():
    fab = NixlFabric()
    p, d = fab.agent("P0", "P", 3), fab.agent("D0", "D", 5)
    p.register_memory(_arr([[1000, 100, 0], [2000, 100, 0]]), "DRAM")
    d.register_memory(_arr([[5000, 100, 0]]), "DRAM")
    d.add_remote_agent(p.get_agent_metadata())
    p.add_remote_agent(d.get_agent_metadata())
    return fab, p, d


def test_agents_of_a_fabric() -> None:
    fab = NixlFabric()
    assert fab.agents == {} and fab.executed == [] and fab._regions == {}
    a = fab.agent("A", "P", 2)
    assert (a.name, a.engine, a.rank, a.fabric) == ("A", "P", 2, fab) and fab.agents == {"A": a}
    b = fab.agent("B")
    assert (b.engine, b.rank) == ("", 0)
    with pytest.raises(ValueError, match="'A' already exists"):
        RecordingAgent("A", fabric=fab)
    lone = RecordingAgent("X", None, True)
    assert lone.fabric.agents == {"X": lone} and lone.fabric is not fab
    assert (lone.engine, lone.rank) == ("", 0)
    assert lone.backends == {"UCX": 0} and lone.get_plugin_list() == ["UCX"]
    assert lone.registrations == [] and lone.notifs == {}
    with pytest.raises(ValueError, match="must not be empty"):
        RecordingAgent("", fabric=fab)


def test_regions_and_locate() -> None:
    fab, p, d = _agents()
    assert fab.regions("P0") == [(1000, 100), (2000, 100)]
    assert fab.locate("P0", 1000, 100) == (0, 0)
    assert fab.locate("P0", 2099, 1) == (1, 99)
    assert fab.locate("P0", 2000, 0) == (1, 0)
    for addr, n in ((999, 1), (1050, 51), (2099, 2)):
        with pytest.raises(ValueError, match="lie in none of its regions") as err:
            fab.locate("P0", addr, n)
        assert f"[{addr:#x}, {addr + n:#x})" in str(err.value)
    fab.set_regions("P0", [(np.uint64(1000), np.int64(50)), (1050, 50)])
    assert fab.regions("P0") == [(1000, 50), (1050, 50)]
    assert all(isinstance(x, int) for r in fab.regions("P0") for x in r)
    assert fab.locate("P0", 1060, 4) == (1, 10)
    assert fab.regions("D0") == [(5000, 100)]


def test_moves_of_reads_and_writes() -> None:
    fab, p, d = _agents()
    # D reads P's 2000+8 and 1000 (8 bytes each) into its 5000+16 and 5000+40
    local = d.prep_xfer_dlist("", _arr([[5016, 8, 0], [5040, 8, 0]]), "DRAM")
    remote = d.prep_xfer_dlist("P0", _arr([[2008, 8, 0], [1000, 8, 0]]), "DRAM")
    d.transfer(d.make_prepped_xfer("READ", local, [0, 1], remote, [0, 1]))
    # P writes its 1010 (4 bytes) into D's 5096
    h = p.initialize_xfer("WRITE", _x([[1010, 4, 0]]), _x([[5096, 4, 0]]), "D0")
    p.transfer(h)
    moves = fab.moves("P", "D")
    assert moves.dtype == np.int64
    assert moves.tolist() == [
        [3, 1, 8, 5, 0, 16, 8],
        [3, 0, 0, 5, 0, 40, 8],
        [3, 0, 10, 5, 0, 96, 4],
    ]
    assert fab.moves().tolist() == moves.tolist()  # P to D by default
    assert NixlFabric().moves().shape == (0, 7)
    with pytest.raises(ValueError) as err:
        fab.moves("D", "P")
    assert str(err.value) == "READ by D0 moves bytes from P0 (engine 'P') to D0 (engine 'D')"
    with pytest.raises(ValueError):
        fab.moves("P", "P")
    with pytest.raises(ValueError):
        fab.moves("D", "D")


def test_moves_default_engines_and_a_wrong_way_write() -> None:
    fab, p, d = _agents()
    h = d.initialize_xfer("WRITE", _x([[5000, 4, 0]]), _x([[1000, 4, 0]]), "P0")
    d.transfer(h)
    with pytest.raises(ValueError, match="WRITE by D0 moves bytes from D0 .engine 'D'. to P0 .engine 'P'."):
        fab.moves()
    assert fab.moves("D", "P").tolist() == [[5, 0, 0, 3, 0, 0, 4]]


# -- memory and metadata ----------------------------------------------------------------------------------
def test_register_and_deregister() -> None:
    fab = NixlFabric()
    a = fab.agent("A")
    got = a.register_memory([(10, 5, 0, ""), (20, 5, 1, "x")], "VRAM")
    assert got.descs.tolist() == [[10, 5, 0], [20, 5, 1]] and got.mem_type == "VRAM"
    assert a.registrations == [nd._Registration(10, 5, 0, "VRAM"), nd._Registration(20, 5, 1, "VRAM")]
    a.register_memory(FakeTensor(30, 4, 1))
    assert a.registrations[-1] == nd._Registration(30, 4, 0, "DRAM")
    a.deregister_memory(XferDList(_arr([[20, 5, 1]]), "VRAM"))
    assert a.registrations == [nd._Registration(10, 5, 0, "VRAM"), nd._Registration(30, 4, 0, "DRAM")]
    with pytest.raises(ValueError):  # not registered with that memory type
        a.deregister_memory(XferDList(_arr([[10, 5, 0]]), "DRAM"))
    a.deregister_memory(got.__class__(_arr([[10, 5, 0]]), "VRAM"), backends=["UCX"])
    assert a.registrations == [nd._Registration(30, 4, 0, "DRAM")]
    with pytest.raises(ValueError, match="4-tuple list"):
        a.register_memory([(10, 5, 0)], "DRAM")
    with pytest.raises(ValueError, match="4-tuple list"):
        a.get_reg_descs([(10, 5, 0, "", 1)], "DRAM")
    assert a.get_reg_descs(_arr([[1, 2, 3]]), "DRAM").descs.tolist() == [[1, 2, 3]]
    assert a.get_xfer_descs([(1, 2, 3)], "cuda").mem_type == "VRAM"


def test_metadata_and_remote_agents() -> None:
    fab = NixlFabric()
    a, b = fab.agent("A"), fab.agent("B")
    a.register_memory(_arr([[10, 5, 0]]), "DRAM")
    md = a.get_agent_metadata()
    assert json.loads(md) == {"nixl_double_agent": "A", "registrations": [[10, 5, 0, "DRAM"]]}
    assert b.add_remote_agent(md) == b"A"
    assert b._remote == {"A": [nd._Registration(10, 5, 0, "DRAM")]}
    a.register_memory(_arr([[20, 5, 0]]), "DRAM")
    b.add_remote_agent(bytearray(a.get_agent_metadata()))  # adds only the new one
    assert b._remote["A"] == [nd._Registration(10, 5, 0, "DRAM"), nd._Registration(20, 5, 0, "DRAM")]
    assert b._registrations_of("A") is b._remote["A"] and b._registrations_of("B") is b.registrations
    b.remove_remote_agent(b"A")
    assert b._remote == {}
    b.add_remote_agent(md)
    b.remove_remote_agent("A")
    assert b._remote == {}
    b.remove_remote_agent("nobody")
    with pytest.raises(nixlNotFoundError, match="metadata for remote agent 'A' not found"):
        b._registrations_of("A")


# -- preparation and transfers ----------------------------------------------------------------------------
def test_prep_xfer_dlist_sides() -> None:
    fab, p, d = _agents()
    for name in ("", "NIXL_INIT_AGENT"):
        h = d.prep_xfer_dlist(name, _arr([[5000, 100, 0]]), "DRAM")
        assert (h.owner, h.agent) == ("D0", None) and h.dlist.descs.tolist() == [[5000, 100, 0]]
    r = d.prep_xfer_dlist("P0", [(2000, 100, 0)], "DRAM")
    assert (r.owner, r.agent, r.dlist.mem_type) == ("D0", "P0", "DRAM")
    with pytest.raises(nixlNotFoundError, match="registered by D0"):
        d.prep_xfer_dlist("", _arr([[1000, 4, 0]]), "DRAM")  # P's memory is not D's
    with pytest.raises(nixlNotFoundError, match="registered by P0"):
        d.prep_xfer_dlist("P0", _arr([[5000, 4, 0]]), "DRAM")
    with pytest.raises(ValueError, match="Please specify a mem type for strided"):
        d.prep_xfer_dlist("", _arr([[5000, 4, 0, 8, 2]]))
    s = d.prep_xfer_dlist("", _arr([[5000, 4, 0, 8, 2]]), "DRAM")
    assert s.dlist.descs.tolist() == [[5000, 4, 0], [5008, 4, 0]]
    with pytest.raises(ValueError, match="memory type is needed"):  # not strided, still needs one
        d.prep_xfer_dlist("", _arr([[5000, 4, 0]]))
    t = d.prep_xfer_dlist("", [FakeTensor(5000, 2, 2)])  # a tensor names its own memory type
    assert t.dlist.descs.tolist() == [[5000, 4, 0]]


def _prepped(d):
    local = d.prep_xfer_dlist("", _arr([[5000, 8, 0], [5008, 8, 0], [5016, 4, 0]]), "DRAM")
    remote = d.prep_xfer_dlist("P0", _arr([[1000, 8, 0], [2000, 8, 0]]), "DRAM")
    return local, remote


def test_make_prepped_xfer_pairs_by_index() -> None:
    fab, p, d = _agents()
    local, remote = _prepped(d)
    h = d.make_prepped_xfer("WRITE", local, np.array([[1], [0]]), remote, (0, 1), "note")
    assert (h.owner, h.op, h.remote, h.notif, h.posts) == ("D0", "WRITE", "P0", b"note", 0)
    assert h.local_descs.tolist() == [[5008, 8, 0], [5000, 8, 0]]
    assert h.remote_descs.tolist() == [[1000, 8, 0], [2000, 8, 0]]
    assert d.check_xfer_state(h) == "ERR"
    h3 = d.make_prepped_xfer(
        "READ", local, (0, 1), remote, np.array([[1], [0]])
    )  # any index shape: flattened
    assert h3.remote_descs.tolist() == [[2000, 8, 0], [1000, 8, 0]] and h3.local_descs.shape == (2, 3)
    h2 = d.make_prepped_xfer("READ", local, [1], remote, [1])
    assert h2.notif == b"" and h2.op == "READ"
    local.dlist.descs[1, 0] = 1  # the handle holds copies
    assert h.local_descs[0, 0] == 5008


def test_make_prepped_xfer_validations() -> None:
    fab, p, d = _agents()
    local, remote = _prepped(d)
    cases = [
        ([3], [0], "local index out of range at index 0 with value 3"),
        ([0, 1], [0, 2], "remote index out of range at index 1 with value 2"),
        ([0, -2], [0, 1], "local index out of range at index 1 with value -2"),
        ([0], [-1], "remote index out of range at index 0 with value -1"),
        ([0, 1], [0], r"different number of indices for local \(2\), remote \(1\)"),
        ([], [], r"different number of indices for local \(0\), remote \(0\)"),
        ([2], [0], "length mismatch at index 0: local 4, remote 8"),
        ([0, 2], [0, 1], "length mismatch at index 1: local 4, remote 8"),
        (np.array([0.0]), [0], "local indices must be integers"),
        ([0], np.array([1.0]), "remote indices must be integers"),
    ]
    for li, ri, what in cases:
        with pytest.raises(nixlInvalidParamError, match=what):
            d.make_prepped_xfer("READ", local, li, remote, ri)
    with pytest.raises(nixlInvalidParamError, match="local side must be prepared"):
        d.make_prepped_xfer("READ", local, [0], local, [0])
    with pytest.raises(nixlInvalidParamError, match="local side must be prepared"):
        d.make_prepped_xfer("READ", remote, [0], remote, [0])
    with pytest.raises(KeyError):
        d.make_prepped_xfer("read", local, [0], remote, [0])
    theirs = p.prep_xfer_dlist("", _arr([[1000, 8, 0]]), "DRAM")
    with pytest.raises(nixlInvalidParamError, match="local dlist handle belongs to agent 'P0'"):
        d.make_prepped_xfer("READ", theirs, [0], remote, [0])
    mine = p.prep_xfer_dlist("D0", _arr([[5000, 8, 0]]), "DRAM")
    with pytest.raises(nixlInvalidParamError, match="remote dlist handle belongs to agent 'P0'"):
        d.make_prepped_xfer("READ", local, [0], mine, [0])
    d.release_dlist_handle(local)
    assert local.released
    with pytest.raises(nixlInvalidParamError, match="local dlist handle was released"):
        d.make_prepped_xfer("READ", local, [0], remote, [0])


def test_make_prepped_xfer_at_the_last_index() -> None:
    fab, p, d = _agents()
    local, remote = _prepped(d)
    h = d.make_prepped_xfer("READ", local, np.array([1], dtype=np.uint8), remote, np.array([1], np.int8))
    assert h.local_descs.tolist() == [[5008, 8, 0]] and h.remote_descs.tolist() == [[2000, 8, 0]]


def test_initialize_xfer() -> None:
    fab, p, d = _agents()
    h = d.initialize_xfer("READ", _x([(5000, 8, 0)]), _x([(2000, 8, 0)]), "P0", "n")
    assert (h.op, h.remote, h.notif, h.owner) == ("READ", "P0", b"n", "D0")
    assert h.local_descs.tolist() == [[5000, 8, 0]] and h.remote_descs.tolist() == [[2000, 8, 0]]
    assert h.local_descs.dtype == np.uint64
    with pytest.raises(
        nixlInvalidParamError, match=r"different number of descriptors for local \(1\), remote \(2\)"
    ):
        d.initialize_xfer("READ", _x([(5000, 8, 0)]), _x([(2000, 8, 0), (1000, 8, 0)]), "P0")
    with pytest.raises(nixlInvalidParamError, match=r"local \(0\), remote \(0\)"):
        d.initialize_xfer("READ", _x([]), _x([]), "P0")
    with pytest.raises(nixlInvalidParamError, match="length mismatch at index 0: local 8, remote 4"):
        d.initialize_xfer("READ", _x([(5000, 8, 0)]), _x([(2000, 4, 0)]), "P0")
    with pytest.raises(nixlNotFoundError, match="registered by D0"):
        d.initialize_xfer("READ", _x([(1000, 8, 0)]), _x([(2000, 8, 0)]), "P0")
    with pytest.raises(nixlNotFoundError, match="registered by P0"):
        d.initialize_xfer("READ", _x([(5000, 8, 0)]), _x([(5000, 8, 0)]), "P0")
    with pytest.raises(nixlNotFoundError, match="remote agent 'Q'"):
        d.initialize_xfer("READ", _x([(5000, 8, 0)]), _x([(2000, 8, 0)]), "Q")
    with pytest.raises(KeyError):
        d.initialize_xfer("MOVE", _x([(5000, 8, 0)]), _x([(2000, 8, 0)]), "P0")
    cuda = d.initialize_xfer("READ", [FakeTensor(5000, 4, 2)], [FakeTensor(2000, 4, 2)], "P0")
    assert cuda.local_descs.tolist() == [[5000, 8, 0]]


def test_transfer_records_and_notifies() -> None:
    fab, p, d = _agents()
    h = d.initialize_xfer("READ", _x([(5000, 8, 0)]), _x([(2000, 8, 0)]), "P0", b"first")
    assert d.transfer(h) == "DONE"
    assert h.posts == 1 and d.check_xfer_state(h) == "DONE"
    assert d.transfer(h, "second") == "DONE" and h.posts == 2
    assert len(fab.executed) == 2
    x = fab.executed[0]
    assert isinstance(x, ExecutedTransfer)
    assert (x.op, x.initiator, x.remote, x.notif) == ("READ", "D0", "P0", b"first")
    assert x.local_descs.tolist() == [[5000, 8, 0]] and x.remote_descs.tolist() == [[2000, 8, 0]]
    assert fab.executed[1].notif == b"second"
    assert p.get_new_notifs() == {"D0": [b"first", b"second"]}
    silent = d.initialize_xfer("READ", _x([(5000, 8, 0)]), _x([(2000, 8, 0)]), "P0")
    d.transfer(silent)
    assert p.get_new_notifs() == {} and fab.executed[2].notif == b""
    d.release_xfer_handle(silent)
    assert silent.released
    with pytest.raises(nixlInvalidParamError, match="transfer handle was released"):
        d.transfer(silent)
    with pytest.raises(nixlInvalidParamError, match="transfer handle was released"):
        d.check_xfer_state(silent)
    with pytest.raises(nixlInvalidParamError, match="transfer handle belongs to agent 'D0'"):
        p.transfer(h)
    with pytest.raises(nixlInvalidParamError, match="belongs to agent 'D0'"):
        p.check_xfer_state(h)
    assert len(fab.executed) == 3


def test_telemetry_merges_pairs_contiguous_on_both_sides() -> None:
    fab, p, d = _agents()
    # pairs (local, remote): (5000, 1000) (5008, 1008): both contiguous -> merged;
    # (5016, 1020): remote not contiguous (1016 != 1020); (5030, 1028): local not (5024 != 5030)
    h = XferHandle(
        "D0",
        local_descs=_arr([[5000, 8, 0], [5008, 8, 0], [5016, 8, 0], [5030, 8, 0]]),
        remote_descs=_arr([[1000, 8, 0], [1008, 8, 0], [1020, 8, 0], [1028, 8, 0]]),
    )
    t = d.get_xfer_telemetry(h)
    assert (t.totalBytes, t.descCount) == (32, 3)
    assert d.get_xfer_telemetry(XferHandle("D0")) == XferTelemetry(0, 0)
    one = XferHandle("D0", local_descs=_arr([[5000, 5, 0]]), remote_descs=_arr([[1000, 5, 0]]))
    assert d.get_xfer_telemetry(one) == XferTelemetry(5, 1)
    # 3 contiguous on both sides, lengths 2, 3, 4: one descriptor of 9 bytes
    three = XferHandle(
        "D0",
        local_descs=_arr([[10, 2, 0], [12, 3, 0], [15, 4, 0]]),
        remote_descs=_arr([[50, 2, 0], [52, 3, 0], [55, 4, 0]]),
    )
    assert d.get_xfer_telemetry(three) == XferTelemetry(9, 1)
    # descending addresses do not merge (the next must start where the previous ends)
    down = XferHandle(
        "D0", local_descs=_arr([[8, 8, 0], [0, 8, 0]]), remote_descs=_arr([[8, 8, 0], [0, 8, 0]])
    )
    assert d.get_xfer_telemetry(down) == XferTelemetry(16, 2)


def test_notifications() -> None:
    fab, p, d = _agents()
    p.send_notif("D0", "hello")
    p.send_notif("D0", b"req-2:done", backend="UCX")
    assert d.update_notifs() == {"P0": [b"hello", b"req-2:done"]}
    assert d.update_notifs() == {"P0": [b"hello", b"req-2:done"]}  # kept until consumed
    p.send_notif("D0", "x")
    assert d.update_notifs() == {"P0": [b"hello", b"req-2:done", b"x"]}
    assert not d.check_remote_xfer_done("P0", b"done")  # not a prefix
    assert d.check_remote_xfer_done("P0", b"done", tag_is_prefix=False)
    assert d.notifs == {"P0": [b"hello", b"x"]}
    assert d.check_remote_xfer_done("P0", b"hel")
    assert d.notifs == {"P0": [b"x"]}
    assert not d.check_remote_xfer_done("Q", b"")
    assert not d.check_remote_xfer_done("P0", b"hel", tag_is_prefix=False)
    assert d.check_remote_xfer_done("P0", b"x", tag_is_prefix=False) and d.notifs == {"P0": []}
    q = fab.agent("Q", "D")
    with pytest.raises(nixlNotFoundError, match="metadata for remote agent 'Q'"):
        p.send_notif("Q", "x")
    q.add_remote_agent(p.get_agent_metadata())
    q.send_notif("P0", "from q")
    assert p.get_new_notifs() == {"Q": [b"from q"]} and p.get_new_notifs() == {}
    with pytest.raises(nixlNotFoundError, match="agent 'nobody' is not in this fabric"):
        p._deliver("nobody", b"x")


def test_check_remote_done_removes_one_matching_message() -> None:
    fab, p, d = _agents()
    p.send_notif("D0", "a:1")
    p.send_notif("D0", "a:1")
    assert d.check_remote_xfer_done("P0", b"a:")
    assert d.notifs == {"P0": [b"a:1"]}


def test_telemetry_is_exact_for_large_addresses() -> None:
    # 2**60 + 8 and 2**60 + 9 differ (as float64 they would not): the second pair is not contiguous
    fab, p, d = _agents()
    big = 1 << 60
    h = XferHandle(
        "D0",
        local_descs=_arr([[big, 8, 0], [big + 9, 8, 0]]),
        remote_descs=_arr([[big, 8, 0], [big + 8, 8, 0]]),
    )
    assert d.get_xfer_telemetry(h) == XferTelemetry(16, 2)
    h = XferHandle(
        "D0",
        local_descs=_arr([[big, 8, 0], [big + 8, 8, 0]]),
        remote_descs=_arr([[big, 8, 0], [big + 9, 8, 0]]),
    )
    assert d.get_xfer_telemetry(h) == XferTelemetry(16, 2)


def test_recording_agents_default_to_no_engine_label() -> None:
    from kvgeom.testing import NixlFabric

    agent = NixlFabric().agent("a")
    assert agent.engine == "" and agent.rank == 0
