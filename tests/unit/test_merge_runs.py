"""kvgeom mode's posted descriptors: a transfer's pairs merged into maximal runs contiguous on both sides
(``kvgeom.layout.runs.merge_runs``, which both NIXL transports post: ``kvgeom_nixl`` and ``kvgeom_vllm``'s
kvgeom mode), as many as ``contiguous_runs`` counts, never past a region's end."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom.errors import PlanError
from kvgeom.layout.runs import addressed, merge_runs
from kvgeom.plan.requestplan import contiguous_runs


def _moves(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    m = np.zeros((len(src), 7), dtype=np.int64)
    m[:, 1], m[:, 2], m[:, 3], m[:, 4], m[:, 5], m[:, 6] = (
        src[:, 0],
        src[:, 1],
        1,
        dst[:, 0],
        dst[:, 1],
        src[:, 2],
    )
    return m


def _byte_map(src: np.ndarray, dst: np.ndarray) -> set[tuple[int, int, int, int]]:
    """Every moved byte as (src region, src offset, dst region, dst offset)."""
    out = set()
    for (sr, so, n), (dr, do, _) in zip(src.tolist(), dst.tolist()):
        out.update((sr, so + k, dr, do + k) for k in range(n))
    return out


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("src", ["local", "remote"])
def test_merged_runs_move_the_same_bytes_in_contiguous_runs_many_pairs(seed, src):
    rng = np.random.default_rng(seed)
    blocks, length = 40, int(rng.choice([4, 8, 12]))
    # a table of fixed-size rows in 2 regions; a request takes some blocks, in a random order
    regions = 2
    sizes = [blocks * length] * regions
    taken = rng.choice(blocks, size=int(rng.integers(1, blocks)), replace=False)
    dst_slot = rng.permutation(blocks)[: taken.size] if seed % 2 else np.sort(taken)  # sequential or shuffled
    reg = rng.integers(0, regions, size=taken.size)
    a = np.column_stack([reg, taken * length, np.full(taken.size, length)])
    b = np.column_stack([reg, dst_slot * length, np.full(taken.size, length)])
    local, remote = (a, b) if src == "local" else (b, a)
    ml, mr = merge_runs(local, remote, sizes, sizes, src)
    s0, d0 = (a, b)
    s1, d1 = (ml, mr) if src == "local" else (mr, ml)
    assert len(ml) == len(mr) == contiguous_runs(_moves(s0, d0))
    assert (ml[:, 2] == mr[:, 2]).all() and int(ml[:, 2].sum()) == int(a[:, 2].sum())
    assert _byte_map(s1, d1) == _byte_map(s0, d0)


def test_sequential_blocks_become_one_run_per_region():
    rows = np.array([[0, 0, 8], [0, 8, 8], [0, 16, 8], [1, 0, 8], [1, 8, 8]])
    ml, mr = merge_runs(rows, rows, [24, 16], [24, 16], "remote")
    assert ml.tolist() == [[0, 0, 24], [1, 0, 16]] and mr.tolist() == ml.tolist()


def test_rows_adjacent_across_a_region_boundary_stay_two_runs():
    # region 0 ends where region 1 starts (as two registrations side by side would): never one descriptor
    local = np.array([[0, 92, 8], [1, 0, 8]])
    remote = np.array([[0, 92, 8], [1, 0, 8]])
    ml, mr = merge_runs(local, remote, [100, 100], [100, 100], "remote")
    assert ml.tolist() == [[0, 92, 8], [1, 0, 8]] and mr.tolist() == [[0, 92, 8], [1, 0, 8]]


def test_contiguous_on_one_side_only_is_not_merged():
    local = np.array([[0, 0, 8], [0, 8, 8]])
    remote = np.array([[0, 0, 8], [0, 24, 8]])
    ml, mr = merge_runs(local, remote, [64], [64], "remote")
    assert len(ml) == len(mr) == 2


@pytest.mark.parametrize("side", ["local", "remote"])
def test_a_run_past_its_region_is_refused(side):
    rows = np.array([[0, 0, 8], [0, 8, 8]])
    sizes_short = [12]
    lsz, rsz = (sizes_short, [64]) if side == "local" else ([64], sizes_short)
    with pytest.raises(PlanError) as ei:
        merge_runs(rows, rows, lsz, rsz, "remote")
    assert ei.value.field == f"{side} run"
    assert (ei.value.values["value"], ei.value.values["expected"]) == (16, 12)


def test_unequal_pair_lengths_are_refused():
    with pytest.raises(PlanError) as ei:
        merge_runs(np.array([[0, 0, 8]]), np.array([[0, 0, 4]]), [64], [64], "remote")
    assert ei.value.field == "descriptor length"


def test_the_posting_path_is_a_checked_config_field():
    from kvgeom_nixl.config import TransportConfig

    assert TransportConfig().kvgeom_post == "initialize"
    assert TransportConfig.from_env({"KVGEOM_NIXL_KVGEOM_POST": "prep"}).kvgeom_post == "prep"
    with pytest.raises(ValueError, match="kvgeom_post"):
        TransportConfig(kvgeom_post="runs")


def test_addressed_rows_are_nixl_descriptors_at_each_regions_base() -> None:
    rows = np.array([[1, 8, 16], [0, 0, 4]], dtype=np.int64)
    out = addressed(rows, [1000, 5000], 3)
    assert out.dtype == np.uint64 and out.tolist() == [[5008, 16, 3], [1000, 4, 3]]
