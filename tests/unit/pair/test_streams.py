"""Pipeline stages and packed rows, planned as transfer streams (kvgeom.pair.streams), in both modes."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom import (
    AttentionSpec,
    EngineConfig,
    IncompatiblePairError,
    KvgeomError,
    MLASpec,
    ModelSpec,
    Pairing,
    UnsupportedError,
    plan_request,
    rank_geometry,
)
from kvgeom.layout.view import SHARED_GROUP, EngineView, pseudo, unpseudo
from kvgeom.model.layers import Layer, MambaSpec
from kvgeom.model.stages import stage_partition, stage_range
from kvgeom.pair.streams import hma_required, pair_streams, region_group_ids, region_mapped, registration
from kvgeom.testing import Request, run
from kvgeom.testing.oracle import push_plans

FULL = AttentionSpec(2, 4, "float16")
SWA = AttentionSpec(2, 4, "float16", sliding_window=8)
# six layers, full and sliding window alternating: groups full [0, 2, 4] and window [1, 3, 5]; region i holds
# full layer 2i and window layer 2i + 1
ALTERNATING = ModelSpec.from_layers("alternating", [FULL, SWA] * 3)
MLA3 = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 3)


def _engine(
    tp: int = 1,
    pp: int = 1,
    rank: int = 0,
    stage: int = 0,
    block: int = 4,
    blocks: int = 4,
    packed: bool = False,
) -> EngineConfig:
    return EngineConfig(
        tp_size=tp,
        block_size=block,
        num_blocks=blocks,
        tp_rank=rank,
        pp_size=pp,
        pp_rank=stage,
        packed_rows=packed,
    )


def test_stage_partition_is_vllms() -> None:
    # vLLM's get_pp_indices: L // pp per stage, the remainder one each to the stages before the last, from the
    # second-to-last backwards (10 layers over 4 stages: 2, 3, 3, 2)
    assert stage_partition(10, 4) == (2, 3, 3, 2)
    assert stage_partition(6, 2) == (3, 3)
    assert stage_partition(7, 3) == (2, 3, 2)
    assert [stage_range(10, s, 4) for s in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]


def test_a_stage_holds_its_layers_and_all_groups() -> None:
    geom = rank_geometry(ALTERNATING, _engine(pp=2, stage=0))
    assert geom.layer_names == ("layers.0.attn", "layers.1.attn", "layers.2.attn")
    assert [g.layers for g in geom.groups] == [("layers.0.attn", "layers.2.attn"), ("layers.1.attn",)]
    assert [r.members for r in geom.regions] == [
        ((0, "layers.0.attn"), (1, "layers.1.attn")),
        ((0, "layers.2.attn"),),
    ]


def test_pipeline_push_routes_by_layer_name_with_vllms_descriptor_ids() -> None:
    """A push stage holding full layers 0, 2 and window layer 1: its transfer layers are (layer 0, group 0),
    (layer 1, group 1), (layer 2, group 0), each its region's 4 blocks: P ids [[1], [2]] -> [1, 4 + 2, 8 + 1]."""
    p = rank_geometry(ALTERNATING, _engine(pp=2, stage=0))
    d = rank_geometry(ALTERNATING, _engine())
    reg = registration(p, "push")
    assert reg.transfer_names == ("layers.0.attn", "layers.1.attn", "layers.2.attn")
    assert reg.transfer_groups == (0, 1, 0)
    pairing = Pairing.create(p, [d], "push", "vllm")
    plan = plan_request(pairing, [[1], [2]], [[3], [1]], num_tokens=4)
    (t,) = plan.transfers
    assert t.local_ids.tolist() == [1, 6, 9]
    # on D, layers 0 and 1 live in region 0 and layer 2 in region 1 (4 blocks each): D ids [[3], [1]]
    assert t.remote_ids.tolist() == [3, 4 + 1, 8 + 3]
    moves = plan.moves(pairing)
    assert moves[:, [4]].ravel().tolist() == [0, 0, 1]  # destination regions on D
    # the bytes: every layer of the stage lands in D's block of its own group
    report = run(
        ALTERNATING, _engine(pp=2), _engine(), Request(4, ((1,), (2,)), ((3,), (1,))), "push", "vllm"
    )
    assert report.ok and report.bytes_moved == 6 * 4 * 2 * 8 * 2  # layers * tokens * heads * (K+V) * bytes


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_pull_stage_reads_its_window_of_a_peer_without_stages(compat: str) -> None:
    dense = ModelSpec.from_layers("dense", [FULL] * 4)
    d = rank_geometry(dense, _engine(pp=2, stage=1))
    p = rank_geometry(dense, _engine())
    pairing = Pairing.create(d, [p], "pull", compat)
    plan = plan_request(pairing, [[2]], [[1]], num_tokens=3)
    moves = plan.moves(pairing)
    assert sorted(set(moves[:, 1].tolist())) == [2, 3]  # P's regions of layers 2 and 3
    assert sorted(set(moves[:, 4].tolist())) == [0, 1]  # into the stage's own regions
    assert run(dense, _engine(), _engine(pp=2), Request(3, ((1,),), ((2,),)), "pull", compat).ok


