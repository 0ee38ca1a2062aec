"""Decode context parallelism (kvgeom.pair.dcp) and the TP mapping with DCP or a head-sharded draft: examples
worked by hand from the page layout (global page ``j * dcp + rank``), and vLLM 0.33.0's documented cases."""

from __future__ import annotations

import pytest

from kvgeom.errors import ConfigError, IncompatiblePairError, PlanError, RatioError
from kvgeom.pair.dcp import (
    apply_dcp_prefix_caching,
    check_parallel_pair,
    dcp_consumer_count,
    dcp_source_ranks,
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
    with pytest.raises(IncompatiblePairError, match="span its PCP group"):
        check_parallel_pair(1, 1, 4, 2)
    with pytest.raises(IncompatiblePairError, match="replicated PCP"):
        check_parallel_pair(2, 1, 1, 2)
    with pytest.raises(IncompatiblePairError, match="divide"):
        check_parallel_pair(1, 4, 1, 6)
    with pytest.raises(IncompatiblePairError, match="Mamba"):
        check_parallel_pair(1, 2, 1, 4, has_mamba=True)
    assert transfer_rank(0, 1, 3, 4, 4) == (3, 4)
    assert transfer_rank(2, 4, 0, 1, 4) == (2, 4)
    with pytest.raises(ConfigError):
        transfer_rank(0, 2, 1, 4, 4)


def test_pull_from_a_dcp8_remote_reads_every_rank() -> None:
    """Local TP1 MLA, remote TP8 with DCP 8: pages are read from ranks 0..7, each its own pages (global
    page ``j * 8 + r`` is rank ``r``'s list entry ``j``), and P ranks free after one reader each."""
    from kvgeom.layout.allocate import rank_geometry
    from kvgeom.layout.engine import EngineConfig
    from kvgeom.model.layers import MLASpec
    from kvgeom.model.spec import ModelSpec
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
