"""Decode context parallelism (kvgeom.pair.dcp) and the TP mapping with DCP or a head-sharded draft: examples
worked by hand from the page layout (global page ``j * dcp + rank``), and vLLM 0.33.0's documented cases."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvgeom import ConfigError, IncompatiblePairError, KvgeomError, RatioError
from kvgeom.errors import BlockIdError, PlanError
from kvgeom.model.layers import MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.pair.dcp import (
    apply_dcp_prefix_caching,
    check_parallel_pair,
    dcp_consumer_count,
    dcp_rank,
    dcp_source_ranks,
    dcp_units,
    global_pages,
    transfer_rank,
)
from kvgeom.pair.tp import compute_tp_mapping, dcp_handshake_targets


@pytest.mark.parametrize(
    ("rank", "tp", "remote_tp", "dcp", "remote_dcp", "sources"),
    [
        (0, 1, 8, 1, 8, tuple(range(8))),  # replicated local: every remote shard
        (0, 4, 4, 1, 4, (0, 1, 2, 3)),
        (2, 4, 4, 4, 4, (2,)),  # equal sharding: the same rank
        (0, 2, 4, 2, 4, (0, 2)),  # local pages 0, 2, 4, ... sit on remote ranks 0 and 2
        (3, 4, 2, 4, 2, (1,)),  # local finer: one remote rank covers all of rank 3's pages
    ],
)
def test_mla_dcp_sources(
    rank: int, tp: int, remote_tp: int, dcp: int, remote_dcp: int, sources: tuple
) -> None:
    mapping = compute_tp_mapping(rank, tp, remote_tp, 1, True, [False], dcp, remote_dcp)
    assert mapping.all_source_ranks == sources
    assert dcp_handshake_targets(rank, tp, dcp, remote_tp, remote_dcp) == sources


@pytest.mark.parametrize(
    ("tp", "remote_tp", "dcp", "remote_dcp"),
    [(4, 2, 4, 2), (4, 4, 4, 4), (4, 1, 4, 1), (4, 4, 1, 4), (2, 4, 2, 4)],
)
def test_every_reader_is_counted(tp: int, remote_tp: int, dcp: int, remote_dcp: int) -> None:
    """A producer waits for exactly the local ranks that read from it."""
    maps = [compute_tp_mapping(r, tp, remote_tp, 1, True, [False], dcp, remote_dcp) for r in range(tp)]
    for remote in range(remote_tp):
        readers = [m for m in maps if remote in m.all_source_ranks]
        assert readers, remote
        assert {m.local_consumers for m in readers} == {len(readers)}
    assert dcp_consumer_count(tp, dcp, remote_tp, remote_dcp) == maps[0].local_consumers


def test_dcp_sources_share_one_attention_slot() -> None:
    # MLA's single "head": every DCP source holds head 0, so they all get the last source's slot (as vLLM).
    m = compute_tp_mapping(0, 1, 4, 1, True, [False], 1, 4)
    assert m.rank_to_attention_slot == ((0, 3), (1, 3), (2, 3), (3, 3))


@pytest.mark.parametrize(
    ("rank", "tp", "remote_tp", "draft_heads", "offset"), [(3, 8, 1, 8, 3), (5, 8, 2, 8, 1), (5, 16, 1, 8, 2)]
)
def test_head_sharded_draft_under_mla_target(
    rank: int, tp: int, remote_tp: int, draft_heads: int, offset: int
) -> None:
    """An MLA target reads offset 0; its GQA draft's heads are sharded: rank 5 of 16 holds draft head 2 of 8."""
    target = compute_tp_mapping(rank, tp, remote_tp, 1, True, [False])
    draft = compute_tp_mapping(rank, tp, remote_tp, 1, True, [False], head_sharded_kv_heads=draft_heads)
    assert target.rank_offset_factor == 0 and draft.rank_offset_factor == offset
    assert draft.all_source_ranks == target.all_source_ranks


