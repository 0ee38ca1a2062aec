"""Exact behaviour of :mod:`kvgeom.pair.tp` on small hand-derived cases: every branch of the TP mapping, both
sides of each comparison, and every refusal's class, field and values."""

from __future__ import annotations

import pytest

from kvgeom import ConfigError, RatioError
from kvgeom.errors import PlanError, SpecError
from kvgeom.pair.tp import (
    TPMapping,
    compute_tp_mapping,
    consumers_per_producer,
    handshake_targets,
    head_offset,
    needs_split_local_handles,
    tp_ratio,
)


@pytest.mark.parametrize(
    ("local", "remote", "want"),
    [(4, 2, 2), (2, 4, -2), (2, 2, 1), (1, 1, 1), (4, 1, 4), (1, 4, -4), (6, 3, 2), (3, 6, -2)],
)
def test_tp_ratio_values(local: int, remote: int, want: int) -> None:
    # local >= remote: local // remote; else -(remote // local)
    got = tp_ratio(local, remote)
    assert got == want and isinstance(got, int)


@pytest.mark.parametrize(("local", "remote"), [(3, 2), (2, 3), (6, 4), (4, 6)])
def test_tp_ratio_refuses_sizes_that_do_not_divide(local: int, remote: int) -> None:
    with pytest.raises(RatioError) as err:
        tp_ratio(local, remote)
    assert type(err.value) is RatioError
    assert err.value.field == "remote_tp"
    assert err.value.values == {"local": local, "remote": remote}


@pytest.mark.parametrize(
    ("local", "remote", "field", "value"),
    [(0, 1, "local_tp", 0), (1, 0, "remote_tp", 0), (True, 1, "local_tp", True), (1, 1.0, "remote_tp", 1.0)],
)
def test_tp_ratio_refuses_non_positive_sizes(
    local: object, remote: object, field: str, value: object
) -> None:
    with pytest.raises(RatioError) as err:
        tp_ratio(local, remote)  # type: ignore[arg-type]
    assert type(err.value) is RatioError
    assert err.value.field == field and err.value.values == {"value": value}


def _mapping(**kw: object) -> TPMapping:
    m = compute_tp_mapping(**kw)  # type: ignore[arg-type]
    ints = [*m.all_source_ranks, *(r for g in m.source_ranks_per_group for r in g)]
    ints += [x for pair in m.rank_to_attention_slot for x in pair] + [m.rank_offset_factor, m.local_consumers]
    assert all(isinstance(x, int) for x in ints)  # plain ints, never floats
    return m


def test_mapping_more_remote_ranks_distinct_heads() -> None:
    # rank 1 of TP2 reading TP4, K=8: a = 2, candidates [2, 3], heads 2*8//4 = 4 and 3*8//4 = 6 (distinct)
    m = _mapping(local_rank=1, local_tp=2, remote_tp=4, num_kv_heads=8, is_mla=False, group_is_ssm=[False])
    assert m.source_ranks_per_group == ((2, 3),)
    assert m.all_source_ranks == (2, 3)
    assert m.rank_to_attention_slot == ((2, 0), (3, 1))
    assert m.rank_offset_factor == 0  # local_tp <= remote_tp
    assert m.local_consumers == 1  # max(1, tp_ratio = -2)


def test_mapping_gqa_dedup_and_ssm_sources() -> None:
    # rank 0 of TP1 reading TP4, K=2: candidates [0,1,2,3], heads p*2//4 = 0,0,1,1 -> attn [0, 2];
    # the SSM group reads every candidate; slots: the index of the head's attention source
    m = _mapping(
        local_rank=0, local_tp=1, remote_tp=4, num_kv_heads=2, is_mla=False, group_is_ssm=[False, True]
    )
    assert m.source_ranks_per_group == ((0, 2), (0, 1, 2, 3))
    assert m.all_source_ranks == (0, 1, 2, 3)
    assert m.rank_to_attention_slot == ((0, 0), (1, 0), (2, 1), (3, 1))
    assert m.rank_offset_factor == 0 and m.local_consumers == 1


