"""Exact values and refusals of kvgeom.plan.regionmap on small hand-derived inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvgeom import (
    AttentionSpec,
    EngineConfig,
    MLASpec,
    ModelSpec,
    Pairing,
    rank_geometry,
)
from kvgeom.errors import (
    BlockIdError,
    GroupMismatchError,
    PlanError,
    TokenCountError,
    UnsupportedError,
)
from kvgeom.plan.regionmap import (
    apply_prefix_caching_by_region,
    block_ids_by_region,
    region_zero_ids,
    region_zero_rows,
)
from kvgeom.plan.request import plan_request
from kvgeom.testing import Request


def _raises(cls, fn, *args, **kwargs):
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    assert type(info.value) is cls
    return info.value


def _lists(arrays):
    return [np.asarray(a).tolist() for a in arrays]


def test_block_ids_by_region_own_and_shared():
    # region of group 0 -> group 0's list; group 1 -> its list; shared (-1) -> all groups in group order
    out = block_ids_by_region([[1, 2], [3]], [0, 1, -1, -1])
    assert _lists(out) == [[1, 2], [3], [1, 2, 3], [1, 2, 3]]
    assert all(a.dtype == np.int64 for a in out)
    # every list is its own copy: writing one region's list changes no other
    out[2][0] = 99
    assert out[3].tolist() == [1, 2, 3]
    twice = block_ids_by_region([[5, 6]], [0, 0])
    twice[0][0] = 99
    assert twice[1].tolist() == [5, 6]
    # no groups at all: a shared region gets an empty list
    assert _lists(block_ids_by_region([], [-1])) == [[]]


def test_block_ids_by_region_refusals():
    err = _raises(GroupMismatchError, block_ids_by_region, [[1], [2]], [0, 2])  # group 2 of 2 groups
    assert err.field == "region_group_ids[1]"
    assert err.values == {"value": 2, "expected": 2}
    err = _raises(GroupMismatchError, block_ids_by_region, [[1], [2]], [-2])
    assert err.field == "region_group_ids[0]" and err.values == {"value": -2, "expected": 2}
    assert _lists(block_ids_by_region([[1], [2]], [1])) == [[2]]  # the last group is in range
    err = _raises(BlockIdError, block_ids_by_region, [[1], [-1]], [0])
    assert err.field == "block_ids[1]"


def test_apply_prefix_caching_by_region_end_trims():
    # without page positions each region end-trims P's list to D's count
    dec, pre = apply_prefix_caching_by_region([[1, 2], [3, 4, 5], []], [[5, 6, 7], [8, 9, 10], [11]])
    assert _lists(dec) == [[1, 2], [3, 4, 5], []]
    assert _lists(pre) == [[6, 7], [8, 9, 10], []]


def test_apply_prefix_caching_by_region_nothing_on_d():
    dec, pre = apply_prefix_caching_by_region([[], []], [[1, 2], [3]])
    assert _lists(dec) == [[], []] and _lists(pre) == [[], []]
    assert dec[0] is not pre[0] and dec[0] is not dec[1]


def test_apply_prefix_caching_by_region_refusals():
    err = _raises(GroupMismatchError, apply_prefix_caching_by_region, [[1], [2]], [[1]])
    assert err.field == "prefill_ids" and err.values == {"value": 1, "expected": 2}
    err = _raises(PlanError, apply_prefix_caching_by_region, [[1], [2, 3]], [[1], [4]])
    assert err.field == "decode_ids[1]" and err.values == {"local": 2, "remote": 1}
    err = _raises(BlockIdError, apply_prefix_caching_by_region, [[1], [-2]], [[1], [4]])
    assert err.field == "decode_ids[1]"
    err = _raises(BlockIdError, apply_prefix_caching_by_region, [[1], [2]], [[1], [-4]])
    assert err.field == "prefill_ids[1]"
    err = _raises(PlanError, apply_prefix_caching_by_region, [[1]], [[1]], num_computed_blocks=[0])
    assert err.field == "num_remote_blocks" and err.values == {"value": None}
    err = _raises(
        GroupMismatchError,
        apply_prefix_caching_by_region,
        [[1]],
        [[1]],
        num_computed_blocks=[0, 0],
        num_remote_blocks=1,
    )
    assert err.field == "num_computed_blocks" and err.values == {"value": 2, "expected": 1}


def test_apply_prefix_caching_by_region_by_position():
    # no DCP: D's uncached list starts at page c, P's list at page 0.
    # region 0: c = 1, D [10, 11] are pages 1, 2; P [20, 21, 22] -> P pages 1, 2 = [21, 22]
    # region 1: c = 0, D [5] is page 0; P [7, 8] -> [7]
    dec, pre = apply_prefix_caching_by_region(
        [[10, 11], [5]], [[20, 21, 22], [7, 8]], num_computed_blocks=[1, 0], num_remote_blocks=3
    )
    assert _lists(dec) == [[10, 11], [5]]
    assert _lists(pre) == [[21, 22], [7]]
    # the remote page count cuts D's list: 2 pages exist, c = 0 -> D keeps [10, 11]
    dec, pre = apply_prefix_caching_by_region(
        [[10, 11, 12]], [[20, 21, 22]], num_computed_blocks=[0], num_remote_blocks=2
    )
    assert _lists(dec) == [[10, 11]] and _lists(pre) == [[20, 21]]


def test_apply_prefix_caching_by_region_dcp_defaults():
    # remote DCP 2, local 1, remote rank 0 by default: remote rank 0 holds even global pages 0, 2;
    # local pages 0..3 -> the even ones [10, 12] pair with P's [20, 21]
    dec, pre = apply_prefix_caching_by_region(
        [[10, 11, 12, 13]], [[20, 21]], num_computed_blocks=[0], num_remote_blocks=4, remote_dcp_size=2
    )
    assert _lists(dec) == [[10, 12]] and _lists(pre) == [[20, 21]]
    # remote rank 1 holds the odd pages 1, 3
    dec, pre = apply_prefix_caching_by_region(
        [[10, 11, 12, 13]],
        [[20, 21]],
        num_computed_blocks=[0],
        num_remote_blocks=4,
        remote_dcp_size=2,
        remote_rank=1,
    )
    assert _lists(dec) == [[11, 13]] and _lists(pre) == [[20, 21]]
    # local DCP 2 (rank 0 by default), remote 1: local pages are global 0, 2 -> P pages 0, 2
    dec, pre = apply_prefix_caching_by_region(
        [[10, 11]], [[20, 21, 22, 23]], num_computed_blocks=[0], num_remote_blocks=4, local_dcp_size=2
    )
    assert _lists(dec) == [[10, 11]] and _lists(pre) == [[20, 22]]
    # local DCP rank 1: global 1, 3 -> P pages 1, 3
    dec, pre = apply_prefix_caching_by_region(
        [[10, 11]],
        [[20, 21, 22, 23]],
        num_computed_blocks=[0],
        num_remote_blocks=4,
        local_dcp_size=2,
        local_dcp_rank=1,
    )
    assert _lists(dec) == [[10, 11]] and _lists(pre) == [[21, 23]]


def test_region_zero_ids():
    # region 0: 1 + 1 pages matched over two ranks -> zero from index 2; region 1: 1 matched
    local = [np.asarray([1, 2, 3]), np.asarray([4, 5])]
    out = region_zero_ids(local, [[np.asarray([1]), np.asarray([4])], [[2], []]])
    assert _lists(out) == [[3], [5]]
    out[0][0] = 99
    assert local[0].tolist() == [1, 2, 3]
    assert _lists(region_zero_ids([[1, 2]], [])) == [[1, 2]]  # nothing matched: all zeroed


def test_region_zero_rows():
    # page b of region r is [b * stride_r, + len_r): region 0 (len 10, stride 16), region 1 (20, 32)
    rows = region_zero_rows([[1, 3], [0, 2]], [10, 20], [16, 32])
    assert rows.tolist() == [[0, 16, 10], [0, 48, 10], [1, 0, 20], [1, 64, 20]]
    # fewer id lists than regions is allowed
    assert region_zero_rows([[2]], [10, 20], [16, 32]).tolist() == [[0, 32, 10]]
    assert region_zero_rows([], [10], [16]).shape == (0, 3)


def test_region_zero_rows_refusals():
    err = _raises(GroupMismatchError, region_zero_rows, [[1], [2], [3]], [10, 20], [16, 32])
    assert err.field == "block_ids_by_region" and err.values == {"value": 3, "expected": 2}
    err = _raises(GroupMismatchError, region_zero_rows, [[1]], [10, 20], [16])
    assert err.field == "block_ids_by_region" and err.values == {"value": 1, "expected": 2}
    err = _raises(BlockIdError, region_zero_rows, [[1], [-1]], [10, 20], [16, 32])
    assert err.field == "block_ids_by_region[1]"


def test_regionmap_dtypes():
    # every list is int64, also empty ones and ones from narrower or unsigned inputs
    dec, pre = apply_prefix_caching_by_region([[]], [[1]])
    assert dec[0].dtype == np.int64 and pre[0].dtype == np.int64
    out = region_zero_ids([np.asarray([1, 2], dtype=np.int32)], [])
    assert out[0].dtype == np.int64
    u = np.uint64
    rows = region_zero_rows([[1]], np.asarray([10], dtype=u), np.asarray([16], dtype=u))
    assert rows.dtype == np.int64 and rows.tolist() == [[0, 16, 10]]
    assert region_zero_rows([[1, 2]], [10], [16]).dtype == np.int64


# Exact plans of pulls between sides that group the same regions differently (:mod:`kvgeom.plan.regionmap`)
# through :func:`kvgeom.plan.request.plan_request`: ids per region, notifications, zeroed pages, and refusals
# .
#
# MLA model of 4 layers (latent 8 fp16 = 16 B per token: a 4-token page is 64 B), 10 blocks per region.
# D keeps layers 1 and 3 in a group of their own: D's regions 0, 2 take group 0's ids, regions 1, 3 group
# 1's; P has one group. Descriptor ids: region r's block b is id ``10 r + b``.


MLA4 = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 4)

SEP = ("layers.1.attn", "layers.3.attn")


def _engine(block: int = 4, **kw: object) -> EngineConfig:
    return EngineConfig(tp_size=1, block_size=block, num_blocks=10, **kw)  # type: ignore[arg-type]


def _pair(
    compat: str, p: EngineConfig | None = None, d: EngineConfig | None = None, pc: bool = False
) -> Pairing:
    d = d or _engine(separate_group=SEP)
    p = p or _engine()
    pairing = Pairing.create(
        rank_geometry(MLA4, d), [rank_geometry(MLA4, p)], "pull", compat, prefix_caching=pc
    )
    assert pairing.region_mapped
    return pairing


def _ids(plan) -> list[tuple[list[int], list[int]]]:  # type: ignore[no-untyped-def]
    return [(t.local_ids.tolist(), t.remote_ids.tolist()) for t in plan.transfers]


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_whole_request_pairs_every_region(compat: str) -> None:
    # D group 0 = [2, 3] (regions 0, 2), group 1 = [6, 7] (regions 1, 3); P = [4, 5] in every region
    plan = plan_request(_pair(compat), [[2, 3], [6, 7]], [[4, 5]], "a", "b", num_tokens=8)
    assert _ids(plan) == [([2, 3, 16, 17, 22, 23, 36, 37], [4, 5, 14, 15, 24, 25, 34, 35])]
    (t,) = plan.transfers
    assert t.notif == "b:1" and t.remote_rank == 0
    assert plan.request_id == "a" and plan.mode == "pull" and plan.notify_only == ()
    assert plan.expected_notifications == 1 and plan.consumer_rank == 0 and plan.regroup == ()
    assert plan.zero.shape == (0, 3)
    plan = plan_request(_pair(compat), [[2, 3], [6, 7]], [[4, 5]], "a", num_tokens=8)
    assert [t.notif for t in plan.transfers] == ["a:1"]


@pytest.mark.parametrize(("compat", "prefill"), [("vllm", 4), ("kvgeom", 4), ("kvgeom", None)])
def test_pages_p_did_not_send_are_zeroed(compat: str, prefill: int | None) -> None:
    # P sent one block (tokens 0..3): each region's first D block is read, its second zeroed whole:
    # region 0 block 3 at 3 x 64 = 192, region 1 block 7 at 448, region 2 block 3, region 3 block 7
    plan = plan_request(_pair(compat), [[2, 3], [6, 7]], [[4]], num_tokens=8, prefill_tokens=prefill)
    assert _ids(plan) == [([2, 16, 22, 36], [4, 14, 24, 34])]
    assert plan.zero.tolist() == [[0, 192, 64], [1, 448, 64], [2, 192, 64], [3, 448, 64]]


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_prefix_hit_reads_the_uncached_tail(compat: str) -> None:
    # D caches block 0 of each group (tokens 0..3); its lists [3], [7] hold tokens 4..7 = P's block 5
    plan = plan_request(_pair(compat, pc=True), [[3], [7]], [[4, 5]], num_tokens=8, prefill_tokens=8)
    assert _ids(plan) == [([3, 17, 23, 37], [5, 15, 25, 35])]
    assert plan.zero.shape == (0, 3)


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_nothing_local_is_notification_only(compat: str) -> None:
    plan = plan_request(_pair(compat), [], [[4]], num_tokens=8, prefill_tokens=4)
    assert plan.transfers == () and plan.notify_only == (0,) and plan.zero.shape == (0, 3)
    plan = plan_request(_pair(compat), [[], []], [[4]], num_tokens=8, prefill_tokens=4)
    assert plan.transfers == () and plan.notify_only == (0,)


def test_prefix_caching_needs_num_tokens() -> None:
    with pytest.raises(PlanError) as err:
        plan_request(_pair("vllm", pc=True), [[2, 3], [6, 7]], [[4, 5]], prefill_tokens=8)
    assert type(err.value) is TokenCountError and err.value.field == "num_tokens"


def test_vllm_mode_refuses_other_logical_blocks_without_token_counts() -> None:
    # P: logical block 4 of two 2-token kernel blocks (ppl 2); D: block 2 (ppl 1): same kernel pages
    p, d = _engine(4, kernel_block_size=2), _engine(2, separate_group=SEP)
    with pytest.raises(UnsupportedError) as err:
        plan_request(_pair("vllm", p, d), [[2, 3], [6, 7]], [[4]], num_tokens=4)
    assert type(err.value) is UnsupportedError
    assert err.value.field == "prefill_tokens" and err.value.values == {"local": 1, "remote": 2}
    # with the token counts vLLM pairs by page position: P's block 4 = kernel pages 8, 9
    want = [([2, 3, 16, 17, 22, 23, 36, 37], [8, 9, 28, 29, 48, 49, 68, 69])]
    assert (
        _ids(plan_request(_pair("vllm", p, d), [[2, 3], [6, 7]], [[4]], num_tokens=4, prefill_tokens=4))
        == want
    )
    assert _ids(plan_request(_pair("kvgeom", p, d), [[2, 3], [6, 7]], [[4]], num_tokens=4)) == want


def test_vllm_mode_refuses_more_d_pages_than_p_supplies_without_prefill_tokens() -> None:
    with pytest.raises(PlanError) as err:
        plan_request(_pair("vllm"), [[2, 3], [6, 7]], [[4]], num_tokens=8)
    assert err.value.field == "decode_ids[0]" and err.value.values == {"local": 2, "remote": 1}


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_bad_ids_name_their_side(compat: str) -> None:
    with pytest.raises(BlockIdError) as err:
        plan_request(_pair(compat), [[2, 3], [6, 7]], [[4, -5]], num_tokens=8)
    assert type(err.value) is BlockIdError
    assert err.value.field == "remote_ids[0]" and err.value.values == {"value": -5}
    with pytest.raises(BlockIdError) as err:
        plan_request(_pair(compat), [[2, 3], [6, 7]], [[4, 10]], num_tokens=8)
    assert err.value.field == "remote_ids[0]" and err.value.values == {"value": 10, "expected": 10}
    with pytest.raises(BlockIdError) as err:
        plan_request(_pair(compat), [[2, 3], [6, 10]], [[4, 5]], num_tokens=8)
    assert err.value.field == "local_ids[1]" and err.value.values == {"value": 10, "expected": 10}
    with pytest.raises(BlockIdError) as err:
        plan_request(_pair(compat), [[2, 3], [3, 7]], [[4, 5]], num_tokens=8)
    assert err.value.field == "local_ids[1]" and err.value.values == {"value": 3, "groups": (0, 1)}


@pytest.mark.parametrize(("d_ids", "region"), [([[0], []], 0), ([[], [5]], 1)])
def test_vllm_mode_refuses_pairing_a_region_by_count_against_the_token_axis(d_ids: list, region: int) -> None:
    # 5 tokens: D's one block of a group is its uncached tail (tokens 4..7); P's one block holds tokens
    # 0..3. vLLM end-trims and pairs them (other tokens): refused naming the region's page lists.
    # kvgeom mode reads nothing and zeroes that block in the group's two regions.
    with pytest.raises(UnsupportedError) as err:
        plan_request(_pair("vllm"), d_ids, [[6]], num_tokens=5)
    assert type(err.value) is UnsupportedError
    assert err.value.field == f"regions[{region}]"
    assert err.value.values == {"local": [d_ids[region][0]], "remote": [6]}
    plan = plan_request(_pair("kvgeom"), d_ids, [[6]], num_tokens=5)
    b = d_ids[region][0]
    assert plan.transfers == () and plan.notify_only == (0,)
    assert plan.zero.tolist() == [[region, 64 * b, 64], [region + 2, 64 * b, 64]]


@pytest.mark.parametrize("compat", ["vllm", "kvgeom"])
def test_tail_blocks_pair_with_p_tail(compat: str) -> None:
    # 5 tokens: D's tails [0] (group 0: regions 0, 2) and [5] (group 1: regions 1, 3) hold tokens 4..7 =
    # P's second block 7; ids 10 r + b
    plan = plan_request(_pair(compat), [[0], []], [[6, 7]], num_tokens=5)
    assert _ids(plan) == [([0, 20], [7, 27])]
    plan = plan_request(_pair(compat), [[0], [5]], [[6, 7]], num_tokens=5, prefill_tokens=5)
    assert _ids(plan) == [([0, 15, 20, 35], [7, 17, 27, 37])] and plan.zero.shape == (0, 3)


DENSE2 = ModelSpec.from_layers("dense", [AttentionSpec(2, 4, "float16")] * 2)


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_kvgeom_mode_reads_head_slices_region_by_region(layout: str) -> None:
    """Dense, 2 layers, 2 KV heads of 4 fp16 (16 B per token-head with K and V): P TP2 (one head per rank,
    64 B pages) -> D TP1 (128 B pages) keeping layer 1 in a group of its own (4 blocks per region).
    Head-major: D head h of block b at 128 b + 64 h, 64 B. Token-major (cut per token): token t of head h
    at 128 b + 32 t + 16 h, 16 B; P's token t of block b at 64 b + 16 t."""
    d = rank_geometry(DENSE2, EngineConfig(1, 4, 4, separate_group=("layers.1.attn",), kv_layout=layout))
    ps = [rank_geometry(DENSE2, EngineConfig(2, 4, 4, tp_rank=r, kv_layout=layout)) for r in range(2)]
    pairing = Pairing.create(d, ps, "pull", "kvgeom")
    assert pairing.region_mapped
    plan = plan_request(pairing, [[1], [2]], [[3]], num_tokens=4)
    got = sorted(map(tuple, plan.moves(pairing).tolist()))
    want = []
    for r in range(2):  # P rank r holds head r; D block 1 (region 0) and 2 (region 1) <- P block 3
        for region, b in ((0, 1), (1, 2)):
            if layout == "head_major":
                want.append((r, region, 192, 0, region, 128 * b + 64 * r, 64))
            else:
                want += [
                    (r, region, 192 + 16 * t, 0, region, 128 * b + 32 * t + 16 * r, 16) for t in range(4)
                ]
    assert got == sorted(want)
    assert [t.notif for t in plan.transfers] == ["req:1", "req:1"] and plan.zero.shape == (0, 3)
    # 8 tokens of which P computed the first 4: D's second blocks (0 in region 0, 3 in region 1) zeroed
    plan = plan_request(pairing, [[1, 0], [2, 3]], [[3]], num_tokens=8, prefill_tokens=4)
    assert plan.zero.tolist() == [[0, 0, 128], [1, 384, 128]]