def test_source_ranks_validation() -> None:
    assert dcp_source_ranks(1, 2, 8, 8) == (1, 3, 5, 7)
    with pytest.raises(RatioError):
        dcp_source_ranks(0, 4, 6, 6)  # 4 and 6 do not divide
    with pytest.raises(ConfigError):
        dcp_source_ranks(2, 2, 4, 4)


@pytest.mark.parametrize(
    ("local", "remote", "remote_rank", "ld", "d", "rd", "cached", "want_local", "want_remote"),
    [
        # local TP1 reads remote DCP 2 rank 1: local page 1 is global 1 = remote rank 1's page 0; local page
        # 2 (global 2) sits on rank 0, and rank 1's page 1 (global 3) is past the local list.
        ([100, 101, 102], [200, 201], 1, 1, 0, 2, 0, [101], [200]),
        # local DCP 2 rank 1 holds global 1, the remote (DCP 1) list has only global 0.
        ([100], [200], 0, 2, 1, 1, 0, [], []),
        # local DCP 2 rank 0 with 3 cached pages: its first uncached page is global 6 = remote (DCP 4) rank
        # 2's page 1.
        ([100], [200, 201], 2, 2, 0, 4, 3, [100], [201]),
        # equal DCP: skip the cached pages on the remote's list too.
        ([100, 101], [200, 201, 202, 203], 1, 2, 1, 2, 2, [100, 101], [202, 203]),
    ],
)
def test_pages_pair_by_global_position(
    local: list,
    remote: list,
    remote_rank: int,
    ld: int,
    d: int,
    rd: int,
    cached: int,
    want_local: list,
    want_remote: list,
) -> None:
    a, b = apply_dcp_prefix_caching(local, remote, remote_rank, ld, d, rd, cached)
    assert a.tolist() == want_local and b.tolist() == want_remote
    # the pairs hold the same global pages
    lpos = {x: p for x, p in zip(local, global_pages(cached, len(local), ld, d).tolist())}
    rpos = {x: p for x, p in zip(remote, global_pages(0, len(remote), rd, remote_rank % rd).tolist())}
    assert [lpos[x] for x in a.tolist()] == [rpos[x] for x in b.tolist()]


def test_page_count_cuts_padding_and_refuses_missing_pages() -> None:
    # 19 pages in all; local TP1 (DCP 1) reads remote DCP 8 rank 3: global 3 and 11 (19 is past the end).
    a, b = apply_dcp_prefix_caching(list(range(100, 121)), [50, 51, 52], 3, 1, 0, 8, 0, num_remote_blocks=19)
    assert a.tolist() == [103, 111] and b.tolist() == [50, 51]
    with pytest.raises(PlanError):  # rank 3 supplied only its first page
        apply_dcp_prefix_caching(list(range(100, 121)), [50], 3, 1, 0, 8, 0, num_remote_blocks=19)


def test_parallel_pair_rules() -> None:
    check_parallel_pair(1, 1, 1, 8)
    check_parallel_pair(4, 4, 1, 2)
    with pytest.raises(IncompatiblePairError) as exc:
        check_parallel_pair(1, 1, 4, 2)
    assert exc.value.field == "dcp_size" and exc.value.values == {"local": (1, 1), "remote": (4, 2)}
    with pytest.raises(IncompatiblePairError) as exc:
        check_parallel_pair(2, 1, 1, 2)
    assert exc.value.field == "dcp_size" and exc.value.values == {"local": (2, 1), "remote": (1, 2)}
    with pytest.raises(IncompatiblePairError) as exc:
        check_parallel_pair(1, 4, 1, 6)
    assert exc.value.field == "dcp_size" and exc.value.values == {"local": 4, "remote": 6}
    with pytest.raises(IncompatiblePairError) as exc:
        check_parallel_pair(1, 2, 1, 4, has_mamba=True)
    assert exc.value.field == "dcp_size" and exc.value.values == {"local": 2, "remote": 4}
    assert transfer_rank(0, 1, 3, 4, 4) == (3, 4)
    assert transfer_rank(2, 4, 0, 1, 4) == (2, 4)
    with pytest.raises(ConfigError):
        transfer_rank(0, 2, 1, 4, 4)


