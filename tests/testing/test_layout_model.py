"""The oracle's layout model against hand-computed byte positions (never against the planner), and the
coordinate tags it uses."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec, Shard
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import POISON, ZERO, CoordSpace, Request, describe_tag
from kvgeom.testing import _layout as la
from kvgeom.testing._coords import location_tags
from kvgeom.testing._layout import NEEDED, OPTIONAL, OUTSIDE, PADDING, LayoutError, RankImage, rank_image

ATTN = ModelSpec.from_layers("tiny", [AttentionSpec(num_kv_heads=2, head_size=2, dtype="float16")])


def _where(img, space: CoordSpace, tag: int) -> list[tuple[int, int]]:
    return [(r, int(i)) for r, t in enumerate(img.tags) for i in np.flatnonzero(t == tag)]


@pytest.mark.parametrize(
    ("layout", "h0_t7_v", "h1_t6_k"), [("head_major", 108, 112), ("token_major", 116, 104)]
)
def test_attention_byte_positions(layout: str, h0_t7_v: int, h1_t6_k: int) -> None:
    """2 KV heads x (K 4 B + V 4 B), 2-token blocks: 32 B per block. The request's blocks are 0 and 3 from
    token 4, so tokens 6, 7 are positions 0, 1 of block 3 (bytes 96..127). Head-major ``[H, kb, C]``: head
    ``j`` token ``n`` at ``16 j + 8 n``; token-major ``[kb, H, C]``: at ``16 n + 8 j``; V after 4 K bytes."""
    geom = rank_geometry(ATTN, EngineConfig(tp_size=1, block_size=2, num_blocks=4, kv_layout=layout))
    space = CoordSpace(ATTN, 8)
    img = rank_image(geom, space, [[0, 3]], first_token=4, num_tokens=7)  # token 7 is past the end
    assert _where(img, space, int(space.tag("layers.0.attn", "kv", 7, 0, 1, 0))) == [(0, h0_t7_v)]
    assert _where(img, space, int(space.tag("layers.0.attn", "kv", 6, 1, 0, 0))) == [(0, h1_t6_k)]
    assert _where(img, space, int(space.tag("layers.0.attn", "kv", 7, 1, 1, 0))) == [(0, 96 + 16 + 8 + 4)]
    assert img.role[0][h0_t7_v] == OPTIONAL and img.role[0][0] == NEEDED
    assert (img.role[0][32:96] == OUTSIDE).all()


def test_head_replication_and_split_kv() -> None:
    """TP4 over 2 KV heads: ranks 0, 1 hold head 0, ranks 2, 3 head 1; split K/V regions hold 4 B per token."""
    for rank in range(4):
        geom = rank_geometry(
            ATTN, EngineConfig(tp_size=4, tp_rank=rank, block_size=2, num_blocks=2, kv_split=True)
        )
        space = CoordSpace(ATTN, 2)
        img = rank_image(geom, space, [[1]], 0, 2)
        v_tag = int(space.tag("layers.0.attn", "kv", 1, rank // 2, 1, 3))
        assert _where(img, space, v_tag) == [(1, 8 + 4 + 3)]  # region 1 (V), block 1 at 8, token 1 at 4


def test_mla_and_padding() -> None:
    model = ModelSpec.from_layers("mla", [MLASpec(3, "float16")])
    geom = rank_geometry(
        model, EngineConfig(tp_size=2, tp_rank=1, block_size=4, kernel_block_size=2, num_blocks=3)
    )
    space = CoordSpace(model, 8)
    img = rank_image(geom, space, [[2]], 0, 3)
    assert _where(img, space, int(space.tag("layers.0.attn", "latent", 3, 5))) == [(0, 4 * 12 + 12 + 6 + 5)]
    assert (img.role[0][48:72] != OUTSIDE).all() and (img.role[0][:48] == OUTSIDE).all()


def test_mamba2_state_in_its_slot() -> None:
    """Mamba2 (4 heads x 2, 2 groups x 2 states, conv kernel 3, fp16) at TP2, rank 1: x channels 4..7,
    B and C channels 2..3 (2 per rank), each channel 2 rows x 2 B; temporal elements 8..15 after the conv."""
    m2 = MambaSpec.mamba2(
        num_heads=4, head_dim=2, n_groups=2, state_size=2, conv_kernel=3, conv_dtype="float16"
    )
    model = ModelSpec.from_layers("m", [AttentionSpec(2, 8, "float16"), m2])
    geom = rank_geometry(model, EngineConfig(tp_size=2, tp_rank=1, block_size=8, num_blocks=4))
    page = geom.regions[0].block_stride * geom.ppl
    space = CoordSpace(model, 8)
    img = rank_image(geom, space, [[0], [3]], 0, 8)
    base = 3 * page
    # x: 4 local channels * 2 rows * 2 B = 16 B; B at 16, C at 24 (2 channels * 4 B each); temporal at 32
    assert _where(img, space, int(space.tag("layers.1.mamba", "x", 5, 1, 0))) == [(0, base + 1 * 4 + 2)]
    assert _where(img, space, int(space.tag("layers.1.mamba", "C", 3, 0, 1))) == [(0, base + 24 + 4 + 1)]
    assert _where(img, space, int(space.tag("layers.1.mamba", "temporal", 9, 1))) == [(0, base + 32 + 2 + 1)]
    assert img.role[0][base + 32 + 8 * 2] == PADDING  # past the 48-byte state, inside the page


def test_tags_decode_to_readable_names() -> None:
    space = CoordSpace(ATTN, 16)
    assert (
        space.describe(int(space.tag("layers.0.attn", "kv", 9, 1, 1, 3)))
        == "layers.0.attn token 9 head 1 V byte 3"
    )
    assert describe_tag(POISON).startswith("POISON") and describe_tag(ZERO).startswith("ZERO")
    loc = int(location_tags(1, 3, 2, np.array([4096]))[0])
    assert describe_tag(loc) == "no coordinate (D rank 3 region 2 byte 4096)"


def test_requests_are_checked_against_the_engines() -> None:
    from kvgeom.testing import Oracle, RequestError

    p = EngineConfig(tp_size=1, block_size=4, num_blocks=4)
    with pytest.raises(RequestError) as err:
        Oracle.for_engines(ATTN, p, p, Request(5, [[0]], [[1, 2]]))
    assert err.value.field == "p_ids[0]" and err.value.values == {"value": 1, "expected": 2}
    with pytest.raises(RequestError) as err:
        Oracle.for_engines(ATTN, p, p, Request(5, [[0, 9]], [[1, 2]]))
    assert err.value.field == "p_ids[0]" and err.value.values == {"value": [9], "expected": 4}
    assert Request.simple(ATTN, p, p, 5, prefix_blocks=1).d_ids == ((1,),)


def test_importing_kvgeom_testing_does_not_import_hypothesis() -> None:
    code = "import sys, kvgeom.testing; print('hypothesis' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# The oracle's layout model (:mod:`kvgeom.testing._layout`) pinned byte for byte on tiny geometries.
#
# Each expected image is built here with a per-byte loop from the layout facts written in the comments
# (``within`` = the byte's offset inside its kernel block), never from the module's vectorised arithmetic.
# Tags follow :mod:`kvgeom.testing._coords`: attention ``((t * H + head) * 2 + kv) * W + byte`` with
# ``W = max(head_size, head_size_v) * e``, MLA ``t * width + byte``, after the fields of earlier layers.


A2 = ModelSpec.from_layers("a", [AttentionSpec(2, 1, "float16")])  # 2 heads, K 2 B + V 2 B per head


def _expect(sizes, places):
    """Tags and roles from ``places``: (region, offset) -> (tag, role)."""
    tags = [np.full(n, -1, dtype=np.int64) for n in sizes]
    role = [np.zeros(n, dtype=np.int8) for n in sizes]
    for (r, o), (t, ro) in places.items():
        tags[r][o], role[r][o] = t, ro
    return tags, role


def _assert_image(img: RankImage, tags, role) -> None:
    assert len(img.tags) == len(tags)
    for got, want in zip(img.tags, tags):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(img.role, role):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_attention_with_kernel_blocks(layout: str) -> None:
    # block 4 tokens = 2 kernel blocks of 2; a kernel block holds 2 heads x 2 tokens x C = 4 bytes = 16 B;
    # logical block 2 = kernel blocks 4, 5 = bytes 64..95; its tokens 4..7 (first_token 4); num_tokens 7
    geom = rank_geometry(
        A2, EngineConfig(tp_size=1, block_size=4, kernel_block_size=2, num_blocks=3, kv_layout=layout)
    )
    space = CoordSpace(A2, 8)
    img = rank_image(geom, space, [[2]], 4, 7)
    places = {}
    for o in range(64, 96):
        k, within = (o - 64) // 16, o % 16
        if layout == "head_major":  # [head, token, C]
            j, n = within // 8, (within % 8) // 4
        else:  # [token, head, C]
            n, j = within // 8, (within % 8) // 4
        kv, b = (within % 4) // 2, within % 2
        t = 4 + 2 * k + n
        places[(0, o)] = (((t * 2 + j) * 2 + kv) * 2 + b, NEEDED if t < 7 else OPTIONAL)
    _assert_image(img, *_expect([96], places))
    assert img.rank == 0


def test_attention_blocks_in_list_order() -> None:
    # ids [2, 0]: block 2 holds tokens 0, 1; block 0 tokens 2, 3 (kernel = block = 2); head-major, 8 B blocks
    geom = rank_geometry(A2, EngineConfig(tp_size=1, block_size=2, num_blocks=3))
    img = rank_image(geom, CoordSpace(A2, 4), [[2, 0]], 0, 4)
    places = {}
    for block, first in ((2, 0), (0, 2)):
        for within in range(16):
            j, n, kv, b = within // 8, (within % 8) // 4, (within % 4) // 2, within % 2
            t = first + n
            places[(0, block * 16 + within)] = (((t * 2 + j) * 2 + kv) * 2 + b, NEEDED)
    _assert_image(img, *_expect([48], places))


def test_split_kv_token_major_with_tp_and_dcp() -> None:
    # TP 2 rank 1 holds head 1 (1 head per rank); DCP 2 = TP: dcp rank 1; block 2, one list entry = 4 tokens.
    # Regions k and v: 1 head x 2 tokens x 2 B = 4 B per block, 6 blocks. first_token 4 -> first entry 1;
    # entry j of dcp rank 1 holds global page (1 + j) * 2 + 1: pages 3, 5 = tokens 6, 7 and 10, 11.
    geom = rank_geometry(
        A2,
        EngineConfig(
            tp_size=2,
            tp_rank=1,
            block_size=2,
            num_blocks=6,
            kv_layout="token_major",
            kv_split=True,
            dcp_size=2,
        ),
    )
    img = rank_image(geom, CoordSpace(A2, 12), [[1, 3]], 4, 11)
    places = {}
    for region, kv in ((0, 0), (1, 1)):
        for block, first in ((1, 6), (3, 10)):
            for within in range(4):
                n, b = within // 2, within % 2
                t = first + n
                places[(region, block * 4 + within)] = (
                    ((t * 2 + 1) * 2 + kv) * 2 + b,
                    NEEDED if t < 11 else OPTIONAL,
                )
    _assert_image(img, *_expect([24, 24], places))
    assert img.rank == 1


def test_mla_page() -> None:
    # latent 3 x fp16 = 6 B per token; block 2: 12 B; block 1 at 12: token n at 12 + 6 n; tag 6 t + b
    m = ModelSpec.from_layers("mla", [MLASpec(3, "float16")])
    img = rank_image(
        rank_geometry(m, EngineConfig(tp_size=1, block_size=2, num_blocks=3)), CoordSpace(m, 2), [[1]], 0, 1
    )
    places = {
        (0, 12 + 6 * n + b): (6 * n + b, NEEDED if n < 1 else OPTIONAL) for n in range(2) for b in range(6)
    }
    _assert_image(img, *_expect([36], places))


def test_packed_mla_row() -> None:
    # two MLA layers packed in one row per block: layer 0 (6 B/token) at slot offset 0 (12 B), layer 1
    # (latent 2: 4 B/token) at offset 12 (8 B); a row is 20 B; block 2 at 40. Tags: layer 0 6 t + b,
    # layer 1 after layer 0's field (2 tokens x 6 B = 12): 12 + 4 t + b
    m = ModelSpec.from_layers("p", [MLASpec(3, "float16"), MLASpec(2, "float16")])
    geom = rank_geometry(m, EngineConfig(tp_size=1, block_size=2, num_blocks=3, packed_rows=True))
    img = rank_image(geom, CoordSpace(m, 2), [[2]], 0, 2)
    places = {(0, 40 + 6 * n + b): (6 * n + b, NEEDED) for n in range(2) for b in range(6)}
    places |= {(0, 52 + 4 * n + b): (12 + 4 * n + b, NEEDED) for n in range(2) for b in range(4)}
    _assert_image(img, *_expect([60], places))


MAMBA = MambaSpec("mamba2", (Shard(2, 3), Shard(1, 2)), Shard(4, 2), 3, "float16", "float32", ("x", "b"))

HYB = ModelSpec.from_layers("h", [AttentionSpec(2, 4, "float16"), MAMBA])


@pytest.mark.parametrize("conv", ["DS", "SD"])
def test_hybrid_state_and_tokens(conv: str) -> None:
    # TP 2, rank 1, block 4: one region of 64 B blocks viewed by both layers (page 64 B).
    # Attention: head 1 only, K 8 B + V 8 B: C 16, head-major: token n at 16 n; block 0; 3 tokens of 4.
    # State in slot 2 (base 128): x has 2 units of 3 channels: rank 1 holds unit 1 = channels 3..5
    # (local 0..2); b has 1 unit of 2 channels, replicated: channels 0..1 (local 3..4); conv_dim 5,
    # 2 rows of 2 B. DS: local channel c at c * 4 + row * 2 + byte; SD: row * 10 + c * 2 + byte.
    # Temporal after the 20 conv bytes: 4 units of 2 elements, rank 1 holds units 2..3 = elements 4..7,
    # 4 B each: element 4 + i at 20 + 4 i. Tags: attention field 4 tokens x 2 heads x 2 x 8 = 128;
    # x at 128 (6 x 2 x 2 = 24), b at 152 (8), temporal at 160.
    geom = rank_geometry(
        HYB, EngineConfig(tp_size=2, tp_rank=1, block_size=4, num_blocks=3, conv_layout=conv)
    )
    img = rank_image(geom, CoordSpace(HYB, 4), [[0], [2]], 0, 3)
    places = {}
    for within in range(64):
        n, kv, b = within // 16, (within % 16) // 8, within % 8
        places[(0, within)] = (((n * 2 + 1) * 2 + kv) * 8 + b, NEEDED if n < 3 else OPTIONAL)
    for o in range(128 + 36, 192):
        places[(0, o)] = (-1, PADDING)
    for c in range(5):
        for row in range(2):
            for b in range(2):
                off = c * 4 + row * 2 + b if conv == "DS" else row * 10 + c * 2 + b
                tag = 128 + ((3 + c) * 2 + row) * 2 + b if c < 3 else 152 + ((c - 3) * 2 + row) * 2 + b
                places[(0, 128 + off)] = (tag, NEEDED)
    for i in range(4):
        for b in range(4):
            places[(0, 128 + 20 + 4 * i + b)] = (160 + (4 + i) * 4 + b, NEEDED)
    _assert_image(img, *_expect([192], places))


def test_every_id_claims_its_block_in_every_region() -> None:
    # split K/V: blocks of 4 B (1 head x 2 tokens x 2 B, TP 2); the request's ids claim both regions
    geom = rank_geometry(A2, EngineConfig(tp_size=2, block_size=2, num_blocks=4, kv_split=True))
    img = RankImage.empty(geom)
    for r in geom.regions:
        img.claim(r.index, 4, 4)
    img.role[0][5] = NEEDED
    img.claim(0, 4, 8)
    assert img.role[0].tolist() == [0] * 4 + [1, 2, 1, 1, 1, 1, 1, 1] + [0] * 4
    assert img.role[1].tolist() == [0] * 4 + [1] * 4 + [0] * 8


def test_empty_image() -> None:
    geom = rank_geometry(A2, EngineConfig(tp_size=2, tp_rank=1, block_size=2, num_blocks=4, kv_split=True))
    img = RankImage.empty(geom)
    assert img.rank == 1 and [t.tolist() for t in img.tags] == [[-1] * 16, [-1] * 16]
    assert [t.dtype for t in img.tags] == [np.int64, np.int64] and [r.dtype for r in img.role] == [
        np.int8
    ] * 2
    assert [r.tolist() for r in img.role] == [[0] * 16, [0] * 16]
    assert (OUTSIDE, PADDING, NEEDED, OPTIONAL) == (0, 1, 2, 3)


def test_put_checks_the_region_end() -> None:
    geom = rank_geometry(A2, EngineConfig(tp_size=2, block_size=2, num_blocks=4, kv_split=True))
    img = RankImage.empty(geom)
    img.put(1, np.array([15, 3]), np.array([7, 8]), NEEDED)
    assert (
        img.tags[1][15] == 7
        and img.tags[1][3] == 8
        and img.role[1][15] == NEEDED
        and img.role[1][3] == NEEDED
    )
    img.put(0, np.array([[0], [1]]), np.array([[5, 6]])[:, :1], np.array([[OPTIONAL], [NEEDED]]))
    assert img.tags[0][:2].tolist() == [5, 5] and img.role[0][:2].tolist() == [OPTIONAL, NEEDED]
    img.put(0, np.array([2, 3]), 9, PADDING)  # one tag broadcast
    assert img.tags[0][2:4].tolist() == [9, 9]
    img.put(0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), NEEDED)  # nothing: fine
    with pytest.raises(LayoutError) as err:
        img.put(1, np.array([3, 16]), np.array([1, 2]), NEEDED)
    assert err.value.field == "regions[1]" and err.value.values == {"value": 16, "expected": 16}
    assert type(err.value) is LayoutError and isinstance(err.value, ValueError)
    assert img.tags[1][3] == 8  # nothing written


def test_regions_of_a_layer() -> None:
    geom = rank_geometry(A2, EngineConfig(tp_size=2, tp_rank=1, block_size=2, num_blocks=4, kv_split=True))
    assert [r.index for r in la._regions_of(geom, "layers.0.attn")] == [0, 1]
    with pytest.raises(LayoutError) as err:
        la._regions_of(geom, "nope")
    assert err.value.field == "layer" and err.value.values == {"value": "nope"}


def test_content_must_fit_the_page() -> None:
    geom = rank_geometry(A2, EngineConfig(tp_size=1, block_size=2, num_blocks=4))
    region = geom.regions[0]
    la._check_fits(region, 16, 16)
    with pytest.raises(LayoutError) as err:
        la._check_fits(region, 17, 16)
    assert err.value.field == "regions[0]" and err.value.values == {"value": 17, "expected": 16}


def test_state_must_fit_its_page() -> None:
    geom = rank_geometry(HYB, EngineConfig(tp_size=2, tp_rank=1, block_size=4, num_blocks=3))
    space = CoordSpace(HYB, 4)
    fits = dataclasses.replace(geom.regions[0], block_stride=36)  # the 36-byte state exactly
    la._place_state(RankImage.empty(geom), geom, MAMBA, "layers.1.mamba", fits, 0, space)
    small = dataclasses.replace(geom.regions[0], block_stride=35)
    with pytest.raises(LayoutError) as err:
        la._place_state(RankImage.empty(geom), geom, MAMBA, "layers.1.mamba", small, 0, space)
    assert err.value.field == "layers.1.mamba" and err.value.values == {"value": 36, "expected": 35}


def test_attention_content_past_the_page_is_refused() -> None:
    geom = rank_geometry(A2, EngineConfig(tp_size=1, block_size=2, num_blocks=4))
    small = dataclasses.replace(geom.regions[0], block_len=15, block_stride=15)
    with pytest.raises(LayoutError) as err:
        la._place_tokens(
            RankImage.empty(geom),
            geom,
            A2.layers[0].spec,
            "layers.0.attn",
            small,
            np.array([1]),
            0,
            2,
            CoordSpace(A2, 2),
        )
    assert err.value.field == "regions[0]" and err.value.values == {"value": 16, "expected": 15}
    m = ModelSpec.from_layers("mla", [MLASpec(3, "float16")])
    g = rank_geometry(m, EngineConfig(tp_size=1, block_size=2, num_blocks=3))
    small = dataclasses.replace(g.regions[0], block_len=11, block_stride=11)
    with pytest.raises(LayoutError) as err2:
        la._place_tokens(
            RankImage.empty(g),
            g,
            m.layers[0].spec,
            "layers.0.attn",
            small,
            np.array([1]),
            0,
            2,
            CoordSpace(m, 2),
        )
    assert err2.value.field == "regions[0]" and err2.value.values == {"value": 12, "expected": 11}


@pytest.mark.parametrize("split", [False, True])
def test_k_and_v_of_different_sizes(split: bool) -> None:
    # 1 head, K 2 x fp16 = 4 B, V 1 x fp16 = 2 B; tag width max(2, 1) * 2 = 4: tag (2 t + kv) * 4 + byte.
    # Packed: a token-head holds K|V = 6 B: token n of block 1 (12 B blocks) at 12 + 6 n, V after 4 K bytes.
    # Split: region k holds 4 B per token (8 B blocks), region v 2 B (4 B blocks).
    m = ModelSpec.from_layers("kv", [AttentionSpec(1, 2, "float16", head_size_v=1)])
    geom = rank_geometry(m, EngineConfig(tp_size=1, block_size=2, num_blocks=2, kv_split=split))
    img = rank_image(geom, CoordSpace(m, 2), [[1]], 0, 2)
    places = {}
    for n in range(2):
        for b in range(4):
            places[(0, (8 + 4 * n if split else 12 + 6 * n) + b)] = ((2 * n) * 4 + b, NEEDED)
        for b in range(2):
            places[(1, 4 + 2 * n + b) if split else (0, 12 + 6 * n + 4 + b)] = ((2 * n + 1) * 4 + b, NEEDED)
    _assert_image(img, *_expect([16, 8] if split else [24], places))


def test_ids_for_every_group_are_required() -> None:
    geom = rank_geometry(A2, EngineConfig(tp_size=1, block_size=2, num_blocks=3))
    with pytest.raises(ValueError):
        rank_image(geom, CoordSpace(A2, 2), [[1], [2]], 0, 2)


def test_ids_of_any_integer_type() -> None:
    # numpy unsigned ids place the same bytes as Python ints
    geom = rank_geometry(A2, EngineConfig(tp_size=1, block_size=2, num_blocks=3))
    want = rank_image(geom, CoordSpace(A2, 2), [[1]], 0, 2)
    got = rank_image(geom, CoordSpace(A2, 2), [np.array([1], dtype=np.uint64)], 0, 2)
    _assert_image(got, want.tags, want.role)
