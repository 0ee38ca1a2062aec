"""Exact behaviour of kvgeom.model.stages and kvgeom.plan.recipe (hand-derived values, every boundary and error)."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom.errors import ConfigError
from kvgeom.model.layers import AttentionSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.model.stages import stage_layers, stage_partition, stage_range
from kvgeom.plan.recipe import Recipe, trace

# -- stages ----------------------------------------------------------------------------------------------


def test_stage_partition_hand_values() -> None:
    # 10 // 4 = 2 rest 2: the 2nd-to-last and 3rd-to-last stages get one more -> 2, 3, 3, 2
    assert stage_partition(10, 4) == (2, 3, 3, 2)
    # 7 // 4 = 1 rest 3: stages -2, -3, -4 get one more -> 2, 2, 2, 1
    assert stage_partition(7, 4) == (2, 2, 2, 1)
    # 3 // 2 = 1 rest 1: stage -2 (the first) gets one more -> 2, 1
    assert stage_partition(3, 2) == (2, 1)
    # no rest: even split; one stage holds everything
    assert stage_partition(6, 3) == (2, 2, 2)
    assert stage_partition(5, 1) == (5,)
    # the smallest legal inputs (boundary of both `< 1` checks)
    assert stage_partition(1, 1) == (1,)
    # more stages than layers: 2 // 3 = 0 rest 2 -> stages -2, -3 get one -> 1, 1, 0
    assert stage_partition(2, 3) == (1, 1, 0)
    assert isinstance(stage_partition(10, 4), tuple)


@pytest.mark.parametrize(("layers", "pp"), [(0, 1), (0, 2), (5, 0), (1, 0), (-1, 3), (3, -1)])
def test_stage_partition_refuses(layers: int, pp: int) -> None:
    # each side alone below 1 is refused (an `and` would let (0, 2) through and divide by zero on (5, 0))
    with pytest.raises(ConfigError) as info:
        stage_partition(layers, pp)
    err = info.value
    assert type(err) is ConfigError
    assert err.field == "pp_size"
    assert err.values == {"value": pp, "expected": layers}


def test_stage_range_hand_values() -> None:
    # sizes 2, 3, 3, 2: starts 0, 2, 5, 8
    assert stage_range(10, 0, 4) == (0, 2)
    assert stage_range(10, 1, 4) == (2, 5)
    assert stage_range(10, 2, 4) == (5, 8)
    assert stage_range(10, 3, 4) == (8, 10)
    assert stage_range(4, 0, 1) == (0, 4)


@pytest.mark.parametrize("rank", [-1, 4, 5])
def test_stage_range_refuses_rank(rank: int) -> None:
    with pytest.raises(ConfigError) as info:
        stage_range(10, rank, 4)
    err = info.value
    assert type(err) is ConfigError
    assert err.field == "pp_rank"
    assert err.values == {"value": rank, "expected": 4}


def test_stage_range_checks_partition_first() -> None:
    with pytest.raises(ConfigError) as info:
        stage_range(0, 0, 1)
    assert info.value.field == "pp_size"


def _model(n: int) -> ModelSpec:
    # layers 0..n-1 with a cache except layer 1 (a decoder layer without a cache)
    specs = [AttentionSpec(2, 8) if i != 1 else None for i in range(n)]
    return ModelSpec.from_layers("m", specs)


def test_stage_layers() -> None:
    m = _model(5)  # cache-holding indices 0, 2, 3, 4; 5 decoder layers
    assert stage_layers(m, 0, 1) is m.layers
    # 5 over 2: 2 rest 1 -> stage 0 gets 3 layers [0, 3), stage 1 [3, 5)
    assert [la.index for la in stage_layers(m, 0, 2)] == [0, 2]
    assert [la.index for la in stage_layers(m, 1, 2)] == [3, 4]
    assert isinstance(stage_layers(m, 1, 2), tuple)
    # 5 over 3: 1 rest 2 -> 2, 2, 1: [0, 2), [2, 4), [4, 5)
    assert [la.index for la in stage_layers(m, 0, 3)] == [0]
    assert [la.index for la in stage_layers(m, 1, 3)] == [2, 3]
    assert [la.index for la in stage_layers(m, 2, 3)] == [4]
    with pytest.raises(ConfigError) as info:
        stage_layers(m, 3, 3)
    assert info.value.field == "pp_rank"


# -- recipe ----------------------------------------------------------------------------------------------


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