def test_pull_from_a_dcp8_remote_reads_every_rank() -> None:
    """Local TP1 MLA, remote TP8 with DCP 8: pages are read from ranks 0..7, each its own pages (global
    page ``j * 8 + r`` is rank ``r``'s list entry ``j``), and P ranks free after one reader each."""
    from kvgeom.layout.allocate import rank_geometry
    from kvgeom.layout.engine import EngineConfig
    from kvgeom.plan.pairing import Pairing
    from kvgeom.plan.request import plan_request

    model = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 2)
    d = rank_geometry(model, EngineConfig(tp_size=1, block_size=4, num_blocks=32))
    ps = [
        rank_geometry(model, EngineConfig(tp_size=8, tp_rank=r, block_size=4, num_blocks=8, dcp_size=8))
        for r in range(8)
    ]
    for compat in ("kvgeom", "vllm"):
        pairing = Pairing.create(d, ps, "pull", compat)
        assert pairing.targets == tuple(range(8)) and pairing.mapping.all_source_ranks == tuple(range(8))
        # 40 tokens = 10 pages of 4: D's list 10 blocks (ids 10..19), P's 2 scheduler blocks (ids 3, 5)
        plan = plan_request(pairing, [list(range(10, 20))], [[3, 5]], num_tokens=40)
        by_rank = {t.remote_rank: t for t in plan.transfers}
        assert sorted(by_rank) == list(range(8)) and plan.expected_notifications == 1
        # rank 1 holds global pages 1 and 9: D blocks 11 and 19 <- its blocks 3 and 5, in both regions
        assert by_rank[1].local_ids.tolist() == [11, 19, 32 + 11, 32 + 19]
        assert by_rank[1].remote_ids.tolist() == [3, 5, 8 + 3, 8 + 5]
        assert by_rank[2].local_ids.tolist() == [12, 32 + 12]  # global page 18 is past the request


# kvgeom.pair.dcp, function by function: values on small inputs derived by hand, both sides of every
# boundary, every refusal's class, field and values.


def refused(cls: type[KvgeomError], field: str, fn: Callable[[], object], **values: object) -> None:
    with pytest.raises(KvgeomError) as info:
        fn()
    assert type(info.value) is cls, (type(info.value), info.value)
    assert info.value.field == field
    assert info.value.values == values


def test_dcp_rank() -> None:
    assert dcp_rank(5, 4) == 1
    assert dcp_rank(3, 1) == 0
    assert dcp_rank(0, 2) == 0
    refused(ConfigError, "tp_rank", lambda: dcp_rank(-1, 2), value=-1)
    refused(ConfigError, "dcp_size", lambda: dcp_rank(1, 0), value=0)


def test_transfer_rank() -> None:
    assert transfer_rank(3, 4) == (3, 4)
    # PCP 2 + DCP 2 at TP 1: the PCP rank transfers
    assert transfer_rank(0, 1, pcp_rank=1, pcp_size=2, dcp_size=2) == (1, 2)
    assert transfer_rank(0, 1, pcp_size=2, dcp_size=2) == (0, 2)  # default pcp_rank 0
    # only one of them shards: the TP ranks transfer
    assert transfer_rank(0, 1, pcp_rank=1, pcp_size=2) == (0, 1)  # default dcp_size 1
    assert transfer_rank(1, 2, dcp_size=2) == (1, 2)  # default pcp_size 1
    assert transfer_rank(1, 2, pcp_rank=1, pcp_size=1, dcp_size=2) == (1, 2)
    refused(ConfigError, "dcp_size", lambda: transfer_rank(0, 2, 0, 2, 2), value=(2, 2, 2))
    refused(ConfigError, "dcp_size", lambda: transfer_rank(0, 1, 0, 2, 4), value=(1, 2, 4))


