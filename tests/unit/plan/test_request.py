"""Exact behaviour of :mod:`kvgeom.plan.request` around its edges, on small hand-derived cases: the plan's
rendering and byte moves, id checks at the pool's edge, the per-shape plan cache, notifications in both
modes, the post-receive steps' refusals and defaults, ``contiguous_runs`` and ``check_writes``.

The dense model has 2 KV heads of 4 fp16 elements: (K + V) x 2 heads x 4 x 2 B = 32 B per token, so a
4-token block is a 128 B page, one region per layer."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvgeom import EngineConfig, Pairing, card_of
from kvgeom.errors import BlockIdError, PlanError, TokenCountError, UnsupportedError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.model.layers import AttentionSpec, MambaSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.planmemo import memo_of
from kvgeom.plan.receive import post_receive, receive_step
from kvgeom.plan.request import plan_request
from kvgeom.plan.requestplan import (
    MOVE_COLUMNS,
    Regroup,
    RequestPlan,
    Transfer,
    check_writes,
    contiguous_runs,
)
from kvgeom.testing import Request

DENSE = ModelSpec.from_layers("dense", [AttentionSpec(2, 4, "float16")])
HYBRID = ModelSpec.from_layers(
    "m2",
    [
        AttentionSpec(4, 2, "float16"),
        MambaSpec.mamba2(
            num_heads=4, head_dim=2, n_groups=4, state_size=2, conv_kernel=3, conv_dtype="float16"
        ),
    ],
)


def _geom(model: ModelSpec, tp: int, block: int, blocks: int, rank: int = 0, **kw: object):  # type: ignore[no-untyped-def]
    return rank_geometry(
        model, EngineConfig(tp_size=tp, block_size=block, num_blocks=blocks, **kw).with_rank(rank)
    )  # type: ignore[arg-type]


def _pair(
    model: ModelSpec = DENSE,
    p: tuple[int, int, int] = (1, 4, 8),
    d: tuple[int, int, int] = (1, 4, 8),
    mode: str = "pull",
    compat: str = "kvgeom",
    rank: int = 0,
    prefix_caching: bool = False,
) -> Pairing:
    """A pairing seen from D rank ``rank`` (pull) or P rank ``rank`` (push); ``p``/``d`` = (tp, block, blocks)."""
    local_e, remote_e = (d, p) if mode == "pull" else (p, d)
    local = _geom(model, *local_e, rank=rank)
    remotes = [_geom(model, *remote_e, rank=r) for r in range(remote_e[0])]
    return Pairing.create(local, remotes, mode, compat, prefix_caching=prefix_caching)


# rendering and byte moves


def test_describe_renders_every_part_of_a_plan() -> None:
    t1 = Transfer(2, (1, -1), np.array([1, 2, 3]), np.array([4, 5, 6]), "q:2")
    t2 = Transfer(3, (2, 0), np.array([7, 8]), np.array([9, 10]), "q:2")
    rg = Regroup((0, 1, 2, 3, 4), np.array([7, 8]), 2, 4, 16, 8)
    plan = RequestPlan("q", "push", (t1, t2), (0, 1), 2, -1, (rg,), np.array([[0, 0, 10], [1, 5, 20]]))
    assert plan.op == "WRITE" and plan.num_descriptors == 5 and len(t1) == 3
    assert plan.describe().splitlines() == [
        "request 'q': push (WRITE), 2 transfer(s), 5 descriptor pairs",
        "  rank 2: 3 descs, local table whole at ratio 1, notif 'q:2'",
        "  rank 3: 2 descs, local table split for source #0 at ratio 2, notif 'q:2'",  # key (2, 0): a split
        "  notify only: ranks [0, 1]",
        "  the other side expects 2 notification(s) per rank",
        "  regroup 2 block(s) in regions [0, 1, 2, 3]... ([2,4,8,*] -> [4,16,*])",  # 16 tokens // bsr 2 = 8
        "  zero on rank -1: 2 range(s), 30 B",
    ]
    bare = RequestPlan("r", "pull", (), (), 1, 0)
    assert bare.op == "READ" and bare.num_descriptors == 0 and bare.zero.shape == (0, 3)
    assert bare.describe().splitlines() == [
        "request 'r': pull (READ), 0 transfer(s), 0 descriptor pairs",
        "  the other side expects 1 notification(s) per rank",
    ]


def test_describe_with_a_pairing_adds_the_bytes() -> None:
    # vLLM mode at equal TP reads into the whole local table; 2 blocks of 128 B
    pairing = _pair(compat="vllm")
    plan = plan_request(pairing, [[2, 5]], [[1, 3]], request_id="r7", num_tokens=8)
    assert plan.describe(pairing).splitlines() == [
        "request 'r7': pull (READ), 1 transfer(s), 2 descriptor pairs",
        "  rank 0: 2 descs, local table whole at ratio 1, notif 'r7:1', 256 B",
        "  the other side expects 1 notification(s) per rank",
    ]


def test_moves_in_pull_and_push() -> None:
    # pull: P block 1 (offset 128) -> D block 2 (offset 256), P block 3 (384) -> D block 5 (640)
    pull = _pair()
    plan = plan_request(pull, [[2, 5]], [[1, 3]], num_tokens=8)
    assert plan.moves(pull).tolist() == [[0, 0, 128, 0, 0, 256, 128], [0, 0, 384, 0, 0, 640, 128]]
    # push from P: local = P's blocks [1, 3] -> D's [2, 5]; the source is the local side
    push = _pair(mode="push")
    plan = plan_request(push, [[1, 3]], [[2, 5]], num_tokens=8)
    assert plan.moves(push).tolist() == [[0, 0, 128, 0, 0, 256, 128], [0, 0, 384, 0, 0, 640, 128]]
    assert plan.consumer_rank == -1 and plan.transfers[0].notif == "req:1"
    assert len(MOVE_COLUMNS) == 7
    empty = RequestPlan("e", "pull", (), (), 1, 0).moves(pull)
    assert empty.shape == (0, 7) and empty.dtype == np.int64


def test_moves_between_global_ranks() -> None:
    # P TP2 -> D TP1, K=2: D reads head 0 from P0 and head 1 from P1 (64 B each per 4-token block);
    # D's page holds both heads: head h of D block 1 at 128 + 64 h. Move ranks are global ranks.
    pairing = _pair(p=(2, 4, 8))
    plan = plan_request(pairing, [[1]], [[6]], num_tokens=4)
    got = sorted(map(tuple, plan.moves(pairing).tolist()))
    assert got == [(0, 0, 6 * 64, 0, 0, 128, 64), (1, 0, 6 * 64, 0, 0, 192, 64)]


def test_moves_refuse_descriptors_of_unequal_length() -> None:
    pairing = _pair(HYBRID, p=(1, 4, 8), d=(1, 4, 8))
    plan = plan_request(pairing, [[3], [1]], [[5], [7]], num_tokens=4)
    (t,) = plan.transfers
    lrows = pairing.local_table(t.local_table).take(t.local_ids)
    rrows = pairing.remote_table(t.remote_rank).take(t.remote_ids)
    assert (lrows[:, 2] == rrows[:, 2]).all()
    # pair the first local descriptor with a remote one of another length
    j = int(np.flatnonzero(rrows[:, 2] != lrows[0, 2])[0])
    bad = dataclasses.replace(t, local_ids=t.local_ids[[0, 0]], remote_ids=t.remote_ids[[0, j]])
    with pytest.raises(PlanError) as err:
        dataclasses.replace(plan, transfers=(bad,)).moves(pairing)
    assert type(err.value) is PlanError
    assert err.value.field == "descriptor length"
    assert err.value.values == {"local": int(lrows[0, 2]), "remote": int(rrows[j, 2])}
    assert "pair 1 " in str(err.value)


# id checks


@pytest.mark.parametrize("side", ["local", "remote"])
def test_ids_at_the_pool_edge(side: str) -> None:
    pairing = _pair()
    ok = plan_request(pairing, [[0, 7]], [[7, 0]], num_tokens=8)  # 8 logical blocks: 0 and 7 are in the pool
    assert [t.local_ids.tolist() for t in ok.transfers] == [[0, 7]]

    def call(ids: list[list[int]]) -> None:
        other = [list(range(len(ids[0])))]
        plan_request(
            pairing, *((ids, other) if side == "local" else (other, ids)), num_tokens=4 * len(ids[0])
        )

    with pytest.raises(BlockIdError) as err:
        call([[3, 9, 8]])
    assert type(err.value) is BlockIdError
    assert err.value.field == f"{side}_ids[0]" and err.value.values == {"value": 9, "expected": 8}
    with pytest.raises(BlockIdError) as err:
        call([[8]])
    assert err.value.values == {"value": 8, "expected": 8}
    with pytest.raises(BlockIdError) as err:
        call([[2, -1]])
    assert err.value.field == f"{side}_ids[0]" and err.value.values == {"value": -1}
    with pytest.raises(BlockIdError) as err:
        call([[4, 4]])
    assert err.value.field == f"{side}_ids[0]" and err.value.values == {"value": 4, "group": 0}
    with pytest.raises(BlockIdError) as err:
        call([[1, 6, 4, 6]])  # a repeat that is not the smallest id
    assert err.value.field == f"{side}_ids[0]" and err.value.values == {"value": 6, "group": 0}


def test_ids_shared_by_two_groups_are_refused_on_both_sides() -> None:
    pairing = _pair(HYBRID)
    with pytest.raises(BlockIdError) as err:
        plan_request(pairing, [[3], [3]], [[5], [7]])
    assert err.value.field == "local_ids[1]" and err.value.values == {"value": 3, "groups": (0, 1)}
    with pytest.raises(BlockIdError) as err:
        plan_request(pairing, [[3], [1]], [[5], [5]])
    assert err.value.field == "remote_ids[1]" and err.value.values == {"value": 5, "groups": (0, 1)}
    # past the pool in the second group (the first one empty): the group is named
    with pytest.raises(BlockIdError) as err:
        plan_request(pairing, [[], [8]], [[5], [7]])
    assert err.value.field == "local_ids[1]" and err.value.values == {"value": 8, "expected": 8}
    with pytest.raises(BlockIdError) as err:
        plan_request(pairing, [[3], [8]], [[5], [7]])
    assert err.value.field == "local_ids[1]" and err.value.values == {"value": 8, "expected": 8}


def test_an_empty_local_list_is_notification_only() -> None:
    pairing = _pair(p=(2, 4, 8))
    for local in ([], [[]], np.zeros((0,), dtype=np.int64)):
        plan = plan_request(pairing, local, [[1]])  # type: ignore[arg-type]
        assert plan.transfers == () and plan.notify_only == (0, 1)
        assert plan.zero.shape == (0, 3) and plan.regroup == ()
        assert plan.expected_notifications == 1 and plan.consumer_rank == 0


# notifications and ids


def test_notifications_name_the_remote_request_and_the_count() -> None:
    # pull, P TP1 -> D TP2: each P rank is read by 2 D ranks ("tag:2"); push P TP1 -> D TP2: D waits for
    # P_TP = 1 writer ("tag:1")
    pull = _pair(p=(1, 4, 8), d=(2, 4, 8), rank=1)
    plan = plan_request(pull, [[1]], [[2]], request_id="d-req", remote_request_id="p-req", num_tokens=4)
    assert plan.request_id == "d-req"
    assert [t.notif for t in plan.transfers] == ["p-req:2"] and plan.expected_notifications == 2
    assert plan.consumer_rank == 1
    plan = plan_request(pull, [[1]], [[2]], request_id="d-req", num_tokens=4)
    assert [t.notif for t in plan.transfers] == ["d-req:2"]
    # D rank 1 holds head 1 (64 B pages); P's 128 B page holds head 1 at +64: P block 2 -> D block 1
    assert plan.moves(pull).tolist() == [[0, 0, 2 * 128 + 64, 1, 0, 64, 64]]
    push = _pair(p=(1, 4, 8), d=(2, 4, 8), mode="push")
    plan = plan_request(push, [[2]], [[1]], request_id="x", remote_request_id="y", num_tokens=4)
    assert sorted(t.notif for t in plan.transfers) == ["y:1", "y:1"]
    assert plan.consumer_rank == -1 and plan.mode == "push"


def _fields(plan: RequestPlan) -> tuple:
    return (
        plan.request_id,
        plan.mode,
        [
            (t.remote_rank, t.local_table, t.local_ids.tolist(), t.remote_ids.tolist(), t.notif)
            for t in plan.transfers
        ],
        plan.notify_only,
        plan.expected_notifications,
        plan.consumer_rank,
        [(r.regions, r.blocks.tolist(), r.bsr, r.heads, r.tokens, r.head_bytes) for r in plan.regroup],
        plan.zero.tolist(),
    )


@pytest.mark.parametrize("remote_request_id", [None, "peer"])
def test_repeated_shapes_plan_like_the_first(remote_request_id: str | None) -> None:
    """The third request of a shape is planned from a recipe; it must equal a plan made from scratch
    (P TP2 -> D TP1, two source ranks; 3 D blocks of 4 tokens from 2 P blocks of 8: zeroes a tail)."""
    shapes = [
        ([[1, 2, 3]], [[4, 5]]),
        ([[6, 0, 7]], [[1, 3]]),
        ([[2, 4, 5]], [[0, 6]]),
        ([[7, 1, 2]], [[2, 7]]),
    ]
    cached = _pair(p=(2, 8, 8), d=(1, 4, 8))
    for i, (lids, rids) in enumerate(shapes):
        got = plan_request(cached, lids, rids, f"r{i}", remote_request_id, num_tokens=12, prefill_tokens=12)
        fresh = plan_request(_pair(p=(2, 8, 8), d=(1, 4, 8)), lids, rids, f"r{i}", remote_request_id, 12, 12)
        assert _fields(got) == _fields(fresh)
        tag = remote_request_id or f"r{i}"
        assert {t.notif for t in got.transfers} == {f"{tag}:1"}
        assert [len(t) for t in got.transfers] == [3, 3]


def test_the_shape_cache_is_bounded_and_forgets_the_oldest() -> None:
    pairing = _pair(p=(1, 4, 320), d=(1, 4, 320))
    for k in range(1, 301):  # 300 shapes: k blocks on each side
        plan_request(pairing, [list(range(k))], [list(range(k))], num_tokens=4 * k)
    shapes = memo_of(pairing).shapes
    assert len(shapes) == 256  # the 44 oldest were forgotten
    assert list(shapes)[0] == ((45,), (45,), 180, None) and list(shapes)[-1] == ((300,), (300,), 1200, None)
    # the second request of a shape records its recipe in place; the third (a recipe hit) moves it last
    plan_request(pairing, [list(range(45))], [list(range(45))], num_tokens=180)
    assert list(shapes)[0] == ((45,), (45,), 180, None)
    plan = plan_request(pairing, [list(range(1, 46))], [list(range(45))], num_tokens=180)
    assert list(shapes)[-1] == ((45,), (45,), 180, None) and len(shapes) == 256
    assert plan.transfers[0].local_ids.tolist() == list(range(1, 46))


# post-receive steps


def test_receive_step_refuses_p_blocks_that_are_not_multiples_of_d_blocks() -> None:
    d, p = _geom(DENSE, 1, 8, 8), _geom(DENSE, 1, 4, 8)
    with pytest.raises(PlanError) as err:
        receive_step(d, p, [[1]], [[2, 3]], num_tokens=8)
    assert type(err.value) is PlanError
    assert err.value.field == "block_size" and err.value.values == {"local": 8, "remote": 4}


def test_receive_step_names_its_arguments() -> None:
    d, p = _geom(DENSE, 1, 4, 8), _geom(DENSE, 1, 8, 8)
    with pytest.raises(BlockIdError) as err:
        receive_step(d, p, [[1, 1]], [[2]])
    assert err.value.field == "consumer_ids[0]" and err.value.values == {"value": 1, "group": 0}
    with pytest.raises(BlockIdError) as err:
        receive_step(d, p, [[-1]], [[2]])
    assert err.value.field == "consumer_ids[0]"
    with pytest.raises(BlockIdError) as err:
        receive_step(d, p, [[1]], [[-2]])
    assert err.value.field == "producer_ids[0]"


def test_receive_step_zeroes_what_p_did_not_send() -> None:
    # D blocks of 4 tokens [1, 2, 6] hold tokens 0..11; P sent one block of 8 tokens: tokens 0..7.
    # D block 6 (bytes 768..895) is zeroed whole, in runs per head (2 heads of 64 B)
    d, p = _geom(DENSE, 1, 4, 8), _geom(DENSE, 1, 8, 8)
    regroup, zero = receive_step(d, p, [[1, 2, 6]], [[3]], num_tokens=12)
    assert regroup == ()
    assert zero.tolist() == [[0, 768, 128]]  # a whole block: one row per page
    # without num_tokens D's list cannot be placed (a prefix hit leaves no trace in the lists): refused
    with pytest.raises(TokenCountError) as err:
        receive_step(d, p, [[1, 2, 6]], [[3]])
    assert err.value.field == "num_tokens" and err.value.values == {"value": None, "group": 0, "blocks": 3}
    # P sent 12 tokens (2 blocks of 8): nothing to zero
    _, none = receive_step(d, p, [[1, 2, 6]], [[3, 4]], num_tokens=12)
    assert none.shape == (0, 3)
    # P computed only 10 of them (prefill_tokens): its second block still covers tokens 8..15, so
    # D block 6 is written whole (tokens past those P computed may hold anything P sent)
    _, part = receive_step(d, p, [[1, 2, 6]], [[3, 4]], num_tokens=12, prefill_tokens=10)
    assert part.shape == (0, 3)
    # with prefix caching D's list starts after its cached blocks: num_tokens places it
    _, cached = receive_step(d, p, [[6]], [[3, 4]], num_tokens=12, prefix_caching=True)
    assert cached.shape == (0, 3)
    _, cached = receive_step(d, p, [[6]], [[3]], num_tokens=12, prefix_caching=True)
    assert cached.tolist() == [[0, 768, 128]]  # D block 6 holds tokens 8..11, P sent 0..7


def test_receive_step_checks_p_blocks_against_the_tokens_p_computed() -> None:
    # D blocks of 4 tokens [1, 2] hold tokens 0..7; P (blocks of 4) computed 7 of them (the N-1 flow), or 5
    # after a prefix hit: ceil(7 / 4) = ceil(5 / 4) = 2 P blocks hold them, P sent 1. Refused, naming the
    # blocks needed (2) and sent (1), whether or not the pair caches prefixes.
    d = p = _geom(DENSE, 1, 4, 8)
    for kw in ({"prefill_tokens": 7}, {"prefill_tokens": 5, "prefix_caching": True}):
        with pytest.raises(PlanError) as err:
            receive_step(d, p, [[1, 2]], [[3]], num_tokens=8, **kw)  # type: ignore[arg-type]
        assert err.value.field == "block_ids[0]" and err.value.values == {"local": 2, "remote": 1}
    # the 2 blocks P needs: nothing to zero (token 7, which P did not compute, may hold anything P sent)
    regroup, zero = receive_step(d, p, [[1, 2]], [[3, 4]], num_tokens=8, prefill_tokens=7)
    assert regroup == () and zero.shape == (0, 3)


def test_post_receive_vllm_skips_equal_blocks_and_kvgeom_does_not() -> None:
    d, p = _geom(DENSE, 1, 4, 8), _geom(DENSE, 1, 4, 8)
    pairing = _pair()
    view = pairing.remote_view(0)
    lk, rk = [np.array([1, 2], dtype=np.int64)], [np.array([5], dtype=np.int64)]
    regroup, zero = post_receive(d, view, lk, rk, 1, "vllm")
    assert regroup == () and zero.shape == (0, 3) and zero.dtype == np.int64
    # kvgeom (the default): covered = min(2 * 1, 1) = 1 block: D block 2 (256..383) is zeroed
    regroup, zero = post_receive(d, view, lk, rk, 1)
    assert regroup == ()
    assert (
        int(zero[:, 2].sum()) == 128
        and int(zero[:, 1].min()) == 256
        and int((zero[:, 1] + zero[:, 2]).max()) == 384
    )
    del p


# contiguous_runs


def _runs(rows: list[tuple[int, ...]]) -> int:
    return contiguous_runs(np.asarray(rows, dtype=np.int64).reshape(-1, 7))


def test_contiguous_runs() -> None:
    assert _runs([]) == 0
    assert _runs([(0, 0, 0, 1, 0, 100, 10)]) == 1
    # a chain of three, given out of order: one run
    assert _runs([(0, 0, 20, 1, 0, 120, 10), (0, 0, 0, 1, 0, 100, 10), (0, 0, 10, 1, 0, 110, 10)]) == 1
    # adjacent on one side only
    assert _runs([(0, 0, 0, 1, 0, 100, 10), (0, 0, 10, 1, 0, 120, 10)]) == 2
    assert _runs([(0, 0, 0, 1, 0, 100, 10), (0, 0, 20, 1, 0, 110, 10)]) == 2
    # the length of the first move decides adjacency (not the second's)
    assert _runs([(0, 0, 0, 1, 0, 100, 10), (0, 0, 10, 1, 0, 110, 5)]) == 1
    assert _runs([(0, 0, 0, 1, 0, 100, 5), (0, 0, 10, 1, 0, 110, 10)]) == 2
    # adjacent offsets on another rank or region: not one run
    base = (0, 0, 0, 1, 0, 100, 10)
    for col in (0, 1, 3, 4):
        other = list(base)
        other[col] += 1
        other[2], other[5] = 10, 110
        assert _runs([base, tuple(other)]) == 2, col


def test_contiguous_runs_sorts_by_every_key() -> None:
    a = (0, 0, 0, 0, 0, 0, 10)
    # two moves from src offset 10: the one to dst 10 continues a; listed first, the one to dst 90
    assert _runs([(0, 0, 10, 0, 0, 90, 10), (0, 0, 10, 0, 0, 10, 10), a]) == 2
    # ... to dst region 1 listed first
    assert _runs([(0, 0, 10, 0, 1, 10, 10), (0, 0, 10, 0, 0, 10, 10), a]) == 2
    # ... to dst rank 1 listed first
    assert _runs([(0, 0, 10, 1, 0, 10, 10), (0, 0, 10, 0, 0, 10, 10), a]) == 2
    # a move of src rank 1 between a and its continuation in offset order
    assert _runs([(1, 0, 5, 0, 0, 50, 10), (0, 0, 10, 0, 0, 10, 10), a]) == 2
    assert _runs([(0, 1, 5, 0, 0, 50, 10), (0, 0, 10, 0, 0, 10, 10), a]) == 2
    # an overlapping move at src offset 5 sorts between a and its continuation: three runs
    assert _runs([(0, 0, 10, 0, 0, 10, 10), (0, 0, 5, 0, 0, 50, 10), a]) == 3


# check_writes


def test_check_writes_accepts_the_request_own_blocks() -> None:
    pairing = _pair()
    plan = plan_request(pairing, [[2, 7]], [[1, 3]], num_tokens=8)
    assert check_writes(plan, pairing, [[2, 7]]) is None
    assert check_writes(RequestPlan("e", "pull", (), (), 1, 0), pairing, [[2]]) is None
    push = _pair(mode="push")
    plan = plan_request(push, [[1, 3]], [[0, 7]], num_tokens=8)
    assert check_writes(plan, push, [[0, 7]]) is None  # push: the remote (D) ids are written


def test_check_writes_refuses_a_write_outside_the_request() -> None:
    pairing = _pair()
    plan = plan_request(pairing, [[2, 7]], [[1, 3]], num_tokens=8)
    with pytest.raises(PlanError) as err:
        check_writes(plan, pairing, [[2, 6]])  # block 7 (bytes 896..1023) is not the request's
    assert type(err.value) is PlanError
    assert err.value.field == "destination" and err.value.values == {"value": (0, 896, 128)}
    with pytest.raises(PlanError) as err:
        check_writes(plan, pairing, [[3, 7]])  # block 2 is the first move
    assert err.value.values == {"value": (0, 256, 128)}
    push = _pair(mode="push")
    plan = plan_request(push, [[1, 3]], [[0, 7]], num_tokens=8)
    with pytest.raises(PlanError) as err:
        check_writes(plan, push, [[0, 6]])
    assert err.value.values == {"value": (0, 896, 128)}


def test_check_writes_refuses_moves_across_a_block_edge_or_region() -> None:
    pairing = _pair()
    plan = plan_request(pairing, [[2, 3]], [[1, 4]], num_tokens=8)
    (t,) = plan.transfers
    table = pairing.local_table(t.local_table)
    rows = table.take(t.local_ids)
    assert rows.tolist() == [[0, 256, 128], [0, 384, 128]]

    class Shifted:
        """A plan whose moves land 1 B later: the second ends in block 4, outside [2, 3]."""

        mode = "pull"

        def __init__(self, delta: int, length: int | None = None, region: int = 0) -> None:
            self.delta, self.length, self.region = delta, length, region

        def moves(self, _pairing: Pairing) -> np.ndarray:
            m = plan.moves(pairing).copy()
            m[:, 5] += self.delta
            m[:, 4] = self.region
            if self.length is not None:
                m[:, 6] = self.length
            return m

    # a block-long move over two of the request's blocks at ppl 1 (257..384: last - first = 1 >= 1)
    for ok in ([[2, 3]], [[2, 3, 4]]):
        with pytest.raises(PlanError) as err:
            check_writes(Shifted(1), pairing, ok)  # type: ignore[arg-type]
        assert err.value.field == "destination" and err.value.values == {"value": (0, 257, 128)}
    with pytest.raises(PlanError) as err:
        check_writes(Shifted(0), pairing, [[2]])  # type: ignore[arg-type]
    assert err.value.values == {"value": (0, 384, 128)}  # the second move is block 3
    # ending exactly at the block's end is inside; a zero-length move at a block start counts as 1 byte
    assert check_writes(Shifted(0, 128), pairing, [[2, 3]]) is None  # type: ignore[arg-type]
    assert check_writes(Shifted(127, 1), pairing, [[2, 3]]) is None  # type: ignore[arg-type]
    assert check_writes(Shifted(0, 0), pairing, [[2, 3]]) is None  # type: ignore[arg-type]
    assert check_writes(Shifted(-256, 0), pairing, [[0, 1]]) is None  # type: ignore[arg-type]
    with pytest.raises(PlanError) as err:
        check_writes(Shifted(-256, 0), pairing, [[0]])  # type: ignore[arg-type]
    assert err.value.values == {"value": (0, 128, 0)}
    with pytest.raises(PlanError) as err:
        check_writes(Shifted(-257, 1), pairing, [[0, 1, 2, 3]])  # type: ignore[arg-type]
    assert err.value.values == {"value": (0, -1, 1)}  # a negative offset
    with pytest.raises(PlanError) as err:
        check_writes(Shifted(0, 128, region=1), pairing, [[2, 3]])  # type: ignore[arg-type]
    assert err.value.field == "destination region" and err.value.values == {"value": 1, "expected": 1}
    with pytest.raises(PlanError) as err:
        check_writes(Shifted(0, 128, region=-1), pairing, [[2, 3]])  # type: ignore[arg-type]
    assert err.value.field == "destination region" and err.value.values == {"value": -1, "expected": 1}


def test_vllm_mode_refuses_a_count_pairing_of_other_tokens() -> None:
    # 5 tokens, D's one block is its uncached tail (tokens 4..7); P's one block holds tokens 0..3.
    # vLLM pairs them by count (D 0 <- P 8): refused, naming both lists; kvgeom mode reads nothing
    # and zeroes D block 0 (bytes 0..127)
    with pytest.raises(UnsupportedError) as err:
        plan_request(_pair(compat="vllm"), [[0]], [[8 - 1]], num_tokens=5)
    assert type(err.value) is UnsupportedError
    assert err.value.field == "block_ids[0]" and err.value.values == {"local": [0], "remote": [7]}
    plan = plan_request(_pair(), [[0]], [[7]], num_tokens=5)
    assert plan.transfers == () and plan.notify_only == (0,) and plan.zero.tolist() == [[0, 0, 128]]
    # P's two blocks (tokens 0..7): both modes pair D 0 <- P's second block 6
    for compat in ("vllm", "kvgeom"):
        plan = plan_request(_pair(compat=compat), [[0]], [[5, 6]], num_tokens=5)
        assert [(t.local_ids.tolist(), t.remote_ids.tolist()) for t in plan.transfers] == [([0], [6])]
        assert plan.zero.shape == (0, 3)


def test_int64_arrays_are_checked_like_lists() -> None:
    from kvgeom.errors import GroupMismatchError

    pairing = _pair()
    a = np.array([2, 5], dtype=np.int64)
    plan = plan_request(pairing, [a], (np.array([1, 3], dtype=np.int64),), num_tokens=8)
    assert plan.transfers[0].local_ids.tolist() == [2, 5] and plan.transfers[0].remote_ids.tolist() == [1, 3]
    assert a.tolist() == [2, 5]
    two = [np.array([1], dtype=np.int64), np.array([2], dtype=np.int64)]
    with pytest.raises(GroupMismatchError) as err:
        plan_request(pairing, two, [[1]])
    assert err.value.field == "local_ids" and err.value.values == {"value": 2, "expected": 1}
    with pytest.raises(GroupMismatchError) as err:
        plan_request(pairing, [[1]], two)
    assert err.value.field == "remote_ids" and err.value.values == {"value": 2, "expected": 1}
    flat2d = [np.array([[1, 2]], dtype=np.int64)]
    with pytest.raises(BlockIdError) as err:
        plan_request(pairing, flat2d, [[1]])
    assert err.value.field == "local_ids[0]"
    with pytest.raises(BlockIdError) as err:
        plan_request(pairing, [[1]], flat2d)
    assert err.value.field == "remote_ids[0]"
    with pytest.raises(BlockIdError) as err:
        plan_request(pairing, [np.array([3, -2], dtype=np.int64)], [[1, 2]])
    assert err.value.field == "local_ids[0]" and err.value.values == {"value": -2}
    with pytest.raises(BlockIdError) as err:
        plan_request(pairing, [[1, 2]], [np.array([3, -2], dtype=np.int64)])
    assert err.value.field == "remote_ids[0]" and err.value.values == {"value": -2}
    # other integer arrays are converted
    plan = plan_request(
        pairing, [np.array([2, 5], dtype=np.int32)], [np.array([1, 3], dtype=np.uint16)], num_tokens=8
    )
    (t,) = plan.transfers
    assert t.local_ids.tolist() == [2, 5] and t.remote_ids.tolist() == [1, 3]
    assert t.local_ids.dtype == np.int64 and t.remote_ids.dtype == np.int64


def test_repeated_shapes_with_zeroed_blocks_and_notifications_only() -> None:
    # D 3 blocks of 4 tokens, P one block of 8 (tokens 0..7) of 12: D's third block is zeroed in full
    # (D block b at 128 b; P TP2 -> D TP1: each P rank gives one head of D's 2 blocks: 2 descs each)
    cached = _pair(p=(2, 8, 8), d=(1, 4, 8))
    shapes = [([[1, 2, 3]], [[4]]), ([[6, 0, 7]], [[1]]), ([[2, 4, 5]], [[0]]), ([[7, 1, 2]], [[2]])]
    for i, (lids, rids) in enumerate(shapes):
        got = plan_request(cached, lids, rids, f"r{i}", num_tokens=12, prefill_tokens=8)
        fresh = plan_request(_pair(p=(2, 8, 8), d=(1, 4, 8)), lids, rids, f"r{i}", None, 12, 8)
        assert _fields(got) == _fields(fresh)
        assert got.zero.dtype == np.int64 and got.zero.tolist() == [[0, 128 * lids[0][2], 128]]
        assert [len(t) for t in got.transfers] == [2, 2]
    for i in range(4):  # nothing local: notification only, from the recipe too
        got = plan_request(cached, [], [[i]], f"n{i}", "peer", num_tokens=12, prefill_tokens=8)
        assert got.transfers == () and got.notify_only == (0, 1) and got.request_id == f"n{i}"
        assert got.zero.shape == (0, 3) and got.zero.dtype == np.int64


def test_default_fields_of_a_plan() -> None:
    plan = RequestPlan("r", "push", (), (), 1, -1)
    assert plan.regroup == () and plan.zero.shape == (0, 3) and plan.zero.dtype == np.int64
    for compat in ("kvgeom", "vllm"):
        plan = plan_request(_pair(compat=compat), [[1]], [[2]], num_tokens=4)
        assert plan.zero.dtype == np.int64 and plan.zero.shape == (0, 3) and plan.regroup == ()
    assert plan.transfers[0].local_ids.dtype == np.int64 and plan.transfers[0].remote_ids.dtype == np.int64


def _regroup_tuple(r: Regroup) -> tuple:
    return (r.regions, r.blocks.tolist(), r.bsr, r.heads, r.tokens, r.head_bytes)


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_post_receive_regroups_and_zeroes_in_the_given_pages(compat: str) -> None:
    # D blocks of 8 tokens (256 B page, head-major: head h at 128 h, 16 B per token-head) receive P's
    # 4-token blocks (bsr 2). D block 1 at 256 is regrouped: [2, 2 heads, 4, 16 B] -> [2 heads, 8, 16 B].
    d, p = _geom(DENSE, 1, 8, 8), _geom(DENSE, 1, 4, 8)
    view = Pairing.create(d, [p], "pull", "kvgeom").remote_view(0)
    one, two = [np.array([1], dtype=np.int64)], [np.array([4, 5], dtype=np.int64)]
    regroup, zero = post_receive(d, view, one, two, 2, compat)
    assert [_regroup_tuple(r) for r in regroup] == [((0,), [1], 2, 2, 8, 16)] and zero.shape == (0, 3)
    # one P block covers tokens 0..3: tokens 4..7 of each head (64 B at 256 + 128 h + 64) are zeroed
    regroup, zero = post_receive(d, view, one, [np.array([4], dtype=np.int64)], 2, compat)
    assert [_regroup_tuple(r) for r in regroup] == [((0,), [1], 2, 2, 8, 16)]
    assert zero.tolist() == [[0, 320, 64], [0, 448, 64]]
    # only the given pages are regrouped and zeroed
    regroup, zero = post_receive(d, view, one, [np.array([4], dtype=np.int64)], 2, compat, pages=lambda g: [])
    assert regroup == () and zero.shape == (0, 3)
    # nothing local: nothing to regroup or zero
    regroup, zero = post_receive(d, view, [np.zeros(0, np.int64)], two, 2, compat)
    assert regroup == () and zero.shape == (0, 3)


def _token_major(tp: int, block: int, rank: int = 0):  # type: ignore[no-untyped-def]
    return _geom(DENSE, tp, block, 8, rank=rank, kv_layout="token_major")


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_push_of_larger_p_blocks_into_d_halves(compat: str) -> None:
    # token-major: P block 3 (8 tokens x 32 B at 768) is two 128 B halves (table ids 6, 7) written to
    # D blocks 1 and 2 (128 B at 128 b)
    pairing = Pairing.create(_token_major(1, 8), [_token_major(1, 4)], "push", compat)
    for kw in ({"num_tokens": 8}, {"num_tokens": 6}, {"num_tokens": 8, "prefill_tokens": 5}):
        plan = plan_request(pairing, [[3]], [[1, 2]], **kw)  # type: ignore[arg-type]
        assert [(t.local_ids.tolist(), t.remote_ids.tolist(), t.notif) for t in plan.transfers] == [
            ([6, 7], [1, 2], "req:1")
        ]
        assert plan.moves(pairing).tolist() == [[0, 0, 768, 0, 0, 128, 128], [0, 0, 896, 0, 0, 256, 128]]
        assert plan.consumer_rank == -1 and plan.zero.shape == (0, 3)
    # P's 2 blocks (16 tokens) into D's 2 blocks of 4: D's list must be a tail, so num_tokens is needed
    with pytest.raises(TokenCountError) as err:
        plan_request(pairing, [[3, 4]], [[1, 2]])
    assert err.value.field == "num_tokens" and err.value.values == {"value": None, "group": 0, "blocks": 2}


def test_kvgeom_push_to_more_ranks_cuts_token_major_pages_per_token() -> None:
    # P TP1 token t of head h at 768 + 32 t + 16 h (block 3) -> D rank h, block 1 + t // 4, token t % 4:
    # 64 (1 + t // 4) + 16 (t % 4) = 64 + 16 t; 16 B each. D ranks wait for P_TP = 1 writer.
    pairing = Pairing.create(_token_major(1, 8), [_token_major(2, 4, r) for r in range(2)], "push", "kvgeom")
    plan = plan_request(pairing, [[3]], [[1, 2]], num_tokens=8)
    assert [t.notif for t in plan.transfers] == ["req:1", "req:1"]
    got = sorted(map(tuple, plan.moves(pairing).tolist()))
    assert got == sorted(
        (0, 0, 768 + 32 * t + 16 * h, h, 0, 64 + 16 * t, 16) for t in range(8) for h in range(2)
    )


SLIDING = ModelSpec.from_layers(
    "sw", [AttentionSpec(2, 4, "float16"), AttentionSpec(2, 4, "float16", sliding_window=4)]
)


def test_a_sliding_group_ends_where_the_full_group_does() -> None:
    """A full-attention group and a sliding-window group (both pages 128 B at 128 b in one shared region).
    12 tokens; P's full list [0, 1] says P computed 8 tokens, so P's sliding list [6, 7] holds tokens
    0..7 (not 4..11): D's sliding blocks [4, 5] (tokens 4..11) get D 4 <- P 7 and D 5 zeroed; the full
    group pairs D 0, 1 <- P 0, 1 and zeroes D 2."""
    pairing = Pairing.create(_geom(SLIDING, 1, 4, 8), [_geom(SLIDING, 1, 4, 8)], "pull", "kvgeom")
    for kw in ({}, {"prefill_tokens": 8}):
        plan = plan_request(pairing, [[0, 1, 2], [4, 5]], [[0, 1], [6, 7]], num_tokens=12, **kw)  # type: ignore[arg-type]
        assert [(t.local_ids.tolist(), t.remote_ids.tolist()) for t in plan.transfers] == [
            ([0, 1, 4], [0, 1, 7])
        ]
        assert plan.zero.tolist() == [[0, 256, 128], [0, 640, 128]]
    # P computed all 12: its sliding list [6, 7] holds tokens 4..11; D's sliding tail [5] <- P 7
    for compat in ("kvgeom", "vllm"):
        pairing = Pairing.create(_geom(SLIDING, 1, 4, 8), [_geom(SLIDING, 1, 4, 8)], "pull", compat)
        plan = plan_request(pairing, [[0, 1, 2], [5]], [[0, 1, 2], [6, 7]], num_tokens=12)
        assert [(t.local_ids.tolist(), t.remote_ids.tolist()) for t in plan.transfers] == [
            ([0, 1, 2, 5], [0, 1, 2, 7])
        ]
        assert plan.zero.shape == (0, 3)
        # without num_tokens a sliding list cannot be placed
        with pytest.raises(PlanError) as err:
            plan_request(pairing, [[0, 1, 2], [4, 5]], [[0, 1, 2], [6, 7]])
        assert err.value.field == "num_tokens"


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_pull_of_smaller_p_blocks_regroups_and_zeroes_the_tail(compat: str) -> None:
    """D blocks of 8 tokens (256 B, received as two 128 B sub-pages: D block b's half j at 256 b + 128 j)
    from P blocks of 4 (128 B at 128 b), bsr 2; then each D block is regrouped per head
    ([2, 2 heads, 4, 16 B] -> [2 heads, 8, 16 B]). vLLM's table is the whole one (ratio 2, -1)."""
    pairing = Pairing.create(_geom(DENSE, 1, 8, 8), [_geom(DENSE, 1, 4, 8)], "pull", compat)
    key = (2, 0) if compat == "kvgeom" else (2, -1)
    plan = plan_request(pairing, [[1]], [[4, 5]], num_tokens=8)
    assert [(t.local_table, t.local_ids.tolist(), t.remote_ids.tolist()) for t in plan.transfers] == [
        (key, [2, 3], [4, 5])
    ]
    assert plan.moves(pairing).tolist() == [[0, 0, 512, 0, 0, 256, 128], [0, 0, 640, 0, 0, 384, 128]]
    assert [_regroup_tuple(r) for r in plan.regroup] == [((0,), [1], 2, 2, 8, 16)] and plan.zero.shape == (
        0,
        3,
    )
    # 12 tokens: P's 3 blocks fill D block 1 and the first half of D block 2; tokens 4..7 of each head
    # of D block 2 (after the regroup: 512 + 128 h + 64, 64 B) are zeroed
    for kw in ({"num_tokens": 12}, {"num_tokens": 12, "prefill_tokens": 12}):
        plan = plan_request(pairing, [[1, 2]], [[4, 5, 6]], **kw)  # type: ignore[arg-type]
        assert [(t.local_ids.tolist(), t.remote_ids.tolist()) for t in plan.transfers] == [
            ([2, 3, 4], [4, 5, 6])
        ]
        assert [_regroup_tuple(r) for r in plan.regroup] == [((0,), [1, 2], 2, 2, 8, 16)]
        assert plan.zero.tolist() == [[0, 576, 64], [0, 704, 64]]
    plan = plan_request(pairing, [[1]], [[4]], num_tokens=4)
    assert [(t.local_ids.tolist(), t.remote_ids.tolist()) for t in plan.transfers] == [([2], [4])]
    assert plan.zero.tolist() == [[0, 320, 64], [0, 448, 64]]


class _Moves:
    """A plan stand-in with given byte moves (check_writes reads only ``mode`` and ``moves``)."""

    def __init__(self, rows: list[tuple[int, ...]], mode: str = "pull") -> None:
        self.mode, self.rows = mode, rows

    def moves(self, _pairing: Pairing) -> np.ndarray:
        return np.asarray(self.rows, dtype=np.int64).reshape(-1, 7)


def test_check_writes_with_kernel_blocks_and_state_slots() -> None:
    """Hybrid, logical blocks of 8 tokens = 2 kernel blocks of 4 (ppl 2, 128 B each, kernel block k at
    128 k). Attention id b covers kernel blocks 2b, 2b + 1; an SSM slot s's page spans kernel blocks 2s
    and 2s + 1 too."""
    g = _geom(HYBRID, 1, 8, 8, kernel_block_size=4)
    assert g.ppl == 2
    pairing = Pairing.create(g, [_geom(HYBRID, 1, 8, 8, kernel_block_size=4)], "pull", "kvgeom")
    plan = plan_request(pairing, [[3], [1]], [[5], [7]], num_tokens=8)
    assert check_writes(plan, pairing, [[3], [1]]) is None
    with pytest.raises(PlanError) as err:
        check_writes(plan, pairing, [[3], [2]])  # the state pieces land in slot 1's kernel block 2 (256)
    assert err.value.field == "destination" and err.value.values["value"][1] == 256
    with pytest.raises(PlanError) as err:
        check_writes(plan, pairing, [[2], [1]])  # attention lands in kernel blocks 6, 7 (768, 896)
    assert err.value.values == {"value": (0, 768, 128)}
    ok = [[2], [1]]  # kernel blocks 4, 5 (attention) and 2, 3 (state slot 1)
    assert check_writes(_Moves([(0, 0, 0, 0, 0, 384 + 96, 32)]), pairing, ok) is None  # type: ignore[arg-type]
    # one move over two kernel blocks of one logical block or slot: fine (last - first = 1 < ppl 2)
    assert check_writes(_Moves([(0, 0, 0, 0, 0, 256, 256)]), pairing, ok) is None  # type: ignore[arg-type]
    assert check_writes(_Moves([(0, 0, 0, 0, 0, 512, 256)]), pairing, ok) is None  # type: ignore[arg-type]
    # over three kernel blocks (2..4: all the request's): refused (last - first = 2 >= ppl)
    with pytest.raises(PlanError) as err:
        check_writes(_Moves([(0, 0, 0, 0, 0, 256, 384)]), pairing, ok)  # type: ignore[arg-type]
    assert err.value.values == {"value": (0, 256, 384)}
    with pytest.raises(PlanError) as err:
        check_writes(_Moves([(0, 0, 0, 0, 0, 100, 32)]), pairing, ok)  # type: ignore[arg-type]
    assert err.value.values == {"value": (0, 100, 32)}  # kernel block 0
    assert check_writes(_Moves([]), pairing, ok) is None  # type: ignore[arg-type]


def test_a_full_prefix_hit_of_a_hybrid_moves_only_the_state() -> None:
    """D caches every attention block (its attention list is empty) but takes the state slot. vLLM's
    ``prefill[-0:]`` keeps P's whole attention list against D's none: vLLM mode refuses the unpairable
    counts; kvgeom mode moves the state slot only (4 descriptors: x, B, C and the temporal state)."""
    g = _geom(HYBRID, 1, 4, 8)
    pairing = Pairing.create(g, [_geom(HYBRID, 1, 4, 8)], "pull", "vllm")
    for p_attn, n in (([5], 4), ([5, 6], 8)):
        with pytest.raises(PlanError) as err:
            plan_request(pairing, [[], [1]], [p_attn, [7]], num_tokens=n)
        assert type(err.value) is PlanError
        assert err.value.field == "block_ids[0]" and err.value.values == {"local": 0, "remote": len(p_attn)}
    pairing = Pairing.create(g, [_geom(HYBRID, 1, 4, 8)], "pull", "kvgeom")
    plan = plan_request(pairing, [[], [1]], [[5, 6], [7]], num_tokens=8)
    (t,) = plan.transfers
    assert len(t) == 4 and plan.zero.shape == (0, 3)
    # the state slot 1's page (128 B at 128) receives P slot 7's (at 896): 4 pieces of 32 B
    moves = plan.moves(pairing)
    assert (moves[:, 5] >= 128).all() and (moves[:, 5] + moves[:, 6] <= 256).all()
    assert (moves[:, 2] >= 896).all() and (moves[:, 2] + moves[:, 6] <= 1024).all()


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_repeated_shapes_with_regroups_plan_like_the_first(compat: str) -> None:
    def pairing() -> Pairing:
        return Pairing.create(_geom(DENSE, 1, 8, 8), [_geom(DENSE, 1, 4, 8)], "pull", compat)

    cached = pairing()
    shapes = [
        ([[1, 2]], [[4, 5, 6]]),
        ([[3, 0]], [[1, 2, 7]]),
        ([[5, 6]], [[0, 3, 2]]),
        ([[7, 4]], [[6, 5, 4]]),
    ]
    for i, (lids, rids) in enumerate(shapes):
        got = plan_request(cached, lids, rids, f"q{i}", "peer", num_tokens=12)
        assert _fields(got) == _fields(plan_request(pairing(), lids, rids, f"q{i}", "peer", num_tokens=12))
        # D's 2 blocks regrouped; the second half of D's second block (8 b + 4.., per head) zeroed
        b = lids[0][1]
        assert [_regroup_tuple(r) for r in got.regroup] == [((0,), lids[0], 2, 2, 8, 16)]
        assert got.zero.tolist() == [[0, 256 * b + 64, 64], [0, 256 * b + 192, 64]]
        assert {t.notif for t in got.transfers} == {"peer:1"}


def test_repeated_shapes_with_two_regroups() -> None:
    """Full and sliding groups, D blocks of 8 from P blocks of 4 (bsr 2): one regroup per group, each of its
    own D blocks (shared region 0, 2 heads, 8 tokens, 16 B per token-head); recipes keep them apart."""

    def pairing() -> Pairing:
        return Pairing.create(_geom(SLIDING, 1, 8, 8), [_geom(SLIDING, 1, 4, 8)], "pull", "kvgeom")

    cached = pairing()
    shapes = [([[1, 2], [5]], [[0, 1, 2, 3], [6, 7]]), ([[3, 0], [6]], [[4, 5, 6, 7], [0, 1]])]
    shapes += [([[7, 4], [1]], [[1, 2, 0, 3], [4, 6]]), ([[6, 5], [2]], [[7, 4, 5, 6], [2, 3]])]
    for lids, rids in shapes:
        got = plan_request(cached, lids, rids, num_tokens=16)
        assert _fields(got) == _fields(plan_request(pairing(), lids, rids, num_tokens=16))
        assert [_regroup_tuple(r) for r in got.regroup] == [
            ((0,), lids[0], 2, 2, 8, 16),
            ((0,), lids[1], 2, 2, 8, 16),
        ]


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_k_and_v_regions_regroup_and_zero_apart(compat: str) -> None:
    """Split K and V (one region each per layer, 2 layers: k 0, v 1, k 2, v 3): a D block of 8 tokens is
    2 heads x 8 tokens x 8 B = 128 B per region. One regroup per part, k before v (head_bytes 128 //
    (2 x 8) = 8). One P block of 4 tokens fills tokens 0..3: tokens 4..7 of head h of D block 1 (128 +
    64 h + 32, 32 B) are zeroed in all 4 regions."""
    model = ModelSpec.from_layers("dense", [AttentionSpec(2, 4, "float16")] * 2)
    d, p = _geom(model, 1, 8, 8, kv_split=True), _geom(model, 1, 4, 8, kv_split=True)
    assert [r.part for r in d.regions] == ["k", "v", "k", "v"]
    plan = plan_request(Pairing.create(d, [p], "pull", compat), [[1]], [[2]], num_tokens=4)
    assert [_regroup_tuple(r) for r in plan.regroup] == [((0, 2), [1], 2, 2, 8, 8), ((1, 3), [1], 2, 2, 8, 8)]
    assert sorted(map(tuple, plan.zero.tolist())) == [(r, o, 32) for r in range(4) for o in (160, 224)]


def test_pull_notifications_count_the_readers_not_the_local_ranks() -> None:
    # P TP2 -> D TP4: each P rank is read by 4 // 2 = 2 D ranks ("req:2"), though D has 4 ranks
    pairing = _pair(p=(2, 4, 8), d=(4, 4, 8), rank=3)
    plan = plan_request(pairing, [[1]], [[2]], num_tokens=4)
    assert [t.notif for t in plan.transfers] == ["req:2"] and plan.expected_notifications == 2


def test_receive_step_needs_num_tokens_with_or_without_prefix_caching() -> None:
    d, p = _geom(DENSE, 1, 4, 8), _geom(DENSE, 1, 8, 8)
    for caching in (False, True):  # a pair that says it caches no prefix is no proof D's list starts at 0
        with pytest.raises(TokenCountError) as err:
            receive_step(d, p, [[6]], [[3]], prefix_caching=caching)
        assert err.value.field == "num_tokens" and err.value.values == {
            "value": None,
            "group": 0,
            "blocks": 1,
        }
    assert receive_step(d, p, [[6]], [[3]], num_tokens=4)[1].shape == (0, 3)  # told: D's list starts at 0


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_repeated_shapes_with_k_and_v_regroups(compat: str) -> None:
    # the K and V regroups of the split layout above, from a recipe from the third request on: both hold
    # D's blocks (never P's ids), like a fresh plan
    model = ModelSpec.from_layers("dense", [AttentionSpec(2, 4, "float16")] * 2)

    def pairing() -> Pairing:
        d, p = _geom(model, 1, 8, 8, kv_split=True), _geom(model, 1, 4, 8, kv_split=True)
        return Pairing.create(d, [p], "pull", compat)

    cached = pairing()
    shapes = [
        ([[1, 2]], [[2, 3, 4, 5]]),
        ([[3, 0]], [[1, 0, 6, 7]]),
        ([[5, 6]], [[3, 2, 1, 0]]),
        ([[7, 4]], [[4, 5, 6, 7]]),
    ]
    for lids, rids in shapes:
        got = plan_request(cached, lids, rids, num_tokens=16)
        assert _fields(got) == _fields(plan_request(pairing(), lids, rids, num_tokens=16))
        assert [_regroup_tuple(r) for r in got.regroup] == [
            ((0, 2), lids[0], 2, 2, 8, 8),
            ((1, 3), lids[0], 2, 2, 8, 8),
        ]


def test_plan_describe_lists_each_remote_rank() -> None:
    from kvgeom import plan_request

    d = card_of("d", DENSE, EngineConfig(tp_size=1, block_size=4, num_blocks=4))
    p = [
        card_of("p", DENSE, EngineConfig(tp_size=2, tp_rank=r, block_size=4, num_blocks=4)) for r in range(2)
    ]
    pairing = Pairing.create(d, p, mode="pull")
    text = pairing and plan_request(pairing, [[1]], [[2]], num_tokens=3).describe(pairing)
    assert "rank 0:" in text and "rank 1:" in text


def test_each_stage_pairing_regroups_only_its_own_layers_pages() -> None:
    """P in two pipeline stages (one layer each), D one stage with blocks twice P's (bsr 2), head-major
    with 2 KV heads: every received block is regrouped per head (B.3.9). Each stage's pairing must regroup
    only the pages its own layer fills; regrouping every page of the group would permute the other
    stage's layer twice (once per pairing), which the oracle reports as I2."""
    from kvgeom import AttentionSpec, EngineConfig, ModelSpec
    from kvgeom.testing.oracle import run_pull

    m = ModelSpec.from_layers("pp", [AttentionSpec(2, 2, "float16")] * 2)
    p = EngineConfig(tp_size=1, block_size=2, num_blocks=8, pp_size=2)
    d = EngineConfig(tp_size=1, block_size=4, num_blocks=8)
    for n in (5, 7, 8):
        report = run_pull(m, p, d, Request.simple(m, p, d, n), compat="kvgeom")
        assert report.ok, report
        # 2 layers x n tokens x K and V x 2 heads x 2 elements x 2 B, whole blocks of 2 tokens from P
        assert report.bytes_moved == 2 * (2 * -(-n // 2)) * 2 * 2 * 2 * 2
