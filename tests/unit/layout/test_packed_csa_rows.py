"""Packed CSA-linear rows across TP sizes (``EngineConfig(packed_rows=True)``, kvgeom/layout/csarows.py): the geometry
helpers (``packed_csa_rows``, ``RankGeometry.layer_page``, ``region_tp_scaling``), kvgeom mode's streams
(``streams.packed_streams``, ``desc_segments(..., group_streams=True)``, ``route(..., unread=...)``,
``Pairing.zero_pages`` / ``Pairing.route``), the chunked read of replicated CSA pages, and the handshake's
refusals (``_check_packed_rows``, ``check_csa_linear_pair``'s ``packed_rows``).

Hand-derived from ``csa_linear_model(main_kv_heads=2, gdn=MambaSpec.gdn(4, 4, 4, 4))`` (``MODEL``), block 16,
8 blocks, packed rows. Groups: 0 main KV + MLA (kv0, attn0, kv2, attn2), 1 rings, 2 GDN states, 3 PLE. Pages
per rank: main KV 16 tokens x 1 head x (8 + 8) x 2 B = 512 B (2 heads: one per rank at TP2, replicated at
TP4), MLA 16 x 8 x 2 B = 256 B, ring 64 B, GDN state 208 B at TP2 and 104 B at TP4, PLE 48 B. The 1,536-byte
row: kv0 @0, kv2 @512, attn0 @1024, attn2 @1280; rings @0 and @64; GDN states @0 and @208 (TP4 @104); PLE
@0. Regions in layer order: 0 kv0 @0 (512 B; ring0, gdn1 and ple start there too), 1 attn0 @1024 (256),
2 kv2 @512 (512), 3 attn2 @1280 (256), 4 ring2 @64 (64), 5 gdn3 @208 (208; TP4 @104, 104 B)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgeom.errors import GroupMismatchError, IncompatiblePairError, KvgeomError, UnsupportedError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import RankGeometry, packed_csa_rows
from kvgeom.layout.view import pseudo
from kvgeom.model.csa import csa_linear_model
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.pair.handshake import check_pair
from kvgeom.pair.route import route
from kvgeom.pair.streams import PackedStream, packed_streams, pair_streams
from kvgeom.plan.align import Page
from kvgeom.plan.descids import desc_segments, segment_ids
from kvgeom.plan.pairing import Pairing

MODEL = csa_linear_model(main_kv_heads=2, gdn=MambaSpec.gdn(4, 4, 4, 4))
PLAIN = csa_linear_model()  # no main KV: MLA, rings, GDN(2, 4, 2, 4) (208 B at TP1, 104 B at TP2), PLE
ROW = 1536


def eng(tp: int, rank: int = 0, packed: bool = True, **kw: object) -> EngineConfig:
    return EngineConfig(tp_size=tp, tp_rank=rank, block_size=16, num_blocks=8, packed_rows=packed, **kw)  # type: ignore[arg-type]


def geo(model: ModelSpec, tp: int, rank: int = 0, packed: bool = True, **kw: object) -> RankGeometry:
    return rank_geometry(model, eng(tp, rank, packed, **kw))


def refused(cls: type[KvgeomError], field: str, fn: object, **values: object) -> None:
    with pytest.raises(KvgeomError) as info:
        fn()  # type: ignore[operator]
    assert type(info.value) is cls, (type(info.value), info.value)
    assert info.value.field == field, info.value
    assert info.value.values == values, info.value.values


# ---- geometry -------------------------------------------------------------------------------------------


def test_packed_csa_rows() -> None:
    assert packed_csa_rows(geo(MODEL, 2)) is True
    assert packed_csa_rows(geo(MODEL, 2, packed=False)) is False  # a CSA-linear rank, regions of its own
    # an MLA model without SSM may use packed rows too, but it is no CSA-linear rank
    mla = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 2)
    assert packed_csa_rows(geo(mla, 1)) is False


def test_layer_page() -> None:
    g2, g4 = geo(MODEL, 2), geo(MODEL, 4)
    pages = {
        n: g2.layer_page(n) for n in ("layers.0.kv", "layers.0.attn", "layers.0.ring", "layers.1.gdn", "ple")
    }
    assert pages == {
        "layers.0.kv": 512,
        "layers.0.attn": 256,
        "layers.0.ring": 64,
        "layers.1.gdn": 208,
        "ple": 48,
    }
    assert (g4.layer_page("layers.0.kv"), g4.layer_page("layers.3.gdn")) == (512, 104)
    # one kernel block of a logical one: 4 heads of 2 (fp16) at TP2, 2 per rank x (2 + 2) x 2 B x 16 tokens
    # = 256 B per logical block of 16, two kernel blocks of 8: 128 B
    dense = ModelSpec.from_layers("d", [AttentionSpec(4, 2, "float16")] * 2)
    g = rank_geometry(dense, EngineConfig(tp_size=2, block_size=16, kernel_block_size=8, num_blocks=8))
    assert g.ppl == 2 and g.layer_page(dense.layers[0].name) == 128


def test_region_tp_scaling() -> None:
    # region 0 holds kv0 (heads) beside the ring, GDN and PLE; 1 and 3 MLA; 4 a ring; 5 only a GDN state
    assert geo(MODEL, 2).region_tp_scaling == ("heads", "whole", "heads", "whole", "whole", "state")
    # without main KV: region 0 holds attn0 (MLA) beside ring0, gdn1 (a state) and ple: not only states
    assert geo(PLAIN, 1).region_tp_scaling == ("whole", "whole", "whole", "state")


# ---- streams --------------------------------------------------------------------------------------------


def test_packed_streams() -> None:
    """One stream per region for the first token group viewing it (region 5: the GDN state's group, kind
    "state"), then one more over region 0 for the ring group (ring0 starts there too), 64 B."""
    want = (
        PackedStream(0, 0, 512, "heads"),
        PackedStream(1, 0, 256, "whole"),
        PackedStream(2, 0, 512, "heads"),
        PackedStream(3, 0, 256, "whole"),
        PackedStream(4, 1, 64, "whole"),
        PackedStream(5, 2, 208, "state"),
        PackedStream(0, 1, 64, "whole"),
    )
    assert packed_streams(geo(MODEL, 2)) == want
    assert packed_streams(geo(MODEL, 4))[5] == PackedStream(5, 2, 104, "state")
    # without main KV (TP1): regions 0 attn0 @0 (also ring0, gdn1, ple), 1 attn2 @256, 2 ring2 @64, 3 gdn3 @208
    assert packed_streams(geo(PLAIN, 1)) == (
        PackedStream(0, 0, 256, "whole"),
        PackedStream(1, 0, 256, "whole"),
        PackedStream(2, 1, 64, "whole"),
        PackedStream(3, 2, 208, "state"),
        PackedStream(0, 1, 64, "whole"),
    )


def test_kvgeom_pair_streams_of_packed_rows() -> None:
    """D TP4 (local) and P TP2: the streams above as views; page kinds other than "heads" read as latents."""
    local, remote = geo(MODEL, 4), geo(MODEL, 2, 1)
    lview, rview = pair_streams(local, remote, "pull", "kvgeom")
    assert lview.group_streams and rview.group_streams
    assert lview.bases == rview.bases == tuple(pseudo(r) for r in (0, 1, 2, 3, 4, 5, 0))
    assert lview.block_lens == (512, 256, 512, 256, 64, 104, 64)
    assert rview.block_lens == (512, 256, 512, 256, 64, 208, 64)
    assert lview.block_strides == rview.block_strides == (ROW,) * 7
    assert lview.region_is_mla == (False, True, False, True, True, True, True)
    assert lview.group_ids == rview.group_ids == (0, 0, 0, 0, 1, 2, 1)
    assert rview.tp_rank == 1 and lview.tp_rank == 0
    # vllm mode: vLLM's own region streams, no group streams
    assert not pair_streams(local, local, "pull", "vllm")[0].group_streams


def test_kvgeom_packed_streams_refuse_regions_of_other_groups() -> None:
    """The remote's region 4 viewed by kv2 (group 0, a head-sharded page) instead of ring2."""
    local = geo(MODEL, 2)
    bad = replace(
        local,
        regions=(
            *local.regions[:4],
            replace(local.regions[4], members=((0, "layers.2.kv"),)),
            local.regions[5],
        ),
    )
    here = [
        (0, 0, "heads"),
        (1, 0, "whole"),
        (2, 0, "heads"),
        (3, 0, "whole"),
        (4, 1, "whole"),
        (5, 2, "state"),
        (0, 1, "whole"),
    ]
    there = [*here[:4], (4, 0, "heads"), *here[5:]]
    refused(
        IncompatiblePairError,
        "regions",
        lambda: pair_streams(local, bad, "pull", "kvgeom"),
        local=here,
        remote=there,
    )