def test_dcp_source_ranks() -> None:
    assert dcp_source_ranks(0, 1, 8, 8) == tuple(range(8))  # a replicated local side reads every rank
    assert dcp_source_ranks(1, 2, 8, 8) == (1, 3, 5, 7)  # every rank r with r % 2 == 1
    assert dcp_source_ranks(1, 2, 4, 2) == (1, 3)  # equal DCP: ranks 1, 3 of TP 4
    assert dcp_source_ranks(3, 4, 2, 2) == (1,)  # local finer: 3 % 2
    assert dcp_source_ranks(2, 4, 1, 1) == (0,)
    assert dcp_source_ranks(1, 2, 8, 4) == (1, 3, 5, 7)
    refused(ConfigError, "local_dcp_rank", lambda: dcp_source_ranks(2, 2, 4, 2), value=2, expected=2)
    refused(ConfigError, "local_dcp_rank", lambda: dcp_source_ranks(-1, 2, 4, 2), value=-1)
    refused(RatioError, "remote_tp_size", lambda: dcp_source_ranks(0, 1, 0, 1), value=0)
    refused(RatioError, "local_dcp_size", lambda: dcp_source_ranks(0, 0, 2, 1), value=0)
    refused(RatioError, "remote_dcp_size", lambda: dcp_source_ranks(0, 1, 2, 0), value=0)
    refused(RatioError, "remote_dcp_size", lambda: dcp_source_ranks(0, 2, 6, 3), local=2, remote=3)
    refused(RatioError, "remote_dcp_size", lambda: dcp_source_ranks(0, 3, 6, 2), local=3, remote=2)


def test_dcp_consumer_count_remote_sharded() -> None:
    assert dcp_consumer_count(4, 1, 8, 8) == 4  # replicated local side: every local rank reads
    assert dcp_consumer_count(8, 8, 4, 4) == 2  # local DCP 8 over remote DCP 4: 8 // 4
    assert dcp_consumer_count(8, 8, 4, 2) == 4  # 8 // 2
    assert dcp_consumer_count(4, 4, 8, 8) == 1  # max(1, 4 // 8 = 0)
    assert dcp_consumer_count(2, 2, 2, 2) == 1


def test_dcp_consumer_count_remote_replicated() -> None:
    assert dcp_consumer_count(4, 1, 2, 1) == 2  # TP ratio 2
    assert dcp_consumer_count(2, 1, 2, 1) == 1  # equal TP
    assert dcp_consumer_count(4, 4, 2, 1) == 2  # local DCP does not matter
    assert dcp_consumer_count(2, 1, 4, 1) == 1  # fewer local ranks: each reads several, one each
    refused(RatioError, "remote_tp", lambda: dcp_consumer_count(3, 1, 2, 1), local=3, remote=2)
    refused(RatioError, "remote_tp", lambda: dcp_consumer_count(2, 1, 3, 1), local=2, remote=3)
    refused(RatioError, "local_tp_size", lambda: dcp_consumer_count(0, 1, 2, 1), value=0)
    refused(RatioError, "remote_tp_size", lambda: dcp_consumer_count(2, 1, 0, 1), value=0)
    refused(RatioError, "remote_dcp_size", lambda: dcp_consumer_count(2, 2, 3, 3), local=2, remote=3)


def test_dcp_sizes_that_divide_either_way_are_accepted() -> None:
    assert dcp_source_ranks(0, 2, 4, 4) == (0, 2)
    assert dcp_source_ranks(0, 4, 2, 2) == (0,)