def test_vllm_refuses_stages_on_the_peer_and_kvgeom_pairs_each_stage() -> None:
    p_engine, d_engine = _engine(pp=2, blocks=8), _engine(blocks=8)
    request = Request.simple(ALTERNATING, p_engine, d_engine, 7)
    with pytest.raises(UnsupportedError) as err:
        run(ALTERNATING, p_engine, d_engine, request, "pull", "vllm")
    assert err.value.field == "pp_size"
    report = run(ALTERNATING, p_engine, d_engine, request, "pull", "kvgeom")
    assert report.ok and report.bytes_moved == 6 * 8 * 2 * 8 * 2


def test_packed_rows_move_a_block_of_every_layer_in_one_descriptor() -> None:
    geom = rank_geometry(MLA3, _engine(packed=True))
    (row,) = geom.regions
    page = 4 * 8 * 2  # tokens * latent * bytes
    assert row.block_len == row.block_stride == 3 * page
    assert row.slots == ((0, page), (page, page), (2 * page, page))
    for compat in ("vllm", "kvgeom"):
        pairing = Pairing.create(geom, [rank_geometry(MLA3, _engine(packed=True))], "pull", compat)
        plan = plan_request(pairing, [[2, 3]], [[0, 1]], num_tokens=8)
        moves = plan.moves(pairing)
        assert moves[:, 6].tolist() == [3 * page, 3 * page]
        assert run(
            MLA3, _engine(packed=True), _engine(packed=True), Request(8, ((0, 1),), ((2, 3),)), "pull", compat
        ).ok


def test_per_layer_rank_reads_a_packed_row_by_layer() -> None:
    page = 4 * 8 * 2
    d = rank_geometry(MLA3, _engine())
    pairing = Pairing.create(d, [rank_geometry(MLA3, _engine(packed=True))], "pull", "vllm")
    moves = plan_request(pairing, [[2]], [[1]], num_tokens=4).moves(pairing)
    # one descriptor per layer: P's row of block 1, at the layer's offset in it
    assert moves[:, 2].tolist() == [3 * page, 3 * page + page, 3 * page + 2 * page]
    assert moves[:, 4].tolist() == [0, 1, 2] and moves[:, 6].tolist() == [page] * 3


@pytest.mark.parametrize(
    ("p_packed", "d_packed", "p_block", "d_block"),
    [(False, True, 4, 4), (True, True, 4, 8), (False, True, 4, 8)],
)
def test_rows_packed_differently_pair_layer_by_layer_in_kvgeom_mode(
    p_packed: bool, d_packed: bool, p_block: int, d_block: int
) -> None:
    p, d = (
        _engine(packed=p_packed, block=p_block, blocks=6),
        _engine(packed=d_packed, block=d_block, blocks=6),
    )
    request = Request.simple(MLA3, p, d, 13)
    with pytest.raises(KvgeomError):
        run(MLA3, p, d, request, "pull", "vllm")
    report = run(MLA3, p, d, request, "pull", "kvgeom")
    assert report.ok and report.bytes_moved >= 3 * 13 * 8 * 2


def test_packed_rows_are_refused_where_a_row_cannot_be_cut_by_heads() -> None:
    with pytest.raises(KvgeomError) as err:
        rank_geometry(ModelSpec.from_layers("dense", [FULL] * 2), _engine(packed=True))
    assert err.value.field == "packed_rows"