# ---- desc_segments(group_streams=True) ------------------------------------------------------------------

GROUPS_SSM = (False, False, True, True)


def _segments(**kw: object) -> object:
    args: dict[str, object] = dict(
        num_groups=4,
        dst_num_blocks=8,
        num_regions=7,
        block_size_ratio=1,
        physical_blocks_per_logical=1,
        group_is_ssm=GROUPS_SSM,
        ssm_region_indices=[0, 5],
        num_conv_pieces=3,
        region_group_ids=[0, 0, 0, 0, 1, 2, 1],
        ple_group=3,
    )
    args.update(kw)
    return desc_segments(**args)  # type: ignore[arg-type]


def test_desc_segments_group_streams() -> None:
    """7 streams of 8 blocks: nfa = 56; group 0 through streams 0-3 (offsets 0, 8, 16, 24), group 1 through
    4 and 6 (32, 48); GDN: 2 SSM regions x (3 conv pieces + temporal) = 8 streams at 56 + 8s; the PLE group
    the one after them, 56 + 64 = 120. Ids ((1, 2, 3), (4,), (5,), (6,)): group 0 at 1-3 + each offset,
    ring 36 and 52, GDN 61, 69, ..., 117, PLE 126."""
    seg = _segments(group_streams=True)
    assert seg.offset.tolist() == [0, 8, 16, 24, 32, 48, *range(56, 120, 8), 120]  # type: ignore[attr-defined]
    assert seg.group.tolist() == [0] * 4 + [1] * 2 + [2] * 8 + [3]  # type: ignore[attr-defined]
    assert seg.capacity.tolist() == [8] * 15  # type: ignore[attr-defined]
    ids = segment_ids(seg, ((1, 2, 3), (4,), (5,), (6,)), GROUPS_SSM)  # type: ignore[arg-type]
    assert ids.tolist() == [1, 2, 3, 9, 10, 11, 17, 18, 19, 25, 26, 27, 36, 52, *range(61, 118, 8), 126]
    # without group streams (vLLM's path 4): every token group through all 7 regions
    plain = _segments()
    assert plain.group.tolist()[:14] == [0] * 7 + [1] * 7  # type: ignore[attr-defined]
    assert plain.offset.tolist()[:14] == list(range(0, 56, 8)) * 2  # type: ignore[attr-defined]