def test_dcp_handshake_targets() -> None:
    # remote DCP 8: local rank 3 of TP 4 DCP 4 has DCP rank 3 -> remote ranks 3, 7
    assert dcp_handshake_targets(3, 4, 4, 8, 8) == (3, 7)
    assert dcp_handshake_targets(3, 4, 1, 8, 8) == tuple(range(8))  # local DCP rank 0 of 1
    # remote DCP 1: the TP rule (local 4 over remote 2: rank 3 reads 3 // 2 = 1)
    assert dcp_handshake_targets(3, 4, 1, 2, 1) == (1,)
    assert dcp_handshake_targets(1, 2, 2, 4, 1) == (2, 3)  # fewer local ranks: 1*2 + {0, 1}
    refused(RatioError, "local_dcp_size", lambda: dcp_handshake_targets(0, 2, 0, 2, 1), value=0)


@pytest.mark.parametrize(
    "args,values",
    [
        ((0, 1, 1, 1), dict(value=0)),
        ((1, 0, 1, 1), dict(value=0)),
        ((1, 1, 0, 1), dict(value=0)),
        ((1, 1, 1, 0), dict(value=0)),
    ],
)
def test_check_parallel_pair_positive_sizes(args: tuple[int, int, int, int], values: dict) -> None:
    names = ("local_pcp_size", "local_dcp_size", "remote_pcp_size", "remote_dcp_size")
    field = names[args.index(0)]
    refused(IncompatiblePairError, field, lambda: check_parallel_pair(*args), **values)


def test_check_parallel_pair_rules() -> None:
    # the remote's DCP spans its PCP group, or is 1
    refused(
        IncompatiblePairError,
        "dcp_size",
        lambda: check_parallel_pair(1, 4, 2, 4),
        local=(1, 4),
        remote=(2, 4),
    )
    check_parallel_pair(1, 2, 2, 2)
    check_parallel_pair(1, 1, 1, 4)  # no remote PCP: any DCP
    # replicated PCP against a DCP-sharded peer, both directions
    refused(
        IncompatiblePairError,
        "dcp_size",
        lambda: check_parallel_pair(2, 1, 1, 2),
        local=(2, 1),
        remote=(1, 2),
    )
    refused(
        IncompatiblePairError,
        "dcp_size",
        lambda: check_parallel_pair(1, 2, 2, 1),
        local=(1, 2),
        remote=(2, 1),
    )
    check_parallel_pair(1, 1, 1, 2)  # no local PCP
    check_parallel_pair(2, 1, 1, 1)  # remote not sharded
    check_parallel_pair(2, 2, 1, 2)  # local PCP sharded by DCP
    check_parallel_pair(1, 1, 2, 1)  # local not sharded
    check_parallel_pair(1, 2, 1, 1)  # no remote PCP
    check_parallel_pair(2, 2, 2, 2)
    # DCP sizes divide one another
    refused(IncompatiblePairError, "dcp_size", lambda: check_parallel_pair(1, 2, 1, 3), local=2, remote=3)
    check_parallel_pair(1, 2, 1, 4)
    check_parallel_pair(1, 4, 1, 2)
    # Mamba hybrids: equal DCP sizes
    refused(
        IncompatiblePairError, "dcp_size", lambda: check_parallel_pair(1, 2, 1, 4, True), local=2, remote=4
    )
    check_parallel_pair(1, 4, 1, 4, True)
    check_parallel_pair(1, 4, 1, 2)  # the default is no Mamba


def test_global_pages() -> None:
    pages = global_pages(2, 3, 4, 1)  # positions 2, 3, 4 of rank 1 of 4: 9, 13, 17
    assert pages.dtype == np.int64
    assert pages.tolist() == [9, 13, 17]
    assert global_pages(0, 0, 2, 1).tolist() == []


def lists(result: tuple[np.ndarray, np.ndarray]) -> tuple[list[int], list[int]]:
    return result[0].tolist(), result[1].tolist()


