"""Request-shape recipes (kvgeom.plan.recipe): a plan from a recipe equals the general planner's, field by
field, for requests of a shape seen before with other block ids, in both modes and compat settings."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom.plan.planmemo import memo_of
from kvgeom.plan.recipe import Recipe, trace
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
        with pytest.raises(ValueError) as exc:
            plan_request(p, bad, req.prefill, num_tokens=700)
        assert exc.value.field == "local_ids[1]" and exc.value.values == {"value": 596, "groups": (0, 1)}


def test_trace_rejects_what_is_not_one_gather() -> None:
    # an output that mixes a local and a remote id, or squares one, has no recipe
    assert trace(lambda lg, rg: lg[0] + rg[0], [3], [3], 100, 100) is None
    assert trace(lambda lg, rg: lg[0] * lg[0], [3], [3], 100, 100) is None
    r = trace(lambda lg, rg: np.concatenate([5 + 4 * lg[0][::-1], [7], rg[0]]), [3], [2], 100, 100)
    assert r is not None
    assert r.apply(np.asarray([10, 11, 12, 50, 60])).tolist() == [53, 49, 45, 7, 50, 60]


def test_trace_needs_room_for_its_probes() -> None:
    assert trace(lambda lg, rg: lg[0], [30], [1], 50, 100) is None


def _linear(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
    # out = [3 * l0 + 5, 3 * l1 + 5, r0 - 4, 9, 2 * l2]
    lf = np.concatenate(local)
    rf = np.concatenate(remote)
    return np.array([3 * lf[0] + 5, 3 * lf[1] + 5, rf[0] - 4, 9, 2 * lf[2]])


def test_trace_linear_recipe() -> None:
    # local groups of 2 and 1 ids, remote 1 id: the local ids are positions 0..2, the remote id position 3
    r = trace(_linear, [2, 1], [1], 6, 2)
    assert r is not None
    assert r.position.tolist() == [0, 1, 3, 0, 2]
    assert r.factor.tolist() == [3, 3, 1, 0, 2]
    assert r.const.tolist() == [5, 5, -4, 9, 0]
    ids = np.array([10, 20, 30, 40], dtype=np.int64)
    got = r.apply(ids)
    assert got.dtype == np.int64
    assert got.tolist() == [35, 65, 36, 9, 60]


def test_trace_pool_boundaries() -> None:
    # probes need twice the ids on each side: 3 local ids need 6, 1 remote id needs 2
    assert trace(_linear, [2, 1], [1], 6, 2) is not None
    assert trace(_linear, [2, 1], [1], 5, 2) is None
    assert trace(_linear, [2, 1], [1], 6, 1) is None
    assert trace(_linear, [2, 1], [1], 100, 100) is not None


def test_trace_remote_pool_boundary_two_ids() -> None:
    def run(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([*local, *remote])

    # 2 remote ids need 4 slots, 2 local ids need 4
    r = trace(run, [2], [2], 4, 4)
    assert r is not None
    assert r.position.tolist() == [0, 1, 2, 3]
    assert r.factor.tolist() == [1, 1, 1, 1]
    assert r.const.tolist() == [0, 0, 0, 0]
    assert trace(run, [2], [2], 4, 3) is None
    assert trace(run, [2], [2], 3, 4) is None


def test_trace_constant_only_and_empty_apply() -> None:
    def run(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
        assert local == [] and remote == []
        return np.array([7, 8])

    r = trace(run, [], [], 0, 0)
    assert r is not None
    assert r.factor.tolist() == [0, 0]
    assert r.const.tolist() == [7, 8]
    out = r.apply(np.zeros(0, dtype=np.int64))
    assert out.tolist() == [7, 8]
    out[0] = 99  # a copy: the recipe's constants are not changed through it
    assert r.const.tolist() == [7, 8]


def test_recipe_apply_direct() -> None:
    rec = Recipe(np.array([2, 0]), np.array([2, 0]), np.array([1, 4]))
    # 1 + 2 * ids[2], 4 + 0 * ids[0]
    assert rec.apply(np.array([5, 6, 7])).tolist() == [15, 4]
    assert rec.apply(np.array([5, 6, 7])).dtype == np.int64


def test_trace_refusals() -> None:
    def mixed(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
        return local[0][:1] + remote[0][:1]  # one output from two ids: not a recipe

    assert trace(mixed, [1], [1], 10, 10) is None

    def refuses(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
        raise ValueError("refused")

    assert trace(refuses, [1], [1], 10, 10) is None

    def shape(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
        # output length depends on the id value: 1 at the base probe (id 0), 2 once the id is 1
        return np.arange(int(local[0][0]) + 1)

    assert trace(shape, [1], [1], 10, 10) is None

    def odd(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
        # 3 a // 2 over a = 0, 1 (step 1) and reversed a = 2 (3): 2c = 0 + 3 - 2 * 1 * 1 = 1 is odd
        return local[0][:1] * 3 // 2

    assert trace(odd, [2], [], 10, 10) is None

    def square(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
        # a * a: base 0, step 1, reversed 4 -> c = 1, position (0 - 1) / 2 is not an integer
        return local[0][:1] * local[0][:1]

    assert trace(square, [2], [], 10, 10) is None

    def doubled(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
        # 2 * a + 4: base 4, step 2, reversed 8 -> 2c = 12 - 4 = 8, c = 4, p = 0: a recipe at position 0
        return local[0][:1] * 2 + 4

    r = trace(doubled, [2], [], 10, 10)
    assert r is not None and r.position.tolist() == [0] and r.const.tolist() == [4]

    def sums(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
        # a + b: step 2, reversed == base = 2: 2c = 2 + 2 - 2 * 2 = 0, p = 2 / 4: not an integer
        return local[0][:1] + local[0][1:2]

    assert trace(sums, [2], [], 10, 10) is None

    def table(values: dict[int, int]):  # one output g(a) of the first local id, from a table
        def run(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
            return np.array([values[int(local[0][0])]])

        return run

    # n = 2 ids; probes a = 0 (base B), a = 1 (B + m), reversed a = 2 (R); c = (B + R) / 2 - m,
    # p = (B - c) / (2 m). g = 0, 1, -6: c = -4, p = 2 (past the 2 ids); g = 0, 1, 6: c = 2, p = -1
    assert trace(table({0: 0, 1: 1, 2: -6}), [2], [], 10, 10) is None
    assert trace(table({0: 0, 1: 1, 2: 6}), [2], [], 10, 10) is None
    # g = 0, 1, -2: c = -2, p = 1 (the last id): kept
    r = trace(table({0: 0, 1: 1, 2: -2}), [2], [], 10, 10)
    assert r is not None and r.position.tolist() == [1] and r.const.tolist() == [-2]


def test_recipe_apply_is_int64_for_narrow_inputs() -> None:
    i32 = np.int32
    rec = Recipe(np.array([1], dtype=i32), np.array([3], dtype=i32), np.array([2], dtype=i32))
    out = rec.apply(np.array([4, 5], dtype=i32))  # 2 + 3 * 5
    assert out.tolist() == [17]
    assert out.dtype == np.int64


def test_trace_passes_the_groups_apart() -> None:
    # three local groups of one id each: the run sees three arrays (local[2] is the third id)
    def run(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
        assert len(local) == 3 and len(remote) == 2
        return np.array([local[2][0], remote[1][0] + 1])

    r = trace(run, [1, 1, 1], [1, 1], 10, 10)
    assert r is not None
    # local ids are positions 0..2, remote 3..4: local[2] is position 2, remote[1] position 4
    assert r.position.tolist() == [2, 4]
    assert r.const.tolist() == [0, 1]


def test_trace_outputs_are_int64() -> None:
    def run(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
        return np.array([2.0 * local[0][0] + 1.0, 7.0])  # floats of integer value

    r = trace(run, [2], [], 10, 10)
    assert r is not None
    assert r.const.dtype == np.int64 and r.factor.dtype == np.int64 and r.position.dtype == np.int64
    assert r.const.tolist() == [1, 7] and r.factor.tolist() == [2, 0] and r.position.tolist() == [0, 0]


def test_trace_refuses_a_position_far_before_the_ids() -> None:
    # g(0) = 0, g(1) = 1, g(2) = 22 over 2 ids: 2c = 0 + 22 - 2 = 20, c = 10, p = (0 - 10) / 2 = -5
    def run(local: list[np.ndarray], remote: list[np.ndarray]) -> np.ndarray:
        return np.array([{0: 0, 1: 1, 2: 22}[int(local[0][0])]])

    assert trace(run, [2], [], 10, 10) is None