def test_desc_segments_group_streams_need_one_group_id_per_region() -> None:
    refused(
        GroupMismatchError,
        "region_group_ids",
        lambda: _segments(group_streams=True, region_group_ids=[0, 0, 0, 0, 1, 2]),
        value=6,
        expected=7,
    )
    refused(
        GroupMismatchError,
        "region_group_ids",
        lambda: _segments(group_streams=True, region_group_ids=None),
        value=0,
        expected=7,
    )
    # one id too many is refused too
    refused(
        GroupMismatchError,
        "region_group_ids",
        lambda: _segments(group_streams=True, region_group_ids=[0, 0, 0, 0, 1, 2, 1, 1]),
        value=8,
        expected=7,
    )


# ---- route(unread=...) and the pairing ------------------------------------------------------------------


def _packed_route(unread: frozenset[int]) -> object:
    local, remote = geo(MODEL, 4), geo(MODEL, 2)
    return route(
        local,
        remote,
        0,
        "pull",
        1,
        (512, 256, 512, 256, 64, 208, 64),
        (512, 256, 512, 256, 64, 104, 64),
        (False, True, False, True, True, True, True),
        unread,
    )


def test_route_reads_an_unread_stream_of_other_lengths() -> None:
    """D TP4 rank 0 from P TP2 rank 0 (its only source: both hold head 0): every stream whole; the GDN
    state's stream 5 (104 B here, 208 B there) is unread, cut to the shorter side; read, it is refused."""
    r = _packed_route(frozenset({5}))
    assert r.fa == ((0, 0, 512), (0, 0, 256), (0, 0, 512), (0, 0, 256), (0, 0, 64), (0, 0, 104), (0, 0, 64))  # type: ignore[attr-defined]
    assert r.groups[0] is True  # type: ignore[attr-defined]
    refused(
        UnsupportedError, "regions[5].block_len", lambda: _packed_route(frozenset()), local=104, remote=208
    )


