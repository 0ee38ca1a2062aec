"""The byte oracle pinned exactly on tiny hand-derived worlds: its tagged arrays, each violation it
reports for deliberately broken moves (invariant, side, rank, region, bytes, names, counts), and what it
reports for correct ones (nothing).

The tiny world ``M1``: one attention layer, 1 KV head of head size 1 in float16 (2 bytes), block size 2,
TP 1 on both sides. A block is head-major ``[1 head, 2 tokens, K 2 B | V 2 B]`` = 8 bytes, so byte ``o`` of
a block holds token ``o // 4``, K or V ``(o % 4) // 2``, byte ``o % 2``: its tag (``CoordSpace``: token-major
``(token, head, kv, byte)``) is ``4 * token + o % 4``. Location tags are ``-(3 + offset)`` on P rank 0
region 0 and ``-(3 + 2**54 + offset)`` on D rank 0 region 0 (side bit 1 shifted past 6 + 12 + 36 bits).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvgeom.testing.oracle as oracle_mod
from kvgeom.errors import TokenCountError
from kvgeom.layout.engine import EngineConfig
from kvgeom.model.layers import AttentionSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.requestplan import Regroup
from kvgeom.testing import (
    POISON,
    ZERO,
    Oracle,
    RankPlan,
    Request,
    RequestError,
    check_moves,
    engine_geometries,
    pull_plans,
    push_plans,
    run,
    run_plans,
    run_pull,
    run_push,
)
from kvgeom.testing._report import Violation

M1 = ModelSpec.from_layers("t", [AttentionSpec(1, 1, "float16")])
E1 = EngineConfig(tp_size=1, block_size=2, num_blocks=4)
# 3 tokens: P blocks 1 (tokens 0, 1) and 2 (tokens 2, 3); D blocks 3 (tokens 0, 1) and 0 (tokens 2, 3)
REQ = Request(3, [[1, 2]], [[3, 0]])
D_LOC = 3 + (1 << 54)  # D rank 0 region 0 location tag of byte o: -(D_LOC + o)
NAME0 = "layers.0.attn token 0 head 0 K byte 0"


def _p_loc(o):
    return -(3 + np.asarray(o))


def _d_loc(o):
    return -(D_LOC + np.asarray(o))


def _move(sr=0, sreg=0, soff=8, dr=0, dreg=0, doff=24, slen=8, dlen=None):
    row = [sr, sreg, soff, dr, dreg, doff, slen] + ([] if dlen is None else [dlen])
    return np.array([row], dtype=np.int64)


# -- the tagged arrays ------------------------------------------------------------------------------------
def test_initial_arrays_of_the_tiny_world() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    # P: blocks 1, 2 (bytes 8..23) hold tags 0..15; blocks 0 and 3 their location tags
    want_p = np.concatenate([_p_loc(range(8)), np.arange(16), _p_loc(range(24, 32))])
    assert len(o.src) == 1 and len(o.src[0]) == 1
    np.testing.assert_array_equal(o.src[0][0], want_p)
    # D: blocks 3 and 0 are the request's (POISON), blocks 1, 2 location tags
    want_d = np.concatenate([np.full(8, POISON), _d_loc(range(8, 24)), np.full(8, POISON)])
    np.testing.assert_array_equal(o.dst[0][0], want_d)
    # roles: block 3 needed (tokens 0, 1); block 0: token 2 needed, token 3 optional (>= num_tokens 3)
    np.testing.assert_array_equal(o.d_images[0].role[0], [2] * 4 + [3] * 4 + [0] * 16 + [2] * 8)
    assert o.space.max_tokens == 4 and o.prefix_tokens == 0
    assert o.writer[0][0].tolist() == [np.iinfo(np.int64).min] * 32
    assert o.result.ok and o.result.limit == 20


def test_oracle_limit_is_passed_to_the_report() -> None:
    o = Oracle(M1, engine_geometries(M1, E1), engine_geometries(M1, E1), REQ, limit=1)
    assert o.result.limit == 1
    o.execute(np.concatenate([_move(soff=-1), _move(soff=-2)]))
    assert len(o.result.of("I6")) == 1 and o.result.violated_bytes["I6"] == 16


def test_max_tokens_is_the_largest_block_cover() -> None:
    p4 = EngineConfig(tp_size=1, block_size=4, num_blocks=6)
    d2 = EngineConfig(tp_size=1, block_size=2, num_blocks=6)
    # P block 4: 5 tokens -> 2 P blocks = 8 tokens; D: 3 blocks of 2 = 6 tokens
    assert Oracle.for_engines(M1, p4, d2, Request(5, [[1, 2]], [[1, 2, 3]])).space.max_tokens == 8
    # the other way round: P 3 blocks of 2 = 6, D 2 blocks of 4 = 8
    assert Oracle.for_engines(M1, d2, p4, Request(5, [[1, 2, 3]], [[1, 2]])).space.max_tokens == 8
    # a prefix block of D counts: prefix 1 block (4 tokens) + 1 block = 8 tokens; P: 4 tokens of 2 blocks
    o = Oracle.for_engines(M1, d2, p4, Request(5, [[1, 2, 3]], [[1]], prefix_blocks=1))
    assert o.prefix_tokens == 4 and o.space.max_tokens == 8
    # P computed 3 of 7 tokens: 2 P blocks of 2 = 4, D 2 blocks of 4 = 8, num_tokens 7
    o = Oracle.for_engines(M1, d2, p4, Request(7, [[1, 2]], [[1, 2]], prefill_tokens=3))
    assert o.space.max_tokens == 8


def test_request_block_counts_are_checked_on_both_sides() -> None:
    with pytest.raises(RequestError) as err:
        Oracle.for_engines(M1, E1, E1, Request(3, [[1]], [[3, 0]]))  # P needs ceil(3 / 2) = 2
    assert err.value.field == "p_ids[0]" and err.value.values == {"value": 1, "expected": 2}
    with pytest.raises(RequestError) as err:
        Oracle.for_engines(M1, E1, E1, Request(3, [[1, 2]], [[3]]))
    assert err.value.field == "d_ids[0]" and err.value.values == {"value": 1, "expected": 2}
    # P computed 2 tokens: 1 block; D still holds 2 blocks, 1 of them a prefix: 1 id
    o = Oracle.for_engines(M1, E1, E1, Request(3, [[1]], [[0]], prefix_blocks=1, prefill_tokens=2))
    assert o.prefix_tokens == 2
    with pytest.raises(RequestError) as err:
        Oracle.for_engines(M1, E1, E1, Request(3, [[1]], [[0, 3]], prefix_blocks=1, prefill_tokens=2))
    assert err.value.field == "d_ids[0]" and err.value.values == {"value": 2, "expected": 1}


def test_geometries_must_be_every_rank_in_order() -> None:
    e2 = EngineConfig(tp_size=2, block_size=2, num_blocks=4)
    m2 = ModelSpec.from_layers("t2", [AttentionSpec(2, 1, "float16")])
    g = engine_geometries(m2, e2)
    req = Request(3, [[1, 2]], [[3, 0]])
    for p, d, side in ((g[::-1], g, "P"), (g, g[::-1], "D"), (g[1:], g, "P"), (g, g[1:], "D")):
        with pytest.raises(RequestError) as err:
            Oracle(m2, p, d, req)
        given = [x.global_rank for x in (p if side == "P" else d)]
        assert err.value.field == f"{side.lower()}_geoms"
        assert err.value.values == {"value": given, "expected": list(range(len(given)))}
    assert Oracle(m2, g, g, req).result.ok


def test_blocks_holding_only_tokens_d_computes_start_zero() -> None:
    # P computed 2 of 4 tokens: D block 0 holds tokens 2, 3 (>= 2): D's own, ZERO; block 3 POISON
    o = Oracle.for_engines(M1, E1, E1, Request(4, [[1]], [[3, 0]], prefill_tokens=2))
    want = np.concatenate([np.full(8, ZERO), _d_loc(range(8, 24)), np.full(8, POISON)])
    np.testing.assert_array_equal(o.dst[0][0], want)
    assert o.d_images[0].role[0].tolist() == [3] * 8 + [0] * 16 + [2] * 8
    # P computed 3: block 0 holds token 2, which P computed: POISON, not D's own
    o = Oracle.for_engines(M1, E1, E1, Request(4, [[1, 2]], [[3, 0]], prefill_tokens=3))
    assert o.dst[0][0][:8].tolist() == [POISON] * 8


def test_own_blocks_with_a_prefix() -> None:
    # prefix block 1 (tokens 0, 1 cached); D's list [3, 0] holds tokens 2, 3 and 4, 5; P computed 4
    o = Oracle.for_engines(M1, E1, E1, Request(6, [[1, 2]], [[3, 0]], prefix_blocks=1, prefill_tokens=4))
    assert o.dst[0][0][24:].tolist() == [POISON] * 8  # tokens 2, 3 < 4
    assert o.dst[0][0][:8].tolist() == [ZERO] * 8  # tokens 4, 5 >= 4


# -- executing -------------------------------------------------------------------------------------------
def test_a_correct_move_copies_tags() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(_move())
    assert o.dst[0][0][24:].tolist() == list(range(8))
    assert o.writer[0][0][24:].tolist() == list(range(8))
    assert o.result.descriptors == 1 and o.result.bytes_moved == 8 and o.result.ok
    o.execute(_move(soff=16, doff=0))  # tokens 2, 3 into D block 0
    assert o.dst[0][0][:8].tolist() == list(range(8, 16))
    assert o.result.descriptors == 2 and o.result.bytes_moved == 16
    rep = o.report()
    assert rep.ok and rep.violations == [], rep


def test_empty_moves_do_nothing() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(np.zeros((0, 7), dtype=np.int64))
    o.execute([])
    assert o.result.descriptors == 0 and o.result.ok


@pytest.mark.parametrize("shape", [(7,), (1, 6), (1, 9), (1, 1, 7)])
def test_moves_of_a_wrong_shape_raise(shape) -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    with pytest.raises(RequestError) as err:
        o.execute(np.zeros(shape, dtype=np.int64))
    assert err.value.field == "moves" and err.value.values == {"value": shape}


def test_unequal_lengths_are_i2_and_move_the_shorter() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(_move(slen=8, dlen=6), "mine")
    assert o.result.violations[0] == Violation(
        "I2",
        "D",
        0,
        0,
        24,
        30,
        "6 bytes from the source",
        "a 8-byte source descriptor",
        "mine #0: unequal lengths",
    )
    assert o.result.violated_bytes["I2"] == 2 and o.result.bytes_moved == 6
    assert o.dst[0][0][24:].tolist() == [0, 1, 2, 3, 4, 5, POISON, POISON]
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(_move(slen=5, dlen=8))  # destination longer: 3 bytes, 5 moved
    assert o.result.violations[0] == Violation(
        "I2",
        "D",
        0,
        0,
        24,
        32,
        "8 bytes from the source",
        "a 5-byte source descriptor",
        "move #0: unequal lengths",
    )
    assert o.result.violated_bytes["I2"] == 3 and o.result.bytes_moved == 5
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(_move(slen=8, dlen=8))  # 8 columns, equal: fine
    assert o.result.ok and o.result.bytes_moved == 8


def test_a_source_outside_its_region_is_i6() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(np.concatenate([_move(), _move(soff=28, doff=0)]), "m")  # P bytes [28, 36) of 32
    assert o.result.violations == [
        Violation("I6", "P", 0, 0, 28, 36, "a range inside a 32-byte region", "[28, 36)", "m #1 source")
    ]
    assert o.result.violated_bytes["I6"] == 8 and o.result.descriptors == 2 and o.result.bytes_moved == 8
    assert o.dst[0][0][:8].tolist() == [POISON] * 8  # nothing written


def test_both_sides_outside_are_both_reported() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(_move(soff=-4, doff=30, slen=4))
    assert o.result.violations == [
        Violation("I6", "P", 0, 0, -4, 0, "a range inside a 32-byte region", "[-4, 0)", "move #0 source"),
        Violation(
            "I6", "D", 0, 0, 30, 34, "a range inside a 32-byte region", "[30, 34)", "move #0 destination"
        ),
    ]
    assert o.result.violated_bytes["I6"] == 8


def test_range_boundaries() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    assert o._bounds(0, 0, 0, 0, 32, "x")  # the whole region
    assert o._bounds(0, 0, 0, 32, 0, "x")  # empty, at the end
    assert o._bounds(1, 0, 0, 31, 1, "x")
    assert o.result.ok
    assert not o._bounds(1, 0, 0, 31, 2, "x")
    assert not o._bounds(1, 0, 0, -1, 1, "x")
    assert not o._bounds(1, 0, 0, 4, -1, "x")  # negative length: stop = start, counted as 1
    assert o.result.violations[-1] == Violation(
        "I6", "D", 0, 0, 4, 4, "a range inside a 32-byte region", "[4, 3)", "x"
    )
    assert o.result.violated_bytes["I6"] == 2 + 1 + 1


@pytest.mark.parametrize(
    ("side", "rank", "region"), [(0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (1, -1, 0), (0, 0, -1)]
)
def test_no_such_rank_or_region(side: int, rank: int, region: int) -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    assert o._region(side, rank, region) is None
    assert not o._bounds(side, rank, region, 0, 4, "w")
    assert o.result.violations == [
        Violation("I6", "PD"[side], rank, region, 0, 4, "a range inside no such rank/region", "[0, 4)", "w")
    ]


def test_region_lookup_by_side() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    assert o._region(0, 0, 0) is o.src[0][0]
    assert o._region(1, 0, 0) is o.dst[0][0]


def test_two_writers_with_different_bytes_are_i5() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(np.concatenate([_move(soff=8, doff=24, slen=8), _move(soff=12, doff=28, slen=4)]))
    # second move writes D [28, 32) again with tags 4..7: the same bytes: no clash
    assert o.result.ok
    o.execute(_move(soff=16, doff=26, slen=4), "again")  # D [26, 30) held 2..5, now 8..11
    v = o.result.of("I5")
    assert v == [
        Violation(
            "I5",
            "D",
            0,
            0,
            26,
            30,
            "layers.0.attn token 0 V byte 0".replace("token 0 V", "token 0 head 0 V"),
            "layers.0.attn token 2 head 0 K byte 0",
            "again #0 overwrites an earlier write",
        )
    ]
    assert o.result.violated_bytes["I5"] == 4
    assert o.dst[0][0][24:].tolist() == [0, 1, 8, 9, 10, 11, 6, 7]


def test_i5_runs_are_split_where_bytes_agree() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(_move(soff=8, doff=24, slen=8))
    # overwrite D [24, 32) with P [8, 16) but two bytes changed: P byte 10 and 11 differ only if the source
    # differs; use a source whose bytes 2..3 agree: P [8, 12) then [12, 16) equal -> no clash at all
    o.execute(_move(soff=8, doff=24, slen=8))
    assert o.result.ok
    o.src[0][0][10:12] = 99  # plant: the source now differs at bytes 2, 3 of the block only
    o.execute(_move(soff=8, doff=24, slen=8))
    assert [(v.start, v.stop) for v in o.result.of("I5")] == [(26, 28)]


def test_padding_bytes_take_any_writes() -> None:
    # head size 1 with head_size_v 1 but float32 page? use MLA-free padding: a kv_split model whose V
    # region is smaller than K's is not possible; instead mark padding directly in the D image
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.d_images[0].role[0][24:28] = 1  # PADDING
    o.execute(_move(soff=8, doff=24, slen=8))
    o.execute(_move(soff=16, doff=24, slen=8))
    assert [(v.start, v.stop) for v in o.result.of("I5")] == [(28, 32)]


def test_zero_ranges() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.zero(0, np.array([[0, 4, 4], [0, 30, 2]]))
    assert o.dst[0][0][:8].tolist() == [POISON] * 4 + [ZERO] * 4
    assert o.dst[0][0][30:].tolist() == [ZERO] * 2
    assert o.result.bytes_zeroed == 6 and o.result.ok
    o.zero(0, [0, 30, 4, 0, 0, 1], "z")  # flat rows: the first is outside
    assert o.result.violations == [
        Violation("I6", "D", 0, 0, 30, 34, "a range inside a 32-byte region", "[30, 34)", "z #0")
    ]
    assert o.result.bytes_zeroed == 7 and o.dst[0][0][0] == ZERO
    o.zero(0, np.array([[0.0, 8.0, 2.0]]))  # float rows are taken as integers
    assert o.dst[0][0][8:10].tolist() == [ZERO, ZERO] and o.result.bytes_zeroed == 9
    o.zero(1, [[0, 0, 1]])
    assert o.result.violations[-1].detail == "zero #0" and o.result.violations[-1].found == "[0, 1)"


# -- regroup --------------------------------------------------------------------------------------------
def _regroup_world() -> Oracle:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.dst[0][0][:] = np.arange(32)
    return o


def test_regroup_permutes_per_its_documented_meaning() -> None:
    # heads 2, tokens 4, bsr 2, 1 byte: n = 2; the block viewed as [bsr 2, heads 2, n 2] is stored as
    # [heads 2, tokens 4]: dest (h, t) <- source (t // 2, h, t % 2) = ((t // 2) * 2 + h) * 2 + t % 2:
    # h 0: t 0..3 <- 0, 1, 4, 5; h 1: t 0..3 <- 2, 3, 6, 7
    o = _regroup_world()
    o.regroup(0, Regroup((0,), np.array([1, 3]), 2, 2, 4, 1))
    perm = [0, 1, 4, 5, 2, 3, 6, 7]
    want = list(range(8)) + [8 + i for i in perm] + list(range(16, 24)) + [24 + i for i in perm]
    assert o.dst[0][0].tolist() == want
    assert o.result.regrouped_blocks == 2 and o.result.ok


def test_regroup_with_head_bytes_and_one_head() -> None:
    # heads 1, tokens 4, bsr 2, 2 bytes: [2, 1, 2, 2] -> [1, 4, 2]: the same order (one head)
    o = _regroup_world()
    o.regroup(0, Regroup((0,), [2], 2, 1, 4, 2))
    assert o.dst[0][0].tolist() == list(range(32)) and o.result.regrouped_blocks == 1
    # heads 2, tokens 2, bsr 2, 2 bytes: n = 1; dest (h, t, x) <- ((t * 2 + h) * 1) * 2 + x:
    # h 0: t 0 <- 0, 1; t 1 <- 4, 5; h 1: t 0 <- 2, 3; t 1 <- 6, 7
    o.regroup(0, Regroup((0,), [0], 2, 2, 2, 2))
    assert o.dst[0][0][:8].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    # bsr 1: the layouts agree: nothing moves (heads 2, tokens 2, 2 bytes)
    o = _regroup_world()
    o.regroup(0, Regroup((0,), [0], 1, 2, 2, 2))
    assert o.dst[0][0].tolist() == list(range(32)) and o.result.regrouped_blocks == 1
    # bsr 4 = tokens: n = 1, heads 2, 1 byte: dest (h, t) <- t * 2 + h: h 0: 0, 2, 4, 6; h 1: 1, 3, 5, 7
    o.regroup(0, Regroup((0,), [0], 4, 2, 4, 1))
    assert o.dst[0][0][:8].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize(("bsr", "tokens"), [(0, 4), (3, 4), (-1, 4), (2, 3)])
def test_regroup_needs_tokens_divisible_by_bsr(bsr: int, tokens: int) -> None:
    o = _regroup_world()
    o.regroup(0, Regroup((0,), [1], bsr, 1, tokens, 1), "rg")
    assert o.result.violations == [
        Violation("I6", "D", 0, -1, 0, 0, "tokens divisible by bsr", f"tokens {tokens}, bsr {bsr}", "rg")
    ]
    assert not o.result.ok and o.result.regrouped_blocks == 0
    assert o.dst[0][0].tolist() == list(range(32))


def test_regroup_larger_than_a_block() -> None:
    o = _regroup_world()
    o.regroup(0, Regroup((0,), [1, 2], 1, 1, 9, 1))  # 9 bytes, blocks of 8
    assert o.result.violations == [
        Violation("I6", "D", 0, 0, 8, 17, "at most one 8-byte block", "9 bytes", "regroup"),
        Violation("I6", "D", 0, 0, 16, 25, "at most one 8-byte block", "9 bytes", "regroup"),
    ]
    assert o.result.violated_bytes["I6"] == 18 and o.result.regrouped_blocks == 0
    o = _regroup_world()
    o.regroup(0, Regroup((0,), [1], 4, 2, 4, 1))  # exactly one block: fine
    assert o.result.ok and o.result.regrouped_blocks == 1


def test_regroup_outside_the_region_or_rank() -> None:
    o = _regroup_world()
    o.regroup(0, Regroup((0,), [4], 2, 2, 4, 1), "rg")  # block 4 of 4: bytes [32, 40)
    assert o.result.violations == [
        Violation("I6", "D", 0, 0, 32, 40, "a range inside a 32-byte region", "[32, 40)", "rg")
    ]
    o = _regroup_world()
    o.regroup(0, Regroup((1, 0), [3], 2, 2, 4, 1), "rg")  # region 1 does not exist; region 0 still done
    assert o.result.violations == [
        Violation("I6", "D", 0, 1, 0, 8, "a range inside no such rank/region", "[0, 8)", "rg")
    ]
    assert o.result.regrouped_blocks == 1 and o.dst[0][0][24:].tolist() == [24, 25, 28, 29, 26, 27, 30, 31]
    for rank, region in ((1, 0), (-1, 0), (0, -1)):
        o = _regroup_world()
        o.regroup(rank, Regroup((region,), [0], 2, 2, 4, 1), "rg")
        assert o.result.violations == [
            Violation("I6", "D", rank, region, 0, 8, "a range inside no such rank/region", "[0, 8)", "rg")
        ]
        assert o.result.regrouped_blocks == 0


def test_receive_regroups_then_zeroes() -> None:
    o = _regroup_world()
    o.receive(0, [Regroup((0,), [0], 2, 2, 4, 1)], np.array([[0, 0, 2]]), "rx")
    # regroup first ([0, 1, 4, 5, ...]), then bytes 0, 1 zeroed
    assert o.dst[0][0][:8].tolist() == [ZERO, ZERO, 4, 5, 2, 3, 6, 7]
    assert o.result.regrouped_blocks == 1 and o.result.bytes_zeroed == 2
    o.receive(0, [Regroup((0,), [0], 2, 1, 3, 1)], np.array([[0, 40, 1]]), "rx")
    assert [v.detail for v in o.result.violations] == ["rx regroup", "rx zero #0"]
    o.receive(0, [Regroup((0,), [0], 2, 1, 3, 1)], np.zeros((0, 3)))
    assert o.result.violations[-1].detail == "receive regroup"


# -- plans -> moves ---------------------------------------------------------------------------------------
M2 = ModelSpec.from_layers("t2", [AttentionSpec(2, 1, "float16")])
E2 = EngineConfig(tp_size=2, block_size=2, num_blocks=4)


def test_moves_of_pull_and_push_plans() -> None:
    # P TP 1 (2 heads: a 16-byte block, head h at 8 h) to D TP 2 (one head per rank: 8-byte blocks);
    # D ids [3, 0] <- P ids [1, 2]: D rank r reads P bytes 16 + 8 r and 32 + 8 r into D bytes 24 and 0
    o = Oracle.for_engines(M2, E1, E2, REQ)
    pull = pull_plans(M2, E1, E2, REQ)
    assert [o._label(rp) for rp in pull] == ["pull plan of D rank 0", "pull plan of D rank 1"]
    assert o.moves_of(pull[0]).tolist() == [[0, 0, 16, 0, 0, 24, 8, 8], [0, 0, 32, 0, 0, 0, 8, 8]]
    assert o.moves_of(pull[1]).tolist() == [[0, 0, 24, 1, 0, 24, 8, 8], [0, 0, 40, 1, 0, 0, 8, 8]]
    push = push_plans(M2, E1, E2, REQ)
    assert [o._label(rp) for rp in push] == ["push plan of P rank 0"]
    assert sorted(o.moves_of(push[0]).tolist()) == [
        [0, 0, 16, 0, 0, 24, 8, 8],
        [0, 0, 24, 1, 0, 24, 8, 8],
        [0, 0, 32, 0, 0, 0, 8, 8],
        [0, 0, 40, 1, 0, 0, 8, 8],
    ]
    assert o.result.ok
    # the other way: P TP 2 to D TP 1: D rank 0 reads from P ranks 0 and 1 (src rank = the peer)
    o = Oracle.for_engines(M2, E2, E1, REQ)
    rows = sorted(np.concatenate([o.moves_of(rp) for rp in pull_plans(M2, E2, E1, REQ)]).tolist())
    assert rows == [
        [0, 0, 8, 0, 0, 48, 8, 8],
        [0, 0, 16, 0, 0, 0, 8, 8],
        [1, 0, 8, 0, 0, 56, 8, 8],
        [1, 0, 16, 0, 0, 8, 8, 8],
    ]
    rows = sorted(np.concatenate([o.moves_of(rp) for rp in push_plans(M2, E2, E1, REQ)]).tolist())
    assert [r[0] for r in rows] == [0, 0, 1, 1] and [r[3] for r in rows] == [0, 0, 0, 0]


def _with_ids(rp: RankPlan, local=None, remote=None) -> RankPlan:
    t = rp.plan.transfers[0]
    t = dataclasses.replace(
        t,
        local_ids=t.local_ids if local is None else np.asarray(local),
        remote_ids=t.remote_ids if remote is None else np.asarray(remote),
    )
    return dataclasses.replace(rp, plan=dataclasses.replace(rp.plan, transfers=(t, *rp.plan.transfers[1:])))


def test_moves_of_reports_unequal_id_counts() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    rp = _with_ids(pull_plans(M1, E1, E1, REQ)[0], local=[3])
    assert o.moves_of(rp).shape == (0, 8)
    assert o.result.violations == [
        Violation(
            "I2",
            "D",
            -1,
            -1,
            0,
            0,
            "as many local as remote ids",
            "1 local, 2 remote",
            "pull plan of D rank 0 transfer 0",
        )
    ]
    assert o.result.violated_bytes["I2"] == 1


def test_moves_of_reports_ids_outside_their_table() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    rp = pull_plans(M1, E1, E1, REQ)[0]
    n = len(rp.pairing.remote_table(0).rows)
    nl = len(rp.pairing.local_table(rp.plan.transfers[0].local_table).rows)
    assert n == nl == 4  # one 8-byte descriptor per block
    moves = o.moves_of(_with_ids(rp, local=[3, 4], remote=[-1, 2]))
    assert moves.shape == (0, 8)  # both pairs dropped: pair 0 for its remote id, pair 1 for its local id
    label = "pull plan of D rank 0 transfer 0"
    assert o.result.violations == [
        Violation("I6", "table", -1, -1, 4, 5, "an id below 4", "4", f"{label}: local id #1"),
        Violation("I6", "table", -1, -1, -1, 0, "an id below 4", "-1", f"{label}: remote id #0"),
    ]
    assert o.result.violated_bytes["I6"] == 2
    o = Oracle.for_engines(M1, E1, E1, REQ)
    moves = o.moves_of(_with_ids(rp, local=[3, 0], remote=[1, 3]))  # 3 is the last id: fine
    assert moves.tolist() == [[0, 0, 8, 0, 0, 24, 8, 8], [0, 0, 24, 0, 0, 0, 8, 8]] and o.result.ok
    moves = o.moves_of(_with_ids(rp, local=[3, 0], remote=[1, 4]))
    assert moves.tolist() == [[0, 0, 8, 0, 0, 24, 8, 8]]


def test_moves_of_reports_at_most_three_bad_ids_per_side() -> None:
    m = ModelSpec.from_layers("t", [AttentionSpec(1, 1, "float16")])
    e = EngineConfig(tp_size=1, block_size=2, num_blocks=8)
    req = Request(9, [[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 5]])
    o = Oracle.for_engines(m, e, e, req)
    rp = _with_ids(pull_plans(m, e, e, req)[0], remote=[9, 10, 11, 12, 1])
    assert o.moves_of(rp).shape == (1, 8)
    assert [v.start for v in o.result.violations] == [9, 10, 11]
    assert o.result.violated_bytes["I6"] == 3


def test_run_plan_pull_receives_push_does_not() -> None:
    p, d = (
        EngineConfig(tp_size=1, block_size=2, num_blocks=6),
        EngineConfig(tp_size=1, block_size=8, num_blocks=4),
    )
    req = Request(3, [[1, 2]], [[3]])
    rp = pull_plans(M1, p, d, req)[0]
    assert rp.plan.zero.size  # D's 8-token block: tokens 4..7 are zeroed
    o = Oracle.for_engines(M1, p, d, req)
    o.run_plan(rp)
    assert o.result.bytes_zeroed == 16 and o.result.bytes_moved == 16 and o.report().ok
    o = Oracle.for_engines(M1, p, d, req)
    o.run_plan(dataclasses.replace(rp, plan=dataclasses.replace(rp.plan, mode="push")))
    assert o.result.bytes_zeroed == 0


# -- report ----------------------------------------------------------------------------------------------
def test_report_with_no_moves_names_missing_and_stale_bytes() -> None:
    rep = Oracle.for_engines(M1, E1, E1, REQ).report()
    assert rep.violations == [
        Violation(
            "I3", "D", 0, 0, 0, 4, "layers.0.attn token 2 head 0 K byte 0", "POISON (never written)", ""
        ),
        Violation("I3", "D", 0, 0, 24, 32, NAME0, "POISON (never written)", ""),
        Violation(
            "I4",
            "D",
            0,
            0,
            4,
            8,
            "layers.0.attn token 3 head 0 K byte 0",
            "POISON (never written)",
            "or ZERO (token past num_tokens)",
        ),
    ]
    assert rep.violated_bytes == {"I3": 12, "I4": 4}


def test_report_zero_is_fine_only_where_optional() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(np.concatenate([_move(), _move(soff=16, doff=0, slen=4)]))
    o.zero(0, [[0, 4, 4]])
    assert o.report().ok
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(np.concatenate([_move(), _move(soff=16, doff=0, slen=4)]))
    o.zero(0, [[0, 2, 6]])  # token 2's V bytes zeroed: needed
    assert o.report().violations == [
        Violation("I3", "D", 0, 0, 2, 4, "layers.0.attn token 2 head 0 V byte 0", "ZERO (zeroed)", "")
    ]


def test_report_wrong_coordinate_and_neighbour_write() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(np.concatenate([_move(soff=16, doff=24), _move(soff=16, doff=0), _move(soff=8, doff=8)]))
    rep = o.report()
    assert rep.violations == [
        Violation("I1", "D", 0, 0, 8, 16, "no coordinate (D rank 0 region 0 byte 8)", NAME0, ""),
        Violation("I2", "D", 0, 0, 24, 32, NAME0, "layers.0.attn token 2 head 0 K byte 0", ""),
    ]
    assert rep.violated_bytes == {"I1": 8, "I2": 8}
    assert rep.invariants == {"I1", "I2"}


def test_report_reads_a_neighbour_block() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(np.concatenate([_move(soff=0, doff=24), _move(soff=16, doff=0)]))
    v = o.report().violations
    assert v == [Violation("I2", "D", 0, 0, 24, 32, NAME0, "no coordinate (P rank 0 region 0 byte 0)", "")]
    assert (
        o._name(-3) == "no coordinate (P rank 0 region 0 byte 0)"
        and o._name(np.int64(7)) == "layers.0.attn token 1 head 0 V byte 1"
    )


def test_report_optional_byte_with_another_coordinate_is_i2() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(np.concatenate([_move(), _move(soff=16, doff=0, slen=4), _move(soff=8, doff=4, slen=4)]))
    assert o.report().violations == [
        Violation("I2", "D", 0, 0, 4, 8, "layers.0.attn token 3 head 0 K byte 0", NAME0, "")
    ]


def test_report_checks_every_rank_and_region() -> None:
    split = EngineConfig(tp_size=2, block_size=2, num_blocks=4, kv_split=True)
    o = Oracle.for_engines(M2, split, split, REQ)
    rep = o.report()
    # 2 ranks x 2 regions (K, V: 2 tokens x 2 bytes = 4-byte blocks), D blocks 3 and 0 each
    assert {(v.rank, v.region) for v in rep.violations} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert rep.violated_bytes == {"I3": 4 * 6, "I4": 4 * 2}
    assert run_pull(M2, split, split, REQ).ok


# -- planning every rank ----------------------------------------------------------------------------------
def test_told_and_prefix_caching_defaults() -> None:
    req = Request(4, [[1]], [[3, 0]], prefill_tokens=2)
    assert oracle_mod._told(req, True, None) == (4, 2)
    assert oracle_mod._told(req, False, None) == (None, None)
    assert oracle_mod._told(req, True, False) == (4, None)
    assert oracle_mod._told(req, False, True) == (None, 2)
    assert oracle_mod._prefix_caching(REQ, None) is False
    assert oracle_mod._prefix_caching(Request(3, [[1, 2]], [[0]], prefix_blocks=1), None) is True
    assert oracle_mod._prefix_caching(REQ, True) is True
    assert oracle_mod._prefix_caching(Request(3, [[1, 2]], [[0]], prefix_blocks=1), False) is False


@pytest.fixture
def told(monkeypatch):
    """Record what every plan_request / receive_step call is told."""
    calls = []
    real_plan, real_receive = oracle_mod.plan_request, oracle_mod.receive_step

    def plan(pairing, local_ids, remote_ids, **kw):
        calls.append(("plan", pairing.mode, pairing.compat, pairing.prefix_caching, kw))
        return real_plan(pairing, local_ids, remote_ids, **kw)

    def receive(d, p, d_ids, p_ids, n, caching, computed):
        calls.append(("receive", n, caching, computed))
        return real_receive(d, p, d_ids, p_ids, n, caching, computed)

    monkeypatch.setattr(oracle_mod, "plan_request", plan)
    monkeypatch.setattr(oracle_mod, "receive_step", receive)
    return calls


REQ_N1 = Request(4, [[1]], [[3, 0]], prefill_tokens=2)


def test_pull_plans_are_told_the_token_counts(told) -> None:
    pull_plans(M1, E1, E1, REQ_N1)
    pull_plans(M1, E1, E1, REQ, "vllm", True)
    with pytest.raises(TokenCountError):  # told no num_tokens: the planner refuses (recorded first)
        pull_plans(M1, E1, E1, REQ, tell_num_tokens=False)
    pull_plans(M1, E1, E1, REQ, tell_prefill_tokens=False)
    with pytest.raises(TokenCountError):
        pull_plans(M1, E1, E1, REQ, tell_num_tokens=False, tell_prefill_tokens=True)
    assert told == [
        ("plan", "pull", "kvgeom", False, {"num_tokens": 4, "prefill_tokens": 2}),
        ("plan", "pull", "vllm", True, {"num_tokens": 3, "prefill_tokens": 3}),
        ("plan", "pull", "kvgeom", False, {"num_tokens": None, "prefill_tokens": None}),
        ("plan", "pull", "kvgeom", False, {"num_tokens": 3, "prefill_tokens": None}),
        ("plan", "pull", "kvgeom", False, {"num_tokens": None, "prefill_tokens": 3}),
    ]


def test_push_plans_are_told_the_token_counts(told) -> None:
    push_plans(M1, E1, E1, REQ_N1)
    push_plans(M1, E1, E1, REQ, "vllm", True)
    with pytest.raises(TokenCountError):  # told no num_tokens: the planner refuses (recorded first)
        push_plans(M1, E1, E1, REQ, tell_num_tokens=False)
    push_plans(M1, E1, E1, REQ, tell_prefill_tokens=False)
    with pytest.raises(TokenCountError):
        push_plans(M1, E1, E1, REQ, tell_num_tokens=False, tell_prefill_tokens=True)
    assert told == [
        ("plan", "push", "kvgeom", False, {"num_tokens": 4, "prefill_tokens": 2}),
        ("plan", "push", "vllm", True, {"num_tokens": 3, "prefill_tokens": 3}),
        ("plan", "push", "kvgeom", False, {"num_tokens": None, "prefill_tokens": None}),
        ("plan", "push", "kvgeom", False, {"num_tokens": 3, "prefill_tokens": None}),
        ("plan", "push", "kvgeom", False, {"num_tokens": None, "prefill_tokens": 3}),
    ]


@pytest.mark.parametrize("fn", [run_pull, run_push])
def test_run_pull_and_push_pass_their_options(told, fn) -> None:
    mode = "pull" if fn is run_pull else "push"
    assert fn(M1, E1, E1, REQ_N1).ok
    rep = fn(M1, E1, E1, REQ, "vllm", True, tell_prefill_tokens=False)
    assert rep.ok and rep.bytes_moved == 16
    with pytest.raises(TokenCountError):  # the planner is told no num_tokens
        fn(M1, E1, E1, REQ, tell_num_tokens=False, tell_prefill_tokens=True)
    plans = [c for c in told if c[0] == "plan"]
    assert plans == [
        ("plan", mode, "kvgeom", False, {"num_tokens": 4, "prefill_tokens": 2}),
        ("plan", mode, "vllm", True, {"num_tokens": 3, "prefill_tokens": None}),
        ("plan", mode, "kvgeom", False, {"num_tokens": None, "prefill_tokens": 3}),
    ]
    receives = [c for c in told if c[0] == "receive"]
    if mode == "push":
        assert receives == [("receive", 4, False, 2), ("receive", 3, True, None)]
    else:
        assert receives == []


def test_run_checks_its_mode_and_uses_the_given_world() -> None:
    with pytest.raises(RequestError) as err:
        run(M1, E1, E1, REQ, "pul")
    assert err.value.field == "mode" and err.value.values == {"value": "pul"}
    rep = run(M1, E1, E1, REQ)  # pull by default
    assert rep.ok and rep.descriptors == 2 and rep.bytes_moved == 16
    rep = run(M2, E1, E2, REQ, "push")
    assert rep.ok and rep.descriptors == 4 and rep.bytes_moved == 32
    with pytest.raises(RequestError):  # the request is checked before planning
        run(M1, E1, E1, Request(3, [[1]], [[3, 0]]), "push")


def test_run_plans_defaults_and_push_receive() -> None:
    p = EngineConfig(tp_size=1, block_size=4, num_blocks=6)
    d = EngineConfig(tp_size=1, block_size=8, num_blocks=4, kernel_block_size=4)
    req = Request(3, [[1]], [[3]])
    rep = run_plans(M1, p, d, req, push_plans(M1, p, d, req))
    # push: P writes tokens 0..3 (16 B); D's receive step zeroes tokens 4..7 (16 B)
    assert rep.ok and rep.bytes_moved == 16 and rep.bytes_zeroed == 16
    o = Oracle.for_engines(M1, p, d, req)
    assert run_plans(M1, p, d, req, [], o) is o.result
    assert not o.result.ok  # nothing moved: I3
    rep = run_plans(M1, p, d, req, pull_plans(M1, p, d, req))
    assert rep.ok and rep.bytes_zeroed == 16


def test_run_plans_uses_the_given_oracle() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(_move(soff=0, doff=8))  # a neighbour write before the plans
    rep = run_plans(M1, E1, E1, REQ, pull_plans(M1, E1, E1, REQ), o)
    assert rep is o.result and rep.invariants == {"I1"}


def test_run_plans_push_without_telling() -> None:
    p = EngineConfig(tp_size=1, block_size=4, num_blocks=6)
    d = EngineConfig(tp_size=1, block_size=8, num_blocks=4, kernel_block_size=4)
    req = Request(3, [[1]], [[3]])
    plans = push_plans(M1, p, d, req)
    with pytest.raises(TokenCountError) as err:  # D's receive step is told no num_tokens
        run_plans(M1, p, d, req, plans, tell_num_tokens=False)
    assert err.value.field == "num_tokens" and err.value.values == {"value": None, "group": 0, "blocks": 1}
    assert run_plans(M1, p, d, req, plans).ok


# -- check_moves -----------------------------------------------------------------------------------------
def test_check_moves_applies_each_ranks_zero_and_regroup() -> None:
    m = np.concatenate([_move(), _move(soff=16, doff=0, slen=4)])
    assert check_moves(M1, E1, E1, REQ, m).invariants == {"I4"}  # token 3's bytes stay POISON
    rep = check_moves(M1, E1, E1, REQ, np.concatenate([_move(), _move(soff=16, doff=0, slen=8)]))
    assert rep.ok and rep.descriptors == 2
    rep = check_moves(M1, E1, E1, REQ, m, zero={0: np.array([[0, 4, 4]])})
    assert rep.ok and rep.bytes_zeroed == 4
    rep = check_moves(M1, E1, E1, REQ, m, zero={0: np.array([[0, 0, 8]])})
    assert rep.invariants == {"I3"} and rep.violated_bytes["I3"] == 4
    rep = check_moves(M1, E1, E1, REQ, m, zero={1: np.array([[0, 4, 4]])})  # no D rank 1: ignored
    assert rep.invariants == {"I4"} and rep.bytes_zeroed == 0
    rg = Regroup((0,), np.array([3]), 2, 2, 4, 1)  # swaps bytes 2, 3 with 4, 5 of D block 3
    rep = check_moves(M1, E1, E1, REQ, m, regroup={0: [rg]})
    assert rep.regrouped_blocks == 1 and rep.invariants == {"I2", "I4"}
    bad = check_moves(M1, E1, E1, REQ, m, regroup={0: [Regroup((0,), [0], 2, 1, 3, 1)]})
    assert [v.detail for v in bad.of("I6")] == ["D rank 0 regroup"]
    rep = check_moves(M1, E1, E1, REQ, m, regroup={7: [rg]})
    assert rep.regrouped_blocks == 0


def test_own_blocks_with_decode_context_parallelism() -> None:
    # D: TP 2 = DCP 2, block 2: list entry j of DCP rank r holds global page 2 j + r (tokens 2 page, +1).
    # P computed 5 of 8 tokens. Rank 0: pages 0, 2 (tokens 0..1, 4..5): both hold computed tokens.
    # Rank 1: pages 1, 3 (tokens 2..3, 6..7): entry 1 (block 0) holds only tokens >= 5: ZERO.
    d = EngineConfig(tp_size=2, block_size=2, num_blocks=4, dcp_size=2)
    o = Oracle.for_engines(M2, E1, d, Request(8, [[1, 2, 3]], [[3, 0]], prefill_tokens=5))
    assert o.dst[0][0][:8].tolist() == [POISON] * 8 and o.dst[0][0][24:].tolist() == [POISON] * 8
    assert o.dst[1][0][:8].tolist() == [ZERO] * 8 and o.dst[1][0][24:].tolist() == [POISON] * 8


def test_p_tokens_start_at_token_zero() -> None:
    # P block size 1: P blocks 1, 2, 3 (4 bytes each) hold tokens 0, 1, 2: tags 0..11 at bytes 4..15
    e0 = EngineConfig(tp_size=1, block_size=1, num_blocks=8)
    o = Oracle.for_engines(M1, e0, E1, Request(3, [[1, 2, 3]], [[3, 0]]))
    want = np.concatenate([_p_loc(range(4)), np.arange(12), _p_loc(range(16, 32))])
    np.testing.assert_array_equal(o.src[0][0], want)


def test_every_local_rank_is_paired_with_each_stage() -> None:
    # P: TP 1 x PP 2 (global ranks 0, 1: one per stage); D: TP 2. Pull: each D rank pairs with each P stage
    # (2 x 2 plans, one remote each); push: each P rank pairs with D's one stage of 2 ranks
    m = ModelSpec.from_layers("pp", [AttentionSpec(2, 1, "float16")] * 2)
    p = EngineConfig(tp_size=1, block_size=2, num_blocks=4, pp_size=2)
    pull = pull_plans(m, p, E2, REQ)
    assert [(rp.rank, [g.global_rank for g in rp.pairing.remotes.values()]) for rp in pull] == [
        (0, [0]),
        (0, [1]),
        (1, [0]),
        (1, [1]),
    ]
    push = push_plans(m, p, E2, REQ)
    assert [(rp.rank, sorted(g.global_rank for g in rp.pairing.remotes.values())) for rp in push] == [
        (0, [0, 1]),
        (1, [0, 1]),
    ]
    assert run_pull(m, p, E2, REQ).ok and run_push(m, p, E2, REQ).ok


def test_a_one_byte_length_difference_counts_one() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(_move(slen=8, dlen=7))
    assert o.result.violated_bytes["I2"] == 1 and o.result.bytes_moved == 7


def test_moves_after_a_refused_one_still_run() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    o.execute(np.concatenate([_move(soff=40), _move()]))
    assert o.result.descriptors == 2 and o.result.bytes_moved == 8
    assert o.dst[0][0][24:].tolist() == list(range(8))


def test_float_block_ids_and_descriptor_ids_are_taken_as_integers() -> None:
    o = _regroup_world()
    o.regroup(0, Regroup((0,), np.array([1.0]), 2, 2, 4, 1))
    assert o.dst[0][0][8:16].tolist() == [8, 9, 12, 13, 10, 11, 14, 15]
    o = Oracle.for_engines(M1, E1, E1, REQ)
    rp = _with_ids(pull_plans(M1, E1, E1, REQ)[0], local=np.array([3.0, 0.0]), remote=np.array([1.0, 2.0]))
    assert o.moves_of(rp).tolist() == [[0, 0, 8, 0, 0, 24, 8, 8], [0, 0, 16, 0, 0, 0, 8, 8]]


def test_check_moves_labels_its_moves() -> None:
    rep = check_moves(M1, E1, E1, REQ, _move(doff=30))
    assert [v.detail for v in rep.of("I6")] == ["move #0 destination"]


def test_run_plans_tells_the_push_receive_step_by_default(told) -> None:
    run_plans(M1, E1, E1, REQ_N1, push_plans(M1, E1, E1, REQ_N1))
    assert [c for c in told if c[0] == "receive"] == [("receive", 4, False, 2)]


def test_run_defaults(told) -> None:
    assert run(M1, E1, E1, REQ_N1).ok
    assert run(M1, E1, E1, REQ_N1, "push").ok
    assert [c for c in told if c[0] == "plan"] == [
        ("plan", "pull", "kvgeom", False, {"num_tokens": 4, "prefill_tokens": 2}),
        ("plan", "push", "kvgeom", False, {"num_tokens": 4, "prefill_tokens": 2}),
    ]
    assert [c for c in told if c[0] == "receive"] == [("receive", 4, False, 2)]


def test_run_plan_labels_its_moves() -> None:
    o = Oracle.for_engines(M1, E1, E1, REQ)
    rp = pull_plans(M1, E1, E1, REQ)[0]
    o.run_plan(rp)
    o.src[0][0][8:16] += 100  # P's first block now holds other tags: running the plan again clashes
    o.run_plan(rp)
    assert [(v.start, v.stop, v.detail) for v in o.result.of("I5")] == [
        (24, 32, "pull plan of D rank 0 #0 overwrites an earlier write")
    ]
