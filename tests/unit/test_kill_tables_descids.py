"""Exact segment tables, descriptor ids and refusals of kvgeom.plan.descids on small hand-derived inputs
(issue 12): every path of desc_segments, every capacity boundary, every error field."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom.errors import BlockIdError, GroupMismatchError, RatioError
from kvgeom.layout.view import SHARED_GROUP
from kvgeom.plan.descids import Segments, apply_segments, compute_desc_ids, desc_segments, segment_ids


def _raises(cls, fn, *args, **kwargs):
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    assert type(info.value) is cls
    return info.value


def _table(seg):
    return [seg.offset.tolist(), seg.group.tolist(), seg.capacity.tolist()]


def _ids(*groups):
    return [np.asarray(g, dtype=np.int64) for g in groups]


# ---------------------------------------------------------------- path 1: layer-name routing


def test_routed_segments_and_ids():
    # transfer layers of groups (0, 1, 0), 4 blocks each: offsets 0, 4, 8
    seg = desc_segments(2, 4, 99, None, 1, [False, False], transfer_layer_group_ids=[0, 1, 0])
    assert _table(seg) == [[0, 4, 8], [0, 1, 0], [4, 4, 4]]
    assert seg.grid is None
    got = compute_desc_ids([[1], [2]], 4, 99, None, 1, [False, False], transfer_layer_group_ids=[0, 1, 0])
    assert got.tolist() == [1, 6, 9]
    # per-layer capacities x bsr 2: (4, 6, 8), offsets (0, 4, 10)
    seg = desc_segments(
        2, 4, 1, 2, 1, [False, False], region_num_blocks=[2, 3, 4], transfer_layer_group_ids=[0, 1, 0]
    )
    assert _table(seg) == [[0, 4, 10], [0, 1, 0], [4, 6, 8]]


def test_routed_refusals():
    for bad in ([0, 2], [-1, 0]):
        err = _raises(
            GroupMismatchError, desc_segments, 2, 4, 1, None, 1, [False, False], transfer_layer_group_ids=bad
        )
        assert err.field == "transfer_layer_group_ids"
        assert err.values == {"value": [g for g in bad if g not in (0, 1)]}
    err = _raises(
        GroupMismatchError,
        desc_segments,
        2,
        4,
        1,
        None,
        1,
        [False, False],
        region_num_blocks=[1, 2],
        transfer_layer_group_ids=[0, 1, 0],
    )
    assert err.field == "region_num_blocks" and err.values == {"value": 2, "expected": 3}
    err = _raises(
        GroupMismatchError,
        desc_segments,
        2,
        4,
        1,
        None,
        1,
        [False, False],
        region_num_blocks=[1, -1],
        transfer_layer_group_ids=[0, 1],
    )
    assert err.field == "region_num_blocks"
    # capacity 0 is allowed (an empty layer)
    seg = desc_segments(1, 4, 1, None, 1, [False], region_num_blocks=[0, 2], transfer_layer_group_ids=[0, 0])
    assert _table(seg) == [[0, 0], [0, 0], [0, 2]]


def test_capacity_checks_in_segment_order():
    # layers of groups (1, 0): the first segment (group 1, cap 4) is the first over capacity
    kw = dict(transfer_layer_group_ids=[1, 0])
    err = _raises(BlockIdError, compute_desc_ids, [[5], [6]], 4, 1, None, 1, [False, False], **kw)
    assert err.field == "block_ids[1]" and err.values == {"value": 6, "expected": 4}
    # a group's limit is its smallest segment: caps (4, 2) -> id 2 is refused at the second segment
    kw = dict(region_num_blocks=[4, 2], transfer_layer_group_ids=[0, 0])
    assert compute_desc_ids([[1]], 4, 1, None, 1, [False], **kw).tolist() == [1, 5]
    err = _raises(BlockIdError, compute_desc_ids, [[2]], 4, 1, None, 1, [False], **kw)
    assert err.field == "block_ids[0]" and err.values == {"value": 2, "expected": 2}


# ---------------------------------------------------------------- path 2: region-major grid


def test_grid_segments_and_ids():
    # 3 regions of 4 blocks, groups (0, 1) in every region
    seg = desc_segments(2, 4, 3, None, 1, [False, False])
    assert _table(seg) == [[0, 0, 4, 4, 8, 8], [0, 1, 0, 1, 0, 1], [4] * 6]
    assert seg.grid == (0, 1)
    got = compute_desc_ids([[1, 2], [3]], 4, 3, None, 1, [False, False])
    assert got.tolist() == [1, 2, 3, 5, 6, 7, 9, 10, 11]
    # bsr 2: 8 kernel blocks per region; 7 is the last id in range
    assert compute_desc_ids([[7]], 4, 2, 2, 1, [False]).tolist() == [7, 15]
    err = _raises(BlockIdError, compute_desc_ids, [[8]], 4, 2, 2, 1, [False])
    assert err.field == "block_ids[0]" and err.values == {"value": 8, "expected": 8}
    # an SSM group without SSM regions: not in the grid, and its ids are refused
    seg = desc_segments(2, 4, 2, None, 1, [False, True])
    assert _table(seg) == [[0, 4], [0, 0], [4, 4]] and seg.grid == (0,)
    assert compute_desc_ids([[1], []], 4, 2, None, 1, [False, True]).tolist() == [1, 5]
    err = _raises(GroupMismatchError, compute_desc_ids, [[1], [0]], 4, 2, None, 1, [False, True])
    assert err.field == "block_ids[1]"


def test_grid_with_capacities():
    # capacities (2, 3) x bsr 1: offsets (0, 2)
    seg = desc_segments(1, 4, 2, None, 1, [False], region_num_blocks=[2, 3])
    assert _table(seg) == [[0, 2], [0, 0], [2, 3]]
    err = _raises(GroupMismatchError, desc_segments, 1, 4, 3, None, 1, [False], region_num_blocks=[2, 3])
    assert err.field == "region_num_blocks" and err.values == {"value": 2, "expected": 3}


def test_common_refusals():
    err = _raises(GroupMismatchError, desc_segments, 1, -1, 1, None, 1, [False])
    assert err.field == "dst_num_blocks" and err.values == {"value": -1}
    assert _table(desc_segments(1, 0, 1, None, 1, [False])) == [[0], [0], [0]]
    err = _raises(RatioError, desc_segments, 1, 4, 1, 0, 1, [False])
    assert err.field == "block_size_ratio" and err.values == {"value": 0}
    err = _raises(RatioError, desc_segments, 1, 4, 1, None, 0, [False])
    assert err.field == "physical_blocks_per_logical" and err.values == {"value": 0}
    err = _raises(GroupMismatchError, desc_segments, 2, 4, 1, None, 1, [False])
    assert err.field == "group_is_ssm" and err.values == {"value": 1, "expected": 2}
    err = _raises(GroupMismatchError, desc_segments, 1, 4, 0, None, 1, [False])
    assert err.field == "num_regions" and err.values == {"value": 0}
    err = _raises(BlockIdError, compute_desc_ids, np.asarray([1, 2]), 4, 1, None, 1, [False])
    assert err.field == "block_ids"


# ---------------------------------------------------------------- path 3: region group mapping


def test_mapped_segments_and_ids():
    # regions of groups (0, 1, shared): group 0 reads regions 0 and 2, group 1 regions 1 and 2
    seg = desc_segments(2, 4, 3, None, 1, [False, False], region_group_ids=[0, 1, SHARED_GROUP])
    assert _table(seg) == [[0, 8, 4, 8], [0, 0, 1, 1], [4, 4, 4, 4]]
    assert seg.grid is None
    got = compute_desc_ids([[1], [2]], 4, 3, None, 1, [False, False], region_group_ids=[0, 1, -1])
    assert got.tolist() == [1, 9, 6, 10]
    # mapping turned off: region-major grid despite distinct group ids
    got = compute_desc_ids(
        [[1], [2]],
        4,
        3,
        None,
        1,
        [False, False],
        region_group_ids=[0, 1, -1],
        uses_region_group_mapping=False,
    )
    assert got.tolist() == [1, 2, 5, 6, 9, 10]
    # mapping forced on with one group id: group 1 has no region
    kw = dict(region_group_ids=[0, 0, 0], uses_region_group_mapping=True)
    assert compute_desc_ids([[1], []], 4, 3, None, 1, [False, False], **kw).tolist() == [1, 5, 9]
    err = _raises(GroupMismatchError, compute_desc_ids, [[1], [1]], 4, 3, None, 1, [False, False], **kw)
    assert err.field == "block_ids[1]" and err.values == {"value": 1}
    # one distinct group id and no override: the grid
    assert desc_segments(1, 4, 2, None, 1, [False], region_group_ids=[0, 0]).grid == (0,)


def test_mapped_capacities_and_refusals():
    # with group ids, the capacity count may differ from num_regions: capacities (1, 2) x bsr 2
    seg = desc_segments(2, 4, 3, 2, 1, [False, False], region_num_blocks=[1, 2], region_group_ids=[0, 1])
    assert _table(seg) == [[0, 2], [0, 1], [2, 4]]
    err = _raises(
        GroupMismatchError,
        desc_segments,
        2,
        4,
        3,
        None,
        1,
        [False, False],
        region_num_blocks=[1, 1],
        region_group_ids=[0, 1, 0],
    )
    assert err.field == "region_group_ids" and err.values == {"value": 3, "expected": 2}


# ---------------------------------------------------------------- path 4: SSM


def test_ssm_segments_and_ids():
    # 2 regions of 8 kernel blocks (nfa 16), ppl 2 -> 4 logical blocks; 2 SSM regions x (2 pieces + 1)
    seg = desc_segments(2, 8, 2, None, 2, [False, True], [0, 1], 2)
    assert _table(seg) == [[0, 8, 16, 20, 24, 28, 32, 36], [0, 0, 1, 1, 1, 1, 1, 1], [8, 8, 4, 4, 4, 4, 4, 4]]
    got = compute_desc_ids([[1], [2]], 8, 2, None, 2, [False, True], [0, 1], 2)
    assert got.tolist() == [1, 9, 18, 22, 26, 30, 34, 38]
    assert compute_desc_ids([[7], [3]], 8, 2, None, 2, [False, True], [0, 1], 2).tolist()[:3] == [7, 15, 19]
    err = _raises(BlockIdError, compute_desc_ids, [[1], [4]], 8, 2, None, 2, [False, True], [0, 1], 2)
    assert err.field == "block_ids[1]" and err.values == {"value": 4, "expected": 4}
    err = _raises(BlockIdError, compute_desc_ids, [[8], [0]], 8, 2, None, 2, [False, True], [0, 1], 2)
    assert err.field == "block_ids[0]" and err.values == {"value": 8, "expected": 8}
    # default 3 conv pieces: 1 SSM region x 4 streams after nfa 16
    seg = desc_segments(2, 8, 2, None, 2, [False, True], [1])
    assert _table(seg)[0] == [0, 8, 16, 20, 24, 28]


def test_ssm_capacities_scratch_and_ple():
    # capacities (2, 3): nfa 5; attention rows stay r * NB' (vLLM)
    seg = desc_segments(2, 8, 2, None, 2, [False, True], [0], 1, region_num_blocks=[2, 3])
    assert _table(seg) == [[0, 8, 5, 9], [0, 0, 1, 1], [8, 8, 4, 4]]
    # a scratch group reads only its regions (sorted)
    seg = desc_segments(
        3, 8, 3, None, 2, [False, False, True], [0], 1, scratch_groups=[1], scratch_region_indices=[2, 0]
    )
    assert _table(seg) == [[0, 8, 16, 0, 16, 24, 28], [0, 0, 0, 1, 1, 2, 2], [8, 8, 8, 8, 8, 4, 4]]
    # the replicated-state group takes the one stream after the SSM streams (group 0 is SSM here)
    seg = desc_segments(3, 8, 1, None, 2, [True, False, True], [0], 1, ple_group=2)
    assert _table(seg) == [[8, 12, 0, 16], [0, 0, 1, 2], [4, 4, 8, 4]]
    seg = desc_segments(2, 8, 1, None, 2, [True, False], [0], 1, ple_group=0)
    assert _table(seg) == [[16, 0], [0, 1], [4, 8]]


def test_ssm_refusals():
    for bad in ([2], [-1], [0, 0]):
        err = _raises(GroupMismatchError, desc_segments, 2, 8, 2, None, 2, [False, True], bad)
        assert err.field == "ssm_region_indices" and err.values == {"value": bad}
    err = _raises(GroupMismatchError, desc_segments, 2, 8, 2, None, 2, [False, True], [0], 0)
    assert err.field == "num_conv_pieces" and err.values == {"value": 0}
    err = _raises(
        GroupMismatchError, desc_segments, 2, 8, 2, None, 2, [False, True], [0], region_num_blocks=[1]
    )
    assert err.field == "region_num_blocks" and err.values == {"value": 1, "expected": 2}
    for bad in ([2], [-1]):
        err = _raises(
            GroupMismatchError,
            desc_segments,
            2,
            8,
            2,
            None,
            2,
            [False, True],
            [0],
            scratch_groups=[0],
            scratch_region_indices=bad,
        )
        assert err.field == "scratch_region_indices" and err.values == {"value": bad}
    # SSM ids are allowed when SSM regions are given (no refusal of the group)
    assert compute_desc_ids([[], [0]], 2, 1, None, 1, [False, True], [0], 1).tolist() == [2, 4]


# ---------------------------------------------------------------- Segments, apply_segments


def test_segments_limits_and_runs():
    seg = Segments(np.asarray([0, 4, 8, 12, 16]), np.asarray([0, 0, 1, 1, 0]), np.asarray([4, 3, 5, 6, 2]))
    assert len(seg) == 5
    assert seg.limits == {0: 2, 1: 5}
    assert seg.runs == ((0, 0, 2), (1, 2, 4), (0, 4, 5))
    empty = Segments(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert empty.runs == () and empty.limits == {} and len(empty) == 0
    # ids of the runs, in segment order
    got = apply_segments(seg, _ids([1], [0, 2]))
    assert got.tolist() == [1, 5, 8, 10, 12, 14, 17]
    # a group without ids emits nothing
    assert apply_segments(seg, _ids([1], [])).tolist() == [1, 5, 17]
    assert apply_segments(empty, _ids([])).tolist() == []


def test_apply_segments_checked():
    seg = desc_segments(1, 4, 2, None, 1, [False])
    # unchecked: id 4 is past the capacity 4
    err = _raises(BlockIdError, apply_segments, seg, _ids([4]))
    assert err.field == "block_ids[0]" and err.values == {"value": 4, "expected": 4}
    # checked: the caller bounds its ids, only missing groups are refused
    assert apply_segments(seg, _ids([4]), checked=True).tolist() == [4, 8]
    err = _raises(GroupMismatchError, apply_segments, seg, _ids([1], [2]), checked=True)
    assert err.field == "block_ids[1]" and err.values == {"value": 1}


def test_segment_ids():
    seg = desc_segments(2, 4, 2, None, 1, [False, False])
    assert segment_ids(seg, [[0], [3]], [False, False]).tolist() == [0, 3, 4, 7]
    err = _raises(GroupMismatchError, segment_ids, seg, [[0]], [False, False])
    assert err.field == "block_ids"
    err = _raises(BlockIdError, segment_ids, seg, [[0], [-1]], [False, False])
    assert err.field == "block_ids[1]"


def test_two_dimensional_inputs_are_flattened():
    # capacities and group ids given as columns read like flat lists
    seg = desc_segments(1, 4, 2, None, 1, [False], region_num_blocks=np.asarray([[2], [3]]))
    assert _table(seg) == [[0, 2], [0, 0], [2, 3]]
    kw = dict(region_group_ids=np.asarray([[0], [1], [-1]]))
    assert compute_desc_ids([[1], [2]], 4, 3, None, 1, [False, False], **kw).tolist() == [1, 9, 6, 10]
    # block ids as a 2-D array: one row per group
    assert compute_desc_ids(np.asarray([[1, 2]]), 4, 2, None, 1, [False]).tolist() == [1, 2, 5, 6]


def test_grid_capacity_refusal_names_the_field():
    err = _raises(GroupMismatchError, desc_segments, 1, 4, 2, None, 1, [False], region_num_blocks=[1, -1])
    assert err.field == "region_num_blocks"


def test_ids_are_int64():
    assert compute_desc_ids([[1, 2], [3]], 4, 3, None, 1, [False, False]).dtype == np.int64
    kw = dict(transfer_layer_group_ids=[0, 1])
    empty = compute_desc_ids([[], []], 4, 1, None, 1, [False, False], **kw)
    assert empty.dtype == np.int64 and empty.size == 0


def test_refusal_order_and_empty_groups():
    # group 1 has no region but also no ids: not an orphan; group 0's id 5 is past its capacity 4
    kw = dict(region_group_ids=[0, 0, 0], uses_region_group_mapping=True)
    err = _raises(BlockIdError, compute_desc_ids, [[5], []], 4, 3, None, 1, [False, False], **kw)
    assert err.field == "block_ids[0]" and err.values == {"value": 5, "expected": 4}
    # a capacity-0 segment of a group without ids is never "over capacity"
    kw = dict(region_num_blocks=[0, 4], transfer_layer_group_ids=[1, 0])
    err = _raises(BlockIdError, compute_desc_ids, [[5], []], 4, 1, None, 1, [False, False], **kw)
    assert err.field == "block_ids[0]" and err.values == {"value": 5, "expected": 4}
    # a flat array is refused before the configuration is looked at
    err = _raises(BlockIdError, compute_desc_ids, np.asarray([1, 2]), 4, 0, None, 1, [False])
    assert err.field == "block_ids"
    # SSM ids without SSM regions: refused by compute_desc_ids itself (no value), not as an orphan group
    err = _raises(GroupMismatchError, compute_desc_ids, [[1], [0]], 4, 2, None, 1, [False, True])
    assert err.field == "block_ids[1]" and err.values == {}
    # the wrong number of id lists
    err = _raises(GroupMismatchError, compute_desc_ids, [[1]], 4, 2, None, 1, [False, False])
    assert err.field == "block_ids" and err.values == {"value": 1, "expected": 2}


def test_compute_desc_ids_passes_every_option():
    # default 3 conv pieces: 1 SSM region x 4 streams of 4 logical blocks after nfa 16
    got = compute_desc_ids([[1], [2]], 8, 2, None, 2, [False, True], [1])
    assert got.tolist() == [1, 9, 18, 22, 26, 30]
    # scratch group 0 reads only region 1
    got = compute_desc_ids(
        [[1], [2]], 8, 2, None, 2, [False, True], [1], 1, scratch_groups=[0], scratch_region_indices=[1]
    )
    assert got.tolist() == [9, 18, 22]
    # the replicated-state group 2 reads the stream after the 2 SSM streams: 16 + 2 * 4 + 1
    got = compute_desc_ids([[0], [1], [1]], 8, 2, None, 2, [False, True, True], [1], 1, ple_group=2)
    assert got.tolist() == [0, 8, 17, 21, 25]


def test_scratch_group_without_scratch_regions():
    # a scratch group over no region has no segment; the table stays int64
    seg = desc_segments(
        2, 8, 1, None, 1, [False, True], [0], 1, scratch_groups=[0], scratch_region_indices=[]
    )
    assert _table(seg) == [[8, 16], [1, 1], [8, 8]]
    assert seg.offset.dtype == np.int64 and seg.capacity.dtype == np.int64 and seg.group.dtype == np.int64
    got = compute_desc_ids(
        [[], [3]], 8, 1, None, 1, [False, True], [0], 1, scratch_groups=[0], scratch_region_indices=[]
    )
    assert got.tolist() == [11, 19] and got.dtype == np.int64


BIG = 2**53 + 1  # not a float64: any float step on the way would round it


def test_exact_beyond_float_precision():
    # mapped path: capacities (BIG, 1) -> offsets (0, BIG)
    seg = desc_segments(2, 4, 2, None, 1, [False, False], region_num_blocks=[BIG, 1], region_group_ids=[0, 1])
    assert _table(seg) == [[0, BIG], [0, 1], [BIG, 1]]
    # SSM path: 3 * BIG kernel blocks, ppl 3 -> BIG logical blocks per stream, after nfa = 3 * BIG
    seg = desc_segments(2, 3 * BIG, 1, None, 3, [False, True], [0], 1)
    assert _table(seg) == [[0, 3 * BIG, 4 * BIG], [0, 1, 1], [3 * BIG, BIG, BIG]]
    # scratch region 1 starts at 1 * BIG
    seg = desc_segments(
        2, BIG, 2, None, 1, [False, True], [0], 1, scratch_groups=[0], scratch_region_indices=[1]
    )
    assert _table(seg)[0] == [BIG, 2 * BIG, 3 * BIG]
