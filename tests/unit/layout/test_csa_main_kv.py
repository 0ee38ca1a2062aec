"""CSA-linear models with head-sharded (GQA) main KV (vLLM's ``Qwen4ExpQSAAttention``; docs/vllm-behaviour.md
B.6.14 "Head-sharded main KV"): the model, its geometry, vLLM's TP rule and the refusals.

Hand-derived from ``csa_linear_model(main_kv_heads=2)`` at block 16: main-KV page 16 tokens x heads x (8 + 8)
x 2 B = 512 B per head on the rank (TP1: 2 heads, 1024 B; TP2: 1 head, 512 B); MLA page 16 x 8 x 2 B = 256 B;
40 tokens: main-KV blocks 1-3, MLA blocks 4-6, ring block 7, GDN slot 8, PLE slot 9."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgeom.errors import ConfigError, IncompatiblePairError, KvgeomError, SpecError, UnsupportedError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.model.csa import csa_linear_model
from kvgeom.model.layers import AttentionSpec, CircularBufferSpec, Layer, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.pair.handshake import check_pair
from kvgeom.testing import Request
from kvgeom.testing import strategies as kst

GQA = csa_linear_model(main_kv_heads=2)


def eng(tp: int = 1, **kw: object) -> EngineConfig:
    return EngineConfig(tp_size=tp, block_size=16, num_blocks=16, **kw)  # type: ignore[arg-type]


def test_main_kv_comes_first_in_each_csa_decoder_layer() -> None:
    assert [la.name for la in GQA.layers] == [
        "layers.0.kv",
        "layers.0.attn",
        "layers.0.ring",
        "layers.1.gdn",
        "layers.2.kv",
        "layers.2.attn",
        "layers.2.ring",
        "layers.3.gdn",
        "ple",
    ]
    kv = GQA.layers[0]
    assert kv.spec == AttentionSpec(2, 8) and kv.shares is None and kv.index == 0
    assert GQA.layers[4].index == 2 and GQA.num_kv_heads == 2
    assert [la.name for la in csa_linear_model().layers][:2] == ["layers.0.attn", "layers.0.ring"]


def test_negative_main_kv_heads_is_refused() -> None:
    with pytest.raises(SpecError) as e:
        csa_linear_model(main_kv_heads=-1)
    assert e.value.field == "main_kv_heads" and e.value.values["value"] == -1


def test_a_sliding_window_owner_is_refused_naming_both_token_kinds() -> None:
    with pytest.raises(SpecError) as e:
        ModelSpec(
            "m",
            (
                Layer("a", 0, MLASpec(8)),
                Layer("r", 0, CircularBufferSpec(4, 8), shares="a"),
                Layer("w", 1, AttentionSpec(2, 8, sliding_window=8)),
            ),
        )
    assert e.value.field == "w.kind"
    assert e.value.values == {"value": "sliding_window", "expected": ["attention", "mla"]}


@pytest.mark.parametrize(("tp", "kv"), [(1, 1024), (2, 512)])
def test_geometry_gives_each_main_kv_a_head_sharded_region(tp: int, kv: int) -> None:
    g = rank_geometry(GQA, eng(tp))
    assert [(x.kind.value, x.layers) for x in g.groups] == [
        ("attention", ("layers.0.kv", "layers.2.kv")),
        ("mla", ("layers.0.attn", "layers.2.attn")),
        ("circular_buffer", ("layers.0.ring", "layers.2.ring")),
        ("gdn", ("layers.1.gdn", "layers.3.gdn")),
        ("replicated_state", ("ple",)),
    ]
    assert [(r.name, r.block_len, r.block_stride, r.is_mla) for r in g.regions] == [
        ("layers.0.kv", kv, kv, False),
        ("layers.0.attn", 256, 256, True),
        ("layers.2.kv", kv, kv, False),
        ("layers.2.attn", 256, 256, True),
    ]
    assert [len(r.members) for r in g.regions] == [1, 4, 1, 3]
    assert g.scratch_region_indices == (1, 3) and g.ssm_region_indices == (1, 3)
    assert g.ple is not None and (g.ple.region, g.ple.length) == (1, 48)


def test_vllm_sees_no_mla_model_and_no_draft() -> None:
    """vLLM's use_mla is False for such a model (its KV heads are the main KV's); without main KV the model
    is an MLA model."""
    g = rank_geometry(GQA, eng())
    assert (g.is_mla, g.has_draft, g.num_kv_heads) == (False, False, 2)
    plain = rank_geometry(csa_linear_model(), eng())
    assert (plain.is_mla, plain.has_draft, plain.num_kv_heads) == (True, False, 1)


def test_request_holds_main_kv_blocks_before_the_compressed_keys() -> None:
    assert Request.simple(GQA, eng(), eng(), 40).d_ids == ((1, 2, 3), (4, 5, 6), (7,), (8,), (9,))


@pytest.mark.parametrize(
    ("heads", "p_tp", "d_tp"),
    [(2, 1, 2), (2, 2, 1), (4, 2, 4), (4, 4, 2)],
)
@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_pairs_across_the_kv_head_boundary_are_refused(heads: int, p_tp: int, d_tp: int, compat: str) -> None:
    """vLLM's rule: both TP sizes below the KV-head count or both at or above it (D is local in a pull)."""
    model = csa_linear_model(main_kv_heads=heads)
    local, remote = rank_geometry(model, eng(d_tp)), rank_geometry(model, eng(p_tp))
    with pytest.raises(IncompatiblePairError) as e:
        check_pair(local, remote, "pull", compat)  # type: ignore[arg-type]
    assert e.value.field == "tp_size" and e.value.values == {"local": d_tp, "remote": p_tp}


