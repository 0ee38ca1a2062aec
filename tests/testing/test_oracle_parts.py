"""The oracle's helpers pinned exactly: byte tags (:mod:`kvgeom.testing._coords`), the request
(:mod:`kvgeom.testing._request`) and the report (:mod:`kvgeom.testing._report`). Expected values are
derived in the comments from the documented tag layout."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kvgeom import EngineConfig
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec, Shard
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import CoordSpace, LayoutError, Request, RequestError, run
from kvgeom.testing import _coords as co
from kvgeom.testing._report import INVARIANTS, Report, Violation
from kvgeom.testing._request import check_side, engine_geometries

MAMBA = MambaSpec("mamba2", (Shard(2, 3), Shard(1, 2)), Shard(4, 2), 3, "float16", "float32", ("x", "b"))
# layer 0: attention, 2 heads, K 2 / V 3 elements of 2 bytes: width max(2, 3) * 2 = 6 bytes
# layer 1: MLA, latent 3 x float32 = 12 bytes; layer 2: conv x (2 x 3 = 6 channels), b (2 channels),
# 2 rows (kernel 3 - 1) of 2 bytes; temporal 4 x 2 = 8 elements of 4 bytes
HYB = ModelSpec.from_layers(
    "h", [AttentionSpec(2, 2, "float16", head_size_v=3), MLASpec(3, "float32"), MAMBA]
)


# -- location tags ----------------------------------------------------------------------------------------
def test_location_tags_values() -> None:
    # -(3 + (((side << 6 | rank) << 12 | region) << 36) + offset)
    head = ((1 << 6 | 2) << 12 | 3) << 36
    assert co.location_tags(1, 2, 3, np.array([0, 5])).tolist() == [-(3 + head), -(3 + head + 5)]
    assert co.location_tags(0, 0, 0, [0, 1]).tolist() == [-3, -4]
    assert co.location_tags(0, 0, 1, 0).tolist() == -(3 + (1 << 36))
    assert co.location_tags(0, 1, 0, 0).tolist() == -(3 + (1 << 48))
    assert co.location_tags(0, 63, 4095, 0).dtype == np.int64
    # offsets of any integer type give int64 tags (an unsigned array must not wrap around when negated)
    assert co.location_tags(0, 0, 0, np.array([5], dtype=np.uint64)).tolist() == [-8]
    assert co.location_tags(0, 0, 0, np.array([5], dtype=np.uint64)).dtype == np.int64


@pytest.mark.parametrize(("rank", "region"), [(64, 0), (-1, 0), (0, 4096), (0, -1)])
def test_location_tags_range(rank: int, region: int) -> None:
    with pytest.raises(LayoutError) as err:
        co.location_tags(0, rank, region, [0])
    assert err.value.field == ("region" if rank == 0 else "rank")
    assert err.value.values == {"value": (rank, region), "expected": (64, 4096)}


def test_locations_decode() -> None:
    for side, rank, region, off in ((0, 0, 0, 0), (1, 63, 4095, (1 << 36) - 1), (1, 2, 3, 5), (0, 7, 1, 9)):
        tag = int(co.location_tags(side, rank, region, off))
        want = f"no coordinate ({'PD'[side]} rank {rank} region {region} byte {off})"
        assert co._describe_location(tag) == want
        assert co.describe_tag(tag) == want


def test_describe_special_tags() -> None:
    assert co.POISON == -1 and co.ZERO == -2
    assert co.describe_tag(-1) == "POISON (never written)"
    assert co.describe_tag(-2) == "ZERO (zeroed)"
    assert co.describe_tag(-3) == "no coordinate (P rank 0 region 0 byte 0)"
    assert co.describe_tag(0) == "coordinate #0" and co.describe_tag(17) == "coordinate #17"
    space = co.CoordSpace(HYB, 5)
    assert co.describe_tag(-1, space) == "POISON (never written)"
    assert co.describe_tag(0, space) == "layers.0.attn token 0 head 0 K byte 0"


# -- the coordinate space ---------------------------------------------------------------------------------
def test_fields_of_a_hybrid_model() -> None:
    s = co.CoordSpace(HYB, 5)
    assert s.model is HYB and s.max_tokens == 5
    # sizes: attention 5 tokens x 2 heads x 2 x 6 = 120; MLA 5 x 12 = 60; x 6 x 2 x 2 = 24; b 2 x 2 x 2 = 8;
    # temporal 8 x 4 = 32
    assert [(f.layer, f.part, f.base, f.size) for f in s._fields] == [
        ("layers.0.attn", "kv", 0, 120),
        ("layers.1.attn", "latent", 120, 60),
        ("layers.2.mamba", "x", 180, 24),
        ("layers.2.mamba", "b", 204, 8),
        ("layers.2.mamba", "temporal", 212, 32),
    ]
    assert s._fields[0].dims == (("token", 5), ("head", 2), ("kv", 2), ("byte", 6))
    assert s._fields[1].dims == (("token", 5), ("byte", 12))
    assert s._fields[2].dims == (("channel", 6), ("row", 2), ("byte", 2))
    assert s._fields[3].dims == (("channel", 2), ("row", 2), ("byte", 2))
    assert s._fields[4].dims == (("element", 8), ("byte", 4))
    assert s._bases == [0, 120, 180, 204, 212]
    assert s._by_key[("layers.2.mamba", "b")] is s._fields[3]


def test_attention_width_takes_the_larger_of_k_and_v() -> None:
    m = ModelSpec.from_layers("kv", [AttentionSpec(1, 4, "float32", head_size_v=2)])
    assert co.CoordSpace(m, 1)._fields[0].dims[-1] == ("byte", 16)
    m = ModelSpec.from_layers("kv", [AttentionSpec(1, 1, "bfloat16")])
    assert co.CoordSpace(m, 3)._fields[0].dims == (("token", 3), ("head", 1), ("kv", 2), ("byte", 2))


def test_tags_are_mixed_radix() -> None:
    s = co.CoordSpace(HYB, 5)
    # kv: ((t * 2 + h) * 2 + kv) * 6 + b
    assert int(s.tag("layers.0.attn", "kv", 3, 1, 1, 5)) == ((3 * 2 + 1) * 2 + 1) * 6 + 5 == 95
    assert int(s.tag("layers.0.attn", "kv", 4, 1, 1, 5)) == 119
    assert int(s.tag("layers.1.attn", "latent", 2, 7)) == 120 + 2 * 12 + 7
    assert int(s.tag("layers.2.mamba", "b", 1, 1, 1)) == 204 + (1 * 2 + 1) * 2 + 1
    assert int(s.tag("layers.2.mamba", "temporal", 7, 3)) == 243
    got = s.tag("layers.1.attn", "latent", np.array([[0], [1]]), np.array([[0, 11]]))
    assert got.tolist() == [[120, 131], [132, 143]] and got.dtype == np.int64
    assert s.tag("layers.2.mamba", "x", 0, 0, 0).dtype == np.int64


@pytest.mark.parametrize(
    ("part", "index", "name", "extent"),
    [
        ("kv", (5, 0, 0, 0), "token", 5),
        ("kv", (-1, 0, 0, 0), "token", 5),
        ("kv", (0, 2, 0, 0), "head", 2),
        ("kv", (0, 0, 2, 0), "kv", 2),
        ("kv", (0, 0, 0, 6), "byte", 6),
        ("kv", (0, 0, 0, np.array([0, 6])), "byte", 6),
    ],
)
def test_tag_index_outside_its_extent(part, index, name, extent) -> None:
    s = co.CoordSpace(HYB, 5)
    with pytest.raises(LayoutError) as err:
        s.tag("layers.0.attn", part, *index)
    assert err.value.field == f"layers.0.attn kv.{name}" and err.value.values["expected"] == extent


def test_tag_needs_every_dimension() -> None:
    s = co.CoordSpace(HYB, 5)
    with pytest.raises(ValueError):
        s.tag("layers.0.attn", "kv", 0, 0, 0)
    with pytest.raises(ValueError):
        s.tag("layers.1.attn", "latent", 0, 0, 0)


def test_decode_every_kind_of_field() -> None:
    s = co.CoordSpace(HYB, 5)
    assert s.describe(0) == "layers.0.attn token 0 head 0 K byte 0"
    assert s.describe(95) == "layers.0.attn token 3 head 1 V byte 5"
    assert s.describe(119) == "layers.0.attn token 4 head 1 V byte 5"
    assert s.describe(6) == "layers.0.attn token 0 head 0 V byte 0"
    assert s.describe(np.int64(12)) == "layers.0.attn token 0 head 1 K byte 0"
    assert s.describe(120) == "layers.1.attn latent token 0 byte 0"
    assert s.describe(151) == "layers.1.attn latent token 2 byte 7"
    assert s.describe(179) == "layers.1.attn latent token 4 byte 11"
    assert s.describe(180) == "layers.2.mamba x channel 0 row 0 byte 0"
    assert s.describe(180 + (5 * 2 + 1) * 2 + 1) == "layers.2.mamba x channel 5 row 1 byte 1"
    assert s.describe(211) == "layers.2.mamba b channel 1 row 1 byte 1"
    assert s.describe(212) == "layers.2.mamba temporal element 0 byte 0"
    assert s.describe(243) == "layers.2.mamba temporal element 7 byte 3"
    assert s.describe(244) == "unknown tag 244"
    assert s.describe(10**9) == "unknown tag 1000000000"
    assert s.describe(-2) == "ZERO (zeroed)"
    assert s._decode(-5) == "unknown tag -5"  # below every field


# -- the request ------------------------------------------------------------------------------------------
def test_request_values_and_defaults() -> None:
    r = Request(5, [[np.int64(1), 2]], ([3],))
    assert r.p_ids == ((1, 2),) and r.d_ids == ((3,),) and isinstance(r.p_ids[0][0], int)
    assert r.prefix_blocks == 0 and r.prefill_tokens is None and r.p_tokens == 5
    assert Request(5, [[1]], [[2]], 0, 5).p_tokens == 5
    assert Request(5, [[1]], [[2]], 0, 1).p_tokens == 1
    assert Request(1, [[1]], [[2]], 3).prefix_blocks == 3


@pytest.mark.parametrize(
    ("args", "field", "values"),
    [
        ((0, [[1]], [[2]]), "num_tokens", {"value": 0}),
        ((-3, [[1]], [[2]]), "num_tokens", {"value": -3}),
        ((4, [[1]], [[2]], -1), "prefix_blocks", {"value": -1}),
        ((4, [[1]], [[2]], 0, 0), "prefill_tokens", {"value": 0, "expected": (1, 4)}),
        ((4, [[1]], [[2]], 0, 5), "prefill_tokens", {"value": 5, "expected": (1, 4)}),
    ],
)
def test_request_values_are_checked(args, field, values) -> None:
    with pytest.raises(RequestError) as err:
        Request(*args)
    assert (err.value.field, err.value.values) == (field, values)


M1 = ModelSpec.from_layers("t", [AttentionSpec(1, 1, "float16")])
HYB2 = ModelSpec.from_layers("h2", [AttentionSpec(2, 4, "float16"), MambaSpec.mamba2(4, 2, 2, 2)])


def test_simple_requests() -> None:
    p = EngineConfig(tp_size=1, block_size=4, num_blocks=8)
    d = EngineConfig(tp_size=1, block_size=2, num_blocks=8)
    # 5 tokens: P ceil(5 / 4) = 2 blocks, D ceil(5 / 2) = 3 blocks, from id 1
    assert Request.simple(M1, p, d, 5) == Request(5, ((1, 2),), ((1, 2, 3),))
    # prefix 1 block on D: D holds 2 ids; first id 4
    assert Request.simple(M1, p, d, 5, 1, 4) == Request(5, ((4, 5),), ((4, 5),), 1)
    # P computed 3 tokens: 1 P block
    assert Request.simple(M1, p, d, 5, prefill_tokens=3) == Request(5, ((1,),), ((1, 2, 3),), 0, 3)
    # a hybrid: attention ids first, then one SSM slot, consecutive across groups
    hp = EngineConfig(tp_size=1, block_size=16, num_blocks=8)
    r = Request.simple(HYB2, hp, hp, 20)
    assert r.p_ids == ((1, 2), (3,)) and r.d_ids == ((1, 2), (3,))
    assert Request.simple(HYB2, hp, hp, 16).p_ids == ((1,), (2,))
    assert Request.simple(HYB2, hp, hp, 17).p_ids == ((1, 2), (3,))


def test_check_side() -> None:
    g = engine_geometries(HYB2, EngineConfig(tp_size=1, block_size=16, num_blocks=4))[0]
    check_side("x", ((0, 3), (1,)), g, 2)
    check_side("x", ((2,), (3,)), g, 1)
    cases = [
        (((0, 1),), 2, "x", {"value": 1, "expected": 2}),
        (((0, 1), (2,), (3,)), 2, "x", {"value": 3, "expected": 2}),
        (((0,), (1,)), 2, "x[0]", {"value": 1, "expected": 2}),
        (((0, 1, 2), (3,)), 2, "x[0]", {"value": 3, "expected": 2}),
        (((0, 1), (2, 3)), 2, "x[1]", {"value": 2, "expected": 1}),
        (((0, 4), (1,)), 2, "x[0]", {"value": [4], "expected": 4}),
        (((-1, 0), (1,)), 2, "x[0]", {"value": [-1], "expected": 4}),
        (((0, 1), (1,)), 2, "x[1]", {"value": [1]}),
        (((0, 0), (1,)), 2, "x[0]", {"value": [0, 0]}),
    ]
    for ids, want, field, values in cases:
        with pytest.raises(RequestError) as err:
            check_side("x", ids, g, want)
        assert (err.value.field, err.value.values) == (field, values)


def test_engine_geometries_are_every_rank_stage_by_stage() -> None:
    m = ModelSpec.from_layers("pp", [AttentionSpec(2, 4, "float16")] * 2)
    e = EngineConfig(tp_size=2, block_size=4, num_blocks=4, pp_size=2, tp_rank=1, pp_rank=1)
    gs = engine_geometries(m, e)
    assert [(g.tp_rank, g.engine.pp_rank, g.global_rank) for g in gs] == [
        (0, 0, 0),
        (1, 0, 1),
        (0, 1, 2),
        (1, 1, 3),
    ]
    assert engine_geometries(m, e)[3] is gs[3]  # cached


# -- the report -------------------------------------------------------------------------------------------
def test_violation_text_and_size() -> None:
    v = Violation("I2", "D", 1, 2, 10, 14, "a", "b", "why")
    assert v.nbytes == 4
    assert str(v) == "I2 D rank 1 region 2 bytes [10, 14): expected a, found b (why)"
    assert (
        str(Violation("I3", "P", 0, 0, 0, 1, "x", "y"))
        == "I3 P rank 0 region 0 bytes [0, 1): expected x, found y"
    )
    assert Violation("I3", "P", 0, 0, 0, 1, "x", "y").detail == ""


def test_report_counts_and_limits() -> None:
    r = Report(limit=2)
    assert r.ok and r.invariants == set() and r.violations == [] and r.notes == []
    assert (r.bytes_moved, r.bytes_zeroed, r.descriptors, r.regrouped_blocks) == (0, 0, 0, 0)
    assert Report().limit == 20
    a = Violation("I1", "D", 0, 0, 0, 3, "e", "f")
    r.add(a)
    r.add(a, count=5)
    r.add(a)  # a third I1: counted, not shown
    r.add(Violation("I3", "D", 0, 0, 4, 6, "e", "f"))
    assert r.violations == [a, a, Violation("I3", "D", 0, 0, 4, 6, "e", "f")]
    assert r.violated_bytes == Counter({"I1": 3 + 5 + 3, "I3": 2})
    assert not r.ok and r.invariants == {"I1", "I3"}
    assert r.of("I1") == [a, a] and r.of("I2") == []
    r.add(Violation("I6", "D", 0, 0, 0, 0, "e", "f"))  # zero bytes: still a violation
    assert r.invariants == {"I1", "I3", "I6"}
    one = Report(limit=1)
    one.add(a)
    one.add(a)
    assert one.violations == [a]


def test_report_text() -> None:
    r = Report()
    assert str(r) == "OK: 0 descriptor pair(s), 0 B moved, 0 B zeroed, 0 block(s) regrouped"
    r.bytes_moved, r.bytes_zeroed, r.descriptors, r.regrouped_blocks = 10, 4, 2, 1
    r.notes.append("a note")
    r.add(Violation("I4", "D", 0, 1, 2, 4, "e", "f"))
    r.add(Violation("I1", "D", 0, 0, 0, 1, "g", "h", "d"))
    assert str(r) == "\n".join(
        [
            "VIOLATED I1, I4: 2 descriptor pair(s), 10 B moved, 4 B zeroed, 1 block(s) regrouped",
            "a note",
            f"  I1 ({INVARIANTS['I1']}): 1 byte(s)",
            "    I1 D rank 0 region 0 bytes [0, 1): expected g, found h (d)",
            f"  I4 ({INVARIANTS['I4']}): 2 byte(s)",
            "    I4 D rank 0 region 1 bytes [2, 4): expected e, found f",
        ]
    )
    assert sorted(INVARIANTS) == ["I1", "I2", "I3", "I4", "I5", "I6"]


DENSE = ModelSpec.from_layers("dense", [AttentionSpec(2, 4, "float16")])


def test_a_request_with_the_wrong_d_id_count_is_refused_naming_d_ids() -> None:
    e = EngineConfig(tp_size=1, block_size=4, num_blocks=4)
    with pytest.raises(RequestError) as err:
        run(DENSE, e, e, Request(5, [[0, 1]], [[0]]), "pull", "kvgeom")
    assert err.value.field == "d_ids[0]" and err.value.values == {"value": 1, "expected": 2}
    with pytest.raises(RequestError) as err:
        run(DENSE, e, e, Request(5, [[0]], [[0, 1]]), "pull", "kvgeom")
    assert err.value.field == "p_ids[0]" and err.value.values == {"value": 1, "expected": 2}


def test_oracle_coordinates_outside_their_extent_are_refused() -> None:
    space = CoordSpace(DENSE, 8)
    layer = DENSE.layers[0].name
    ok = space.tag(layer, "kv", 0, 0, 0, 0)
    assert np.asarray(ok).size == 1
    for bad in ((8, 0, 0, 0), (0, -1, 0, 0), (0, 0, 2, 0)):  # token < 8, head < 2, K or V
        with pytest.raises(LayoutError) as err:
            space.tag(layer, "kv", *bad)
        assert err.value.field.startswith(f"{layer} kv.")


def test_run_plans_builds_its_own_oracle() -> None:
    from kvgeom.testing import pull_plans, run_plans

    p, d = (
        EngineConfig(tp_size=2, block_size=4, num_blocks=4),
        EngineConfig(tp_size=1, block_size=4, num_blocks=4),
    )
    request = Request.simple(DENSE, p, d, 6)
    report = run_plans(DENSE, p, d, request, pull_plans(DENSE, p, d, request))
    assert (
        report.ok and report.bytes_moved == 2 * 4 * 32
    )  # 2 blocks of 4 slots, 2 heads x (K, V) x 4 x 2 B a token


def test_oracle_names_temporal_state_elements() -> None:
    from kvgeom.model.layers import MambaSpec

    model = ModelSpec.from_layers("ssm", [MambaSpec.mamba1(4, 1, 2, "float16")])
    space = CoordSpace(model, 4)
    assert "element 3" in space.describe(int(space.tag("layers.0.mamba", "temporal", 3, 0)))