def test_vllm_refuses_routing_between_different_block_sizes() -> None:
    p = rank_geometry(ALTERNATING, _engine(pp=2, block=8))
    d = rank_geometry(ALTERNATING, _engine(block=4))
    with pytest.raises(UnsupportedError) as err:
        Pairing.create(p, [d], "push", "vllm")
    assert err.value.field == "block_size"
    with pytest.raises(
        KvgeomError
    ):  # P's larger kernel blocks interleave heads in D's: refused in kvgeom mode too
        Pairing.create(p, [d], "push", "kvgeom")


def test_packed_rows_differing_between_p_and_d_are_vllms_refusal() -> None:
    d = rank_geometry(MLA3, _engine(packed=True))
    with pytest.raises(IncompatiblePairError) as err:
        Pairing.create(d, [rank_geometry(MLA3, _engine())], "pull", "vllm")
    assert err.value.field == "packed_rows"


def test_push_stage_notifies_every_d_rank_it_writes() -> None:
    plans = push_plans(
        MLA3, _engine(pp=3), _engine(tp=2), Request.simple(MLA3, _engine(pp=3), _engine(tp=2), 5), "vllm"
    )
    assert len(plans) == 3
    for rp in plans:  # each stage writes its layer's latent to both D ranks (replicated)
        assert sorted(t.remote_rank for t in rp.plan.transfers) == [0, 1]
        assert np.unique(rp.plan.moves(rp.pairing)[:, 4]).size == 1


# Exact behaviour of kvgeom.pair.streams on small geometries: pseudo-addresses, what a rank registers (every
# field), the streams of each pairing rule, and every refusal's class, field and values.


# 2 KV heads of 4, fp16, 4-token blocks at TP1: 2 * 4 * (4 + 4) * 2 = 128 B per block and layer
ALT = ModelSpec.from_layers("alternating", [FULL, SWA] * 3)  # region i: full layer 2i, window 2i + 1

DENSE = ModelSpec.from_layers("dense", [FULL] * 2)

# MLA latent of 8, fp16, 4-token blocks: 64 B per block and layer
HYB = ModelSpec.from_layers("hyb", [FULL, MambaSpec.mamba2(2, 4, 1, 4)] * 2)

L = [f"layers.{i}.attn" for i in range(6)]


def _e(tp: int = 1, pp: int = 1, stage: int = 0, block: int = 4, packed: bool = False, **kw: object):
    return EngineConfig(
        tp_size=tp, block_size=block, num_blocks=4, pp_size=pp, pp_rank=stage, packed_rows=packed, **kw
    )


def _g(model: ModelSpec, **kw: object):
    return rank_geometry(model, _e(**kw))


def test_pseudo_addresses() -> None:
    assert pseudo(3, 5) == 3 * 2**44 + 5
    assert pseudo(2) == 2 * 2**44
    assert pseudo(0, 7) == 7
    assert unpseudo(pseudo(7, 123)) == (7, 123)
    assert unpseudo(2**44 - 1) == (0, 2**44 - 1)
    assert unpseudo(2**44) == (1, 0)


def test_hma_required() -> None:
    assert hma_required(_g(ALT)) is True
    assert hma_required(_g(HYB, block=8)) is True
    assert hma_required(_g(DENSE)) is False
    assert hma_required(_g(MLA3)) is False


def test_region_group_ids() -> None:
    assert region_group_ids(_g(DENSE)) == (0, 0)
    assert region_group_ids(_g(ALT)) == (SHARED_GROUP,) * 3
    # stage 0 of 2 holds layers 0..2: region 0 views full 0 and window 1, region 1 only full 2
    assert region_group_ids(_g(ALT, pp=2)) == (SHARED_GROUP, 0)


def test_registration_of_per_layer_regions() -> None:
    g = _g(DENSE)
    reg = registration(g, "pull")
    assert registration(g, "pull") is reg  # kept on the geometry
    t = reg.table
    assert t.bases == (pseudo(0), pseudo(1))
    assert t.block_lens == (128, 128) and t.block_strides == (128, 128)
    assert t.num_blocks == (4, 4) and t.group_ids == (0, 0)
    assert t.names == (L[0], L[1])
    assert t.members == () and dict(t.packed) == {}
    assert reg.is_mla == (False, False)
    assert reg.transfer_names == () and reg.transfer_regions == () and reg.transfer_groups == ()
    # a push worker of a model that needs no hybrid manager advertises no members either
    assert registration(g, "push").table.members == ()