def test_prefix_caching_equal_dcp() -> None:
    # equal DCP: remote list from the local computed count on
    assert lists(apply_dcp_prefix_caching([10, 11], [20, 21, 22, 23], 0, 2, 0, 2, 1)) == ([10, 11], [21, 22])
    assert lists(apply_dcp_prefix_caching([10, 11, 12], [20, 21], 0, 1, 0, 1, 0)) == ([10, 11], [20, 21])


def test_prefix_caching_local_coarser() -> None:
    # local DCP 1 (global page j) against remote DCP 2 rank 1 (global 2i+1)
    lo, ro = [10, 11, 12, 13, 14], [20, 21, 22]
    assert lists(apply_dcp_prefix_caching(lo, ro, 1, 1, 0, 2, 0)) == ([11, 13], [20, 21])
    # computed 1: local page j is global 1+j: 1, 3, 5 at positions 0, 2, 4 <-> remote 0, 1, 2
    assert lists(apply_dcp_prefix_caching(lo, ro, 1, 1, 0, 2, 1)) == ([10, 12, 14], [20, 21, 22])
    # remote rank 0 (global 2i), computed 1: local positions 1, 3 (global 2, 4) <-> remote 1, 2
    assert lists(apply_dcp_prefix_caching(lo, ro, 0, 1, 0, 2, 1)) == ([11, 13], [21, 22])
    # local DCP 2 rank 1 (global 2j+1) against remote DCP 4 rank 3 (global 4i+3): positions 1, 3 <-> 0, 1
    assert lists(apply_dcp_prefix_caching([1, 2, 3, 4], [7, 8], 3, 2, 1, 4, 0)) == ([2, 4], [7, 8])


def test_prefix_caching_local_finer() -> None:
    # local DCP 2 rank 1 (global 2j+1) against remote DCP 1 (global i): remote 1, 3, 5
    ro = [20, 21, 22, 23, 24, 25, 26]
    assert lists(apply_dcp_prefix_caching([10, 11, 12], ro, 0, 2, 1, 1, 0)) == ([10, 11, 12], [21, 23, 25])
    # computed 1: global 3, 5 -> remote 3, 5
    assert lists(apply_dcp_prefix_caching([10, 11], ro, 0, 2, 1, 1, 1)) == ([10, 11], [23, 25])
    # local DCP 4 rank 3 (global 4j+3) against remote DCP 2 rank 3 (3 % 2 = 1: global 2i+1): i = 2j+1
    assert lists(apply_dcp_prefix_caching([10, 11], ro, 3, 4, 3, 2, 0)) == ([10, 11], [21, 23])
    # rank 0 (global 4j) against remote rank 0 of DCP 2 (global 2i): i = 2j
    assert lists(apply_dcp_prefix_caching([10, 11], ro, 0, 4, 0, 2, 0)) == ([10, 11], [20, 22])


def test_prefix_caching_cuts_allocation_padding() -> None:
    # 3 request pages, computed 1: positions 1, 2 exist; the 4th local id is padding
    assert lists(apply_dcp_prefix_caching([1, 2, 3, 4], [5, 6, 7, 8], 0, 1, 0, 1, 1, 3)) == ([1, 2], [6, 7])
    # DCP 2 rank 1 holds global pages 1, 3 of 4 (ceil((4 - 1) / 2) = 2); equal DCP pairs position by position
    assert lists(apply_dcp_prefix_caching([1, 2, 3], [5, 6, 7], 0, 2, 1, 2, 0, 4)) == ([1, 2], [5, 6])
    # 3 pages: rank 1 holds global 1 only (ceil(2 / 2) = 1)
    assert lists(apply_dcp_prefix_caching([1, 2, 3], [5, 6, 7], 0, 2, 1, 2, 0, 3)) == ([1], [5])
    # 1 page: rank 1 holds none; 2 pages: one
    assert lists(apply_dcp_prefix_caching([1, 2], [5, 6], 0, 2, 1, 2, 0, 1)) == ([], [])
    assert lists(apply_dcp_prefix_caching([1, 2], [5, 6], 0, 2, 1, 2, 0, 2)) == ([1], [5])
    # computed beyond the pages that exist: nothing left
    assert lists(apply_dcp_prefix_caching([1, 2], [5, 6], 0, 1, 0, 1, 5, 3)) == ([], [])
    assert lists(apply_dcp_prefix_caching([1, 2], [5, 6], 0, 1, 0, 1, 0, 0)) == ([], [])


