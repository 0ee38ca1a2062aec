"""The oracle is tested too: take a correct plan, plant one bug, and check the oracle names the right
invariant (and the coordinates involved)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvgeom.layout.engine import EngineConfig
from kvgeom.model.layers import AttentionSpec, MambaSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import Oracle, RankPlan, Report, Request, engine_geometries, pull_plans, push_plans

SRC_OFF, DST_RANK, DST_REGION, DST_OFF, LENGTH = 2, 3, 4, 5, 6


def _run(
    model: ModelSpec,
    p: EngineConfig,
    d: EngineConfig,
    request: Request,
    plans: list[RankPlan],
    mutate=None,
    keep_zero: bool = True,
    keep_regroup: bool = True,
) -> Report:
    """Execute ``plans`` (moves altered by ``mutate(rank, moves)``), then each D rank's receive step."""
    oracle = Oracle.for_engines(model, p, d, request)
    for rp in plans:
        moves = oracle.moves_of(rp)  # N x 8: MOVE_COLUMNS, then the destination length
        oracle.execute(mutate(rp.rank, moves) if mutate else moves, f"rank {rp.rank}")
        if rp.plan.mode == "pull":
            zero = rp.plan.zero if keep_zero else np.zeros((0, 3), np.int64)
            oracle.receive(rp.rank, rp.plan.regroup if keep_regroup else (), zero)
    return oracle.report()


GQA = ModelSpec.from_layers("gqa", [AttentionSpec(8, 4, "float16")] * 2)
P1, D4 = (
    EngineConfig(tp_size=1, block_size=4, num_blocks=8),
    EngineConfig(tp_size=4, block_size=4, num_blocks=8),
)
REQ = Request(10, [[5, 1, 6]], [[2, 7, 3]])


def test_the_correct_plan_passes() -> None:
    report = _run(GQA, P1, D4, REQ, pull_plans(GQA, P1, D4, REQ))
    assert report.ok, report
    assert report.bytes_moved == 2 * 3 * 4 * 8 * 8 * 2  # layers * blocks * tokens * heads * (K+V) * bytes


def _shift_ids(rp: RankPlan, side: str, by: int) -> RankPlan:
    t = rp.plan.transfers[0]
    ids = {f"{side}_ids": getattr(t, f"{side}_ids") + by}
    plan = dataclasses.replace(rp.plan, transfers=(dataclasses.replace(t, **ids), *rp.plan.transfers[1:]))
    return dataclasses.replace(rp, plan=plan)


def test_remote_descriptor_id_off_by_one_reads_a_neighbour_block() -> None:
    plans = pull_plans(GQA, P1, D4, REQ)
    plans[2] = _shift_ids(plans[2], "remote", 1)  # P block ids 5, 1, 6 -> descriptors of 6, 2, 7
    report = _run(GQA, P1, D4, REQ, plans)
    assert report.invariants == {"I2"}
    wrong = report.of("I2")
    assert {v.rank for v in wrong} == {2}
    assert (
        "token 0 head 4" in wrong[0].expected and "token 8 head 4" in wrong[0].found
    )  # P block 6: tokens 8..
    assert any("no coordinate (P rank 0" in v.found for v in wrong)  # P block 2 is not the request's


