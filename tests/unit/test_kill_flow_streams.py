"""Exact behaviour of kvgeom.pair.streams on small geometries: pseudo-addresses, what a rank registers (every
field), the streams of each pairing rule, and every refusal's class, field and values."""

from __future__ import annotations

import pytest

from kvgeom.errors import IncompatiblePairError, UnsupportedError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.view import SHARED_GROUP, EngineView, pseudo, unpseudo
from kvgeom.model.layers import AttentionSpec, Layer, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.pair.streams import hma_required, pair_streams, region_group_ids, region_mapped, registration

# 2 KV heads of 4, fp16, 4-token blocks at TP1: 2 * 4 * (4 + 4) * 2 = 128 B per block and layer
FULL = AttentionSpec(2, 4, "float16")
SWA = AttentionSpec(2, 4, "float16", sliding_window=8)
ALT = ModelSpec.from_layers("alternating", [FULL, SWA] * 3)  # region i: full layer 2i, window 2i + 1
DENSE = ModelSpec.from_layers("dense", [FULL] * 2)
# MLA latent of 8, fp16, 4-token blocks: 64 B per block and layer
MLA3 = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 3)
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