def test_pairing_of_packed_rows() -> None:
    """The pairing passes the SSM group's stream (5) as unread and fills each group's own pages: group 0 the
    main-KV and MLA pages of regions 0-3, group 1 ring0 (region 0 has no slots: its whole 512-byte block) and
    ring2 (region 4)."""
    local = geo(MODEL, 4)
    pairing = Pairing.create(local, [geo(MODEL, 2, 0), geo(MODEL, 2, 1)], "pull", "kvgeom")
    assert pairing.local_view.group_streams
    assert pairing.route(0).fa[5] == (0, 0, 104)
    assert pairing.zero_pages(0) == [
        Page(0, 0, 512, ROW, 1),
        Page(1, 0, 256, ROW, 1),
        Page(2, 0, 512, ROW, 1),
        Page(3, 0, 256, ROW, 1),
    ]
    assert pairing.zero_pages(1) == [Page(0, 0, 512, ROW, 1), Page(4, 0, 64, ROW, 1)]


# ---- the chunked read of replicated CSA pages -----------------------------------------------------------

K4 = csa_linear_model(
    main_kv_heads=4
)  # regions (unpacked): 0 kv0, 1 attn0 (+ ring0, gdn1, ple), 2 kv2, 3 attn2


def _k4_route(
    j: int,
    local_lens: tuple[int, ...] | None = None,
    remote_lens: tuple[int, ...] = (1024, 256, 1024, 256),
    unread: frozenset[int] = frozenset(),
) -> object:
    local = rank_geometry(K4, EngineConfig(tp_size=1, block_size=16, num_blocks=16))
    remote = rank_geometry(K4, EngineConfig(tp_size=2, tp_rank=j, block_size=16, num_blocks=16))
    return route(local, remote, j, "pull", 1, remote_lens, local_lens, None, unread)


def test_replicated_csa_pages_are_read_in_chunks() -> None:
    """K=4, P TP2 -> D TP1: D's 2,048-byte main-KV page (4 heads of 512 B) takes heads 2j, 2j + 1 from P rank
    j: D bytes [1024 j, 1024 j + 1024) from P bytes [0, 1024). The 256-byte MLA pages (identical on both P
    ranks) are read as two 128-byte halves: bytes [128 j, 128 j + 128) from P rank j."""
    for j in (0, 1):
        r = _k4_route(j)
        assert all(isinstance(x, int) for s in r.fa for x in s)  # type: ignore[attr-defined]  # byte counts, not floats
        assert r.fa == (
            (1024 * j, 0, 1024),
            (128 * j, 128 * j, 128),
            (1024 * j, 0, 1024),
            (128 * j, 128 * j, 128),
        )  # type: ignore[attr-defined]


def test_a_replicated_page_that_does_not_divide_is_read_whole() -> None:
    """A 255-byte MLA page (odd: no two equal halves) is read whole from each P rank; an unread stream is
    read whole too; pages of different lengths (256 here, 128 there) are refused."""
    r = _k4_route(1, (2048, 255, 2048, 256), (1024, 255, 1024, 256))
    assert r.fa[1] == (0, 0, 255) and r.fa[3] == (128, 128, 128)  # type: ignore[attr-defined]
    assert _k4_route(1, unread=frozenset({1})).fa[1] == (0, 0, 256)  # type: ignore[attr-defined]
    refused(
        UnsupportedError,
        "regions[1].block_len",
        lambda: _k4_route(1, remote_lens=(1024, 128, 1024, 256)),
        local=256,
        remote=128,
    )


# ---- handshake: _check_packed_rows and check_csa_linear_pair --------------------------------------------

NAMES = [
    ("layers.0.kv", "layers.0.ring", "layers.1.gdn", "ple"),
    ("layers.0.attn",),
    ("layers.2.kv",),
    ("layers.2.attn",),
    ("layers.2.ring",),
    ("layers.3.gdn",),
]


