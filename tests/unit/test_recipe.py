"""Request-shape recipes (kvgeom.plan.recipe): a plan from a recipe equals the general planner's, field by
field, for requests of a shape seen before with other block ids, in both modes and compat settings."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom.plan.planmemo import memo_of
from kvgeom.plan.recipe import trace
from kvgeom.plan.request import _plan, _Shape, plan_request
from kvgeom.tools.scenario import Scenario

PAIRS = [  # (model, mode, compat, P block, P kernel, D block, D kernel)
    ("kimi-linear-48b-a3b", "pull", "vllm", None, 16, None, 32),
    ("kimi-linear-48b-a3b", "pull", "kvgeom", None, 16, None, 32),
    ("nemotron-h-8b", "pull", "vllm", 2080, 16, 2080, 16),
    ("nemotron-h-8b", "pull", "kvgeom", 1040, 16, 2080, 32),
    ("nemotron-h-8b", "push", "kvgeom", 2080, 16, 2080, 16),
    ("llama-3.1-8b-instruct", "pull", "kvgeom", 16, 16, 32, 32),
    ("qwen3-next-80b-a3b", "pull", "kvgeom", None, 16, None, 32),
    ("qwen3-8b", "pull", "vllm", 16, 16, 16, 16),
]


def _scenario(
    model: str, mode: str, compat: str, pb: int | None, pk: int, db: int | None, dk: int
) -> Scenario:
    def side(block: int | None, kernel: int) -> dict:
        out = {"tp_size": 2 if side.first else 1, "kernel_block_size": kernel, "num_blocks": 2000}
        side.first = False
        return out if block is None else {**out, "block_size": block}

    side.first = True
    return Scenario.from_json(
        {"model": model, "mode": mode, "compat": compat, "prefill": side(pb, pk), "decode": side(db, dk)}
    )


def _same(a, b) -> None:  # noqa: ANN001 - two RequestPlans
    assert (a.request_id, a.mode, a.notify_only, a.expected_notifications, a.consumer_rank) == (
        b.request_id,
        b.mode,
        b.notify_only,
        b.expected_notifications,
        b.consumer_rank,
    )
    assert len(a.transfers) == len(b.transfers)
    for x, y in zip(a.transfers, b.transfers):
        assert (x.remote_rank, x.local_table, x.notif) == (y.remote_rank, y.local_table, y.notif)
        assert np.array_equal(x.local_ids, y.local_ids) and np.array_equal(x.remote_ids, y.remote_ids)
    assert len(a.regroup) == len(b.regroup)
    for x, y in zip(a.regroup, b.regroup):
        assert (x.regions, x.bsr, x.heads, x.tokens, x.head_bytes) == (
            y.regions,
            y.bsr,
            y.heads,
            y.tokens,
            y.head_bytes,
        )
        assert np.array_equal(x.blocks, y.blocks)
    assert np.array_equal(a.zero, b.zero)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "-".join(map(str, p)))
@pytest.mark.parametrize("tokens", [1, 700, 5000])
def test_recipe_plans_equal_the_general_planners(pair: tuple, tokens: int) -> None:
    sc = _scenario(*pair)
    p = next(iter(sc.pairings.values()))
    pull = sc.mode == "pull"
    for seed in range(4):  # the same shape, other ids: the third and fourth come from the recipe
        req = sc.request(tokens, seed=seed)
        local, remote = (req.decode, req.prefill) if pull else (req.prefill, req.decode)
        lids = [np.asarray(x, dtype=np.int64) for x in local]
        rids = [np.asarray(x, dtype=np.int64) for x in remote]
        got = plan_request(p, lids, rids, f"r{seed}", num_tokens=tokens)
        _same(got, _plan(p, lids, rids, f"r{seed}", None, tokens, None))
    assert any(isinstance(v, _Shape) for v in memo_of(p).shapes.values())


def test_a_shape_the_planner_refuses_stays_refused() -> None:
    sc = _scenario("kimi-linear-48b-a3b", "pull", "vllm", None, 16, None, 32)
    p = sc.pairings[0]
    req = sc.request(700, seed=1)
    bad = [np.asarray(x, dtype=np.int64) for x in req.decode]
    bad[1] = bad[0][:1].copy()  # an id in two groups
    for _ in range(3):
        with pytest.raises(ValueError, match="two groups|appears twice"):
            plan_request(p, bad, req.prefill, num_tokens=700)


def test_trace_rejects_what_is_not_one_gather() -> None:
    # an output that mixes a local and a remote id, or squares one, has no recipe
    assert trace(lambda lg, rg: lg[0] + rg[0], [3], [3], 100, 100) is None
    assert trace(lambda lg, rg: lg[0] * lg[0], [3], [3], 100, 100) is None
    r = trace(lambda lg, rg: np.concatenate([5 + 4 * lg[0][::-1], [7], rg[0]]), [3], [2], 100, 100)
    assert r is not None
    assert r.apply(np.asarray([10, 11, 12, 50, 60])).tolist() == [53, 49, 45, 7, 50, 60]


def test_trace_needs_room_for_its_probes() -> None:
    assert trace(lambda lg, rg: lg[0], [30], [1], 50, 100) is None