def test_mapping_gqa_dedup_without_ssm_reads_one_rank_per_head() -> None:
    m = _mapping(local_rank=0, local_tp=1, remote_tp=4, num_kv_heads=2, is_mla=False, group_is_ssm=[False])
    assert m.source_ranks_per_group == ((0, 2),)
    assert m.all_source_ranks == (0, 2)
    assert m.rank_to_attention_slot == ((0, 0), (2, 1))


def test_mapping_last_source_of_a_head_wins_its_slot() -> None:
    # rank 1 of TP2 reading TP4, K=1: candidates [2, 3], heads 2*1//4 = 0 and 3*1//4 = 0 -> attn [2];
    # SSM reads both; both ranks hold head 0, whose (only) attention source has index 0
    m = _mapping(
        local_rank=1, local_tp=2, remote_tp=4, num_kv_heads=1, is_mla=False, group_is_ssm=[True, False]
    )
    assert m.source_ranks_per_group == ((2, 3), (2,))
    assert m.rank_to_attention_slot == ((2, 0), (3, 0))


def test_mapping_fewer_remote_ranks() -> None:
    # rank 3 of TP4 reading TP2, K=8: source 3*2//4 = 1; offset: 4 > 8 is false -> 3 % (4 // 2) = 1
    m = _mapping(local_rank=3, local_tp=4, remote_tp=2, num_kv_heads=8, is_mla=False, group_is_ssm=[False])
    assert m.source_ranks_per_group == ((1,),)
    assert m.all_source_ranks == (1,)
    assert m.rank_to_attention_slot == ((1, 0),)
    assert m.rank_offset_factor == 1
    assert m.local_consumers == 2  # max(1, tp_ratio = 2)


def test_mapping_offset_with_local_head_replication() -> None:
    # rank 3 of TP4 reading TP1, K=2: local_tp 4 > K -> 3*2//4 - 0*2//1 = 1 (the modulo rule would give 3)
    m = _mapping(local_rank=3, local_tp=4, remote_tp=1, num_kv_heads=2, is_mla=False, group_is_ssm=[False])
    assert m.rank_offset_factor == 1
    assert m.all_source_ranks == (0,) and m.local_consumers == 4
    # rank 2 of TP4 reading TP2, K=2: source 1; 2*2//4 - 1*2//2 = 0 (the modulo rule would give 0 too);
    # rank 2 of TP4 reading TP1, K=2: 2*2//4 - 0 = 1 (modulo: 2)
    m = _mapping(local_rank=2, local_tp=4, remote_tp=1, num_kv_heads=2, is_mla=False, group_is_ssm=[False])
    assert m.rank_offset_factor == 1


def test_mapping_ssm_at_more_local_ranks_reads_the_attention_source() -> None:
    m = _mapping(
        local_rank=1, local_tp=2, remote_tp=1, num_kv_heads=2, is_mla=False, group_is_ssm=[False, True]
    )
    assert m.source_ranks_per_group == ((0,), (0,))
    assert m.all_source_ranks == (0,)
    assert m.rank_offset_factor == 1  # 2 > 2 is false -> 1 % 2


def test_mapping_mla_reads_one_rank_and_has_no_offset() -> None:
    # MLA, rank 0 of TP1 reading TP2: one source 0*2//1 = 0 (not both candidates)
    m = _mapping(local_rank=0, local_tp=1, remote_tp=2, num_kv_heads=1, is_mla=True, group_is_ssm=[False])
    assert m.source_ranks_per_group == ((0,),) and m.all_source_ranks == (0,)
    assert m.rank_to_attention_slot == ((0, 0),)
    # MLA with an SSM group at fewer local ranks: SSM still reads both candidates
    m = _mapping(
        local_rank=0, local_tp=1, remote_tp=2, num_kv_heads=1, is_mla=True, group_is_ssm=[False, True]
    )
    assert m.source_ranks_per_group == ((0,), (0, 1))
    assert m.rank_to_attention_slot == ((0, 0), (1, 0))
    # MLA at more local ranks, K=4: no offset (without MLA: 2 > 4 false -> 1 % 2 = 1)
    mla = _mapping(local_rank=1, local_tp=2, remote_tp=1, num_kv_heads=4, is_mla=True, group_is_ssm=[False])
    gqa = _mapping(local_rank=1, local_tp=2, remote_tp=1, num_kv_heads=4, is_mla=False, group_is_ssm=[False])
    assert mla.rank_offset_factor == 0 and gqa.rank_offset_factor == 1


