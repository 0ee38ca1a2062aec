"""Exact behaviour of kvgeom.plan.align: list placement on the token axis (every branch and boundary, every
refusal's field and values), overlaps, pages, and the consumer's zero rows (hand-derived byte rows)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvgeom.errors import PlanError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig, KVLayout
from kvgeom.layout.tokenruns import page_token_runs
from kvgeom.model.layers import AttentionSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.align import Page, consumer_zero_rows, group_pages, list_starts, overlap, page_heads


def _refused(*args: object, field: str, **kw: object) -> dict:
    with pytest.raises(PlanError) as info:
        list_starts(*args, **kw)  # type: ignore[arg-type]
    assert type(info.value) is PlanError
    assert info.value.field == field
    return info.value.values


def test_list_starts_with_num_tokens() -> None:
    # D 2 x 16 for 32 tokens: starts at 0; P 2 x 16 from token 0
    assert list_starts(2, 16, 2, 16, 32, False, False, 0) == (0, 0)
    # a prefix hit on D: 1 block of 16 of ceil(32 / 16) = 2 -> starts at 16
    assert list_starts(1, 16, 2, 16, 32, True, False, 0) == (16, 0)
    # N-1 flow: D holds 17 tokens (2 blocks), P computed 16 (1 block)
    assert list_starts(2, 16, 1, 16, 17, False, False, 0, 16) == (0, 0)
    assert list_starts(2, 16, 2, 16, 17, False, False, 0, 17) == (0, 0)
    # a sliding window: P's 2 blocks end at ceil(70 / 16) * 16 = 80 -> 48; D's 3 blocks end at 80 -> 32
    assert list_starts(3, 16, 2, 16, 70, True, True, 0, 70) == (32, 48)
    # sliding without prefill_tokens: P ends at the hint, 64 - 32 = 32
    assert list_starts(2, 32, 2, 16, 64, True, True, 0, p_end_hint=64) == (0, 32)
    # the smallest request
    assert list_starts(1, 16, 1, 16, 1, False, False, 0) == (0, 0)
    # P's last block holds token num_tokens - 1: (2 - 1) * 16 = 16 < 17
    assert list_starts(2, 16, 2, 16, 17, False, False, 0) == (0, 0)
    # prefill_tokens == num_tokens is allowed; 0 computed tokens with no P blocks too
    assert list_starts(2, 16, 2, 16, 32, False, False, 0, 32) == (0, 0)
    assert list_starts(2, 16, 0, 16, 32, False, False, 0, 0) == (0, 0)


def test_list_starts_without_num_tokens() -> None:
    # no prefix caching, full attention: D from token 0
    assert list_starts(2, 16, 2, 16, None, False, False, 0) == (0, 0)
    # D's 17 tokens > P's first (2 - 1) * 16 = 16 tokens: still from token 0
    assert list_starts(1, 17, 2, 16, None, False, False, 0) == (0, 0)
    # prefill_tokens without num_tokens is not compared with it
    assert list_starts(2, 16, 2, 16, None, False, False, 0, 20) == (0, 0)
    vals = _refused(1, 16, 2, 16, None, False, False, 4, field="num_tokens")  # 16 <= 16
    assert vals == {"local": 16, "remote": 32}
    vals = _refused(2, 16, 2, 16, None, True, False, 4, field="num_tokens")  # a prefix hit may skip
    assert vals == {"local": 2, "remote": 2}
    vals = _refused(3, 16, 2, 16, None, False, True, 4, 32, field="num_tokens")  # a sliding window
    assert vals == {"local": 3, "remote": 2}


def test_list_starts_refusals() -> None:
    assert _refused(2, 16, 2, 16, 0, False, False, 1, field="num_tokens") == {"value": 0}
    assert _refused(2, 16, 2, 16, -3, False, False, 1, field="num_tokens") == {"value": -3}
    vals = _refused(2, 16, 2, 16, 32, False, False, 1, -1, field="prefill_tokens")
    assert vals == {"value": -1, "expected": 32}
    vals = _refused(2, 16, 2, 16, 32, False, False, 1, 33, field="prefill_tokens")
    assert vals == {"value": 33, "expected": 32}
    vals = _refused(2, 16, 2, 16, None, False, False, 1, -1, field="prefill_tokens")
    assert vals == {"value": -1, "expected": None}
    # a sliding list on P without prefill_tokens or a hint
    assert _refused(2, 16, 2, 16, 32, False, True, 1, field="prefill_tokens") == {"value": None}
    # P's 3 blocks end at ceil(20 / 16) * 16 = 32: they would start at -16
    vals = _refused(2, 16, 3, 16, 32, False, False, 5, 20, field="block_ids[5]")
    assert vals == {"local": 2, "remote": 3}
    # P's 1 full-attention block ends at 32: it would start at 16, not 0
    vals = _refused(2, 16, 1, 16, 32, False, False, 5, 20, field="block_ids[5]")
    assert vals == {"local": 2, "remote": 1}
    # D's 3 blocks of 16 for 32 tokens start at -16
    vals = _refused(3, 16, 2, 16, 32, False, False, 6, field="block_ids[6]")
    assert vals == {"local": 3, "remote": 2}
    # P's 2 blocks of 16 for 16 tokens: (2 - 1) * 16 >= 16, one block too many
    vals = _refused(1, 16, 2, 16, 16, False, False, 7, field="block_ids[7]")
    assert vals == {"local": 1, "remote": 2}


def test_overlap() -> None:
    assert overlap(0, 4, 2, 4) == (2, 0, 2)
    assert overlap(3, 2, 1, 5) == (0, 2, 2)
    assert overlap(0, 2, 5, 3) == (5, 0, 0)  # disjoint: nothing
    assert overlap(0, 4, 4, 4) == (4, 0, 0)  # touching: nothing
    assert overlap(2, 3, 2, 3) == (0, 0, 3)


PAGE = Page(region=1, offset=100, length=64, stride=1000)


def test_zero_rows_front_gap() -> None:
    # kernel blocks 7, 8, 9 of 4 fine units (16 tokens); units [2, 8) are written: block 9 is zeroed
    # whole (at 9 * 1000 + 100), block 7's units [0, 2) = tokens [0, 8) at 4 B per token: 7100, 32 B
    rows = consumer_zero_rows([PAGE], np.array([7, 8, 9]), 4, 2, 6, 16)
    assert rows.dtype == np.int64
    assert rows.tolist() == [[1, 9100, 64], [1, 7100, 32]]


def test_zero_rows_back_gap_and_last_block() -> None:
    # units [0, 6): block 7 inside, block 8's units [6, 8) = tokens [8, 16): 8100 + 8 * 4, 32 B; 9 whole
    rows = consumer_zero_rows([PAGE], np.array([7, 8, 9]), 4, 0, 6, 16)
    assert rows.tolist() == [[1, 9100, 64], [1, 8132, 32]]
    # one block, units [0, 2): the gap ends at the last unit
    assert consumer_zero_rows([PAGE], np.array([7]), 4, 0, 2, 16).tolist() == [[1, 7132, 32]]
    # a gap on both sides of one block: units [1, 3) of 4
    assert consumer_zero_rows([PAGE], np.array([7]), 4, 1, 2, 16).tolist() == [[1, 7100, 16], [1, 7148, 16]]


def test_zero_rows_heads_and_pages() -> None:
    # two heads: 32 B per head, 2 B per token; block 7's tokens [0, 8) in each head's run
    rows = consumer_zero_rows([PAGE], np.array([7, 8, 9]), 4, 2, 6, 16, heads=2)
    assert rows.tolist() == [[1, 9100, 64], [1, 7100, 16], [1, 7132, 16]]
    # a page's own heads are used when none are given
    own = Page(1, 100, 64, 1000, 2)
    assert consumer_zero_rows([own], np.array([7, 8, 9]), 4, 2, 6, 16).tolist() == rows.tolist()
    # heads given override the page's
    assert consumer_zero_rows([own], np.array([7]), 4, 2, 2, 16, heads=1).tolist() == [[1, 7100, 32]]
    # two pages: whole blocks of each, then each page's gap (page 2: 32 B, 2 B per token, stride 500)
    rows = consumer_zero_rows([PAGE, Page(2, 0, 32, 500)], np.array([7, 8, 9]), 4, 2, 6, 16)
    assert rows.tolist() == [[1, 9100, 64], [2, 4500, 32], [1, 7100, 32], [2, 3500, 16]]
    # a region-like value is its whole block
    region = SimpleNamespace(index=3, block_len=64, block_stride=1000)
    assert consumer_zero_rows([region], np.array([5, 6]), 1, 0, 1, 16).tolist() == [[3, 6000, 64]]
    assert consumer_zero_rows([region], np.array([5]), 2, 0, 1, 16, heads=2).tolist() == [
        [3, 5016, 16],
        [3, 5048, 16],
    ]


def test_zero_rows_nothing() -> None:
    assert consumer_zero_rows([PAGE], np.array([7, 8, 9]), 4, 0, 12, 16).shape == (0, 3)
    out = consumer_zero_rows([PAGE], np.zeros(0, dtype=np.int64), 4, 0, 0, 16)
    assert out.shape == (0, 3) and out.dtype == np.int64
    # several units per block, all written, with units that split a token range unevenly
    assert consumer_zero_rows([PAGE], np.array([4]), 3, 0, 3, 16).shape == (0, 3)
    # 3 units of 16 tokens: unit 0 is tokens [0, 5): zero tokens [5, 16) (11 tokens, 4 B each)
    assert consumer_zero_rows([PAGE], np.array([4]), 3, 0, 1, 16).tolist() == [[1, 4120, 44]]


def _geom(spec: object, tp: int = 2, layout: KVLayout = KVLayout.HEAD_MAJOR):
    model = ModelSpec.from_layers("m", [spec, spec])
    return rank_geometry(model, EngineConfig(tp_size=tp, block_size=16, num_blocks=4, kv_layout=layout))


def test_page_heads_and_group_pages() -> None:
    g = _geom(AttentionSpec(4, 8))  # 2 heads per rank at TP2
    assert page_heads(g, "layers.0.attn") == 2
    assert page_heads(_geom(AttentionSpec(4, 8), layout=KVLayout.TOKEN_MAJOR), "layers.0.attn") == 1
    assert page_heads(_geom(AttentionSpec(4, 8), tp=4), "layers.1.attn") == 1
    assert page_heads(_geom(MLASpec(64)), "layers.0.attn") == 1
    pages = group_pages(g, 0)
    # one page per region, whole blocks: 2 heads * 16 tokens * (8 + 8) * 2 B = 1024 B
    assert [p.region for p in pages] == [r.index for r in g.regions]
    assert all(p.offset == 0 and p.length == 1024 and p.heads == 2 for p in pages)
    assert [p.stride for p in pages] == [r.block_stride for r in g.regions]
    assert group_pages(g, 1) == []


def test_zero_rows_block_edges_and_uneven_pages() -> None:
    # units [4, 8) written: block 7 ends at unit 4 and block 9 starts at unit 8: both whole, in block order
    rows = consumer_zero_rows([PAGE], np.array([7, 8, 9]), 4, 4, 4, 16)
    assert rows.tolist() == [[1, 7100, 64], [1, 9100, 64]]
    # a region-like value without heads: one run (heads 1); units [1, 2) of block 5 = tokens [8, 16), 4 B each
    region = SimpleNamespace(index=3, block_len=64, block_stride=1000)
    assert consumer_zero_rows([region], np.array([5]), 2, 0, 1, 16).tolist() == [[3, 5032, 32]]
    # 66 B over 4 heads: 16 B per head (floored), 8 B per token of 2; tokens [1, 2) of each head's run
    uneven = Page(1, 0, 66, 1000, 4)
    assert consumer_zero_rows([uneven], np.array([0]), 2, 0, 1, 2).tolist() == [
        [1, 8, 8],
        [1, 24, 8],
        [1, 40, 8],
        [1, 56, 8],
    ]
    # 16 B of 6 tokens: 2 B per token (floored); tokens [3, 6) at 3 * 2 = 6, 3 * 2 = 6 B
    assert consumer_zero_rows([Page(1, 0, 16, 1000)], np.array([0]), 2, 0, 1, 6).tolist() == [[1, 6, 6]]


def test_list_starts_messages_name_the_group_and_the_reason() -> None:
    with pytest.raises(PlanError) as info:
        list_starts(2, 16, 2, 16, 32, False, True, 9)
    assert "group 9" in str(info.value)
    with pytest.raises(PlanError) as info:
        list_starts(2, 16, 2, 16, None, True, False, 3)
    assert "a prefix hit may skip its first blocks" in str(info.value)
    with pytest.raises(PlanError) as info:
        list_starts(2, 16, 2, 16, None, False, True, 3, 32)
    assert "a sliding window keeps only its last blocks" in str(info.value)


def _zeroed_bytes(rows: np.ndarray) -> set[tuple[int, int]]:
    return {(int(r), int(o) + i) for r, o, n in rows.tolist() for i in range(int(n))}


@pytest.mark.parametrize("first, count", [(1, 5), (0, 3), (2, 2), (5, 3)])
def test_a_group_mixing_cut_and_plain_pages_zeroes_each_page_as_alone(first: int, count: int) -> None:
    # one CPU attention page (cut by its token runs: 2 heads, 4 tokens, head size 2, fp32) and one plain
    # head-major page of 2 heads in another region: the mixed set zeroes exactly what each page zeroes alone
    cut = Page(0, 0, 128, 160, 1, page_token_runs(KVLayout.HEAD_KV_MAJOR, 2, 4, 8, 8, 4))
    plain = Page(1, 16, 64, 96, 2)
    ids = np.asarray([3, 0, 5], dtype=np.int64)
    args = (ids, 2, first, count, 4)  # 2 fine units per kernel block of 4 tokens
    mixed = consumer_zero_rows([cut, plain], *args)
    alone = consumer_zero_rows([cut], *args), consumer_zero_rows([plain], *args)
    assert _zeroed_bytes(mixed) == _zeroed_bytes(alone[0]) | _zeroed_bytes(alone[1])
    assert len(mixed) == len(alone[0]) + len(alone[1])
