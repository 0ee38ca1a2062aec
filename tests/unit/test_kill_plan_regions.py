"""Exact plans of pulls between sides that group the same regions differently (:mod:`kvgeom.plan.regionmap`)
through :func:`kvgeom.plan.request.plan_request`: ids per region, notifications, zeroed pages, and refusals
(issue 12, mutation score).

MLA model of 4 layers (latent 8 fp16 = 16 B per token: a 4-token page is 64 B), 10 blocks per region.
D keeps layers 1 and 3 in a group of their own: D's regions 0, 2 take group 0's ids, regions 1, 3 group
1's; P has one group. Descriptor ids: region r's block b is id ``10 r + b``."""

from __future__ import annotations

import pytest

from kvgeom import AttentionSpec, EngineConfig, MLASpec, ModelSpec, Pairing, rank_geometry
from kvgeom.errors import BlockIdError, PlanError, TokenCountError, UnsupportedError
from kvgeom.plan.request import plan_request

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
