"""Exact values and refusals of kvgeom.plan.regionmap on small hand-derived inputs (issue 12)."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom.errors import BlockIdError, GroupMismatchError, PlanError
from kvgeom.plan.regionmap import (
    apply_prefix_caching_by_region,
    block_ids_by_region,
    region_zero_ids,
    region_zero_rows,
)


def _raises(cls, fn, *args, **kwargs):
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    assert type(info.value) is cls
    return info.value


def _lists(arrays):
    return [np.asarray(a).tolist() for a in arrays]


def test_block_ids_by_region_own_and_shared():
    # region of group 0 -> group 0's list; group 1 -> its list; shared (-1) -> all groups in group order
    out = block_ids_by_region([[1, 2], [3]], [0, 1, -1, -1])
    assert _lists(out) == [[1, 2], [3], [1, 2, 3], [1, 2, 3]]
    assert all(a.dtype == np.int64 for a in out)
    # every list is its own copy: writing one region's list changes no other
    out[2][0] = 99
    assert out[3].tolist() == [1, 2, 3]
    twice = block_ids_by_region([[5, 6]], [0, 0])
    twice[0][0] = 99
    assert twice[1].tolist() == [5, 6]
    # no groups at all: a shared region gets an empty list
    assert _lists(block_ids_by_region([], [-1])) == [[]]


def test_block_ids_by_region_refusals():
    err = _raises(GroupMismatchError, block_ids_by_region, [[1], [2]], [0, 2])  # group 2 of 2 groups
    assert err.field == "region_group_ids[1]"
    assert err.values == {"value": 2, "expected": 2}
    err = _raises(GroupMismatchError, block_ids_by_region, [[1], [2]], [-2])
    assert err.field == "region_group_ids[0]" and err.values == {"value": -2, "expected": 2}
    assert _lists(block_ids_by_region([[1], [2]], [1])) == [[2]]  # the last group is in range
    err = _raises(BlockIdError, block_ids_by_region, [[1], [-1]], [0])
    assert err.field == "block_ids[1]"


def test_apply_prefix_caching_by_region_end_trims():
    # without page positions each region end-trims P's list to D's count
    dec, pre = apply_prefix_caching_by_region([[1, 2], [3, 4, 5], []], [[5, 6, 7], [8, 9, 10], [11]])
    assert _lists(dec) == [[1, 2], [3, 4, 5], []]
    assert _lists(pre) == [[6, 7], [8, 9, 10], []]


def test_apply_prefix_caching_by_region_nothing_on_d():
    dec, pre = apply_prefix_caching_by_region([[], []], [[1, 2], [3]])
    assert _lists(dec) == [[], []] and _lists(pre) == [[], []]
    assert dec[0] is not pre[0] and dec[0] is not dec[1]


def test_apply_prefix_caching_by_region_refusals():
    err = _raises(GroupMismatchError, apply_prefix_caching_by_region, [[1], [2]], [[1]])
    assert err.field == "prefill_ids" and err.values == {"value": 1, "expected": 2}
    err = _raises(PlanError, apply_prefix_caching_by_region, [[1], [2, 3]], [[1], [4]])
    assert err.field == "decode_ids[1]" and err.values == {"local": 2, "remote": 1}
    err = _raises(BlockIdError, apply_prefix_caching_by_region, [[1], [-2]], [[1], [4]])
    assert err.field == "decode_ids[1]"
    err = _raises(BlockIdError, apply_prefix_caching_by_region, [[1], [2]], [[1], [-4]])
    assert err.field == "prefill_ids[1]"
    err = _raises(PlanError, apply_prefix_caching_by_region, [[1]], [[1]], num_computed_blocks=[0])
    assert err.field == "num_remote_blocks" and err.values == {"value": None}
    err = _raises(
        GroupMismatchError,
        apply_prefix_caching_by_region,
        [[1]],
        [[1]],
        num_computed_blocks=[0, 0],
        num_remote_blocks=1,
    )
    assert err.field == "num_computed_blocks" and err.values == {"value": 2, "expected": 1}


def test_apply_prefix_caching_by_region_by_position():
    # no DCP: D's uncached list starts at page c, P's list at page 0.
    # region 0: c = 1, D [10, 11] are pages 1, 2; P [20, 21, 22] -> P pages 1, 2 = [21, 22]
    # region 1: c = 0, D [5] is page 0; P [7, 8] -> [7]
    dec, pre = apply_prefix_caching_by_region(
        [[10, 11], [5]], [[20, 21, 22], [7, 8]], num_computed_blocks=[1, 0], num_remote_blocks=3
    )
    assert _lists(dec) == [[10, 11], [5]]
    assert _lists(pre) == [[21, 22], [7]]
    # the remote page count cuts D's list: 2 pages exist, c = 0 -> D keeps [10, 11]
    dec, pre = apply_prefix_caching_by_region(
        [[10, 11, 12]], [[20, 21, 22]], num_computed_blocks=[0], num_remote_blocks=2
    )
    assert _lists(dec) == [[10, 11]] and _lists(pre) == [[20, 21]]


def test_apply_prefix_caching_by_region_dcp_defaults():
    # remote DCP 2, local 1, remote rank 0 by default: remote rank 0 holds even global pages 0, 2;
    # local pages 0..3 -> the even ones [10, 12] pair with P's [20, 21]
    dec, pre = apply_prefix_caching_by_region(
        [[10, 11, 12, 13]], [[20, 21]], num_computed_blocks=[0], num_remote_blocks=4, remote_dcp_size=2
    )
    assert _lists(dec) == [[10, 12]] and _lists(pre) == [[20, 21]]
    # remote rank 1 holds the odd pages 1, 3
    dec, pre = apply_prefix_caching_by_region(
        [[10, 11, 12, 13]],
        [[20, 21]],
        num_computed_blocks=[0],
        num_remote_blocks=4,
        remote_dcp_size=2,
        remote_rank=1,
    )
    assert _lists(dec) == [[11, 13]] and _lists(pre) == [[20, 21]]
    # local DCP 2 (rank 0 by default), remote 1: local pages are global 0, 2 -> P pages 0, 2
    dec, pre = apply_prefix_caching_by_region(
        [[10, 11]], [[20, 21, 22, 23]], num_computed_blocks=[0], num_remote_blocks=4, local_dcp_size=2
    )
    assert _lists(dec) == [[10, 11]] and _lists(pre) == [[20, 22]]
    # local DCP rank 1: global 1, 3 -> P pages 1, 3
    dec, pre = apply_prefix_caching_by_region(
        [[10, 11]],
        [[20, 21, 22, 23]],
        num_computed_blocks=[0],
        num_remote_blocks=4,
        local_dcp_size=2,
        local_dcp_rank=1,
    )
    assert _lists(dec) == [[10, 11]] and _lists(pre) == [[21, 23]]


def test_region_zero_ids():
    # region 0: 1 + 1 pages matched over two ranks -> zero from index 2; region 1: 1 matched
    local = [np.asarray([1, 2, 3]), np.asarray([4, 5])]
    out = region_zero_ids(local, [[np.asarray([1]), np.asarray([4])], [[2], []]])
    assert _lists(out) == [[3], [5]]
    out[0][0] = 99
    assert local[0].tolist() == [1, 2, 3]
    assert _lists(region_zero_ids([[1, 2]], [])) == [[1, 2]]  # nothing matched: all zeroed


def test_region_zero_rows():
    # page b of region r is [b * stride_r, + len_r): region 0 (len 10, stride 16), region 1 (20, 32)
    rows = region_zero_rows([[1, 3], [0, 2]], [10, 20], [16, 32])
    assert rows.tolist() == [[0, 16, 10], [0, 48, 10], [1, 0, 20], [1, 64, 20]]
    # fewer id lists than regions is allowed
    assert region_zero_rows([[2]], [10, 20], [16, 32]).tolist() == [[0, 32, 10]]
    assert region_zero_rows([], [10], [16]).shape == (0, 3)


def test_region_zero_rows_refusals():
    err = _raises(GroupMismatchError, region_zero_rows, [[1], [2], [3]], [10, 20], [16, 32])
    assert err.field == "block_ids_by_region" and err.values == {"value": 3, "expected": 2}
    err = _raises(GroupMismatchError, region_zero_rows, [[1]], [10, 20], [16])
    assert err.field == "block_ids_by_region" and err.values == {"value": 1, "expected": 2}
    err = _raises(BlockIdError, region_zero_rows, [[1], [-1]], [10, 20], [16, 32])
    assert err.field == "block_ids_by_region[1]"


def test_regionmap_dtypes():
    # every list is int64, also empty ones and ones from narrower or unsigned inputs
    dec, pre = apply_prefix_caching_by_region([[]], [[1]])
    assert dec[0].dtype == np.int64 and pre[0].dtype == np.int64
    out = region_zero_ids([np.asarray([1, 2], dtype=np.int32)], [])
    assert out[0].dtype == np.int64
    u = np.uint64
    rows = region_zero_rows([[1]], np.asarray([10], dtype=u), np.asarray([16], dtype=u))
    assert rows.dtype == np.int64 and rows.tolist() == [[0, 16, 10]]
    assert region_zero_rows([[1, 2]], [10], [16]).dtype == np.int64
