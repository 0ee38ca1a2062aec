"""Descriptor tables and ids of the layouts vLLM 0.33.0 added: layer-name routing, circular-buffer
(scratch) groups, a TP-replicated (PLE) state page, per-region capacities. Expected values are worked by
hand from the table order (region-major, block-minor; SSM streams after the attention regions)."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom.errors import BlockIdError, GroupMismatchError, IncompatiblePairError
from kvgeom.pair.tp import TPMapping
from kvgeom.plan.descids import compute_desc_ids, desc_segments
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
    with pytest.raises(IncompatiblePairError, match="replicated state pages"):
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