def test_mapping_head_sharded_draft_under_mla() -> None:
    # head_sharded_kv_heads=2: not MLA, K=2: candidates [0, 1], heads 0*2//2 = 0, 1*2//2 = 1 -> both read
    m = _mapping(
        local_rank=0,
        local_tp=1,
        remote_tp=2,
        num_kv_heads=1,
        is_mla=True,
        group_is_ssm=[False],
        head_sharded_kv_heads=2,
    )
    assert m.source_ranks_per_group == ((0, 1),)
    assert m.rank_to_attention_slot == ((0, 0), (1, 1))
    m = _mapping(
        local_rank=1,
        local_tp=2,
        remote_tp=1,
        num_kv_heads=1,
        is_mla=True,
        group_is_ssm=[False],
        head_sharded_kv_heads=4,
    )
    assert m.rank_offset_factor == 1  # not MLA: 2 > 4 false -> 1 % 2


def test_mapping_explicit_dcp_sizes_default_to_one() -> None:
    a = _mapping(local_rank=0, local_tp=2, remote_tp=2, num_kv_heads=1, is_mla=True, group_is_ssm=[False])
    b = _mapping(
        local_rank=0,
        local_tp=2,
        remote_tp=2,
        num_kv_heads=1,
        is_mla=True,
        group_is_ssm=[False],
        local_dcp_size=1,
        remote_dcp_size=1,
    )
    assert a == b and a.local_consumers == 1 and a.all_source_ranks == (0,)


def test_mapping_refusals() -> None:
    with pytest.raises(ConfigError) as err:
        _mapping(local_rank=2, local_tp=2, remote_tp=1, num_kv_heads=1, is_mla=False, group_is_ssm=[False])
    assert type(err.value) is ConfigError
    assert err.value.field == "local_rank" and err.value.values == {"value": 2, "expected": 2}
    with pytest.raises(ConfigError) as err:
        _mapping(local_rank=-1, local_tp=2, remote_tp=1, num_kv_heads=1, is_mla=False, group_is_ssm=[False])
    assert type(err.value) is ConfigError
    assert err.value.field == "local_rank" and err.value.values == {"value": -1}
    with pytest.raises(SpecError) as err:
        _mapping(local_rank=0, local_tp=2, remote_tp=1, num_kv_heads=0, is_mla=False, group_is_ssm=[False])
    assert type(err.value) is SpecError
    assert err.value.field == "num_kv_heads" and err.value.values == {"value": 0}
    with pytest.raises(RatioError) as err:
        _mapping(local_rank=0, local_tp=3, remote_tp=2, num_kv_heads=1, is_mla=False, group_is_ssm=[False])
    assert err.value.field == "remote_tp"


def test_rank_zero_and_last_rank_are_in_range() -> None:
    assert handshake_targets(0, 2, 1) == (0,)
    assert handshake_targets(1, 2, 1) == (0,)


def test_slot_of() -> None:
    m = _mapping(local_rank=0, local_tp=1, remote_tp=4, num_kv_heads=2, is_mla=False, group_is_ssm=[False])
    assert m.slot_of(0) == 0 and m.slot_of(2) == 1
    with pytest.raises(PlanError) as err:
        m.slot_of(1)
    assert type(err.value) is PlanError
    assert err.value.field == "rank" and err.value.values == {"value": 1}