@pytest.mark.parametrize(("heads", "p_tp", "d_tp"), [(2, 2, 4), (2, 4, 2), (4, 1, 2), (4, 2, 1)])
def test_pairs_on_one_side_of_the_boundary_are_accepted(heads: int, p_tp: int, d_tp: int) -> None:
    model = csa_linear_model(main_kv_heads=heads, gdn=None if heads == 4 else MambaSpec.gdn(4, 4, 4, 4))
    shape = check_pair(rank_geometry(model, eng(d_tp)), rank_geometry(model, eng(p_tp)), "pull", "vllm")
    assert shape.tp_ratio == (d_tp // p_tp if d_tp >= p_tp else -(p_tp // d_tp))


def test_packed_rows_bucket_the_main_kv_with_the_compressed_keys() -> None:
    """vLLM's block-outermost allocation: one token group (model order), each spec's pages together in
    first-appearance order (main KV 1024 B at 0 and 1024, compressed keys 256 B at 2048 and 2304: a 2560-byte
    row); regions per page start, the first pages of every group sharing region 0 (the main KV's length)."""
    g = rank_geometry(GQA, eng(packed_rows=True))
    assert [x.layers for x in g.groups] == [
        ("layers.0.kv", "layers.0.attn", "layers.2.kv", "layers.2.attn"),
        ("layers.0.ring", "layers.2.ring"),
        ("layers.1.gdn", "layers.3.gdn"),
        ("ple",),
    ]
    assert g.page_bytes == 2560
    assert [(r.block_len, r.block_stride, r.is_mla, len(r.members)) for r in g.regions] == [
        (1024, 2560, False, 4),
        (256, 2560, True, 1),
        (1024, 2560, False, 1),
        (256, 2560, True, 1),
        (64, 2560, False, 1),
        (208, 2560, False, 1),
    ]
    assert g.scratch_region_indices == (0, 4) and g.ssm_region_indices == (0, 5)


def test_packed_rows_with_two_main_kv_specs_are_refused() -> None:
    layers = tuple(
        Layer(la.name, la.index, AttentionSpec(4, 8)) if la.name == "layers.2.kv" else la for la in GQA.layers
    )
    with pytest.raises(ConfigError) as e:
        rank_geometry(ModelSpec("two-kv", layers), eng(packed_rows=True))
    assert e.value.field == "layers"
    assert e.value.values["value"] == sorted([repr(AttentionSpec(2, 8)), repr(AttentionSpec(4, 8))])


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "expected"),
    [(2, 2, "csa-linear"), (2, 4, "csa-linear"), (4, 2, "csa-linear"), (1, 2, None), (2, 1, None)],
)
def test_strategies_plan_pairs_on_one_side_of_the_kv_heads(
    p_tp: int, d_tp: int, expected: str | None
) -> None:
    """2 KV heads: TP 2 and 4 lie at or above the count, TP 1 below it (GDN(4, 4, 4, 4): no SSM unit is
    replicated up to TP4)."""
    model = csa_linear_model(main_kv_heads=2, gdn=MambaSpec.gdn(4, 4, 4, 4))
    pair = kst.PDPair(model, eng(p_tp), eng(d_tp), "pull", "kvgeom")
    assert kst.plannable_class(pair) == expected


