"""Descriptor tables and ids of the layouts vLLM 0.33.0 added: layer-name routing, circular-buffer
(scratch) groups, a TP-replicated (PLE) state page, per-region capacities. Expected values are worked by
hand from the table order (region-major, block-minor; SSM streams after the attention regions)."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom import IncompatiblePairError, RatioError
from kvgeom.errors import BlockIdError, GroupMismatchError
from kvgeom.layout.view import SHARED_GROUP
from kvgeom.pair.tp import TPMapping
from kvgeom.plan.descids import Segments, apply_segments, compute_desc_ids, desc_segments, segment_ids
from kvgeom.plan.splits import build_local_splits, expand_strided
from kvgeom.plan.strided import (
    block_strided_rows,
    fa_local_rows,
    fa_remote_rows,
    mamba_local_rows,
    mamba_remote_rows,
)


def test_layer_name_routing_follows_the_transfer_layers() -> None:
    # Transfer layers of groups (0, 1, 0), 4 blocks each: group 0's block 1 in layers 0 and 2 (ids 1, 9),
    # group 1's block 2 in layer 1 (id 4 + 2), in layer order.
    assert compute_desc_ids(
        [[1], [2]], 4, 3, None, 1, [False, False], transfer_layer_group_ids=(0, 1, 0)
    ).tolist() == [1, 6, 9]
    # Region group mapping instead orders by group: [1, 9, 6].
    assert compute_desc_ids(
        [[1], [2]], 4, 3, None, 1, [False, False], region_group_ids=(0, 1, 0)
    ).tolist() == [1, 9, 6]
    # Routing with per-layer capacities (3, 2, 4 blocks): offsets 0, 3, 5.
    assert compute_desc_ids(
        [[2], [1]],
        4,
        3,
        None,
        1,
        [False, False],
        region_num_blocks=[3, 2, 4],
        transfer_layer_group_ids=(0, 1, 0),
    ).tolist() == [2, 4, 7]


def test_scratch_group_and_replicated_page() -> None:
    """A CSA-linear layout: 4 regions of 2 blocks; group 0 attention, group 1 a ring in regions 2, 3,
    group 2 a GDN state (3 conv pieces + temporal) in region 0, group 3 the replicated page."""
    kinds = [False, False, True, True]
    ids = compute_desc_ids(
        [[1], [0], [1], [1]],
        2,
        4,
        None,
        1,
        kinds,
        ssm_region_indices=[0],
        scratch_groups=(1,),
        scratch_region_indices=[2, 3],
        ple_group=3,
    )
    # attention: r*2 + 1; ring: regions 2, 3 -> 4, 6; SSM streams after the 8 FA descs: 8 + s*2 + 1;
    # the replicated page is stream 4: 8 + 8 + 1.
    assert ids.tolist() == [1, 3, 5, 7, 4, 6, 9, 11, 13, 15, 17]
    moved = compute_desc_ids(
        [[1], [0], [1], [1]],
        2,
        4,
        None,
        1,
        kinds,
        ssm_region_indices=[0],
        scratch_groups=(1,),
        scratch_region_indices=[0, 1],
        ple_group=3,
    )
    assert moved.tolist()[4:6] == [0, 2]
    assert compute_desc_ids(
        [[], [], [1], [1]],
        2,
        4,
        None,
        1,
        kinds,
        ssm_region_indices=[0],
        scratch_groups=(1,),
        scratch_region_indices=[2, 3],
        ple_group=3,
    ).tolist() == [9, 11, 13, 15, 17]


def test_ring_without_ssm_uses_the_shared_region() -> None:
    # paged MLA (group 0) in regions 0, 1; the ring (group 1) overlays region 1, which is shared (-1)
    assert compute_desc_ids([[1], [0]], 2, 2, None, 1, [False, False], region_group_ids=[0, -1]).tolist() == [
        1,
        3,
        2,
    ]


def test_segments_refuse_what_would_leave_a_region() -> None:
    with pytest.raises(BlockIdError):  # block 2 of a 2-block ring region
        compute_desc_ids([[1], [2]], 2, 2, None, 1, [False, False], region_group_ids=[0, -1])
    with pytest.raises(GroupMismatchError):  # group 1 has ids, no region of group 1 or shared
        compute_desc_ids(
            [[1], [0]], 2, 2, None, 1, [False, False], region_group_ids=[0, 0], uses_region_group_mapping=True
        )
    seg = desc_segments(2, 4, 3, None, 1, [False, False], transfer_layer_group_ids=(0, 1, 0))
    assert (
        seg.offset.tolist() == [0, 4, 8]
        and seg.group.tolist() == [0, 1, 0]
        and seg.capacity.tolist() == [4] * 3
    )


def test_local_rows_follow_each_region_capacity() -> None:
    rows = fa_local_rows([100, 1000], [16, 16], [16, 16], [2, 3])
    assert rows.tolist() == [[100, 16, 0, 16, 2], [1000, 16, 0, 16, 3]]
    # a padded block (stride 48 > 2 x 16) is cut per block; a dense one collapses into one run
    assert block_strided_rows(0, 16, 48, 2, 2).tolist() == [[0, 16, 0, 16, 2], [48, 16, 0, 16, 2]]
    assert block_strided_rows(0, 16, 32, 2, 2).tolist() == [[0, 16, 0, 16, 4]]
    assert expand_strided(block_strided_rows(0, 16, 48, 2, 2))[:, 0].tolist() == [0, 16, 48, 64]


def test_remote_rows_read_a_draft_region_by_its_own_heads() -> None:
    # region 0 MLA (read whole), region 1 a GQA draft read as 1 of 2 heads at slot 1, region 2 split 1 of 4
    rows = fa_remote_rows(
        [0, 1000, 2000],
        [64, 64, 64],
        [5, 5, 5],
        [64, 32, 16],
        [True, False, False],
        1,
        4,
        2,
        draft_regions=[1],
        draft_reads=2,
        draft_offset_factor=1,
    )
    assert rows.tolist() == [[0, 64, 0, 64, 5], [1032, 16, 0, 64, 5], [2032, 4, 0, 64, 5]]


def test_replicated_page_rows_and_splits() -> None:
    bases = [0x10000, 0x20000, 0x30000, 0x40000]
    attn = fa_local_rows(bases, [256] * 4, [256] * 4, [2] * 4)
    mamba = mamba_local_rows(
        bases, [256] * 4, [0], [(0, 8), (8, 8), (16, 8)], (24, 32), 1, 2, ple_region=0, ple_block_len=256
    )
    assert mamba.shape == (5, 5) and mamba[-1].tolist() == [0x10000, 256, 0, 256, 2]
    mapping = TPMapping(((0,), (0,), (0, 1), (0, 1)), (0, 1), ((0, 0), (1, 0)), 0, 1)
    splits = build_local_splits(
        np.concatenate([attn, mamba]),
        mapping,
        int(attn[:, 4].sum()),
        1,
        [False, False, True, True],
        num_replicated_tail=2,
    )
    for p, split in enumerate(splits):
        assert split[-1].tolist() == mamba[-1].tolist()  # the replicated page is never halved
        assert split[-2].tolist() == [0x10000 + 24 + p * 16, 16, 0, 256, 2]  # the temporal state is
    remote = mamba_remote_rows(
        bases,
        [256] * 4,
        2,
        1,
        (24, 32),
        [0],
        [(0, 4), (4, 4), (8, 4)],
        16,
        -2,
        0,
        ple_region=0,
        local_ple_len=256,
        remote_ple_len=256,
    )
    assert remote[-1].tolist() == [0x10000, 256, 0, 256, 2] and remote[-2].tolist() == [
        0x10000 + 24,
        32,
        0,
        256,
        2,
    ]
    with pytest.raises(IncompatiblePairError) as exc:
        mamba_remote_rows(
            bases,
            [256] * 4,
            2,
            1,
            (24, 32),
            [0],
            [],
            16,
            -2,
            0,
            ple_region=0,
            local_ple_len=256,
            remote_ple_len=128,
        )
    assert exc.value.field == "ple_block_len" and exc.value.values == {"local": 256, "remote": 128}


# Exact segment tables, descriptor ids and refusals of kvgeom.plan.descids on small hand-derived inputs
#: every path of desc_segments, every capacity boundary, every error field.


def _raises(cls, fn, *args, **kwargs):
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    assert type(info.value) is cls
    return info.value


def _table(seg):
    return [seg.offset.tolist(), seg.group.tolist(), seg.capacity.tolist()]


def _ids(*groups):
    return [np.asarray(g, dtype=np.int64) for g in groups]


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


def test_region_capacities_of_the_wrong_count_name_both_counts() -> None:
    from kvgeom import GroupMismatchError
    from kvgeom.plan.descids import desc_segments

    with pytest.raises(GroupMismatchError) as err:
        desc_segments(1, 8, 2, None, 1, [False], region_num_blocks=[8, 8, 8])
    assert err.value.field == "region_num_blocks" and err.value.values == {"value": 3, "expected": 2}


def test_desc_segments_with_the_wrong_number_of_group_kinds_names_both_counts() -> None:
    from kvgeom import GroupMismatchError
    from kvgeom.plan.descids import desc_segments

    with pytest.raises(GroupMismatchError) as err:
        desc_segments(2, 8, 2, None, 1, [False])
    assert err.value.field == "group_is_ssm" and err.value.values == {"value": 1, "expected": 2}
