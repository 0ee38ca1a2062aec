"""Exact behaviour of kvgeom.model.stages and kvgeom.plan.recipe (hand-derived values, every boundary and error)."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom.errors import ConfigError
from kvgeom.model.layers import AttentionSpec
from kvgeom.model.spec import ModelSpec
from kvgeom.model.stages import stage_layers, stage_partition, stage_range

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