def test_json_round_trip_and_default_consumers() -> None:
    m = _mapping(
        local_rank=3, local_tp=4, remote_tp=2, num_kv_heads=8, is_mla=False, group_is_ssm=[False, True]
    )
    data = m.to_json()
    assert data == {
        "source_ranks_per_group": [[1], [1]],
        "all_source_ranks": [1],
        "rank_to_attention_slot": [[1, 0]],
        "rank_offset_factor": 1,
        "local_consumers": 2,
    }
    assert TPMapping.from_json(data) == m
    del data["local_consumers"]
    assert TPMapping.from_json(data).local_consumers == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"all_source_ranks": [0]},  # missing keys
        {
            "source_ranks_per_group": [[0]],
            "all_source_ranks": [0],
            "rank_to_attention_slot": [[0]],  # not a pair
            "rank_offset_factor": 0,
        },
        {
            "source_ranks_per_group": [["x"]],
            "all_source_ranks": [0],
            "rank_to_attention_slot": [[0, 0]],
            "rank_offset_factor": 0,
        },
        {
            "source_ranks_per_group": None,
            "all_source_ranks": [0],
            "rank_to_attention_slot": [[0, 0]],
            "rank_offset_factor": 0,
        },
    ],
)
def test_malformed_json_is_a_plan_error(bad: dict[str, object]) -> None:
    with pytest.raises(PlanError) as err:
        TPMapping.from_json(bad)
    assert type(err.value) is PlanError
    assert err.value.field == "mapping" and err.value.values == {}


@pytest.mark.parametrize(
    ("rank", "local", "remote", "k", "want"),
    [
        (3, 4, 2, 8, 1),  # 4 > 8 false: 3 % 2
        (2, 4, 2, 8, 0),  # 2 % 2
        (1, 2, 4, 8, 0),  # local_tp <= remote_tp
        (1, 2, 2, 8, 0),
        (3, 4, 1, 2, 1),  # 4 > 2: 3*2//4 - 0 = 1 (modulo: 3)
        (2, 4, 1, 2, 1),  # 2*2//4 - 0 = 1 (modulo: 2)
        (3, 8, 2, 4, 1),  # 8 > 4: src 3*2//8 = 0; 3*4//8 - 0 = 1 (modulo: 3 % 4 = 3)
        (7, 8, 2, 4, 1),  # src 1: 7*4//8 - 1*4//2 = 3 - 2 = 1 (modulo: 3)
    ],
)
def test_head_offset(rank: int, local: int, remote: int, k: int, want: int) -> None:
    got = head_offset(rank, local, remote, k)
    assert got == want and isinstance(got, int)


def test_head_offset_refusals() -> None:
    with pytest.raises(ConfigError) as err:
        head_offset(4, 4, 2, 8)
    assert err.value.field == "local_rank" and err.value.values == {"value": 4, "expected": 4}
    with pytest.raises(SpecError) as err:
        head_offset(0, 4, 2, 0)
    assert type(err.value) is SpecError and err.value.field == "num_kv_heads"
    with pytest.raises(RatioError) as err:
        head_offset(0, 3, 2, 8)
    assert err.value.field == "remote_tp"


@pytest.mark.parametrize(
    ("rank", "local", "remote", "want"),
    [
        (3, 4, 2, (1,)),  # r = 2: 3 // 2
        (2, 4, 2, (1,)),
        (1, 4, 2, (0,)),
        (1, 2, 4, (2, 3)),  # r = -2: 1*2 + 0, 1*2 + 1
        (0, 1, 3, (0, 1, 2)),
        (0, 1, 1, (0,)),
        (1, 2, 2, (1,)),
    ],
)
def test_handshake_targets(rank: int, local: int, remote: int, want: tuple[int, ...]) -> None:
    got = handshake_targets(rank, local, remote)
    assert got == want and all(isinstance(r, int) for r in got)


def test_handshake_targets_refusals() -> None:
    with pytest.raises(ConfigError) as err:
        handshake_targets(2, 2, 4)
    assert type(err.value) is ConfigError
    assert err.value.field == "local_rank" and err.value.values == {"value": 2, "expected": 2}
    with pytest.raises(RatioError):
        handshake_targets(0, 2, 3)