@pytest.mark.parametrize(("compat", "p_tp", "d_tp"), [("vllm", 2, 4), ("vllm", 2, 2), ("kvgeom", 2, 4)])
def test_token_major_main_kv_across_tp_is_plannable_only_where_pages_need_no_head_slices(
    compat: str, p_tp: int, d_tp: int
) -> None:
    """A token-major main KV: vllm mode cuts head slices across TP sizes and refuses it (``kv_layout``), so
    such a pair is no plannable class; at equal TP, or in kvgeom mode (it cuts token-major pages per
    token), it is, and kvgeom pairs it."""
    model = csa_linear_model(main_kv_heads=2, gdn=MambaSpec.gdn(4, 4, 4, 4))
    p, d = eng(p_tp, kv_layout="token_major"), eng(d_tp, kv_layout="token_major")
    pair = kst.PDPair(model, p, d, "pull", compat)
    if compat == "vllm" and p_tp != d_tp:
        assert kst.plannable_class(pair) is None
        with pytest.raises(KvgeomError) as e:
            pair.check()
        assert e.value.field == "kv_layout"
    else:
        assert kst.plannable_class(pair) == "csa-linear"
        pair.check()


def test_packed_rows_with_main_kv_across_tp() -> None:
    """P TP2 -> D TP4 (2 KV heads, one per rank on both sides) in packed rows (row 1,536 B): regions start at
    row bytes 0, 1024, 512, 1280, 64 and, for the GDN-only region 5, 208 at TP2 but 104 at TP4 (the first GDN
    page before it: conv 3 x 16 channels x 3 rows x 2 B + temporal 2 x 16 x 2 B = 208 B at TP2, half at
    TP4). vLLM copies the token blocks through region 5 too, onto the main-KV page at the other offset:
    vllm mode refuses, naming the region's row offsets; kvgeom mode pairs it."""
    model = csa_linear_model(main_kv_heads=2, gdn=MambaSpec.gdn(4, 4, 4, 4))
    local, remote = (
        rank_geometry(model, eng(4, packed_rows=True)),
        rank_geometry(model, eng(2, packed_rows=True)),
    )
    assert [r.row_offset for r in local.regions] == [0, 1024, 512, 1280, 64, 104]
    assert [r.row_offset for r in remote.regions] == [0, 1024, 512, 1280, 64, 208]
    with pytest.raises(UnsupportedError) as e:
        check_pair(local, remote, "pull", "vllm")
    assert e.value.field == "regions[5].row_offset"
    assert (e.value.values["local"], e.value.values["remote"]) == (104, 208)
    shape = check_pair(local, remote, "pull", "kvgeom")
    assert shape.tp_ratio == 2 and shape.bsr == 1