def test_registration_of_a_hybrid_manager_push_worker() -> None:
    g = _g(ALT)
    pull, push = registration(g, "pull"), registration(g, "push")
    assert pull.table.members == ()
    assert push.table.members == ((L[0], L[1]), (L[2], L[3]), (L[4], L[5]))
    assert push.table.names == (L[0], L[2], L[4])
    assert push.table.group_ids == (SHARED_GROUP,) * 3
    assert push.transfer_names == ()  # no stages: no routing
    # a stage routes by layer name: each member with its region and own group
    s = registration(_g(ALT, pp=2), "push")
    assert s.transfer_names == (L[0], L[1], L[2])
    assert s.transfer_regions == (0, 0, 1)
    assert s.transfer_groups == (0, 1, 0)
    assert s.table.members == ((L[0], L[1]), (L[2],))
    # an SSM hybrid's push worker advertises no members
    assert registration(_g(HYB, block=8), "push").table.members == ()


def test_registration_of_packed_rows() -> None:
    g = _g(MLA3, packed=True)
    reg = registration(g, "pull")
    t = reg.table
    # one row of 3 pages of 64 B, named after its first layer, each layer's page advertised
    assert t.bases == (pseudo(0),) and t.block_lens == (192,) and t.block_strides == (192,)
    assert t.names == (L[0],) and t.num_blocks == (4,) and t.group_ids == (0,)
    assert dict(t.packed) == {L[0]: (0, 64), L[1]: (64, 64), L[2]: (128, 64)}
    assert t.members == () and reg.is_mla == (True,)
    assert registration(g, "push").table.members == ((L[0], L[1], L[2]),)
    # a pull stage (layers 0, 1 of 3): one region per page of its 128-B row
    s = registration(_g(MLA3, pp=2, packed=True), "pull")
    assert s.table.bases == (pseudo(0, 0), pseudo(0, 64))
    assert s.table.block_lens == (64, 64) and s.table.block_strides == (128, 128)
    assert s.table.names == (L[0], L[1]) and dict(s.table.packed) == {}
    assert s.is_mla == (True, True) and s.transfer_names == ()
    # a push stage routes by layer: one region per layer's page
    r = registration(_g(MLA3, pp=2, packed=True), "push")
    assert r.table.bases == (pseudo(0, 0), pseudo(0, 64))
    assert r.table.block_lens == (64, 64)
    assert r.table.members == ((L[0],), (L[1],))
    assert r.transfer_names == (L[0], L[1]) and r.transfer_regions == (0, 1) and r.transfer_groups == (0, 0)


def test_kvgeom_streams_region_by_region() -> None:
    a, b = _g(DENSE), _g(DENSE, block=8)
    lv, rv = pair_streams(a, b, "pull", "kvgeom")
    assert lv == EngineView.of(a) and rv == EngineView.of(b)


def test_kvgeom_streams_layer_by_layer() -> None:
    # per-layer D regions against P's packed row: one stream per layer on each side
    d, p = _g(MLA3), _g(MLA3, packed=True)
    lv, rv = pair_streams(d, p, "pull", "kvgeom")
    assert lv.bases == (pseudo(0), pseudo(1), pseudo(2))
    assert lv.block_lens == (64, 64, 64) and lv.block_strides == (64, 64, 64)
    assert rv.bases == (pseudo(0, 0), pseudo(0, 64), pseudo(0, 128))
    assert rv.block_lens == (64, 64, 64) and rv.block_strides == (192, 192, 192)
    for v in (lv, rv):
        assert v.transfer_groups == (0, 0, 0) and v.group_ids == (0, 0, 0)
        assert v.region_is_mla == (True, True, True)
    # a stage against a peer without stages: only the layers it holds
    lv, rv = pair_streams(_g(MLA3, pp=3, stage=2, packed=True), p, "pull", "kvgeom")
    assert lv.bases == (pseudo(0),) and rv.bases == (pseudo(0, 128),)