def test_vllm_mode_pairs_a_region_every_group_views_by_page_position() -> None:
    """Packed MLA rows (one region holding all 4 layers) on both sides; D keeps layers 1 and 3 in a group
    of their own, so D's one region is viewed by both groups (no single group: vLLM mode only). vLLM pairs
    that region's page list (group 0's [2] then group 1's [6]) with P's [4, 5] by position."""
    p = rank_geometry(MLA4, _engine(packed_rows=True))
    d = rank_geometry(MLA4, _engine(packed_rows=True, separate_group=SEP))
    pairing = Pairing.create(d, [p], "pull", "vllm")
    assert pairing.region_mapped
    plan = plan_request(pairing, [[2], [6]], [[4, 5]], num_tokens=8)
    assert _ids(plan) == [([2, 6], [4, 5])] and plan.zero.shape == (0, 3)
    with pytest.raises(PlanError) as err:  # 4 pages of D's region (2 per group) against P's 2
        plan_request(pairing, [[2, 3], [6, 7]], [[4, 5]], num_tokens=8)
    assert err.value.field == "decode_ids[0]" and err.value.values == {"local": 4, "remote": 2}
    with pytest.raises(UnsupportedError) as err:
        Pairing.create(d, [p], "pull", "kvgeom")
    assert err.value.field == "separate_group"