def test_packed_rows_with_main_kv_across_tp_block_lengths() -> None:
    """The lengths follow each region's kind: K=4 at TP1 vs TP2, main-KV pages of 16 tokens x 32 B K|V per head,
    4 heads (2,048 B) vs 2 (1,024 B); MLA and ring pages equal; the GDN-only region skipped (its state is checked
    piece by piece). vllm mode refuses at the first region whose row offset differs (the MLA page after the
    first main-KV page of each row: 2 x 2,048 vs 2 x 1,024). A remote main-KV page of the wrong length is
    refused, naming the region."""
    model = csa_linear_model(main_kv_heads=4)
    local, remote = (
        rank_geometry(model, eng(1, packed_rows=True)),
        rank_geometry(model, eng(2, packed_rows=True)),
    )
    assert local.region_tp_scaling == ("heads", "whole", "heads", "whole", "whole", "state")
    assert [r.block_len for r in local.regions] == [2048, 256, 2048, 256, 64, 208]
    assert [r.block_len for r in remote.regions] == [1024, 256, 1024, 256, 64, 104]
    check_pair(local, remote, "pull", "kvgeom")
    with pytest.raises(UnsupportedError) as e:
        check_pair(local, remote, "pull", "vllm")
    assert e.value.field == "regions[1].row_offset"
    assert (e.value.values["local"], e.value.values["remote"]) == (4096, 2048)
    bad = replace(remote, regions=(replace(remote.regions[0], block_len=512), *remote.regions[1:]))
    with pytest.raises(IncompatiblePairError) as e2:
        check_pair(local, bad, "pull", "kvgeom")
    assert e2.value.field == "regions[0].block_len"
    assert (e2.value.values["local"], e2.value.values["remote"]) == (2048, 512)


def test_packed_rows_need_packed_rows_on_both_sides() -> None:
    model = csa_linear_model(main_kv_heads=2)
    local, remote = rank_geometry(model, eng(1, packed_rows=True)), rank_geometry(model, eng(1))
    with pytest.raises(IncompatiblePairError) as e:
        check_pair(local, remote, "pull", "kvgeom")
    assert e.value.field == "packed_rows"
    assert (e.value.values["local"], e.value.values["remote"]) == (True, False)


@pytest.mark.parametrize(
    ("compat", "p_tp", "d_tp", "kernel", "expected"),
    [
        ("vllm", 2, 2, 16, "csa-linear"),  # equal TP: the regions start at the same row bytes on both sides
        (
            "vllm",
            2,
            4,
            16,
            None,
        ),  # region 5 at row byte 208 vs 104: vllm mode refuses (regions[5].row_offset)
        ("kvgeom", 2, 4, 16, "csa-linear"),  # each group through its own pages
        ("kvgeom", 2, 2, 8, None),  # two kernel blocks per block: packed rows are modelled with one
    ],
)
def test_strategies_plan_packed_rows_across_tp_in_kvgeom_mode_only(
    compat: str, p_tp: int, d_tp: int, kernel: int, expected: str | None
) -> None:
    model = csa_linear_model(main_kv_heads=2, gdn=MambaSpec.gdn(4, 4, 4, 4))
    p, d = (eng(t, packed_rows=True, kernel_block_size=kernel) for t in (p_tp, d_tp))
    pair = kst.PDPair(model, p, d, "pull", compat)
    assert kst.plannable_class(pair) == expected
    if expected is not None:
        pair.check()
    else:
        with pytest.raises(KvgeomError) as e:
            pair.check()
        assert e.value.field == ("regions[5].row_offset" if kernel == 16 else "kernel_block_size")


@pytest.mark.parametrize(("compat", "field"), [("vllm", "num_regions"), ("kvgeom", "regions")])
def test_packed_rows_viewed_differently_across_tp_are_refused(compat: str, field: str) -> None:
    """GDN(4, 4, 4, 4) without a main KV, packed: at TP1 a GDN state is 3 conv pieces x 16 channels x 3 rows x
    2 B + 4 heads x 16 x 2 B = 416 B, and only one fits the 2 x 256-byte compressed-key width, so each GDN layer
    gets a group of its own, both starting at byte 0 of the row (3 regions); at TP4 (104 B) both share one
    group and the second starts at byte 104 (4 regions). The regions do not line up: refused in both modes."""
    model = csa_linear_model(gdn=MambaSpec.gdn(4, 4, 4, 4))
    local, remote = (
        rank_geometry(model, eng(4, packed_rows=True)),
        rank_geometry(model, eng(1, packed_rows=True)),
    )
    assert (len(local.regions), len(remote.regions)) == (4, 3)
    with pytest.raises(IncompatiblePairError) as e:
        check_pair(local, remote, "pull", compat)  # type: ignore[arg-type]
    assert e.value.field == field
    if compat == "vllm":
        assert (e.value.values["local"], e.value.values["remote"]) == (4, 3)
