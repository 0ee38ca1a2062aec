"""kvgeom.plan.blockrows: the rows of a request's blocks on one rank and rows as the fewest runs, the
geometry both transports zero with (kvgeom_nixl and kvgeom_mooncake), checked against byte masks built
one block at a time."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom import block_rows, block_runs, zero_runs
from kvgeom.errors import BlockIdError, GroupMismatchError, PlanError
from kvgeom.tools.scenario import Scenario


def _geom(kernel: int = 32):
    """Nemotron-H's decode rank (attention and Mamba2 groups; ``ppl`` = 1056 / ``kernel``)."""
    sc = Scenario.from_json(
        {
            "model": "nemotron-h-8b",
            "mode": "pull",
            "prefill": {"tp_size": 1, "block_size": 1056, "kernel_block_size": 16, "num_blocks": 12},
            "decode": {"tp_size": 1, "block_size": 1056, "kernel_block_size": kernel, "num_blocks": 12},
        }
    )
    return sc.cards("decode")[0].geometry


def _mask(geom, rows: np.ndarray) -> list[np.ndarray]:
    out = [np.zeros(r.nbytes, dtype=bool) for r in geom.regions]
    for r, o, n in np.asarray(rows).tolist():
        out[r][o : o + n] = True
    return out


@pytest.mark.parametrize("kernel", [32, 1056])
def test_block_rows_cover_every_kernel_block_of_every_id_in_every_region(kernel: int) -> None:
    geom = _geom(kernel)
    kinds = geom.group_is_ssm
    assert len(kinds) >= 2 and any(kinds) and not all(kinds)
    ids = [[3, 1] if not ssm else [5] for ssm in kinds]
    rows = block_rows(geom, ids)
    assert rows.dtype == np.int64 and rows.shape[1] == 3
    want = [np.zeros(r.nbytes, dtype=bool) for r in geom.regions]
    for b in {b for g in ids for b in g}:  # logical b = kernel b * ppl + j in every group, every region
        for j in range(geom.ppl):
            for r in geom.regions:
                k = b * geom.ppl + j
                want[r.index][k * r.block_stride : (k + 1) * r.block_stride] = True
    assert all(np.array_equal(a, b) for a, b in zip(_mask(geom, rows), want))
    assert len({tuple(x) for x in rows.tolist()}) == len(rows)  # each (region, block) once
    assert (rows[:, 2] == np.asarray([geom.regions[i].block_stride for i in rows[:, 0]])).all()
    assert list(rows[:, 0]) == sorted(rows[:, 0])  # region-major


def test_block_rows_of_no_ids_are_empty() -> None:
    geom = _geom()
    assert block_rows(geom, [[] for _ in geom.group_is_ssm]).shape == (0, 3)


def test_block_rows_refuse_ids_outside_the_rank_and_a_wrong_group_count() -> None:
    geom = _geom()
    n = len(geom.group_is_ssm)
    limit = geom.logical_num_blocks
    with pytest.raises(BlockIdError) as ei:
        block_rows(geom, [[0, limit]] + [[] for _ in range(n - 1)])
    assert ei.value.field == "ids" and ei.value.values == {"value": limit, "expected": limit}
    with pytest.raises(BlockIdError) as neg:
        block_rows(geom, [[0, -1]] + [[] for _ in range(n - 1)])
    assert neg.value.field == "ids[0]"  # as every id list is checked (kvgeom.blocks.as_ids)
    with pytest.raises(GroupMismatchError) as gm:
        block_rows(geom, [[1]] * (n + 1))
    assert gm.value.field == "ids"
    with pytest.raises(BlockIdError):
        block_rows(geom, [1, 2])  # a flat list, not one list per group