def test_vllm_mode_maps_each_region_to_its_group_when_both_sides_group_alike() -> None:
    """Both sides keep layers 1 and 3 in a group of their own: not region-mapped, but vLLM's descriptor ids
    map region r to its group only (group 0: regions 0, 2; group 1: regions 1, 3; id 10 r + b)."""
    e = _engine(separate_group=SEP)
    pairing = Pairing.create(rank_geometry(MLA4, e), [rank_geometry(MLA4, e)], "pull", "vllm")
    assert not pairing.region_mapped
    plan = plan_request(pairing, [[2, 3], [6, 7]], [[4, 5], [8, 9]], num_tokens=8)
    assert _ids(plan) == [([2, 3, 22, 23, 16, 17, 36, 37], [4, 5, 24, 25, 18, 19, 38, 39])]
    # group 0's P blocks 4, 5 (256, 320) -> D 2, 3 (128, 192) in regions 0, 2; group 1's 8, 9 -> 6, 7
    want = [(0, r, 64 * p, 0, r, 64 * d, 64) for r in (0, 2) for p, d in ((4, 2), (5, 3))]
    want += [(0, r, 64 * p, 0, r, 64 * d, 64) for r in (1, 3) for p, d in ((8, 6), (9, 7))]
    assert sorted(map(tuple, plan.moves(pairing).tolist())) == sorted(want)


