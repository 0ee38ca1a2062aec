"""kvgeom.layout.geometry pinned exactly on small models: grouping, regions, pages, the SSM layout, the
hybrid block-size alignment, and every refusal's class, field and values. All numbers are worked out by
hand in the comments from these specs:

* ``M`` = Mamba2, 8 heads x 4, 2 groups x 16 state, conv kernel 3 (2 rows), bfloat16: conv pieces x, B, C
  of 32 channels x 2 rows x 2 B = 128 B each (384 B); temporal 8 x 4 x 16 x 2 B = 1024 B; state 1408 B.
* ``A`` = attention, 2 KV heads x 8, bfloat16: 2 x (8 + 8) x 2 B = 64 B per token at TP 1.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvgeom.errors import ConfigError, SpecError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import Group, Region, align_hybrid_block_size
from kvgeom.model.layers import AttentionSpec, LayerKind, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec

M = MambaSpec.mamba2(8, 4, 2, 16, 3)
A = AttentionSpec(2, 8)
L = MLASpec(8)  # 16 B per token


def _model(*specs: Any) -> ModelSpec:
    return ModelSpec.from_layers("m", list(specs))


def _refused(
    exc: type[Exception], field: str, values: dict[str, Any], model: ModelSpec, **engine: Any
) -> None:
    with pytest.raises(exc) as info:
        rank_geometry(model, EngineConfig(**{"tp_size": 1, "block_size": 16, "num_blocks": 5, **engine}))
    assert type(info.value) is exc
    assert info.value.field == field, str(info.value)
    assert info.value.values == values


# -- the hybrid block size ---------------------------------------------------------------------------
def test_align_hybrid_block_size() -> None:
    h = _model(M, A)
    # A = max(16, 16) = 16 tokens: 16 x 64 = 1024 B per step; ceil(1408 / 1024) = 2 steps -> 32
    assert align_hybrid_block_size(h, 1, 16) == 32
    # A = max(4, 8) = 8: 512 B per step; ceil(1408 / 512) = 3 -> 24; the kernel blocks' lcm rounds it up
    assert align_hybrid_block_size(h, 1, 8, 4) == 24
    assert align_hybrid_block_size(h, 1, 8, 4, kernel_block_sizes=(16,)) == 32
    assert align_hybrid_block_size(h, 1, 8, 4, kernel_block_sizes=(16, 24)) == 48  # lcm 48
    assert align_hybrid_block_size(h, 1, 8, 4, kernel_block_sizes=(8, 12)) == 24  # lcm 24 = 24
    # a block large enough already: A = 64 -> 4096 B holds 1408 B in one step
    assert align_hybrid_block_size(h, 1, 64) == 64
    # the largest attention page per token counts: A' = 4 heads x 16 x 2 B = 128 B; 16 x 128 = 2048 >= 1408
    assert align_hybrid_block_size(_model(M, A, AttentionSpec(4, 8)), 1, 16) == 16
    # TP 2: x 16 + B 32 + C 32 channels (groups replicated? 2 / 2 = 1 each: 16) -> 48 x 2 x 2 = 192 B, temporal
    # 4 x 64 x 2 = 512 B: 704 B; A: 1 head x 16 x 2 B = 32 B/token; A = 8 -> 256 B; ceil(704 / 256) = 3 -> 24
    assert align_hybrid_block_size(h, 2, 8, 8) == 24
    # mla_alignment counts only for MLA models: MLA 16 B/token, KDA 2 x 8 kernel 3: conv 3 x 16 x 2 x 2 B = 192,
    # state 2 x 64 x 4 B = 512 -> 704 B; A = 16 -> 256 B; ceil(704 / 256) = 3 -> 48
    kimi = _model(MambaSpec.kda(2, 8, 3), L)
    assert align_hybrid_block_size(kimi, 1, 16) == 48
    assert align_hybrid_block_size(kimi, 1, 16, mla_alignment=128) == 128  # 128 x 16 B = 2048 >= 704
    assert align_hybrid_block_size(h, 1, 16, mla_alignment=128) == 32
    # nothing to align: no SSM state, or no attention layer
    assert align_hybrid_block_size(_model(A, A), 1, 7) == 7
    assert align_hybrid_block_size(_model(M, M), 1, 7) == 7


# -- grouping ----------------------------------------------------------------------------------------
def _groups(model: ModelSpec, **engine: Any) -> list[tuple[int, LayerKind, tuple[str, ...]]]:
    g = rank_geometry(model, EngineConfig(**{"tp_size": 1, "block_size": 32, "num_blocks": 5, **engine}))
    return [(x.index, x.kind, x.layers) for x in g.groups]


def test_grouping() -> None:
    # A M M A M M: attention [0, 3], SSM [1, 2, 4, 5]; chunks of the smallest count, 2; attention first
    h6 = _model(A, M, M, A, M, M)
    assert _groups(h6) == [
        (0, LayerKind.ATTENTION, ("layers.0.attn", "layers.3.attn")),
        (1, LayerKind.MAMBA2, ("layers.1.mamba", "layers.2.mamba")),
        (2, LayerKind.MAMBA2, ("layers.4.mamba", "layers.5.mamba")),
    ]
    # SSM first in the model: attention groups still come first
    assert _groups(_model(M, A)) == [
        (0, LayerKind.ATTENTION, ("layers.1.attn",)),
        (1, LayerKind.MAMBA2, ("layers.0.mamba",)),
    ]
    # full attention of two specs (a GQA draft beside MLA): one group with the first layer's spec
    g = rank_geometry(_model(L, A), EngineConfig(1, 16, 5))
    assert g.groups == (Group(0, L, ("layers.0.attn", "layers.1.attn")),)
    # a sliding-window layer is not full attention: grouped apart, chunked by the smallest count (1)
    w = AttentionSpec(2, 8, sliding_window=4)
    assert _groups(_model(A, w, A)) == [
        (0, LayerKind.ATTENTION, ("layers.0.attn",)),
        (1, LayerKind.ATTENTION, ("layers.2.attn",)),
        (2, LayerKind.SLIDING_WINDOW, ("layers.1.attn",)),
    ]
    assert _groups(_model(A, A, A)) == [
        (0, LayerKind.ATTENTION, ("layers.0.attn", "layers.1.attn", "layers.2.attn"))
    ]
    # three distinct full-attention specs: still one group
    assert len(rank_geometry(_model(A, L, AttentionSpec(4, 8)), EngineConfig(1, 16, 5)).groups) == 1


def test_group_properties() -> None:
    assert Group(0, M, ()).is_ssm and not Group(0, M, ()).is_mla and Group(0, M, ()).kind is LayerKind.MAMBA2
    assert Group(0, L, ()).is_mla and not Group(0, L, ()).is_ssm
    assert not Group(0, A, ()).is_mla


# -- uniform (one-group) models ------------------------------------------------------------------------
def test_uniform_regions_and_page() -> None:
    model = _model(A, None, A)
    g = rank_geometry(model, EngineConfig(1, 16, 5, kernel_block_size=4))
    # kernel 4 tokens x 64 B = 256 B per kernel block; 16 / 4 = 4 kernel blocks per logical block
    assert g.regions == (
        Region(0, "layers.0.attn", 256, 256, 20, False, ((0, "layers.0.attn"),), "kv"),
        Region(1, "layers.2.attn", 256, 256, 20, False, ((0, "layers.2.attn"),), "kv"),
    )
    assert g.page_bytes == 1024 and g.ssm is None  # 16 tokens x 64 B
    # split K/V with a larger V head (16): K 4 x 2 x 8 x 2 = 128 B, V 4 x 2 x 16 x 2 = 256 B per kernel block
    av = AttentionSpec(2, 8, head_size_v=16)
    s = rank_geometry(_model(av, av), EngineConfig(1, 16, 5, kernel_block_size=4, kv_split=True))
    assert [(r.index, r.name, r.block_len, r.part, r.members) for r in s.regions] == [
        (0, "layers.0.attn.k", 128, "k", ((0, "layers.0.attn"),)),
        (1, "layers.0.attn.v", 256, "v", ((0, "layers.0.attn"),)),
        (2, "layers.1.attn.k", 128, "k", ((0, "layers.1.attn"),)),
        (3, "layers.1.attn.v", 256, "v", ((0, "layers.1.attn"),)),
    ]
    assert s.page_bytes == (128 + 256) * 4
    assert all(r.block_stride == r.block_len and r.num_blocks == 20 for r in s.regions)
    # TP 2: one head per rank: K 4 x 8 x 2 = 64 B
    s2 = rank_geometry(_model(av), EngineConfig(2, 16, 5, kernel_block_size=4, kv_split=True, tp_rank=1))
    assert [r.block_len for r in s2.regions] == [64, 128]
    # MLA: kernel x latent bytes, flagged MLA; kv_split does not split a latent
    m = rank_geometry(_model(L, L), EngineConfig(2, 16, 5, kv_split=True))
    assert [(r.name, r.block_len, r.is_mla, r.part) for r in m.regions] == [
        ("layers.0.attn", 256, True, "kv"),
        ("layers.1.attn", 256, True, "kv"),
    ]


def test_packed_rows() -> None:
    g = rank_geometry(_model(L, L, L), EngineConfig(1, 16, 5, packed_rows=True))
    # three 256 B pages side by side in one 768 B row
    names = ("layers.0.attn", "layers.1.attn", "layers.2.attn")
    assert g.regions == (
        Region(
            0,
            "layers.0.attn",
            768,
            768,
            5,
            True,
            tuple((0, n) for n in names),
            "kv",
            ((0, 256), (256, 256), (512, 256)),
        ),
    )
    assert g.page_bytes == 256
    r = g.regions[0]
    assert r.is_packed and r.slot("layers.2.attn") == (512, 256) and r.nbytes == 5 * 768
    with pytest.raises(SpecError) as info:
        r.slot("layers.9.attn")
    assert info.value.field == "layer" and info.value.values == {"value": "layers.9.attn"}
    _refused(ConfigError, "packed_rows", {"value": True}, _model(A, A), packed_rows=True)
    _refused(ConfigError, "packed_rows", {"value": True}, _model(L, A), packed_rows=True)
    _refused(ConfigError, "packed_rows", {"value": True}, _model(MambaSpec.kda(2, 8, 3), L), packed_rows=True)


def test_region_helpers() -> None:
    r = Region(3, "x", 10, 16, 4, False, ((0, "a"), (2, "b")))
    assert r.nbytes == 64 and not r.is_packed
    assert r.slot("b") == (0, 10) and r.slot("a") == (0, 10)
    assert r.member_of(2) == "b" and r.member_of(0) == "a" and r.member_of(1) is None
    zero = Region(0, "x", 10, 10, 1, False, ((0, "a"),), "kv", ((0, 10),))
    assert not zero.is_packed and zero.slot("a") == (0, 10)
    two = Region(0, "x", 10, 10, 1, False, ((0, "a"), (1, "b")), "kv", ((0, 4), (4, 6)))
    assert two.slot("b") == (4, 6) and two.slot("a") == (0, 4) and two.is_packed


# -- hybrid models ---------------------------------------------------------------------------------------
def test_hybrid_regions_and_ssm_layout() -> None:
    h6 = _model(A, M, M, A, M, M)
    g = rank_geometry(h6, EngineConfig(1, 32, 5, kernel_block_size=16))
    # page = max(32 x 64 = 2048, 1408) = 2048; 2 kernel blocks of 1024 B per page; 5 x 2 = 10 kernel blocks
    assert g.page_bytes == 2048
    assert g.regions == (
        Region(
            0,
            "layers.0.attn",
            1024,
            1024,
            10,
            False,
            ((0, "layers.0.attn"), (1, "layers.1.mamba"), (2, "layers.4.mamba")),
        ),
        Region(
            1,
            "layers.3.attn",
            1024,
            1024,
            10,
            False,
            ((0, "layers.3.attn"), (1, "layers.2.mamba"), (2, "layers.5.mamba")),
        ),
    )
    ssm = g.ssm
    assert ssm is not None and ssm.spec == M
    assert ssm.conv_offsets == ((0, 128), (128, 128), (256, 128))
    assert (ssm.conv_bytes, ssm.ssm_bytes, ssm.sizes, ssm.num_pieces) == (384, 1024, (384, 1024), 3)
    assert ssm.region_indices == (0, 1)
    # the rank's numbers
    assert (g.tp_size, g.tp_rank, g.block_size, g.logical_block_size, g.ppl) == (1, 0, 16, 32, 2)
    assert (g.logical_num_blocks, g.num_blocks, g.num_regions, g.num_fa_descs) == (5, 10, 2, 20)
    assert g.is_hybrid and g.has_ssm and not g.is_mla and not g.has_draft and g.num_kv_heads == 2
    assert g.group_is_ssm == (False, True, True) and g.region_is_mla == (False, False)
    assert g.ssm_region_indices == (0, 1)
    assert (
        g.group_layer_in_region(2, 1) == "layers.5.mamba" and g.group_layer_in_region(0, 0) == "layers.0.attn"
    )
    assert g.layer_names == tuple(f"layers.{i}.{'attn' if i in (0, 3) else 'mamba'}" for i in range(6))
    assert g.layer_specs == {la.name: la.spec for la in h6.layers}


def test_hybrid_pipeline_stage() -> None:
    h6 = _model(A, M, M, A, M, M)
    # 6 layers over 2 stages: 3 + 3; stage 0 holds layers 0-2
    g = rank_geometry(h6, EngineConfig(2, 32, 5, tp_rank=1, pp_size=2, pp_rank=0))
    assert [(x.index, x.layers) for x in g.groups] == [
        (0, ("layers.0.attn",)),
        (1, ("layers.1.mamba", "layers.2.mamba")),
        (2, ()),
    ]
    # region 1 holds only an SSM layer: a state region
    assert [(r.index, r.name, r.members, r.part) for r in g.regions] == [
        (0, "layers.0.attn", ((0, "layers.0.attn"), (1, "layers.1.mamba")), "kv"),
        (1, "layers.2.mamba", ((1, "layers.2.mamba"),), "state"),
    ]
    assert g.layer_names == ("layers.0.attn", "layers.1.mamba", "layers.2.mamba")
    assert (g.pp_size, g.pp_rank, g.global_rank, g.tp_rank) == (2, 0, 1, 1)
    assert g.ssm is not None and g.ssm.region_indices == (0, 1)
    # TP 2: A page 32 x 32 B = 1024 B >= 704 B of state
    assert g.page_bytes == 1024 and g.ssm.conv_offsets == ((0, 64), (64, 64), (128, 64))
    # 5 layers over 3 stages: 2, 2, 1; stage 1 (layers 2, 3) holds no cache layer
    sparse = _model(A, None, None, None, A)
    _refused(ConfigError, "pp_rank", {"value": 1, "expected": 3}, sparse, pp_size=3, pp_rank=1)
    assert rank_geometry(sparse, EngineConfig(1, 16, 5, pp_size=3, pp_rank=2)).layer_names == (
        "layers.4.attn",
    )


def test_ssm_only_model() -> None:
    g = rank_geometry(_model(M, M), EngineConfig(1, 16, 5))
    assert g.page_bytes == 1408 and not g.is_hybrid
    assert [(r.name, r.block_len, r.part, r.members) for r in g.regions] == [
        ("layers.0.mamba", 1408, "state", ((0, "layers.0.mamba"),)),
        ("layers.1.mamba", 1408, "state", ((0, "layers.1.mamba"),)),
    ]
    # 1408 B cannot be cut into 3 kernel blocks
    _refused(
        ConfigError,
        "kernel_block_size",
        {"value": 16, "expected": 48},
        _model(M, M),
        block_size=48,
        kernel_block_size=16,
    )
    assert rank_geometry(_model(M), EngineConfig(1, 64, 5, kernel_block_size=16)).regions[0].block_len == 352


def test_hybrid_refusals() -> None:
    h = _model(M, A)
    # 16 x 64 = 1024 B < 1408 B: the suggestion is align_hybrid_block_size's 32
    _refused(ConfigError, "block_size", {"value": 16, "expected": 32}, h)
    _refused(ConfigError, "kv_split", {"value": True}, h, block_size=32, kv_split=True)
    # attention pages that differ from each other (one equal to the unified page)
    _refused(
        ConfigError,
        "block_size",
        {"value": 32, "expected": 32},
        _model(M, A, AttentionSpec(4, 8)),
        block_size=32,
    )
    # TP must fit every spec: 2 KV heads at TP 3
    _refused(SpecError, "layers.1.attn.num_kv_heads", {"units": 2, "tp": 3}, _model(L, A), tp_size=3)
    _refused(SpecError, "conv piece x", {"units": 8, "tp": 3}, _model(M), tp_size=3)


def test_separate_group() -> None:
    model = _model(A, A, A)
    g = rank_geometry(model, EngineConfig(1, 16, 5, separate_group=("layers.1.attn",)))
    assert g.groups == (
        Group(0, A, ("layers.0.attn", "layers.2.attn")),
        Group(1, A, ("layers.1.attn",)),
    )
    assert [(r.name, r.members) for r in g.regions] == [
        ("layers.0.attn", ((0, "layers.0.attn"),)),
        ("layers.1.attn", ((1, "layers.1.attn"),)),
        ("layers.2.attn", ((0, "layers.2.attn"),)),
    ]
    assert g.page_bytes == 1024 and g.ssm is None
    everything = ("layers.0.attn", "layers.1.attn", "layers.2.attn")
    assert rank_geometry(model, EngineConfig(1, 16, 5, separate_group=everything)).groups == (
        Group(0, A, everything),
    )
    _refused(
        ConfigError,
        "separate_group",
        {"value": ["layers.7.attn", "x"]},
        model,
        separate_group=("x", "layers.7.attn", "layers.1.attn"),
    )
    _refused(
        ConfigError,
        "separate_group",
        {"value": ["layers.0.mamba"]},
        _model(M),
        separate_group=("layers.0.mamba",),
    )
    w = AttentionSpec(2, 8, sliding_window=4)
    _refused(
        ConfigError,
        "separate_group",
        {"value": ["layers.0.attn"]},
        _model(A, w),
        separate_group=("layers.0.attn",),
    )


def test_draft_under_mla() -> None:
    g = rank_geometry(_model(L, A), EngineConfig(2, 16, 5))
    assert g.is_mla and g.has_draft and g.num_kv_heads == 2
    assert [(r.block_len, r.is_mla) for r in g.regions] == [(256, True), (16 * 1 * 16 * 2, False)]
    assert g.region_is_mla == (True, False)
    assert not rank_geometry(_model(L), EngineConfig(1, 16, 5)).has_draft
    assert (
        "pipeline stage 1 of 2"
        in rank_geometry(_model(L, L), EngineConfig(1, 16, 5, pp_size=2, pp_rank=1)).describe()
    )
    assert "pipeline stage" not in g.describe()


def test_align_hybrid_block_size_edges() -> None:
    # the kernel alignment above the block: A = max(16, 8) = 16 -> 1024 B a step; ceil(1408 / 1024) = 2 -> 32
    assert align_hybrid_block_size(_model(M, A), 1, 8, 16) == 32
    # one-token steps: 3 heads x 16 x 2 B = 96 B a token; ceil(1408 / 96) = 15 (odd: no rounding to 2)
    assert align_hybrid_block_size(_model(M, AttentionSpec(3, 8)), 1, 1, 1) == 15
    # an MLA hybrid with one-token steps: latent 32 x 2 B = 64 B; ceil(704 / 64) = 11
    assert align_hybrid_block_size(_model(MambaSpec.kda(2, 8, 3), MLASpec(32)), 1, 1, 1) == 11


def test_hybrid_without_ssm_and_packed_mla_groups() -> None:
    w = AttentionSpec(2, 8, sliding_window=4)
    g = rank_geometry(_model(A, w), EngineConfig(1, 16, 5))
    assert g.ssm is None and not g.has_ssm and g.is_hybrid and g.ssm_region_indices == ()
    # pages 16 x 64 = 1024 B, both groups view one region; sizes are whole bytes
    assert g.regions == (
        Region(0, "layers.0.attn", 1024, 1024, 5, False, ((0, "layers.0.attn"), (1, "layers.1.attn"))),
    )
    h = rank_geometry(_model(M, A), EngineConfig(1, 32, 5, kernel_block_size=16))
    assert all(isinstance(r.block_len, int) and isinstance(r.block_stride, int) for r in h.regions)
    # MLA layers of two window settings are two groups; packed rows then hold the shared page once per member
    p = rank_geometry(_model(L, MLASpec(8, sliding_window=4)), EngineConfig(1, 16, 5, packed_rows=True))
    assert len(p.groups) == 2 and p.ssm is None and p.page_bytes == 256
    assert p.regions == (
        Region(
            0,
            "layers.0.attn",
            256,
            256,
            5,
            True,
            ((0, "layers.0.attn"), (1, "layers.1.attn")),
            "kv",
            ((0, 256), (0, 256)),
        ),
    )
    assert p.model.name == "m" and p.engine.packed_rows and p.groups[1].layers == ("layers.1.attn",)


def test_packed_rows_need_an_mla_model_without_ssm_state() -> None:
    with pytest.raises(ConfigError) as info:
        rank_geometry(_model(A), EngineConfig(1, 16, 5, packed_rows=True))
    assert info.value.field == "packed_rows" and info.value.values == {"value": True}


def test_describe() -> None:
    h6 = _model(A, M, M, A, M, M)
    g = rank_geometry(h6, EngineConfig(2, 32, 5, tp_rank=1, pp_size=2, pp_rank=0))
    # TP 2: A page 32 x 32 B = 1024 B; state: conv 48 channels x 2 rows x 2 B = 192 B, temporal 512 B
    assert g.describe().split("\n") == [
        "m: TP2 rank 1, block 32 tokens (kernel 32, ppl 1), 5 logical blocks, layout head_major, "
        "pipeline stage 0 of 2",
        "  group 0: attention x1 (layers.0.attn ...)",
        "  group 1: mamba2 x2 (layers.1.mamba ...)",
        "  group 2: mamba2 x0 (none on this stage)",
        "  region 0 layers.0.attn: block_len 1024 B, stride 1024 B, 5 kernel blocks, 2 member(s)",
        "  region 1 layers.2.mamba: block_len 1024 B, stride 1024 B, 5 kernel blocks, 1 member(s)",
        "  ssm: conv 192 B in pieces [(0, 64), (64, 64), (128, 64)], temporal 512 B, in regions [0, 1]",
    ]
    mla = rank_geometry(_model(L), EngineConfig(1, 16, 5, kernel_block_size=8))
    assert mla.describe().split("\n") == [
        "m: TP1 rank 0, block 16 tokens (kernel 8, ppl 2), 5 logical blocks, layout head_major",
        "  group 0: mla x1 (layers.0.attn ...)",
        "  region 0 layers.0.attn: block_len 128 B, stride 128 B, 10 kernel blocks, MLA 1 member(s)",
    ]