def test_prefix_caching_refuses_uncovered_pages() -> None:
    refused(
        PlanError,
        "remote_ids",
        lambda: apply_dcp_prefix_caching([1, 2, 3], [5, 6], 0, 1, 0, 1, 0, 3),
        local=3,
        remote=2,
    )
    # exactly covered
    assert lists(apply_dcp_prefix_caching([1, 2], [5, 6], 0, 1, 0, 1, 0, 2)) == ([1, 2], [5, 6])


def test_prefix_caching_argument_errors() -> None:
    refused(
        ConfigError, "local_dcp_rank", lambda: apply_dcp_prefix_caching([1], [2], 0, 1, -1, 1, 0), value=-1
    )
    refused(
        PlanError,
        "local_num_computed_blocks",
        lambda: apply_dcp_prefix_caching([1], [2], 0, 1, 0, 1, -1),
        value=-1,
    )
    refused(ConfigError, "remote_rank", lambda: apply_dcp_prefix_caching([1], [2], -1, 1, 0, 1, 0), value=-1)
    refused(
        PlanError,
        "num_remote_blocks",
        lambda: apply_dcp_prefix_caching([1], [2], 0, 1, 0, 1, 0, -1),
        value=-1,
    )
    refused(
        RatioError,
        "remote_dcp_size",
        lambda: apply_dcp_prefix_caching([1], [2], 0, 2, 0, 3, 0),
        local=2,
        remote=3,
    )


def units(**kw: object) -> dict[str, list]:
    return {k: np.asarray(v).tolist() for k, v in dcp_units(**kw).items()}  # type: ignore[arg-type]


def test_dcp_units_finer_consumer_kernel() -> None:
    # unit gcd(2, 4) = 2 tokens, 2 per consumer page; consumer rank 1 of DCP 2, position 0: global page 1,
    # tokens 4 and 6 -> producer page 1 (DCP 1: rank 0, position 1, id 9); token 6 is not computed (limit 6)
    got = units(
        c_ids=[5], c_first=0, c_page=4, c_kernel=2, c_dcp=2, c_rank=1,
        p_ids=[7, 9], p_page=4, p_kernel=4, p_dcp=1, limit=6,
    )  # fmt: skip
    assert got == {
        "c_pos": [0, 0],
        "c_kernel": [10, 11],  # 5 * (4 // 2) + {0, 1}
        "c_sub": [0, 0],
        "c_fine": [10, 11],
        "p_rank": [0, 0],
        "p_kernel": [9, 9],  # 9 * (4 // 4) + (t % 4) // 4
        "p_sub": [0, 1],  # (t % 4) // 2
        "p_fine": [18, 19],  # 9 * (4 // 2) + sub
        "token": [4, 6],
        "ok": [True, False],
        "held": [True, True],
        "unit": 2,
    }