def lists(groups: list) -> list:
    return [g.tolist() for g in groups]


def test_regions_expand_groups() -> None:
    assert lists(block_ids_by_region([[0], [2]], [-1])) == [[0, 2]]
    assert lists(block_ids_by_region([[1, 2], [5]], [1, 0, -1])) == [[5], [1, 2], [1, 2, 5]]
    with pytest.raises(GroupMismatchError):
        block_ids_by_region([[1]], [1])


@pytest.mark.parametrize(("local_ppl", "remote_ppl"), [(1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("num_tokens", [160, 224])
@pytest.mark.parametrize("cached", [0, 1])
def test_region_pull_ignores_allocation_padding(
    local_ppl: int, remote_ppl: int, num_tokens: int, cached: int
) -> None:
    """D groups a host region (cached prefix of ``cached`` logical blocks) and an indexer region apart, P
    keeps both in one group; 64-token kernel pages; D's and P's logical blocks pad past the request."""
    pages = math.ceil(num_tokens / 64)
    local_count = math.ceil(num_tokens / (64 * local_ppl))
    remote_count = math.ceil(num_tokens / (64 * remote_ppl))
    host = [b * local_ppl + j for b in range(30 + cached, 30 + local_count) for j in range(local_ppl)]
    indexer = [b * local_ppl + j for b in range(40, 40 + local_count) for j in range(local_ppl)]
    remote = [b * remote_ppl + j for b in range(10, 10 + remote_count) for j in range(remote_ppl)]
    local_by_region = block_ids_by_region([host, indexer], [0, 1])
    remote_by_region = block_ids_by_region([remote], [0, 0])
    dec, pre = apply_prefix_caching_by_region(
        local_by_region, remote_by_region, [cached * local_ppl, 0], pages
    )
    first = 10 * remote_ppl
    assert lists(pre) == [
        list(range(first + cached * local_ppl, first + pages)),
        list(range(first, first + pages)),
    ]
    assert lists(dec) == [
        list(range((30 + cached) * local_ppl, 30 * local_ppl + pages)),
        list(range(40 * local_ppl, 40 * local_ppl + pages)),
    ]
    zero = region_zero_ids(local_by_region, [dec])
    assert lists(zero) == [
        list(range(base * local_ppl + pages, (base + local_count) * local_ppl)) for base in (30, 40)
    ]


def test_region_prefix_without_counts_end_trims() -> None:
    dec, pre = apply_prefix_caching_by_region([[5, 6], [7]], [[1, 2, 3], [4, 8]])
    assert lists(dec) == [[5, 6], [7]] and lists(pre) == [[2, 3], [8]]
    dec, pre = apply_prefix_caching_by_region([[], []], [[1], [2]])
    assert lists(dec) == [[], []] and lists(pre) == [[], []]
    with pytest.raises(PlanError):
        apply_prefix_caching_by_region([[5, 6]], [[1]])


def test_region_zero_rows_clear_each_page_in_its_own_region() -> None:
    rows = region_zero_rows([[3, 0], [], [2]], block_lens=[100, 50, 64], block_strides=[128, 50, 64])
    assert rows.tolist() == [[0, 384, 100], [0, 0, 100], [2, 128, 64]]
    assert region_zero_rows([], [1], [1]).shape == (0, 3)
    with pytest.raises(GroupMismatchError):
        region_zero_rows([[1], [2]], [8], [8])


def test_region_mapped_pull_passes_prefill_tokens_on() -> None:
    """Region-mapped pull (D keeps layers 1 and 3 in a group of their own) in the N-1 flow: D holds 9 tokens
    (3 blocks of 4), P computed 8 (2 blocks) and sent 2 blocks per group. Told ``prefill_tokens=8`` both
    modes plan it and the oracle passes (P's shorter list is not refused, D's third block is zeroed)."""
    from kvgeom import EngineConfig, MLASpec, ModelSpec
    from kvgeom.testing.oracle import run

    mla4 = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 4)
    p = EngineConfig(tp_size=1, block_size=4, num_blocks=10)
    d = EngineConfig(
        tp_size=1, block_size=4, num_blocks=10, separate_group=("layers.1.attn", "layers.3.attn")
    )
    request = Request.simple(mla4, p, d, 9, 0, prefill_tokens=8)
    assert [len(x) for x in request.d_ids] == [3, 3] and [len(x) for x in request.p_ids] == [2]
    for compat in ("vllm", "kvgeom"):
        report = run(mla4, p, d, request, "pull", compat)
        assert report.ok, (compat, report)
        assert report.bytes_moved == 4 * 8 * 16  # 4 layers x 8 computed tokens x 16 B of latent
