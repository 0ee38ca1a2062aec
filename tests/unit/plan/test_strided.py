"""Exact rows and refusals of kvgeom.plan.strided and kvgeom.plan.splits on small hand-derived inputs."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom.errors import GroupMismatchError, IncompatiblePairError, PlanError, RatioError, UnsupportedError
from kvgeom.pair.tp import TPMapping
from kvgeom.plan.splits import as_strided, build_local_splits, expand_strided
from kvgeom.plan.strided import (
    block_strided_rows,
    fa_local_rows,
    fa_remote_rows,
    mamba_local_rows,
    mamba_remote_rows,
    strided_starts,
)


def _raises(cls, fn, *args, **kwargs):
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    assert type(info.value) is cls
    return info.value


# ---------------------------------------------------------------- strided


def test_strided_starts():
    rows = [[0, 1, 0, 1, 2], [0, 1, 0, 1, 3], [0, 1, 0, 1, 0], [0, 1, 0, 1, 1]]
    assert strided_starts(rows).tolist() == [0, 2, 5, 5]


def test_block_strided_rows_even_and_padded():
    # stride 40 == 4 sub-blocks x 10: one run of 3 * 4 sub-blocks 10 apart
    assert block_strided_rows(1000, 10, 40, 3, 4).tolist() == [[1000, 10, 0, 10, 12]]
    # bsr 1: one run of the blocks, whatever the padding
    assert block_strided_rows(1000, 10, 48, 2, 1, device=3).tolist() == [[1000, 10, 3, 48, 2]]
    # padded block (48 != 4 * 10): one run of 4 abutting sub-blocks per block
    assert block_strided_rows(1000, 10, 48, 2, 4, device=5).tolist() == [
        [1000, 10, 5, 10, 4],
        [1048, 10, 5, 10, 4],
    ]
    err = _raises(RatioError, block_strided_rows, 0, 10, 40, 3, 0)
    assert err.field == "block_size_ratio" and err.values == {"value": 0}


def test_fa_local_rows():
    # region 0: len 20 / bsr 2 = 10, stride 20 = 2 x 10 -> (0, 10, 0, 10, 2 blocks x 2)
    # region 1: len 40 / 2 = 20, stride 40 -> (1000, 20, 0, 20, 3 x 2)
    rows = fa_local_rows([0, 1000], [20, 40], [20, 40], [2, 3], 2)
    assert rows.tolist() == [[0, 10, 0, 10, 4], [1000, 20, 0, 20, 6]]
    assert fa_local_rows([0, 1000], [20, 40], [20, 40], [2, 3], 2, region_indices=[1]).tolist() == [
        [1000, 20, 0, 20, 6]
    ]
    assert (
        fa_local_rows([0, 1000], [20, 40], [20, 40], [2, 3], 2, region_indices=[]).tolist() == rows.tolist()
    )
    # defaults: bsr 1, device 0
    assert fa_local_rows([0], [20], [32], [2]).tolist() == [[0, 20, 0, 32, 2]]
    assert fa_local_rows([0], [20], [32], [2], device=7).tolist() == [[0, 20, 7, 32, 2]]
    err = _raises(PlanError, fa_local_rows, [], [], [], [])
    assert err.field == "bases" and err.values == {"value": 0}


def test_fa_remote_rows_split_and_replicated():
    # region 0 split in 2 reads at rank offset 1: offset 1 * 32, length 32 // 2; region 1 (MLA) whole
    rows = fa_remote_rows([0, 5000], [64, 128], [4, 8], [32, 64], [False, True], 1, 2, 1)
    assert rows.tolist() == [[32, 16, 0, 64, 4], [5000, 64, 0, 128, 8]]
    # bsr 2: rkv = 32 // 2 = 16 is the length, read in 2 halves at offset 1 * 16; MLA length 64 // 2
    rows = fa_remote_rows([0, 5000], [64, 128], [4, 8], [32, 64], [False, True], 2, 2, 1, device=9)
    assert rows.tolist() == [[16, 8, 9, 64, 4], [5000, 32, 9, 128, 8]]
    # local_region_of swaps the matching local regions
    rows = fa_remote_rows(
        [0, 5000], [64, 128], [4, 8], [32, 64], [False, True], 1, 2, 1, local_region_of=[1, 0]
    )
    assert rows.tolist() == [[0, 64, 0, 64, 4], [5032, 16, 0, 128, 8]]
    # an empty local_region_of means the identity; a short local_replicated means "not replicated"
    rows = fa_remote_rows([0, 5000], [64, 128], [4, 8], [32, 64], [True], 1, 2, 1, local_region_of=[])
    assert rows.tolist() == [[0, 32, 0, 64, 4], [5064, 32, 0, 128, 8]]  # 1 * 64, 64 // 2


def test_fa_remote_rows_drafts():
    # draft region 0 reads in 4 slices at offset 3 * 32; region 1 (not a draft) uses reads 2, factor 1
    rows = fa_remote_rows(
        [0, 5000],
        [64, 128],
        [4, 8],
        [32, 64],
        [False, False],
        1,
        2,
        1,
        draft_regions=[0],
        draft_reads=4,
        draft_offset_factor=3,
    )
    assert rows.tolist() == [[96, 8, 0, 64, 4], [5064, 32, 0, 128, 8]]
    # default draft reads 1 and offset factor 0: the draft region is read whole
    rows = fa_remote_rows([0, 5000], [64, 128], [4, 8], [32, 64], [False, False], 1, 2, 1, draft_regions=[0])
    assert rows.tolist() == [[0, 32, 0, 64, 4], [5064, 32, 0, 128, 8]]
    # an MLA region is read whole even when listed as a draft
    rows = fa_remote_rows([0], [64], [4], [32], [True], 1, 2, 1, draft_regions=[0], draft_reads=4)
    assert rows.tolist() == [[0, 32, 0, 64, 4]]


def test_fa_remote_rows_refusals():
    err = _raises(PlanError, fa_remote_rows, [], [], [], [], [], 1, 1, 0)
    assert err.field == "remote_bases" and err.values == {"value": 0}
    err = _raises(
        GroupMismatchError, fa_remote_rows, [0, 1], [8, 8], [1, 1], [8], [False], 1, 1, 0, local_region_of=[0]
    )
    assert err.field == "local_region_of" and err.values == {"value": 1, "expected": 2}


def test_mamba_local_rows():
    # SSM region 1 (stride 200 x ppl 2 = 400): conv pieces (0, 30), (30, 10), then state (40, 50)
    rows = mamba_local_rows([0, 10000], [100, 200], [1], [(0, 30), (30, 10)], (40, 50), 2, 3)
    assert rows.tolist() == [[10000, 30, 0, 400, 3], [10030, 10, 0, 400, 3], [10040, 50, 0, 400, 3]]
    # no SSM region list: every region, in order
    rows = mamba_local_rows([0, 10000], [100, 200], [], [(0, 30)], (30, 50), 1, 3, device=2)
    assert rows.tolist() == [
        [0, 30, 2, 100, 3],
        [30, 50, 2, 100, 3],
        [10000, 30, 2, 200, 3],
        [10030, 50, 2, 200, 3],
    ]
    # the replicated page of region 0 last: (base, 25 x ppl 2, dev, stride 100 x 2, blocks)
    rows = mamba_local_rows([0, 10000], [100, 200], [1], [], (0, 50), 2, 3, ple_region=0, ple_block_len=25)
    assert rows.tolist() == [[10000, 50, 0, 400, 3], [0, 50, 0, 200, 3]]
    err = _raises(PlanError, mamba_local_rows, [0], [100], [0], [], (0, 50), 1, 3, ple_region=0)
    assert err.field == "ple_block_len" and err.values == {"value": None}


def test_mamba_remote_rows():
    # remote: 6 kernel blocks / ppl 2 = 3 state pages 200 x 2 = 400 apart; tp_ratio 2, local rank 3:
    # temporal slice 3 % 2 = 1 -> at 40 + 1 * 50
    rows = mamba_remote_rows([0, 10000], [100, 200], 6, 2, (40, 100), [1], [(5, 10)], 50, 2, 3)
    assert rows.tolist() == [[10005, 10, 0, 400, 3], [10090, 50, 0, 400, 3]]
    # 7 kernel blocks -> still 3 pages; tp_ratio 1: offset 0
    rows = mamba_remote_rows([0, 10000], [100, 200], 7, 2, (40, 100), [1], [], 50, 1, 3, device=4)
    assert rows.tolist() == [[10040, 50, 4, 400, 3]]
    # tp_ratio < 0: the remote's whole temporal state at its start
    rows = mamba_remote_rows([0, 10000], [100, 200], 6, 2, (40, 100), [1], [], 50, -2, 3)
    assert rows.tolist() == [[10040, 100, 0, 400, 3]]
    # no SSM region list: every remote region
    rows = mamba_remote_rows([0, 10000], [100, 200], 3, 1, (40, 100), [], [], 50, 1, 0)
    assert rows.tolist() == [[40, 50, 0, 100, 3], [10040, 50, 0, 200, 3]]


def test_mamba_remote_rows_ple():
    rows = mamba_remote_rows(
        [0, 10000],
        [100, 200],
        6,
        2,
        (40, 100),
        [1],
        [],
        50,
        1,
        0,
        ple_region=0,
        local_ple_len=60,
        remote_ple_len=60,
    )
    assert rows.tolist() == [[10040, 50, 0, 400, 3], [0, 60, 0, 200, 3]]
    for loc, rem in ((60, 70), (None, 60), (60, None)):
        err = _raises(
            IncompatiblePairError,
            mamba_remote_rows,
            [0],
            [100],
            6,
            2,
            (40, 100),
            [0],
            [],
            50,
            1,
            0,
            ple_region=0,
            local_ple_len=loc,
            remote_ple_len=rem,
        )
        assert err.field == "ple_block_len" and err.values == {"local": loc, "remote": rem}
    err = _raises(RatioError, mamba_remote_rows, [0], [100], 6, 0, (40, 100), [0], [], 50, 1, 0)
    assert err.field == "remote_ppl" and err.values == {"value": 0}


# ---------------------------------------------------------------- splits: as_strided / expand_strided


def test_as_strided():
    assert as_strided([]).shape == (0, 5)
    assert as_strided([[1, 2, 3]]).tolist() == [[1, 2, 3, 2, 1]]
    assert as_strided([[1, 2, 3, 4, 5]]).tolist() == [[1, 2, 3, 4, 5]]
    assert as_strided([[1, 0, 3, 4, 0]]).tolist() == [[1, 0, 3, 4, 0]]  # zero length and count allowed
    for bad in ([[1, 2, 3, 4]], [1, 2, 3], [[[1, 2, 3]]]):
        err = _raises(PlanError, as_strided, bad)
        assert err.field == "descs"
    for bad in ([[1, 2, 3, 4, -1]], [[1, -2, 3, 4, 1]], [[1, -2, 3]]):
        err = _raises(PlanError, as_strided, bad)
        assert err.field == "descs"


def test_expand_strided():
    rows = [[100, 8, 0, 16, 3], [7, 2, 1, 5, 0], [50, 4, 2, 4, 2]]
    assert expand_strided(rows).tolist() == [
        [100, 8, 0],
        [116, 8, 0],
        [132, 8, 0],
        [50, 4, 2],
        [54, 4, 2],
    ]
    assert expand_strided([[9, 3, 1]]).tolist() == [[9, 3, 1]]


# ---------------------------------------------------------------- splits: build_local_splits


def _mapping(groups, sources, slots):
    return TPMapping(tuple(tuple(g) for g in groups), tuple(sources), tuple(slots), 0, 1)


FA_SSM = [[0, 40, 0, 40, 2], [1000, 20, 0, 100, 3]]  # 2 FA descriptors, then 3 SSM descriptors


def test_build_local_splits_fa_by_slot_ssm_by_position():
    # FA: len 40 // 2 sources, addr += slot * 20 (slots reversed: rank 2 slot 1, rank 3 slot 0)
    # SSM: len 20 // 2, addr += p * 10 (p = position in all_source_ranks)
    m = _mapping([(2, 3), (2, 3)], (2, 3), ((2, 1), (3, 0)))
    out = build_local_splits(FA_SSM, m, 2, 1, [False, True])
    assert [x.tolist() for x in out] == [
        [[20, 20, 0, 40, 2], [1000, 10, 0, 100, 3]],
        [[0, 20, 0, 40, 2], [1010, 10, 0, 100, 3]],
    ]


def test_build_local_splits_group_order_and_split_counts():
    # the SSM group comes first: fa_splits = 2 (group 1), ssm_splits = 3 (group 0); 3-column input
    m = _mapping([(0, 1, 2), (0, 1)], (0, 1, 2), ((0, 0), (1, 1), (2, 1)))
    descs = [[0, 40, 0], [40, 40, 0], [1000, 30, 0]]
    out = build_local_splits(descs, m, 2, 1, [True, False])
    assert [x.tolist() for x in out] == [
        [[0, 20, 0, 40, 1], [40, 20, 0, 40, 1], [1000, 10, 0, 30, 1]],
        [[20, 20, 0, 40, 1], [60, 20, 0, 40, 1], [1010, 10, 0, 30, 1]],
        [[20, 20, 0, 40, 1], [60, 20, 0, 40, 1], [1020, 10, 0, 30, 1]],
    ]
    # rank 2 has no attention slot
    err = _raises(
        PlanError,
        build_local_splits,
        descs,
        _mapping([(0, 1, 2), (0, 1)], (0, 1, 2), ((0, 0),)),
        2,
        1,
        [True, False],
    )
    assert err.field == "rank"


def test_build_local_splits_one_ssm_source():
    # ssm_splits 1: SSM length unchanged but still moved by p * len (vLLM)
    m = _mapping([(0, 1), (0,)], (0, 1), ((0, 0), (1, 1)))
    out = build_local_splits(FA_SSM, m, 2, 1, [False, True])
    assert [x.tolist() for x in out] == [
        [[0, 20, 0, 40, 2], [1000, 20, 0, 100, 3]],
        [[20, 20, 0, 40, 2], [1020, 20, 0, 100, 3]],
    ]


def test_build_local_splits_boundary_and_tail():
    m = _mapping([(0, 1), (0, 1)], (0, 1), ((0, 0), (1, 1)))
    # a row straddling the FA/SSM boundary is FA as a whole: nfa 1 inside the first (2-descriptor) row
    out = build_local_splits([[0, 40, 0, 40, 2]], m, 1, 1, [False, True])
    assert out[1].tolist() == [[20, 20, 0, 40, 2]]
    # every descriptor FA (nfa == total)
    out = build_local_splits(FA_SSM, m, 5, 1, [False, True])
    assert out[1].tolist() == [[20, 20, 0, 40, 2], [1010, 10, 0, 100, 3]]  # split as FA: 20 // 2, slot 1
    # a replicated tail of 3 (the last row) is copied whole to every source
    descs = FA_SSM + [[5000, 8, 0, 8, 3]]
    out = build_local_splits(descs, m, 2, 1, [False, True], num_replicated_tail=3)
    assert out[1].tolist() == [[20, 20, 0, 40, 2], [1010, 10, 0, 100, 3], [5000, 8, 0, 8, 3]]
    # tail 6 = everything past the FA part (allowed), tail 7 overlaps FA
    out = build_local_splits(descs, m, 2, 1, [False, True], num_replicated_tail=6)
    assert out[1].tolist() == [[20, 20, 0, 40, 2], [1000, 20, 0, 100, 3], [5000, 8, 0, 8, 3]]
    err = _raises(PlanError, build_local_splits, descs, m, 2, 1, [False, True], num_replicated_tail=7)
    assert err.field == "num_replicated_tail" and err.values == {"value": 7, "expected": 6}
    err = _raises(PlanError, build_local_splits, descs, m, 2, 1, [False, True], num_replicated_tail=-1)
    assert err.field == "num_replicated_tail" and err.values == {"value": -1}


def test_build_local_splits_refusals():
    m = _mapping([(0, 1), (0, 1)], (0, 1), ((0, 0), (1, 1)))
    err = _raises(PlanError, build_local_splits, FA_SSM, m, 6, 1, [False, True])
    assert err.field == "num_fa_descs" and err.values == {"value": 6, "expected": 5}
    err = _raises(PlanError, build_local_splits, FA_SSM, m, -1, 1, [False, True])
    assert err.field == "num_fa_descs" and err.values == {"value": -1}
    err = _raises(RatioError, build_local_splits, FA_SSM, m, 2, 0, [False, True])
    assert err.field == "block_size_ratio" and err.values == {"value": 0}
    err = _raises(GroupMismatchError, build_local_splits, FA_SSM, m, 2, 1, [False])
    assert err.field == "group_is_ssm" and err.values == {"value": 1, "expected": 2}
    err = _raises(GroupMismatchError, build_local_splits, FA_SSM, m, 2, 1, [True, True])
    assert err.field == "group_is_ssm"
    err = _raises(GroupMismatchError, build_local_splits, FA_SSM, m, 2, 1, [False, False])
    assert err.field == "num_fa_descs"


def test_build_local_splits_block_size_ratio_guard():
    m = _mapping([(0, 1)], (0, 1), ((0, 0), (1, 1)))
    fa = [[0, 40, 0, 40, 2]]
    err = _raises(UnsupportedError, build_local_splits, fa, m, 2, 2, [False])
    assert err.field == "block_size_ratio" and err.values == {"value": 2}
    out = build_local_splits(fa, m, 2, 2, [False], allow_sharded_ratio=True)
    assert out[1].tolist() == [[20, 20, 0, 40, 2]]
    # one attention source: nothing head-sharded, bsr 2 is fine
    one = _mapping([(0,)], (0,), ((0, 0),))
    assert build_local_splits(fa, one, 2, 2, [False])[0].tolist() == fa
    # MLA rows are replicated: bsr 2 with 2 sources is fine (1 region of 1 block x bsr 2)
    out = build_local_splits(fa, m, 2, 2, [False], region_is_mla=[True], region_num_blocks=[1])
    assert [x.tolist() for x in out] == [fa, fa]


def test_build_local_splits_regions():
    # region 0 (1 block) MLA, region 1 (1 block) split: the first row stays whole
    m = _mapping([(0, 1)], (0, 1), ((0, 0), (1, 1)))
    fa = [[0, 40, 0, 40, 1], [100, 40, 0, 40, 1]]
    out = build_local_splits(fa, m, 2, 1, [False], region_is_mla=[True, False], region_num_blocks=[1, 1])
    assert out[1].tolist() == [[0, 40, 0, 40, 1], [120, 20, 0, 40, 1]]
    out = build_local_splits(fa, m, 2, 1, [False], region_is_mla=[False, True], region_num_blocks=[1, 1])
    assert out[1].tolist() == [[20, 20, 0, 40, 1], [100, 40, 0, 40, 1]]
    err = _raises(GroupMismatchError, build_local_splits, fa, m, 2, 1, [False], region_is_mla=[True])
    assert err.field == "region_is_mla" and err.values == {"value": 1, "expected": None}
    err = _raises(GroupMismatchError, build_local_splits, fa, m, 2, 1, [False], region_num_blocks=[1, 1])
    assert err.field == "region_is_mla" and err.values == {"value": None, "expected": 2}
    err = _raises(
        GroupMismatchError,
        build_local_splits,
        fa,
        m,
        2,
        1,
        [False],
        region_is_mla=[True],
        region_num_blocks=[1, 1],
    )
    assert err.field == "region_is_mla" and err.values == {"value": 1, "expected": 2}
    err = _raises(
        GroupMismatchError,
        build_local_splits,
        fa,
        m,
        2,
        1,
        [False],
        region_is_mla=[True, False],
        region_num_blocks=[1, 2],
    )
    assert err.field == "region_num_blocks" and err.values == {"value": 3, "expected": 2}


def test_fa_remote_rows_refuses_block_size_ratio():
    # regression: bsr 0 divided by zero (numpy warning, garbage rows), a negative bsr gave negative lengths
    for bad in (0, -1):
        err = _raises(RatioError, fa_remote_rows, [0], [64], [4], [32], [False], bad, 1, 0)
        assert err.field == "block_size_ratio" and err.values == {"value": bad}


def test_strided_dtypes():
    u = np.uint64
    assert strided_starts(np.asarray([[0, 1, 0, 1, 2], [0, 1, 0, 1, 3]], dtype=u)).dtype == np.int64
    assert block_strided_rows(1000, 10, 48, 2, 4).dtype == np.int64
    assert fa_remote_rows([0], [64], [4], [32], [False], 1, 1, 0).dtype == np.int64
    empty = mamba_local_rows([], [], [], [], (0, 0), 1, 1)
    assert empty.shape == (0, 5) and empty.dtype == np.int64
    assert as_strided(np.asarray([[1, 2, 3]], dtype=u)).dtype == np.int64


def test_lengths_not_divisible_by_bsr():
    # vLLM's integer division: 10 // 4 = 2-byte sub-blocks; stride 10 != 4 * 2, so one run per block
    assert fa_local_rows([0], [10], [10], [2], 4).tolist() == [[0, 2, 0, 2, 4], [10, 2, 0, 2, 4]]
    # remote: rkv = 10 // 4 = 2 is the length; offset 3 * 2
    assert fa_remote_rows([0], [64], [4], [10], [False], 4, 1, 3).tolist() == [[6, 2, 0, 64, 4]]


def test_build_local_splits_without_attention():
    # only SSM descriptors: nfa 0 (allowed), empty region lists are consistent with it
    m = _mapping([(0, 1)], (0, 1), ((0, 0), (1, 1)))
    ssm = [[1000, 20, 0, 100, 3]]
    out = build_local_splits(ssm, m, 0, 1, [True])
    assert out[1].tolist() == [[1010, 10, 0, 100, 3]]
    out = build_local_splits(ssm, m, 0, 1, [True], region_is_mla=[], region_num_blocks=[])
    assert out[1].tolist() == [[1010, 10, 0, 100, 3]]


def test_build_local_splits_region_flags_are_truth_values():
    # 1 / 0 flags mean MLA / not MLA
    m = _mapping([(0, 1)], (0, 1), ((0, 0), (1, 1)))
    fa = [[0, 40, 0, 40, 1], [100, 40, 0, 40, 1]]
    out = build_local_splits(fa, m, 2, 1, [False], region_is_mla=[1, 0], region_num_blocks=[1, 1])
    assert out[1].tolist() == [[0, 40, 0, 40, 1], [120, 20, 0, 40, 1]]