@pytest.mark.parametrize("seed", range(12))
def test_zero_runs_are_the_rows_bytes_as_the_fewest_disjoint_runs(seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = [int(rng.integers(1, 4)) * 512 + int(rng.integers(0, 3)) for _ in range(3)]
    n = int(rng.integers(1, 120))
    region = rng.integers(0, 3, n)
    length = rng.integers(0, 64, n)
    offset = np.asarray([rng.integers(0, sizes[r] - ln + 1) for r, ln in zip(region, length)])
    rows = np.stack([region, offset, length], 1).astype(np.int64)
    run_region, start, end, total = zero_runs(rows, sizes)
    assert total == int(length.sum())
    covered = [np.zeros(s, dtype=bool) for s in sizes]
    for r, o, ln in rows.tolist():
        covered[r][o : o + ln] = True
    got = [np.zeros(s, dtype=bool) for s in sizes]
    for r, s, e in zip(run_region.tolist(), start.tolist(), end.tolist()):
        assert 0 <= s < e <= sizes[r]
        got[r][s:e] = True
    assert all(np.array_equal(a, b) for a, b in zip(got, covered))
    same = run_region[1:] == run_region[:-1]
    assert (np.diff(run_region) >= 0).all() and (start[1:][same] > end[:-1][same]).all()  # never touching
    stretches = sum(int(np.count_nonzero(np.diff(np.r_[0, c.astype(np.int8), 0]) == 1)) for c in covered)
    assert run_region.size == stretches


def test_zero_runs_never_join_two_regions() -> None:
    region, start, end, total = zero_runs(np.asarray([[0, 8, 8], [1, 0, 8]]), [16, 16])
    assert (region.tolist(), start.tolist(), end.tolist(), total) == ([0, 1], [8, 0], [16, 8], 16)


@pytest.mark.parametrize("rows", [[[0, 60, 5]], [[0, -1, 2]], [[0, 4, -1]], [[2, 0, 1]], [[-1, 0, 1]]])
def test_zero_runs_refuse_a_row_outside_its_region(rows: list) -> None:
    with pytest.raises(PlanError) as ei:
        zero_runs(np.asarray([[0, 0, 8]] + rows), [64, 32])
    assert ei.value.field == "zero"


def test_zero_runs_refuse_rows_that_are_not_triples_and_pass_empty_ones() -> None:
    with pytest.raises(PlanError):
        zero_runs(np.zeros((4, 2), np.int64), [8])
    region, start, end, total = zero_runs(np.zeros((0, 3), np.int64), [8])
    assert region.size == start.size == end.size == 0 and total == 0
    assert zero_runs(np.asarray([[0, 3, 0]]), [8])[3] == 0


@pytest.mark.parametrize("kernel", [32, 1056])
@pytest.mark.parametrize(
    "ids",
    [[[3, 1], [5]], [[0, 1, 2], [4]], [[7], [6]], [[2, 0], [1]], [[11], [10, 9]], [[], [0]]],
)
def test_block_runs_are_block_rows_bytes_as_the_fewest_rows(kernel: int, ids: list) -> None:
    # the same bytes as block_rows, one row per stretch of adjacent kernel blocks in each region
    geom = _geom(kernel)
    n = len(geom.group_is_ssm)
    full = [ids[0]] + [ids[1] if ssm else [] for ssm in geom.group_is_ssm[1:]]
    assert len(full) == n
    runs = block_runs(geom, full)
    rows = block_rows(geom, full)
    assert runs.dtype == np.int64 and runs.shape[1] == 3
    assert all(np.array_equal(a, b) for a, b in zip(_mask(geom, runs), _mask(geom, rows)))
    key = runs[:, :2].tolist()
    assert key == sorted(key)  # region-major, in block order
    same = runs[1:, 0] == runs[:-1, 0]
    assert (runs[1:, 1][same] > (runs[:-1, 1] + runs[:-1, 2])[same]).all()  # none touches the next
    assert int(runs[:, 2].sum()) == int(rows[:, 2].sum())
    stretches = sum(
        int(np.count_nonzero(np.diff(np.concatenate([[0], m.astype(np.int8), [0]])) == 1))
        for m in _mask(geom, rows)
    )
    assert len(runs) == stretches


def test_block_runs_join_adjacent_ids_and_refuse_what_block_rows_refuses() -> None:
    geom = _geom(1056)  # ppl 1: one kernel block per id
    n = len(geom.group_is_ssm)
    runs = block_runs(geom, [[4, 2, 3]] + [[] for _ in range(n - 1)])
    r0 = geom.regions[0]
    assert runs[runs[:, 0] == 0].tolist() == [[0, 2 * r0.block_stride, 3 * r0.block_stride]]
    assert len(runs) == len(geom.regions)
    assert block_runs(geom, [[] for _ in range(n)]).shape == (0, 3)
    limit = geom.logical_num_blocks
    with pytest.raises(BlockIdError) as ei:
        block_runs(geom, [[0, limit]] + [[] for _ in range(n - 1)])
    assert ei.value.values == {"value": limit, "expected": limit}
    with pytest.raises(BlockIdError):
        block_runs(geom, [[0, -1]] + [[] for _ in range(n - 1)])
    with pytest.raises(GroupMismatchError):
        block_runs(geom, [[1]] * (n + 1))


def test_zero_runs_of_sorted_rows_join_contained_and_touching_rows_and_drop_empty_ones() -> None:
    # rows already in order (no sort): one inside another, one touching, one empty in a gap
    rows = np.asarray([[0, 0, 10], [0, 2, 3], [0, 10, 1], [0, 12, 0], [0, 13, 2], [1, 0, 4], [1, 4, 4]])
    region, start, end, total = zero_runs(rows, [16, 8])
    assert np.stack([region, start, end], 1).tolist() == [[0, 0, 11], [0, 13, 15], [1, 0, 8]]
    assert total == 24
