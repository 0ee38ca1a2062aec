"""vLLM's block-outermost allocation of a CSA-linear model and its worker's registration (kvgeom.layout.csarows,
docs/vllm-behaviour.md B.6.14 "Allocation").

Hand-derived from the default ``csa_linear_model()`` at block 16, TP1: MLA page 16 x 8 x 2 B = 256 B; ring
4 x 8 x 2 B = 64 B; GDN(2, 4, 2, 4) state 3 x 48 + 64 = 208 B; PLE 8 x 3 x 2 B = 48 B. In vLLM's groups
(MLA, ring, GDN, PLE) the row is the widest group, 2 x 256 = 512 B: MLA pages at 0 and 256, rings at 0 and
64, GDN states at 0 and 208, the PLE page at 0."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgeom.errors import ConfigError, IncompatiblePairError, SpecError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.csarows import RowRegion, RowView, packed_groups, packed_registration, packed_row_offsets
from kvgeom.layout.engine import EngineConfig
from kvgeom.model.csa import csa_linear_model
from kvgeom.model.layers import CircularBufferSpec, Layer, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import Request, pull_plans

MODEL = csa_linear_model()
GROUPS = [
    ["layers.0.attn", "layers.2.attn"],
    ["layers.0.ring", "layers.2.ring"],
    ["layers.1.gdn", "layers.3.gdn"],
    ["ple"],
]


def test_row_offsets() -> None:
    assert packed_row_offsets([[256, 256], [64, 64]]) == (512, ((0, 256), (0, 64)))
    assert packed_row_offsets([[64, 64, 64], [208, 208]]) == (416, ((0, 64, 128), (0, 208)))
    # the row is the widest group, rounded up to the alignment
    assert packed_row_offsets([[256, 256], [48]], alignment=100) == (600, ((0, 256), (0,)))
    assert packed_row_offsets([[7]], alignment=7) == (7, ((0,),))


@pytest.mark.parametrize(
    ("pages", "alignment", "field", "value"),
    [
        ([[4]], 0, "alignment", 0),
        ([], 1, "groups", 0),
        ([[4], []], 1, "groups", 2),
        ([[4], [5, 0]], 1, "groups[1]", [5, 0]),
    ],
)
def test_row_offsets_refuse(pages: list[list[int]], alignment: int, field: str, value: object) -> None:
    with pytest.raises(ConfigError) as e:
        packed_row_offsets(pages, alignment)
    assert e.value.field == field and e.value.values["value"] == value


def test_registration_of_the_default_model() -> None:
    reg = packed_registration(MODEL, GROUPS, block_size=16)
    assert reg.row_bytes == 512
    assert reg.views == (
        RowView("layers.0.attn", 0, 0, 256),
        RowView("layers.0.ring", 1, 0, 64),
        RowView("layers.1.gdn", 2, 0, 208),
        RowView("layers.2.attn", 0, 256, 256),
        RowView("layers.2.ring", 1, 64, 64),
        RowView("layers.3.gdn", 2, 208, 208),
        RowView("ple", 3, 0, 48),
    )
    # every group's first page starts the row: one shared region, the MLA page's length; the rest own theirs
    assert reg.regions == (
        RowRegion(0, 256, -1, True, ("layers.0.attn", "layers.0.ring", "layers.1.gdn", "ple")),
        RowRegion(256, 256, 0, True, ("layers.2.attn",)),
        RowRegion(64, 64, 1, False, ("layers.2.ring",)),
        RowRegion(208, 208, 2, False, ("layers.3.gdn",)),
    )
    assert reg.scratch == (0, 2) and reg.ssm == (0, 3) and reg.ple == (0, 48)
    assert reg.kernel_lens(1) == ((256, 512), (256, 512), (64, 512), (208, 512))
    assert reg.kernel_lens(2) == ((128, 256), (128, 256), (32, 256), (104, 256))


def test_registration_order_decides_regions() -> None:
    # a ring registered first opens the region; the MLA page joining it sets its length, a state does not
    order = ["layers.2.ring", "ple", "layers.3.gdn", "layers.2.attn", "layers.0.ring", "layers.1.gdn"]
    reg = packed_registration(MODEL, GROUPS, block_size=16, order=[*order, "layers.0.attn"])
    assert reg.regions == (
        RowRegion(64, 64, 1, False, ("layers.2.ring",)),
        RowRegion(0, 256, -1, True, ("ple", "layers.0.ring", "layers.1.gdn", "layers.0.attn")),
        RowRegion(208, 208, 2, False, ("layers.3.gdn",)),
        RowRegion(256, 256, 0, True, ("layers.2.attn",)),
    )
    # scratch regions sorted, SSM regions in first-seen order
    assert reg.scratch == (0, 1) and reg.ssm == (2, 1) and reg.ple == (1, 48)
    # regions of one group keep its id
    one = packed_registration(MODEL, [GROUPS[0], GROUPS[1], GROUPS[2], GROUPS[3]], block_size=32)
    assert one.row_bytes == 1024 and one.regions[1] == RowRegion(512, 512, 0, True, ("layers.2.attn",))


def test_rows_without_ssm_state_register_whole() -> None:
    # MLA pages with rings and no SSM state: MLA views register the whole row, rings past its start keep theirs
    ring = CircularBufferSpec(4, 8)
    model = ModelSpec(
        "m",
        (
            Layer("a", 0, MLASpec(8)),
            Layer("r", 0, ring, shares="a"),
            Layer("b", 1, MLASpec(8)),
            Layer("s", 1, ring, shares="b"),
        ),
    )
    reg = packed_registration(model, [["a", "b"], ["r", "s"]], block_size=16)
    assert reg.row_bytes == 512
    assert reg.regions == (
        RowRegion(0, 512, -1, True, ("a", "r", "b")),
        RowRegion(64, 64, 1, False, ("s",)),
    )
    assert reg.scratch == (0, 1) and reg.ssm == () and reg.ple is None


def test_registration_at_tp2_keeps_replicated_pages() -> None:
    # TP2: MLA, ring and PLE pages are TP-independent; the GDN state halves (144 / 2 + 64 / 2 = 104)
    reg = packed_registration(MODEL, GROUPS, block_size=16, tp_size=2)
    assert [v.length for v in reg.views] == [256, 64, 104, 256, 64, 104, 48]
    assert reg.row_bytes == 512 and reg.regions[3] == RowRegion(104, 104, 2, False, ("layers.3.gdn",))


@pytest.mark.parametrize(
    ("model", "groups", "order", "field", "value"),
    [
        (
            ModelSpec("plain", (Layer("a", 0, MLASpec(8)),)),
            [["a"]],
            None,
            "model",
            "plain",
        ),
        (MODEL, [*GROUPS[:3], ["ple", "nope"]], None, "groups", "nope"),
        (MODEL, [*GROUPS, ["ple"]], None, "groups", "ple"),
        (MODEL, GROUPS[:3], None, "groups", ["ple"]),
        (
            MODEL,
            [["layers.0.attn", "layers.0.ring"], ["layers.2.attn", "layers.2.ring"], GROUPS[2], GROUPS[3]],
            None,
            "groups[0]",
            ["CircularBufferSpec", "MLASpec"],
        ),
        (MODEL, GROUPS, ["ple"], "order", ["ple"]),
    ],
)
def test_registration_refuses(model: ModelSpec, groups, order, field: str, value: object) -> None:  # noqa: ANN001
    with pytest.raises(SpecError) as e:
        packed_registration(model, groups, block_size=16, order=order)
    assert e.value.field == field and e.value.values["value"] == value


def test_kernel_lens_refuse_rows_that_do_not_split() -> None:
    reg = packed_registration(MODEL, GROUPS, block_size=16)
    for ppl in (0, 3):
        with pytest.raises(ConfigError) as e:
            reg.kernel_lens(ppl)
        assert e.value.field == "kernel_block_size" and e.value.values["value"] == ppl
    # the row divides by 32, the 208-byte state page does not
    with pytest.raises(ConfigError) as e:
        reg.kernel_lens(32)
    assert e.value.values["expected"] == 512


def test_one_byte_pages_and_rows_that_only_fail_to_split() -> None:
    assert packed_row_offsets([[1], [2]]) == (2, ((0,), (0,)))
    # alignment 100 makes the row 600 B: the regions (256, 256, 64, 208) split into 16, the row does not
    reg = packed_registration(MODEL, GROUPS, block_size=16, alignment=100)
    assert reg.row_bytes == 600
    with pytest.raises(ConfigError) as e:
        reg.kernel_lens(16)
    assert e.value.values["expected"] == 600


def test_each_state_its_own_group() -> None:
    # vLLM's packed grouping gives a wide state a group of its own: every such group starts the row, so both
    # GDN states register in region 0, one SSM region
    groups = [GROUPS[0], GROUPS[1], ["layers.1.gdn"], ["layers.3.gdn"], ["ple"]]
    reg = packed_registration(MODEL, groups, block_size=16)
    assert reg.row_bytes == 512
    assert reg.regions == (
        RowRegion(
            0, 256, -1, True, ("layers.0.attn", "layers.0.ring", "layers.1.gdn", "layers.3.gdn", "ple")
        ),
        RowRegion(256, 256, 0, True, ("layers.2.attn",)),
        RowRegion(64, 64, 1, False, ("layers.2.ring",)),
    )
    assert reg.ssm == (0,) and reg.scratch == (0, 2) and reg.ple == (0, 48)


def test_packed_groups() -> None:
    # block 16: MLA pages 2 x 256 = 512 B set the row; ring (64), GDN (208) and PLE (48) pages each fit it
    assert packed_groups(MODEL, 16) == tuple(tuple(g) for g in GROUPS)
    # block 4: MLA 2 x 64 = 128 B, so the 208-byte GDN state is the widest page: one state per group
    assert packed_groups(MODEL, 4) == (
        ("layers.0.attn", "layers.2.attn"),
        ("layers.0.ring", "layers.2.ring"),
        ("layers.1.gdn",),
        ("layers.3.gdn",),
        ("ple",),
    )
    # four layers at block 8: MLA 4 x 128 = 512 B holds two 208-byte states, so two GDN groups, strided
    four = csa_linear_model(num_csa_layers=4)
    assert packed_groups(four, 8)[2:4] == (("layers.1.gdn", "layers.5.gdn"), ("layers.3.gdn", "layers.7.gdn"))
    assert len(packed_groups(four, 8)) == 5
    # TP2 halves the GDN state (104 B): at block 4 the 128-byte MLA row holds one, still one per group
    assert packed_groups(MODEL, 4, 2)[2:4] == (("layers.1.gdn",), ("layers.3.gdn",))
    # a sliding-window MLA bucket splits like a state: at block 16 its 256-byte page is the anchor, one per
    # group (as a token bucket the row would be 512 B and hold both pages and both states)
    swa_mla = MLASpec(8, sliding_window=8)
    swa = ModelSpec(
        "swa", tuple(replace(la, spec=swa_mla) if la.name.endswith("attn") else la for la in MODEL.layers)
    )
    assert packed_groups(swa, 16) == (
        ("layers.0.attn",),
        ("layers.2.attn",),
        ("layers.0.ring", "layers.2.ring"),
        ("layers.1.gdn",),
        ("layers.3.gdn",),
        ("ple",),
    )


def test_packed_geometry() -> None:
    geom = rank_geometry(MODEL, EngineConfig(tp_size=1, block_size=16, num_blocks=8, packed_rows=True))
    assert [g.layers for g in geom.groups] == [tuple(g) for g in GROUPS]
    assert [(r.name, r.block_len, r.block_stride, r.num_blocks, r.is_mla, r.part) for r in geom.regions] == [
        ("layers.0.attn", 256, 512, 8, True, "kv"),
        ("layers.2.attn", 256, 512, 8, True, "kv"),
        ("layers.2.ring", 64, 512, 8, False, "kv"),
        ("layers.3.gdn", 208, 512, 8, False, "state"),
    ]
    assert geom.regions[0].members == (
        (0, "layers.0.attn"),
        (1, "layers.0.ring"),
        (2, "layers.1.gdn"),
        (3, "ple"),
    )
    assert geom.page_bytes == 512 and geom.scratch_region_indices == (0, 2)
    assert geom.ssm is not None and geom.ssm.region_indices == (0, 3)
    assert geom.ssm.conv_offsets == ((0, 48), (48, 48), (96, 48)) and geom.ssm.ssm_bytes == 64
    assert geom.ple is not None and (geom.ple.group, geom.ple.region, geom.ple.length) == (3, 0, 48)


def test_packed_geometry_refusals() -> None:
    no_ssm = ModelSpec("mla-rings", tuple(la for la in MODEL.layers if not la.kind.is_ssm))
    with pytest.raises(ConfigError) as e:
        rank_geometry(no_ssm, EngineConfig(tp_size=1, block_size=16, num_blocks=8, packed_rows=True))
    assert e.value.field == "packed_rows" and e.value.values["value"] is True
    # two compressed-key widths: vLLM would pack both into one group (one token-slot type)
    wide = ModelSpec(
        "two-widths",
        tuple(replace(la, spec=MLASpec(16)) if la.name == "layers.2.attn" else la for la in MODEL.layers),
    )
    with pytest.raises(ConfigError) as e:
        rank_geometry(wide, EngineConfig(tp_size=1, block_size=16, num_blocks=8, packed_rows=True))
    assert e.value.field == "layers" and e.value.values["value"] == sorted(
        {repr(MLASpec(8)), repr(MLASpec(16))}
    )
    # kernel blocks of 8 tokens would cut the rows, not the contiguous ring and state pages
    with pytest.raises(ConfigError) as e:
        rank_geometry(
            MODEL, EngineConfig(tp_size=1, block_size=16, kernel_block_size=8, num_blocks=8, packed_rows=True)
        )
    assert e.value.field == "kernel_block_size" and e.value.values == {"value": 8, "expected": 16}
    # TP1 and TP2 pages of the GDN-only region differ (208 vs 104 B): vLLM asserts equal lengths (use_mla),
    # vllm mode refuses; kvgeom mode plans it (tests/testing/test_oracle_csa_linear.py)
    p, d = (EngineConfig(tp_size=t, block_size=16, num_blocks=8, packed_rows=True) for t in (2, 1))
    with pytest.raises(IncompatiblePairError) as e2:
        pull_plans(MODEL, p, d, Request.simple(MODEL, p, d, 40), "vllm")
    assert e2.value.field == "regions[3].block_len"
    assert (e2.value.values["local"], e2.value.values["remote"]) == (208, 104)


GQA = csa_linear_model(main_kv_heads=2)


@pytest.mark.parametrize(
    ("first", "starts"),
    [
        # main KV first (vLLM's qwen4_exp order): its pages, then the compressed keys'
        ("kv", {"layers.0.kv": 0, "layers.2.kv": 1024, "layers.0.attn": 2048, "layers.2.attn": 2304}),
        # compressed keys first in layer 0: their pages lead
        ("attn", {"layers.0.attn": 0, "layers.2.attn": 256, "layers.0.kv": 512, "layers.2.kv": 1536}),
    ],
)
def test_main_kv_and_compressed_keys_share_a_group(first: str, starts: dict[str, int]) -> None:
    """One token group, 2 x 1024 + 2 x 256 = 2560 B, layers in model order; each spec's pages together, specs
    in the order their first layer appears."""
    layers = list(GQA.layers)
    if first == "attn":
        layers[0], layers[1] = layers[1], layers[0]
    model = ModelSpec("gqa", tuple(layers))
    groups = packed_groups(model, 16)
    assert groups[0] == tuple(la.name for la in layers if la.kind.value in ("attention", "mla"))
    assert groups[1:] == (("layers.0.ring", "layers.2.ring"), ("layers.1.gdn", "layers.3.gdn"), ("ple",))
    reg = packed_registration(model, groups, block_size=16)
    assert reg.row_bytes == 2560
    assert {v.name: v.offset for v in reg.views if v.group == 0} == starts


def test_a_state_wider_than_half_the_token_pages_splits() -> None:
    """GDN(2, 16, 2, 16): conv 96 channels x 3 rows x 2 B = 576 B + temporal 2 x 16 x 16 x 2 B = 1024 B = 1600 B;
    the token bucket's pages sum to 2560 B (2 x 1024 + 2 x 256), 2560 // 1600 = 1 state per group: two groups."""
    model = csa_linear_model(main_kv_heads=2, gdn=MambaSpec.gdn(2, 16, 2, 16))
    assert packed_groups(model, 16)[2:4] == (("layers.1.gdn",), ("layers.3.gdn",))


def test_a_group_of_a_main_kv_and_a_ring_is_refused() -> None:
    groups = [
        ["layers.0.kv", "layers.0.ring"],
        ["layers.0.attn", "layers.2.kv", "layers.2.attn"],
        ["layers.2.ring"],
    ]
    groups += [["layers.1.gdn", "layers.3.gdn"], ["ple"]]
    with pytest.raises(SpecError) as e:
        packed_registration(GQA, groups, block_size=16)
    assert e.value.field == "groups[0]" and e.value.values["value"] == ["AttentionSpec", "CircularBufferSpec"]