def _with_region(g: RankGeometry, i: int, **kw: object) -> RankGeometry:
    regions = list(g.regions)
    regions[i] = replace(regions[i], **kw)  # type: ignore[arg-type]
    return replace(g, regions=tuple(regions))


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_packed_rows_of_other_layers_are_refused(compat: str) -> None:
    """The remote's region 0 lists gdn1 before ring0 (its name, groups and kinds as before: vLLM's region
    names and kvgeom mode's streams pair; the handshake compares the layers); in kvgeom mode also a region 4
    viewed by ring0 instead of ring2 (same group and kind)."""
    local = geo(MODEL, 2)
    order = ((0, "layers.0.kv"), (2, "layers.1.gdn"), (1, "layers.0.ring"), (3, "ple"))
    bad = _with_region(local, 0, members=order)
    there = [("layers.0.kv", "layers.1.gdn", "layers.0.ring", "ple"), *NAMES[1:]]
    refused(
        IncompatiblePairError,
        "regions",
        lambda: check_pair(local, bad, "pull", compat),  # type: ignore[arg-type]
        local=NAMES,
        remote=there,
    )
    check_pair(local, geo(MODEL, 2, 1), "pull", compat)  # type: ignore[arg-type]
    if compat == "kvgeom":
        ring = _with_region(local, 4, members=((1, "layers.0.ring"),))
        there = [*NAMES[:4], ("layers.0.ring",), NAMES[5]]
        refused(
            IncompatiblePairError,
            "regions",
            lambda: check_pair(local, ring, "pull", "kvgeom"),
            local=NAMES,
            remote=there,
        )


def test_packed_rows_region_lengths_by_kind() -> None:
    """K=2, TP2 both sides: a remote MLA page (region 1, "whole") of 128 B instead of 256 is refused; a state
    region's length is not compared here (states are checked piece by piece)."""
    local = geo(MODEL, 2)
    refused(
        IncompatiblePairError,
        "regions[1].block_len",
        lambda: check_pair(local, _with_region(local, 1, block_len=128), "pull", "kvgeom"),
        local=256,
        remote=128,
    )
    check_pair(local, _with_region(local, 5, block_len=100), "pull", "kvgeom")
    # K=4, TP1 -> TP2: a head-sharded page of the remote is 2,048 x 2 / 4 = 1,024 B; 2,048 is refused
    k1, k2 = geo(K4, 1), geo(K4, 2)
    check_pair(k1, k2, "pull", "kvgeom")
    refused(
        IncompatiblePairError,
        "regions[2].block_len",
        lambda: check_pair(k1, _with_region(k2, 2, block_len=2048), "pull", "kvgeom"),
        local=2048,
        remote=2048,
    )


def test_vllm_mode_needs_equal_lengths_without_a_head_sharded_main_kv() -> None:
    """No main KV (MLA-only), TP1 vs TP2: the GDN-only region 3 is 208 B vs 104 B; vLLM asserts equal lengths,
    vllm mode refuses; kvgeom mode pairs it."""
    local, remote = geo(PLAIN, 1), geo(PLAIN, 2)
    refused(
        IncompatiblePairError,
        "regions[3].block_len",
        lambda: check_pair(local, remote, "pull", "vllm"),
        local=208,
        remote=104,
    )
    check_pair(local, remote, "pull", "kvgeom")


def test_vllm_mode_refuses_other_row_offsets() -> None:
    """With main KV, P TP2 -> D TP4: region 5 at row byte 104 (D) vs 208 (P); equal TP sizes pass."""
    refused(
        UnsupportedError,
        "regions[5].row_offset",
        lambda: check_pair(geo(MODEL, 4), geo(MODEL, 2), "pull", "vllm"),
        local=104,
        remote=208,
    )
    check_pair(geo(MODEL, 2), geo(MODEL, 2, 1), "pull", "vllm")
    check_pair(geo(MODEL, 4), geo(MODEL, 2), "pull", "kvgeom")


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_packed_rows_on_one_side_only_are_refused(compat: str) -> None:
    packed, plain = geo(MODEL, 2), geo(MODEL, 2, packed=False)
    refused(
        IncompatiblePairError,
        "packed_rows",
        lambda: check_pair(plain, packed, "pull", compat),
        local=False,
        remote=True,
    )  # type: ignore[arg-type]
    refused(
        IncompatiblePairError,
        "packed_rows",
        lambda: check_pair(packed, plain, "pull", compat),
        local=True,
        remote=False,
    )  # type: ignore[arg-type]
    check_pair(plain, geo(MODEL, 2, 1, packed=False), "pull", compat)  # type: ignore[arg-type]


# ---- three CSA layers: a state-only region before others, more than 8 regions ---------------------------

PLAIN3 = csa_linear_model(num_csa_layers=3)
MODEL3 = csa_linear_model(num_csa_layers=3, main_kv_heads=2, gdn=MambaSpec.gdn(4, 4, 4, 4))