def test_needs_split_local_handles() -> None:
    one = _mapping(local_rank=0, local_tp=1, remote_tp=2, num_kv_heads=1, is_mla=True, group_is_ssm=[False])
    two = _mapping(local_rank=0, local_tp=1, remote_tp=2, num_kv_heads=2, is_mla=False, group_is_ssm=[False])
    assert len(one.all_source_ranks) == 1 and len(two.all_source_ranks) == 2
    assert needs_split_local_handles(-2, one, False) is True  # not MLA
    assert needs_split_local_handles(-2, one, True) is False  # MLA reading one rank
    assert needs_split_local_handles(-2, two, True) is True  # MLA reading two ranks
    assert needs_split_local_handles(2, two, False) is False  # tp_ratio > 0
    assert needs_split_local_handles(1, one, False) is False
    assert needs_split_local_handles(0, two, False) is False  # the boundary of tp_ratio < 0
    assert needs_split_local_handles(-1, one, False) is True


@pytest.mark.parametrize(
    ("producer", "consumer", "want"), [(2, 4, 2), (1, 4, 4), (4, 2, 1), (2, 2, 1), (1, 1, 1), (3, 6, 2)]
)
def test_consumers_per_producer(producer: int, consumer: int, want: int) -> None:
    got = consumers_per_producer(producer, consumer)
    assert got == want and isinstance(got, int)


def test_consumers_per_producer_refusals() -> None:
    for producer, consumer in ((2, 3), (3, 2)):
        with pytest.raises(RatioError) as err:
            consumers_per_producer(producer, consumer)
        assert type(err.value) is RatioError
        assert err.value.field == "consumer_tp"
        assert err.value.values == {"local": consumer, "remote": producer}
    with pytest.raises(RatioError) as err:
        consumers_per_producer(0, 2)
    assert err.value.field == "producer_tp" and err.value.values == {"value": 0}
    with pytest.raises(RatioError) as err:
        consumers_per_producer(2, 0)
    assert err.value.field == "consumer_tp" and err.value.values == {"value": 0}


def test_mapping_mla_with_a_sharded_remote() -> None:
    # MLA, rank 0 of TP4 (no DCP) reading TP4 with DCP 4: every remote rank holds a quarter of the pages
    # (sources 0..3); all hold "head" 0*1//4 = 0, so all share the last attention index 3; the SSM
    # group reads the attention sources at equal TP; a replicated local side is read by all 4 ranks
    m = _mapping(
        local_rank=0,
        local_tp=4,
        remote_tp=4,
        num_kv_heads=1,
        is_mla=True,
        group_is_ssm=[False, True],
        local_dcp_size=1,
        remote_dcp_size=4,
    )
    assert m.source_ranks_per_group == ((0, 1, 2, 3), (0, 1, 2, 3))
    assert m.rank_to_attention_slot == ((0, 3), (1, 3), (2, 3), (3, 3))
    assert m.rank_offset_factor == 0 and m.local_consumers == 4


def test_mapping_slot_of_a_rank_holding_no_attention_head_is_zero() -> None:
    # MLA with K=2, rank 0 of TP1 reading TP2: attention reads rank 0 (head 0); the SSM group reads 0 and 1;
    # rank 1's head 1*2//2 = 1 has no attention source: slot 0
    m = _mapping(
        local_rank=0, local_tp=1, remote_tp=2, num_kv_heads=2, is_mla=True, group_is_ssm=[False, True]
    )
    assert m.source_ranks_per_group == ((0,), (0, 1))
    assert m.rank_to_attention_slot == ((0, 0), (1, 0))


def test_tp_mapping_json_without_local_consumers_means_one() -> None:
    from kvgeom.pair.tp import TPMapping, compute_tp_mapping

    mapping = compute_tp_mapping(0, 2, 1, 2, False, [False])
    data = mapping.to_json()
    del data["local_consumers"]
    assert TPMapping.from_json(data).local_consumers == 1
    assert TPMapping.from_json(mapping.to_json()) == mapping