def test_kvgeom_streams_refusals() -> None:
    with pytest.raises(UnsupportedError) as info:
        pair_streams(_g(HYB, block=8, pp=2, stage=1), _g(HYB, block=8), "pull", "kvgeom")
    assert type(info.value) is UnsupportedError
    assert info.value.field == "pp_size" and info.value.values == {"local": 1, "remote": 0}
    with pytest.raises(UnsupportedError) as info:
        pair_streams(_g(HYB, block=8), _g(HYB, block=8, pp=2, stage=0), "pull", "kvgeom")
    assert info.value.values == {"local": 0, "remote": 0}
    with pytest.raises(UnsupportedError) as info:
        pair_streams(_g(DENSE, kv_split=True), _g(DENSE), "pull", "kvgeom")
    assert info.value.field == "kv_split" and info.value.values == {"value": True}
    with pytest.raises(UnsupportedError) as info:
        pair_streams(_g(DENSE), _g(DENSE, kv_split=True), "pull", "kvgeom")
    assert info.value.field == "kv_split"


def test_vllm_refuses_stages() -> None:
    for mode in ("pull", "push"):
        with pytest.raises(UnsupportedError) as info:
            pair_streams(_g(DENSE), _g(DENSE, pp=2, stage=1), mode, "vllm")
        assert info.value.field == "pp_size" and info.value.values == {"local": 1, "remote": 2}
    with pytest.raises(UnsupportedError) as info:
        pair_streams(_g(ALT, pp=2), _g(ALT), "pull", "vllm")
    assert info.value.field == "pp_size" and info.value.values == {"local": 2, "remote": 1}
    with pytest.raises(UnsupportedError) as info:
        pair_streams(_g(HYB, block=8, pp=2), _g(HYB, block=8), "push", "vllm")
    assert info.value.field == "pp_size" and info.value.values == {"local": 2, "remote": 1}
    # routing needs equal block sizes and D TP <= P TP for attention
    with pytest.raises(UnsupportedError) as info:
        pair_streams(_g(ALT, pp=2, block=8), _g(ALT), "push", "vllm")
    assert info.value.field == "block_size" and info.value.values == {"local": 8, "remote": 4}
    with pytest.raises(UnsupportedError) as info:
        pair_streams(_g(ALT, pp=2), _g(ALT, tp=2), "push", "vllm")
    assert info.value.field == "tp_size" and info.value.values == {"local": 1, "remote": 2}
    # equal TP routes
    lv, rv = pair_streams(_g(ALT, pp=2), _g(ALT), "push", "vllm")
    assert rv.transfer_groups == (0, 1, 0) and lv.transfer_groups == (0, 1, 0)
    # MLA routes to a larger D TP (the latent is replicated)
    lv, rv = pair_streams(_g(MLA3, pp=2, packed=True), _g(MLA3, tp=2, packed=True), "push", "vllm")
    assert len(rv.bases) == 2


def test_vllm_streams_of_a_push_stage() -> None:
    # stage 0 of 2 holds full 0, window 1 (region 0) and full 2 (region 1); D holds 3 regions of 2 layers
    lv, rv = pair_streams(_g(ALT, pp=2), _g(ALT), "push", "vllm")
    assert lv.bases == (pseudo(0), pseudo(0), pseudo(1))
    assert lv.transfer_groups == (0, 1, 0) and lv.group_ids == (0, 1, 0)
    assert rv.bases == (pseudo(0), pseudo(0), pseudo(1))
    assert lv.region_is_mla == (False,) * 3 and rv.region_is_mla == (False,) * 3


def test_vllm_streams_of_a_pull_stage_window() -> None:
    dense4 = ModelSpec.from_layers("dense", [FULL] * 4)
    lv, rv = pair_streams(
        rank_geometry(dense4, _e(pp=2, stage=1)), rank_geometry(dense4, _e()), "pull", "vllm"
    )
    # the stage holds layers 2, 3: P's regions 2, 3
    assert rv.bases == (pseudo(2), pseudo(3))
    assert rv.block_lens == (128, 128)