def test_packed_streams_go_on_past_a_state_only_region() -> None:
    """PLAIN3 at TP1: MLA pages at 0, 256, 512; rings at 0, 64, 128; GDN states (208 B) at 0, 208, 416.
    Regions in layer order: 0 attn0 @0 (ring0, gdn1, ple), 1 attn2 @256, 2 ring2 @64, 3 gdn3 @208, 4 attn4
    @512, 5 ring4 @128, 6 gdn5 @416: the state-only region 3 comes before regions 4-6."""
    g = geo(PLAIN3, 1)
    assert [r.row_offset for r in g.regions] == [0, 256, 64, 208, 512, 128, 416]
    assert packed_streams(g) == (
        PackedStream(0, 0, 256, "whole"),
        PackedStream(1, 0, 256, "whole"),
        PackedStream(2, 1, 64, "whole"),
        PackedStream(3, 2, 208, "state"),
        PackedStream(4, 0, 256, "whole"),
        PackedStream(5, 1, 64, "whole"),
        PackedStream(6, 2, 208, "state"),
        PackedStream(0, 1, 64, "whole"),
    )


# MODEL3 at TP2: row kv0 @0, kv2 @512, kv4 @1024, attn0 @1536, attn2 @1792, attn4 @2048 (2,304 B); rings @0, 64,
# 128; GDN states (208 B) @0, 208, 416. Regions: 0 kv0 (ring0, gdn1, ple), 1 attn0, 2 kv2, 3 attn2, 4 ring2,
# 5 gdn3, 6 kv4, 7 attn4, 8 ring4, 9 gdn5: refusals name the first 8.
NAMES3 = [*NAMES, ("layers.4.kv",), ("layers.4.attn",)]
STREAMS3 = [
    (0, 0, "heads"),
    (1, 0, "whole"),
    (2, 0, "heads"),
    (3, 0, "whole"),
    (4, 1, "whole"),
    (5, 2, "state"),
    (6, 0, "heads"),
    (7, 0, "whole"),
]


def test_refusals_of_many_regions_name_the_first_eight() -> None:
    local = geo(MODEL3, 2)
    assert [r.row_offset for r in local.regions] == [0, 1536, 512, 1792, 64, 208, 1024, 2048, 128, 416]
    swapped = _with_region(
        local, 0, members=((0, "layers.0.kv"), (2, "layers.1.gdn"), (1, "layers.0.ring"), (3, "ple"))
    )
    there = [("layers.0.kv", "layers.1.gdn", "layers.0.ring", "ple"), *NAMES3[1:]]
    refused(
        IncompatiblePairError,
        "regions",
        lambda: check_pair(local, swapped, "pull", "vllm"),
        local=NAMES3,
        remote=there,
    )
    kv = _with_region(local, 4, members=((0, "layers.2.kv"),))
    refused(
        IncompatiblePairError,
        "regions",
        lambda: pair_streams(local, kv, "pull", "kvgeom"),
        local=STREAMS3,
        remote=[*STREAMS3[:4], (4, 0, "heads"), *STREAMS3[5:]],
    )


def test_layer_page_is_an_int() -> None:
    assert type(geo(MODEL, 2).layer_page("layers.0.kv")) is int


def test_packed_pairing_reads_replicated_pages_in_chunks_and_only_the_state_stream_unread() -> None:
    """K=4 packed, P TP2 -> D TP1 (kvgeom mode). D's streams: 0 kv0 (2,048 B, 4 heads), 1 attn0 (256), 2 kv2,
    3 attn2, 4 ring2 (64), 5 gdn3 (208, the state's: unread), 6 ring0 (64). From P rank j (heads 2j, 2j + 1):
    head slices (1024 j, 0, 1024) of each main-KV page, halves (128 j, 128 j, 128) of the MLA pages and
    (32 j, 32 j, 32) of the ring pages; the unread state stream cut to the shorter side (P's 104 B)."""
    local = geo(K4, 1)
    pairing = Pairing.create(local, [geo(K4, 2, 0), geo(K4, 2, 1)], "pull", "kvgeom")
    for j in (0, 1):
        assert pairing.route(j).fa == (
            (1024 * j, 0, 1024),
            (128 * j, 128 * j, 128),
            (1024 * j, 0, 1024),
            (128 * j, 128 * j, 128),
            (32 * j, 32 * j, 32),
            (0, 0, 104),
            (32 * j, 32 * j, 32),
        )
