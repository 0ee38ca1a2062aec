"""Exact tables and refusals of kvgeom.plan.dlist on small hand-derived inputs: Dlist's runs,
lookups, binding and bounds checks; EngineView's numbers; local, remote and routed tables."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvgeom.errors import PlanError
from kvgeom.layout.view import EngineView
from kvgeom.plan.dlist import Dlist, check_bounds_all, local_dlist, remote_dlist, routed_tables

R = 1 << 44  # region 1's pseudo-address base


def _raises(cls, fn, *args, **kwargs):
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    assert type(info.value) is cls
    return info.value


def _view(**kw):
    base = dict(
        tp_size=1,
        tp_rank=0,
        block_size=16,
        ppl=1,
        num_blocks=3,
        block_lens=(64, 32),
        block_strides=(64, 32),
        region_is_mla=(False, False),
        ssm_region_indices=(),
        ssm_sizes=None,
        conv_offsets=None,
    )
    base.update(kw)
    return EngineView(**base)


# ---------------------------------------------------------------- Dlist


def test_dlist_from_rows():
    d = Dlist([[0, 10, 20], [1, 5, 8]], 1)
    assert d.runs.tolist() == [[10, 20, 0, 20, 1], [R + 5, 8, 0, 8, 1]]
    assert d.rows.tolist() == [[0, 10, 20], [1, 5, 8]]
    assert len(d) == 2
    assert d.num_fa == 1 and isinstance(d.num_fa, int)
    assert Dlist([[0, 10, 20]], np.int64(1)).num_fa == 1


def test_dlist_from_runs_expands_rows():
    # run 0: 3 descriptors 16 apart in region 1 from offset 100; run 1: none; run 2: 2 abutting in region 2
    d = Dlist([[R + 100, 8, 0, 16, 3], [0, 4, 0, 4, 0], [2 * R, 4, 0, 4, 2]], 3)
    assert len(d) == 5
    assert d.rows.tolist() == [[1, 100, 8], [1, 116, 8], [1, 132, 8], [2, 0, 4], [2, 4, 4]]
    assert d.pseudo_addresses().tolist() == [
        [R + 100, 8, 0],
        [R + 116, 8, 0],
        [R + 132, 8, 0],
        [2 * R, 4, 0],
        [2 * R + 4, 4, 0],
    ]


def test_dlist_empty_and_bad_shapes():
    for empty in ([], np.zeros((0, 3)), np.zeros((0, 5))):
        d = Dlist(empty, 0)
        assert len(d) == 0 and d.runs.shape == (0, 5) and d.rows.shape == (0, 3)
        assert d.take([]).shape == (0, 3)
        assert d.bind([]).shape == (0, 3)
        d.check_bounds([], "local")  # nothing to check
    err = _raises(PlanError, Dlist, [[1, 2, 3, 4]], 0)
    assert err.field == "rows" and err.values == {"value": (1, 4)}
    err = _raises(PlanError, Dlist, [1, 2, 3], 0)
    assert err.field == "rows" and err.values == {"value": (3,)}


def test_dlist_take():
    d = Dlist([[R + 100, 8, 0, 16, 3], [2 * R, 4, 0, 4, 2]], 3)
    assert d.take([4, 0, 2, 3]).tolist() == [[2, 4, 4], [1, 100, 8], [1, 132, 8], [2, 0, 4]]
    assert d.take(np.asarray([1])).tolist() == [[1, 116, 8]]
    for bad, value in (([5], 5), ([0, 7], 7), ([-1], -1)):
        err = _raises(PlanError, d.take, bad)
        assert err.field == "descriptor ids" and err.values == {"value": value, "expected": 5}
    # a zero-count run between: id 2 is in the third run
    z = Dlist([[0, 8, 0, 8, 2], [R, 4, 0, 4, 0], [2 * R + 6, 2, 0, 2, 1]], 2)
    assert z.take([2, 1]).tolist() == [[2, 6, 2], [0, 8, 8]]
    # row-backed tables answer the same
    rows = Dlist([[1, 100, 8], [1, 116, 8]], 2)
    assert rows.take([1, 0]).tolist() == [[1, 116, 8], [1, 100, 8]]


def test_dlist_take_row_backed_refuses_outside_ids():
    # regression: a table built from expanded rows answered id -1 with its last row (numpy wrap-around)
    # and id 2 of a 2-row table with a raw IndexError; both are a PlanError like the run-backed lookup
    rows = Dlist([[1, 100, 8], [1, 116, 8]], 2)
    for bad, value in (([2], 2), ([-1], -1), ([0, 5], 5)):
        err = _raises(PlanError, rows.take, bad)
        assert err.field == "descriptor ids" and err.values == {"value": value, "expected": 2}


def test_dlist_bind():
    d = Dlist([[8, 4, 0, 16, 2], [R + 2, 6, 0, 6, 1]], 2)
    assert d.bind([1000, 5000]).tolist() == [[1008, 4, 0], [1024, 4, 0], [5002, 6, 0]]
    assert d.bind([1000, 5000], device=3).tolist() == [[1008, 4, 3], [1024, 4, 3], [5002, 6, 3]]
    assert d.bind([1000, 5000]).dtype == np.uint64
    assert d.bind_strided([1000, 5000]).tolist() == [[1008, 4, 0, 16, 2], [5002, 6, 0, 6, 1]]
    assert d.bind_strided([1000, 5000], device=2).tolist() == [[1008, 4, 2, 16, 2], [5002, 6, 2, 6, 1]]
    assert d.bind_strided([1000, 5000]).dtype == np.uint64
    for fn in (d.bind, d.bind_strided):
        err = _raises(PlanError, fn, [1000])
        assert err.field == "bases" and err.values == {"value": 1}
    assert d.bind([1000, 5000, 9000]).shape == (3, 3)  # more bases than regions is fine


def test_dlist_from_pseudo():
    descs = np.asarray([[R + 8, 4, 7, 4, 2]], dtype=np.int64)
    d = Dlist.from_pseudo(descs, 2)
    assert d.runs.tolist() == [[R + 8, 4, 0, 4, 2]] and d.num_fa == 2
    assert descs.tolist() == [[R + 8, 4, 7, 4, 2]]  # the input is not modified
    d = Dlist.from_pseudo([[R + 8, 4, 7], [5, 3, 7]], 1)
    assert d.rows.tolist() == [[1, 8, 4], [0, 5, 3]] and d.num_fa == 1


def test_dlist_check_bounds():
    # 3 descriptors from 10, 30 apart, 10 long: the last ends at 10 + 60 + 10 = 80
    d = Dlist([[10, 10, 0, 30, 3]], 3)
    d.check_bounds([80], "local")
    d.check_bounds([100, 0], "local")
    err = _raises(PlanError, d.check_bounds, [79], "remote")
    assert err.field == "remote dlist[0]" and err.values == {"value": (0, 10, 10, 30, 3)}
    # the first bad run is named by its first descriptor; zero-count runs are skipped
    d = Dlist([[0, 10, 0, 10, 2], [5 * R, 1, 0, 1, 0], [R + 40, 20, 0, 20, 1]], 3)
    d.check_bounds([20, 60], "local")
    err = _raises(PlanError, d.check_bounds, [20, 59], "local")
    assert err.field == "local dlist[2]" and err.values == {"value": (1, 40, 20, 20, 1)}
    # a region past the registered ones
    err = _raises(PlanError, Dlist([[R, 1, 0, 1, 1]], 1).check_bounds, [100], "local")
    assert err.field == "local dlist[0]" and err.values == {"value": (1, 0, 1, 1, 1)}
    # a negative stride: descriptors at 90, 60, 30 are inside 100 bytes; at 10, -20 they are not
    Dlist([[90, 10, 0, -30, 3]], 3).check_bounds([100], "local")
    err = _raises(PlanError, Dlist([[10, 10, 0, -30, 2]], 2).check_bounds, [100], "local")
    assert err.field == "local dlist[0]"
    # a negative length is refused when the table is built (its runs are a layout value); a negative region
    err = _raises(PlanError, Dlist, [[0, -1, 0, 1, 1]], 1)
    assert err.field == "runs.length" and err.values == {"value": -1}
    err = _raises(PlanError, Dlist([[-1, 0, 4]], 1).check_bounds, [100], "local")
    assert err.field == "local dlist[0]" and err.values["value"][0] == -1


def test_check_bounds_all_raises_the_first_out_of_bounds_tables_own_error():
    a = Dlist([[10, 10, 0, 30, 3]], 3)  # ends at 80 in region 0
    b = Dlist([[0, 10, 0, 10, 2], [5 * R, 1, 0, 1, 0], [R + 40, 20, 0, 20, 1]], 3)  # ends at 20 / 60
    c = Dlist([[R, 1, 0, 1, 1]], 1)  # region 1
    check_bounds_all([])
    check_bounds_all([(a, [80], "local"), (b, [20, 60], "remote rank 0"), (c, [0, 1], "remote rank 1")])
    # each table against its own sizes: b's region 1 one byte short, c's region past a's only region
    for tables, field, value in (
        ([(a, [80], "local"), (b, [20, 59], "remote rank 0")], "remote rank 0 dlist[2]", (1, 40, 20, 20, 1)),
        ([(a, [80], "local"), (c, [80], "remote rank 1")], "remote rank 1 dlist[0]", (1, 0, 1, 1, 1)),
        ([(a, [79], "local"), (b, [20, 59], "remote rank 0")], "local dlist[0]", (0, 10, 10, 30, 3)),
    ):
        err = _raises(PlanError, check_bounds_all, tables)
        assert err.field == field and err.values == {"value": value}
    # a negative stride and a negative region, as checked alone
    check_bounds_all([(Dlist([[90, 10, 0, -30, 3]], 3), [100], "local")])
    err = _raises(PlanError, check_bounds_all, [(a, [80], "local"), (Dlist([[-1, 0, 4]], 1), [100], "x")])
    assert err.field == "x dlist[0]" and err.values["value"][0] == -1


# ---------------------------------------------------------------- EngineView


def test_engine_view_of_and_numbers():
    regions = [SimpleNamespace(block_len=64, block_stride=80), SimpleNamespace(block_len=32, block_stride=32)]
    geom = SimpleNamespace(
        tp_size=2,
        tp_rank=1,
        block_size=16,
        ppl=4,
        num_blocks=10,
        regions=regions,
        region_is_mla=(True, False),
        ssm_region_indices=(1,),
        ssm=None,
        scratch_region_indices=(),
        ple=None,
    )
    v = EngineView.of(geom)
    assert (v.tp_size, v.tp_rank, v.block_size, v.ppl, v.num_blocks) == (2, 1, 16, 4, 10)
    assert v.block_lens == (64, 32) and v.block_strides == (80, 32)
    assert v.region_is_mla == (True, False) and v.ssm_region_indices == (1,)
    assert v.ssm_sizes is None and v.conv_offsets is None
    assert v.bases == () and v.group_ids == () and v.transfer_groups == ()
    assert v.num_regions == 2
    assert v.logical_num_blocks == 2  # 10 // 4
    assert v.num_conv_pieces == 0
    assert v.region_bytes() == (800, 320)
    assert v.pseudo_bases() == [0, R]
    geom.ssm = SimpleNamespace(sizes=(40, 80), conv_offsets=((0, 20), (20, 20)))
    v = EngineView.of(geom)
    assert v.ssm_sizes == (40, 80) and v.conv_offsets == ((0, 20), (20, 20))
    assert v.num_conv_pieces == 2


def test_engine_view_bases_and_rescaled():
    v = _view(bases=(16, R + 8))
    assert v.pseudo_bases() == [16, R + 8]
    r = _view(block_size=20, ppl=2, num_blocks=6, block_lens=(60, 30), block_strides=(80, 40)).rescaled(5)
    assert (r.block_size, r.ppl, r.num_blocks) == (4, 10, 30)
    assert r.block_lens == (12, 6) and r.block_strides == (12, 6)


# ---------------------------------------------------------------- local_dlist


def test_local_dlist_attention():
    v = _view()  # lens (64, 32), 3 blocks
    d = local_dlist(v, 2)  # 2 sub-blocks of 32 and of 16 per block
    assert d.runs.tolist() == [[0, 32, 0, 32, 6], [R, 16, 0, 16, 6]]
    assert d.num_fa == 12 and len(d) == 12
    assert local_dlist(v).runs.tolist() == [[0, 64, 0, 64, 3], [R, 32, 0, 32, 3]]
    for bsr in (3, 0, -1):
        err = _raises(PlanError, local_dlist, v, bsr)
        assert err.field == "block_size_ratio" and err.values == {"value": bsr, "expected": (64, 32)}


def test_local_dlist_ssm():
    # 4 kernel blocks, ppl 2 -> 2 state pages 200 apart in region 1: conv (0, 20), (20, 40), state (60, 140)
    v = _view(
        ppl=2,
        num_blocks=4,
        block_lens=(100, 100),
        block_strides=(100, 100),
        ssm_region_indices=(1,),
        ssm_sizes=(60, 140),
        conv_offsets=((0, 20), (20, 40)),
    )
    d = local_dlist(v)
    assert d.runs.tolist() == [
        [0, 100, 0, 100, 4],
        [R, 100, 0, 100, 4],
        [R, 20, 0, 200, 2],
        [R + 20, 40, 0, 200, 2],
        [R + 60, 140, 0, 200, 2],
    ]
    assert d.num_fa == 8 and len(d) == 14
    # streams starting inside a region move the attention rows only (SSM rows use the region bases)
    d = local_dlist(v.__class__(**{**v.__dict__, "bases": (8, R + 4)}))
    assert d.runs[:, 0].tolist() == [8, R + 4, R, R + 20, R + 60]
    # no SSM rows unless both the sizes and the conv pieces are known
    assert len(local_dlist(_view(ssm_sizes=(60, 140), ssm_region_indices=(1,)))) == 6


# ---------------------------------------------------------------- remote_dlist


def test_remote_dlist_attention():
    local = _view(region_is_mla=(False, True))  # lens (64, 32)
    remote = _view(block_strides=(128, 32), block_lens=(128, 32))
    # region 0 split in 2 reads at offset 1 * 64, length 32; region 1 (MLA) whole
    d = remote_dlist(local, remote, 1, 2, 1, None)
    assert d.runs.tolist() == [[64, 32, 0, 128, 3], [R, 32, 0, 32, 3]]
    assert d.num_fa == 6
    # 0 reads mean 1: region 0 whole at offset 0
    assert remote_dlist(local, remote, 1, 0, 0, None).runs.tolist()[0] == [0, 64, 0, 128, 3]
    # a draft (2 reads, factor 1) for the non-MLA regions overrides 4 reads at factor 3
    assert remote_dlist(local, remote, 1, 4, 3, None).runs.tolist()[0] == [192, 16, 0, 128, 3]
    assert remote_dlist(local, remote, 1, 4, 3, None, draft=(2, 1)).runs.tolist()[0] == [64, 32, 0, 128, 3]
    assert remote_dlist(local, remote, 1, 4, 3, None, draft=(0, 0)).runs.tolist()[0] == [0, 64, 0, 128, 3]
    # the remote's stream bases place its rows
    shifted = remote.__class__(**{**remote.__dict__, "bases": (16, R + 8)})
    assert remote_dlist(local, shifted, 1, 2, 1, None).runs[:, 0].tolist() == [80, R + 8]
    err = _raises(PlanError, remote_dlist, local, _view(block_lens=(64,), block_strides=(64,)), 1, 1, 0, None)
    assert err.field == "num_regions" and err.values == {"local": 2, "remote": 1}


def test_remote_dlist_ssm_pieces():
    local = _view(ssm_region_indices=(1,))
    # remote: ppl 2, 4 kernel blocks -> 2 state pages 32 * 2 apart; the remote's own SSM list is not used
    remote = _view(ppl=2, num_blocks=4, ssm_region_indices=(0,), bases=(16, R + 8))
    d = remote_dlist(local, remote, 1, 1, 0, [(10, 20), (50, 30)])
    assert d.runs.tolist()[2:] == [[R + 10, 20, 0, 64, 2], [R + 50, 30, 0, 64, 2]]
    assert d.num_fa == 8 and len(d) == 12
    assert len(remote_dlist(local, remote, 1, 1, 0, [])) == 8


# ---------------------------------------------------------------- routed_tables


def test_routed_tables_attention():
    local = _view(num_blocks=2, block_lens=(64,), block_strides=(64,), region_is_mla=(False,))
    remote = _view(num_blocks=4, block_lens=(32,), block_strides=(32,), region_is_mla=(False,))
    lt, rt = routed_tables(local, remote, 1, 1, [(16, 0, 16)], None)
    assert lt.runs.tolist() == [[16, 16, 0, 64, 2]] and lt.num_fa == 2
    assert rt.runs.tolist() == [[0, 16, 0, 32, 4]] and rt.num_fa == 4
    # 2 local rows per kernel block: 2 sub-blocks of 32 at 32 apart, each cut to (16, 16)
    lt, rt = routed_tables(local, remote, 2, 1, [(16, 4, 16)], None)
    assert lt.runs.tolist() == [[16, 16, 0, 32, 4]] and lt.num_fa == 4
    assert rt.runs.tolist() == [[4, 16, 0, 32, 4]]
    lt, rt = routed_tables(local, remote, 1, 2, [(0, 0, 8)], None)
    assert rt.runs.tolist() == [[0, 8, 0, 16, 8]] and rt.num_fa == 8
    # two regions: each its own cut
    local2 = _view(num_blocks=2, block_lens=(64, 32), block_strides=(64, 32))
    remote2 = _view(num_blocks=2, block_lens=(64, 32), block_strides=(64, 32), bases=(8, R))
    lt, rt = routed_tables(local2, remote2, 1, 1, [(0, 8, 16), (4, 0, 8)], None)
    assert lt.runs.tolist() == [[0, 16, 0, 64, 2], [R + 4, 8, 0, 32, 2]]
    assert rt.runs.tolist() == [[16, 16, 0, 64, 2], [R, 8, 0, 32, 2]]


def _ssm_pair(**remote_kw):
    local = _view(
        ppl=2,
        num_blocks=4,
        block_lens=(64, 64),
        block_strides=(64, 64),
        ssm_region_indices=(1,),
        ssm_sizes=(40, 80),
        conv_offsets=((0, 40),),
    )
    remote = _view(
        ppl=4,
        num_blocks=8,
        block_lens=(32, 32),
        block_strides=(32, 32),
        ssm_region_indices=(1,),
        ssm_sizes=(20, 40),
        conv_offsets=((0, 20),),
    )
    return local, remote.__class__(**{**remote.__dict__, **remote_kw})


FA2 = [(0, 0, 32), (0, 0, 32)]


def test_routed_tables_ssm_slices():
    local, remote = _ssm_pair()
    # local pages 64 * 2 = 128 apart, 4 // 2 = 2 of them; remote 32 * 4 = 128 apart, 8 // 4 = 2
    lt, rt = routed_tables(local, remote, 1, 1, FA2, [(0, 0, 20), (40, 20, 40)])
    assert lt.runs.tolist() == [
        [0, 32, 0, 64, 4],
        [R, 32, 0, 64, 4],
        [R, 20, 0, 128, 2],
        [R + 40, 40, 0, 128, 2],
    ]
    assert rt.runs.tolist() == [
        [0, 32, 0, 32, 8],
        [R, 32, 0, 32, 8],
        [R, 20, 0, 128, 2],
        [R + 20, 40, 0, 128, 2],
    ]
    assert lt.num_fa == 8 and rt.num_fa == 16


def test_routed_tables_ssm_whole_pieces():
    # no state sent: each side's whole pieces (conv pieces then the temporal state)
    local, remote = _ssm_pair()
    lt, rt = routed_tables(local, remote, 1, 1, FA2, None)
    assert lt.runs.tolist()[2:] == [[R, 40, 0, 128, 2], [R + 40, 80, 0, 128, 2]]
    assert rt.runs.tolist()[2:] == [[R, 20, 0, 128, 2], [R + 20, 40, 0, 128, 2]]
    # a remote without conv pieces borrows the local ones
    local, remote = _ssm_pair(conv_offsets=None)
    lt, rt = routed_tables(local, remote, 1, 1, FA2, None)
    assert rt.runs.tolist()[2:] == [[R, 40, 0, 128, 2], [R + 20, 40, 0, 128, 2]]
    # no SSM rows when the remote has no state sizes, or the local no conv pieces
    local, remote = _ssm_pair(ssm_sizes=None)
    assert [len(t) for t in routed_tables(local, remote, 1, 1, FA2, None)] == [8, 16]
    local, remote = _ssm_pair()
    local = local.__class__(**{**local.__dict__, "conv_offsets": None})
    assert [len(t) for t in routed_tables(local, remote, 1, 1, FA2, None)] == [8, 16]
    local = local.__class__(**{**local.__dict__, "conv_offsets": ((0, 40),), "ssm_sizes": None})
    assert [len(t) for t in routed_tables(local, remote, 1, 1, FA2, None)] == [8, 16]


def test_dlist_rows_refuse_offsets_outside_the_offset_bits():
    # regression: an offset of 2**44 or a negative one ran into the region bits (a descriptor of another
    # region, or of a negative one) while the kept rows still showed the given offset
    assert Dlist([[0, R - 1, 4]], 1).runs.tolist() == [[R - 1, 4, 0, 4, 1]]
    assert Dlist([[2, 0, 4]], 1).take([0]).tolist() == [[2, 0, 4]]
    for bad, value in (([[0, R, 4]], (R, R)), ([[1, -1, 4], [1, 3, 4]], (-1, 3))):
        err = _raises(PlanError, Dlist, bad, 1)
        assert err.field == "rows" and err.values == {"value": value}


def test_dlist_unique_rows_fill_every_run_column():
    d = Dlist([[3, 7, 11], [5, 13, 17]], 2)
    assert d.runs.tolist() == [[3 * R + 7, 11, 0, 11, 1], [5 * R + 13, 17, 0, 17, 1]]


def test_dlist_empty_tables_of_any_width():
    # an empty table of any shape is an empty strided table
    for empty in (np.zeros((0, 4)), np.zeros((0, 6)), np.zeros((0, 3, 0))):
        d = Dlist(empty, 0)
        assert d.runs.shape == (0, 5) and len(d) == 0


def test_dlist_take_and_bind_dtypes_and_large_bases():
    d = Dlist([[R + 100, 8, 0, 16, 3]], 3)
    assert d.take([1]).dtype == np.int64
    # bases above 2**53 stay exact (uint64 arithmetic, no float)
    big = 2**60 + 1
    d = Dlist([[0, 3, 4], [1, 5, 6]], 2)
    assert d.bind([big, big + 2]).tolist() == [[big + 3, 4, 0], [big + 7, 6, 0]]
    assert d.bind_strided([big, big + 2]).tolist() == [[big + 3, 4, 0, 4, 1], [big + 7, 6, 0, 6, 1]]


def test_check_bounds_zero_length_and_far_negative_region():
    Dlist([[0, 0, 0, 0, 1]], 1).check_bounds([0], "local")  # a zero-length descriptor at 0 fits
    Dlist([[0, 100, 0]], 1).check_bounds([100], "local")  # ... also at the region's end
    err = _raises(PlanError, Dlist([[-5, 0, 4]], 1).check_bounds, [100], "local")
    assert err.field == "local dlist[0]" and err.values["value"][0] == -5


def test_rescaled_numbers_are_ints():
    r = _view(block_size=20, block_lens=(60, 30), block_strides=(80, 40)).rescaled(5)
    assert all(
        isinstance(x, int) for x in (r.block_size, r.ppl, r.num_blocks, *r.block_lens, *r.block_strides)
    )


def test_routed_tables_cut_lengths_like_vllm():
    # 10-byte pages in 4 rows per block: 10 // 4 = 2-byte rows; stride 10 != 4 * 2, so one run per block
    local = _view(num_blocks=2, block_lens=(10,), block_strides=(10,), region_is_mla=(False,))
    lt, _ = routed_tables(local, local, 4, 1, [(0, 0, 2)], None)
    assert lt.runs.tolist() == [[0, 2, 0, 2, 4], [10, 2, 0, 2, 4]]


def test_routed_tables_without_regions_or_ssm_regions():
    none = _view(num_blocks=2, block_lens=(), block_strides=(), region_is_mla=())
    lt, rt = routed_tables(none, none, 1, 1, [], None)
    assert lt.runs.shape == (0, 5) and rt.runs.shape == (0, 5) and lt.num_fa == 0
    # SSM sizes but no SSM region: no state rows on either side
    local, remote = _ssm_pair()
    local = local.__class__(**{**local.__dict__, "ssm_region_indices": ()})
    lt, rt = routed_tables(local, remote, 1, 1, FA2, None)
    assert lt.runs.tolist() == [[0, 32, 0, 64, 4], [R, 32, 0, 64, 4]]
    assert rt.runs.tolist() == [[0, 32, 0, 32, 8], [R, 32, 0, 32, 8]]
    assert lt.runs.dtype == np.int64


def test_routed_tables_exact_for_high_regions():
    # region 512's pseudo-address 512 << 44 = 2**53: an odd offset there is no float64, so any float
    # step on the way would round it; 513 regions of one 64-byte block, each cut to (1, 1, 8)
    n = 513
    local = _view(num_blocks=1, block_lens=(64,) * n, block_strides=(64,) * n, region_is_mla=(False,) * n)
    lt, rt = routed_tables(local, local, 1, 1, [(1, 1, 8)] * n, None)
    assert lt.runs[-1].tolist() == [512 * R + 1, 8, 0, 64, 1]
    assert rt.runs[-1].tolist() == [512 * R + 1, 8, 0, 64, 1]
    # the same with state sizes but no state region
    ssm = local.__class__(**{**local.__dict__, "ssm_sizes": (8, 8), "conv_offsets": ((0, 8),)})
    lt, rt = routed_tables(ssm, ssm, 1, 1, [(1, 1, 8)] * n, None)
    assert lt.runs[-1].tolist() == [512 * R + 1, 8, 0, 64, 1] and len(lt) == n
    # slices given as unsigned numpy numbers
    u = np.uint64
    lt, _ = routed_tables(local, local, 1, 1, [(u(1), u(1), u(8))] * n, None)
    assert lt.runs[-1].tolist() == [512 * R + 1, 8, 0, 64, 1]


def _dirty_small_buffers():
    """Leave numpy's cache of small freed buffers holding -7s, so that an array allocated next and not
    fully written shows it (a row column left unset)."""
    dirty = [np.full(n, -7, dtype=np.int64) for n in (10, 10, 10, 10, 15, 15, 15, 15) for _ in range(2)]
    del dirty


def test_dlist_from_rows_sets_the_device_column():
    _dirty_small_buffers()
    d = Dlist([[3, 7, 11], [5, 13, 17]], 2)
    assert d.runs[:, 2].tolist() == [0, 0]


def test_routed_state_rows_set_the_device_column():
    local, remote = _ssm_pair()
    _dirty_small_buffers()
    lt, rt = routed_tables(local, remote, 1, 1, FA2, [(0, 0, 20), (40, 20, 40)])
    assert lt.runs[:, 2].tolist() == [0, 0, 0, 0] and rt.runs[:, 2].tolist() == [0, 0, 0, 0]


def test_routed_state_rows_exact_for_high_regions():
    # state of region 512 with a conv piece at offset 1: 512 << 44 | 1 is no float64
    n = 513
    v = _view(
        num_blocks=1,
        block_lens=(64,) * n,
        block_strides=(64,) * n,
        region_is_mla=(False,) * n,
        ssm_region_indices=(512,),
        ssm_sizes=(8, 8),
        conv_offsets=((1, 7),),
    )
    lt, rt = routed_tables(v, v, 1, 1, [(0, 0, 64)] * n, None)
    assert lt.runs[-2:].tolist() == [[512 * R + 1, 7, 0, 64, 1], [512 * R + 8, 8, 0, 64, 1]]