def test_local_descriptor_id_off_by_one_writes_outside_the_request() -> None:
    plans = pull_plans(GQA, P1, D4, REQ)
    plans[0] = _shift_ids(plans[0], "local", -1)  # D blocks 2, 7, 3 -> 1, 6, 2: 1 and 6 are not the request's
    report = _run(GQA, P1, D4, REQ, plans)
    assert {"I1", "I3"} <= report.invariants
    assert {v.rank for v in report.of("I1")} == {0}
    stride = engine_geometries(GQA, D4)[0].regions[0].block_stride
    assert {v.start // stride for v in report.of("I1") if v.region == 0} == {1, 6}


def test_wrong_head_slot() -> None:
    plans = pull_plans(GQA, P1, D4, REQ)
    head = 4 * 16  # P TP1's head-major page: 8 heads x [4 tokens x (K 8 B + V 8 B)]

    def slot_of_rank_2(rank: int, moves: np.ndarray) -> np.ndarray:
        if rank == 1:  # D rank 1 holds heads 2-3: read P's heads 4-5 instead
            moves[:, SRC_OFF] += 2 * head
        return moves

    report = _run(GQA, P1, D4, REQ, plans, slot_of_rank_2)
    assert report.invariants == {"I2"}
    v = report.of("I2")[0]
    assert v.rank == 1 and "head 2 " in v.expected and "head 4 " in v.found


def test_k_v_swap() -> None:
    model = ModelSpec.from_layers("gqa-split", [AttentionSpec(4, 4, "float16")])
    p = EngineConfig(tp_size=2, block_size=4, num_blocks=4, kv_split=True)
    d = EngineConfig(tp_size=2, block_size=4, num_blocks=4, kv_split=True)
    request = Request(6, [[2, 0]], [[1, 3]])
    plans = pull_plans(model, p, d, request)
    assert _run(model, p, d, request, plans).ok

    def swap(rank: int, moves: np.ndarray) -> np.ndarray:
        moves[:, DST_REGION] ^= 1  # region 0 holds K, region 1 holds V: write each into the other
        return moves

    report = _run(model, p, d, request, plans, swap)
    assert report.invariants == {"I2"}
    assert any(" K byte" in v.expected and " V byte" in v.found for v in report.of("I2"))


def test_missing_zero_range_leaves_stale_bytes() -> None:
    p, d = (
        EngineConfig(tp_size=1, block_size=4, num_blocks=6),
        EngineConfig(tp_size=1, block_size=8, num_blocks=6),
    )
    request = Request(3, [[3]], [[2]])  # D's block covers 8 tokens, P sends one 4-token block
    plans = pull_plans(GQA, p, d, request)
    good = _run(GQA, p, d, request, plans)
    assert good.ok and good.bytes_zeroed > 0, good
    report = _run(GQA, p, d, request, plans, keep_zero=False)
    assert report.invariants == {"I4"}
    assert all(v.found.startswith("POISON") and "token" in v.expected for v in report.of("I4"))


def test_missing_regroup_scrambles_heads_and_tokens() -> None:
    model = ModelSpec.from_layers("gqa", [AttentionSpec(4, 4, "float16")])
    p, d = (
        EngineConfig(tp_size=1, block_size=4, num_blocks=6),
        EngineConfig(tp_size=1, block_size=8, num_blocks=6),
    )
    request = Request(6, [[3, 1]], [[2]])
    plans = pull_plans(model, p, d, request)
    assert _run(model, p, d, request, plans).regrouped_blocks == 1
    assert _run(model, p, d, request, plans, keep_regroup=False).invariants == {"I2"}


def test_conv_sub_projection_read_at_the_wrong_offset() -> None:
    mamba2 = MambaSpec.mamba2(num_heads=4, head_dim=2, n_groups=2, state_size=2)
    model = ModelSpec.from_layers("mamba2-hybrid", [AttentionSpec(2, 4, "bfloat16"), mamba2])
    p, d = (
        EngineConfig(tp_size=2, block_size=8, num_blocks=6),
        EngineConfig(tp_size=1, block_size=16, num_blocks=6),
    )
    request = Request(12, [[4, 1], [3]], [[5], [0]])
    plans = pull_plans(model, p, d, request)
    assert _run(model, p, d, request, plans).ok
    p_geom = engine_geometries(model, p)[0]
    page = p_geom.regions[0].block_stride * p_geom.ppl
    (x_off, x_len), (b_off, b_len), _ = p_geom.ssm.conv_offsets

    def read_c_as_b(rank: int, moves: np.ndarray) -> np.ndarray:
        in_slot = moves[:, SRC_OFF] - 3 * page  # P's state slot is block 3
        b_piece = (in_slot >= b_off) & (in_slot < b_off + b_len) & (moves[:, SRC_OFF] >= 3 * page)
        assert b_piece.any()
        moves[b_piece, SRC_OFF] += b_len  # the next piece (C) instead of B
        return moves

    report = _run(model, p, d, request, plans, read_c_as_b)
    assert report.invariants == {"I2"}
    v = report.of("I2")[0]
    assert " B channel" in v.expected and " C channel" in v.found


def test_write_one_block_past_the_request() -> None:
    request = Request(8, [[1, 2]], [[4, 5]])  # D block 6 is not the request's
    plans = pull_plans(GQA, P1, D4, request)
    stride = engine_geometries(GQA, D4)[0].regions[0].block_stride

    def past(rank: int, moves: np.ndarray) -> np.ndarray:
        last = moves[:, DST_OFF] == 5 * stride
        moves[last, DST_OFF] += stride
        return moves

    report = _run(GQA, P1, D4, request, plans, past)
    assert {"I1", "I3"} == report.invariants
    v = report.of("I1")[0]
    assert v.start == 6 * stride and "token 4" in v.found and "no coordinate (D rank" in v.expected


def test_two_writers_of_one_byte() -> None:
    plans = push_plans(GQA, P1, D4, REQ)

    def duplicate(rank: int, moves: np.ndarray) -> np.ndarray:
        extra = moves[:1].copy()
        extra[0, SRC_OFF] += extra[0, LENGTH]  # same destination, other source bytes
        return np.concatenate([moves, extra])

    report = _run(GQA, P1, D4, REQ, plans, duplicate)
    assert "I5" in report.invariants and "overwrites" in report.of("I5")[0].detail


def test_move_past_the_region_end() -> None:
    plans = pull_plans(GQA, P1, D4, REQ)
    size = engine_geometries(GQA, D4)[0].regions[0].nbytes

    def overflow(rank: int, moves: np.ndarray) -> np.ndarray:
        moves[0, DST_OFF] = size - 4
        return moves

    report = _run(GQA, P1, D4, REQ, plans, overflow)
    assert "I6" in report.invariants
    assert report.of("I6")[0].stop == size - 4 + int(plans[0].plan.moves(plans[0].pairing)[0, LENGTH])
    assert "destination" in report.of("I6")[0].detail


def test_unequal_descriptor_lengths_are_a_pairing_violation() -> None:
    oracle = Oracle.for_engines(GQA, P1, D4, REQ)
    moves = np.concatenate([oracle.moves_of(rp) for rp in pull_plans(GQA, P1, D4, REQ)])
    moves[0, 7] -= 2  # the destination descriptor is 2 bytes shorter
    oracle.execute(moves)
    report = oracle.report()
    assert "I2" in report.invariants and "unequal lengths" in report.of("I2")[0].detail


@pytest.mark.parametrize("bad_id", [-1, 10**6])
def test_descriptor_id_outside_its_table(bad_id: int) -> None:
    plans = pull_plans(GQA, P1, D4, REQ)
    t = plans[0].plan.transfers[0]
    ids = t.remote_ids.copy()
    ids[0] = bad_id
    plan = dataclasses.replace(plans[0].plan, transfers=(dataclasses.replace(t, remote_ids=ids),))
    oracle = Oracle.for_engines(GQA, P1, D4, REQ)
    oracle.run_plan(dataclasses.replace(plans[0], plan=plan))
    report = oracle.report()
    assert {"I6", "I3"} <= report.invariants


def test_report_text_names_everything() -> None:
    plans = pull_plans(GQA, P1, D4, REQ)
    plans[2] = _shift_ids(plans[2], "remote", 1)
    text = str(_run(GQA, P1, D4, REQ, plans))
    assert text.startswith("VIOLATED I2") and "D rank 2 region" in text and "expected layers." in text