def test_vllm_streams_identity_and_packed() -> None:
    a, b = _g(DENSE), _g(DENSE)
    lv, rv = pair_streams(a, b, "pull", "vllm")
    assert lv.bases == () and rv.bases == ()  # stream r is region r
    assert lv.group_ids == (0, 0) and rv.group_ids == (0, 0)
    # a per-layer D reads P's packed row as one virtual region per layer
    lv, rv = pair_streams(_g(MLA3), _g(MLA3, packed=True), "pull", "vllm")
    assert rv.bases == (pseudo(0, 0), pseudo(0, 64), pseudo(0, 128))
    assert rv.block_lens == (64, 64, 64) and rv.block_strides == (192, 192, 192)
    assert lv.bases == ()
    # packed alike: identity
    lv, rv = pair_streams(_g(MLA3, packed=True), _g(MLA3, packed=True), "pull", "vllm")
    assert lv.bases == () and rv.bases == ()


def test_vllm_pairing_refusals() -> None:
    with pytest.raises(IncompatiblePairError) as info:
        pair_streams(_g(MLA3, packed=True), _g(MLA3), "pull", "vllm")
    assert info.value.field == "packed_rows"
    assert info.value.values == {"local": {L[0]: (0, 64), L[1]: (64, 64), L[2]: (128, 64)}, "remote": {}}
    three = ModelSpec.from_layers("dense", [FULL] * 3)
    with pytest.raises(IncompatiblePairError) as info:
        pair_streams(_g(DENSE), _g(three), "pull", "vllm")
    assert info.value.field == "num_regions" and info.value.values == {"local": 2, "remote": 3}
    xy = ModelSpec("m", (Layer("x", 0, FULL), Layer("y", 1, FULL)))
    xz = ModelSpec("m", (Layer("x", 0, FULL), Layer("z", 1, FULL)))
    with pytest.raises(IncompatiblePairError) as info:
        pair_streams(_g(xy), _g(xz), "pull", "vllm")
    assert info.value.field == "region_names"
    assert info.value.values == {"local": ["x", "y"], "remote": ["x", "z"]}


def test_region_mapped() -> None:
    a, b = _g(DENSE), _g(DENSE)
    assert region_mapped(a, b, pair_streams(a, b, "pull", "vllm")) is False
    d, p = _g(MLA3), _g(MLA3, packed=True)
    assert region_mapped(d, p, pair_streams(d, p, "pull", "kvgeom")) is False


def test_region_mapped_when_the_same_regions_group_differently() -> None:
    three = ModelSpec.from_layers("dense", [FULL] * 3)
    p = rank_geometry(three, _e(separate_group=("layers.2.attn",)))
    d = rank_geometry(three, _e())
    assert region_group_ids(p) == (0, 0, 1) and region_group_ids(d) == (0, 0, 0)
    for compat in ("kvgeom", "vllm"):
        streams = pair_streams(d, p, "pull", compat)
        assert region_mapped(d, p, streams) is True
        assert region_mapped(d, d, pair_streams(d, d, "pull", compat)) is False


def test_layer_streams_follow_natural_layer_order() -> None:
    # a packed row registered as layers 10, 9 (slots at 0 and 64): streams go in natural order, 9 first
    mla = MLASpec(8, "float16")
    m = ModelSpec("m", (Layer("layers.10.attn", 0, mla), Layer("layers.9.attn", 1, mla)))
    lv, rv = pair_streams(_g(m, packed=True), _g(m), "pull", "kvgeom")
    assert lv.bases == (pseudo(0, 64), pseudo(0, 0))
    assert rv.bases == (pseudo(1), pseudo(0))
    assert rv.region_is_mla == (True, True)


def test_registration_names_and_strides() -> None:
    mla = MLASpec(8, "float16")
    m = ModelSpec("m", (Layer("layers.10.attn", 0, mla), Layer("layers.9.attn", 1, mla)))
    # the row is named after its first layer in natural order
    assert registration(_g(m, packed=True), "pull").table.names == ("layers.9.attn",)
    r = registration(_g(MLA3, pp=2, packed=True), "push")
    assert r.table.block_strides == (128, 128) and r.table.names == (L[0], L[1])
    g = _g(DENSE, kv_split=True)  # split K/V regions keep their own names
    assert registration(g, "pull").table.names == tuple(x.name for x in g.regions)
    assert len(set(registration(g, "pull").table.names)) == len(g.regions)