def test_dcp_units_sharded_producer() -> None:
    # unit gcd(2, 1) = 1; consumer DCP 1 from position 1: pages 1, 2 -> tokens 2, 3, 4, 5; producer pages of
    # 2 tokens on 2 ranks: global pages 1, 1, 2, 2 -> ranks 1, 1, 0, 0, positions 0, 0, 1, 1 (1 not held)
    got = units(
        c_ids=[3, 4], c_first=1, c_page=2, c_kernel=2, c_dcp=1, c_rank=0,
        p_ids=[6], p_page=2, p_kernel=1, p_dcp=2, limit=100,
    )  # fmt: skip
    assert got == {
        "c_pos": [0, 0, 1, 1],
        "c_kernel": [3, 3, 4, 4],
        "c_sub": [0, 1, 0, 1],
        "c_fine": [6, 7, 8, 9],  # kernel * 2 + sub
        "p_rank": [1, 1, 0, 0],
        "p_kernel": [12, 13, 12, 13],  # 6 * 2 + t % 2 (position clipped to the last held one)
        "p_sub": [0, 0, 0, 0],
        "p_fine": [12, 13, 12, 13],
        "token": [2, 3, 4, 5],
        "ok": [True, True, False, False],
        "held": [True, True, False, False],
        "unit": 1,
    }


def test_dcp_units_empty_sides() -> None:
    got = units(
        c_ids=[2], c_first=0, c_page=1, c_kernel=1, c_dcp=1, c_rank=0,
        p_ids=[], p_page=1, p_kernel=1, p_dcp=1, limit=5,
    )  # fmt: skip
    assert (got["held"], got["ok"], got["p_kernel"], got["c_kernel"], got["token"]) == (
        [False], [False], [0], [2], [0]
    )  # fmt: skip
    none = units(
        c_ids=[], c_first=0, c_page=2, c_kernel=1, c_dcp=1, c_rank=0,
        p_ids=[4], p_page=2, p_kernel=1, p_dcp=1, limit=5,
    )  # fmt: skip
    assert none["c_pos"] == [] and none["c_kernel"] == [] and none["p_kernel"] == []


def test_prefix_caching_refuses_a_dcp_rank_outside_its_group() -> None:
    # DCP 2 has ranks 0 and 1: rank 2 would pair pages of no rank (it used to return pairs silently)
    refused(
        ConfigError,
        "local_dcp_rank",
        lambda: apply_dcp_prefix_caching([1, 2], [5, 6], 0, 2, 2, 2, 0),
        value=2,
        expected=2,
    )
    assert lists(apply_dcp_prefix_caching([1, 2], [5, 6], 0, 2, 1, 2, 0)) == ([1, 2], [5, 6])


def test_dcp_units_are_integer_arrays_and_refuse_bad_ids() -> None:
    got = dcp_units(
        c_ids=[3, 4], c_first=1, c_page=2, c_kernel=2, c_dcp=1, c_rank=0,
        p_ids=[6], p_page=2, p_kernel=1, p_dcp=2, limit=100,
    )  # fmt: skip
    for key in ("c_pos", "c_kernel", "c_sub", "c_fine", "p_rank", "p_kernel", "p_sub", "p_fine", "token"):
        assert got[key].dtype == np.int64, key  # ids and positions index arrays: never floats
    assert got["ok"].dtype == bool and got["held"].dtype == bool
    with pytest.raises(BlockIdError) as info:
        dcp_units([-1], 0, 2, 2, 1, 0, [6], 2, 1, 2, 100)
    assert info.value.field == "consumer_ids"
    with pytest.raises(BlockIdError) as info:
        dcp_units([1], 0, 2, 2, 1, 0, [-6], 2, 1, 2, 100)
    assert info.value.field == "producer_ids"


def test_consumer_counts_are_ints() -> None:
    counts = [dcp_consumer_count(*a) for a in ((8, 8, 4, 2), (4, 1, 2, 1), (2, 1, 4, 1), (4, 1, 8, 8))]
    assert counts == [4, 2, 1, 4] and all(isinstance(c, int) for c in counts)


@pytest.mark.parametrize(
    ("local", "remote", "field"),
    [(0, 1, "local_dcp_size"), (1, 0, "remote_dcp_size"), (2, 3, "remote_dcp_size")],
)
def test_dcp_sizes_name_the_side_at_fault(local: int, remote: int, field: str) -> None:
    with pytest.raises(RatioError) as err:
        dcp_source_ranks(0, local, 4, remote)
    assert err.value.field == field
