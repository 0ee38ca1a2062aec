"""The oracle's layout model against hand-computed byte positions (never against the planner), and the
coordinate tags it uses."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import POISON, ZERO, CoordSpace, Request, describe_tag
from kvgeom.testing._coords import location_tags
from kvgeom.testing._layout import NEEDED, OPTIONAL, OUTSIDE, PADDING, rank_image

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
    with pytest.raises(RequestError, match="expected 2"):
        Oracle.for_engines(ATTN, p, p, Request(5, [[0]], [[1, 2]]))
    with pytest.raises(RequestError, match="outside the pool"):
        Oracle.for_engines(ATTN, p, p, Request(5, [[0, 9]], [[1, 2]]))
    assert Request.simple(ATTN, p, p, 5, prefix_blocks=1).d_ids == ((1,),)


def test_importing_kvgeom_testing_does_not_import_hypothesis() -> None:
    code = "import sys, kvgeom.testing; print('hypothesis' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
