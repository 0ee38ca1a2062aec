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
from kvgeom.model.stages import stage_partition, stage_range
from kvgeom.pair.streams import registration
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
