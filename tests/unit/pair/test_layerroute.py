"""Exact behaviour of kvgeom.pair.layerroute on small hand-built region tables (every field, every refusal)."""

from __future__ import annotations

import pytest

from kvgeom.errors import GroupMismatchError, IncompatiblePairError, UnsupportedError
from kvgeom.pair.layerroute import (
    RegionTable,
    align_regions_by_layer,
    pp_region_offset,
    region_sort_key,
    slice_regions,
    split_packed_rows,
    transfer_layers,
)
from kvgeom.pair.rules import check_csa_linear_tp_layout


def _is(exc: pytest.ExceptionInfo, cls: type, field: str, **values: object) -> None:
    assert type(exc.value) is cls
    assert exc.value.field == field
    assert exc.value.values == values


def test_region_sort_key() -> None:
    assert region_sort_key("layers.10.attn") == ((1, "layers."), (0, 10), (1, ".attn"))
    assert region_sort_key("7") == ((1, ""), (0, 7), (1, ""))
    assert region_sort_key("abc") == ((1, "abc"),)
    names = ["layers.10", "layers.2", "layers.1a", "layers.x"]
    assert sorted(names, key=region_sort_key) == ["layers.1a", "layers.2", "layers.10", "layers.x"]


def _table(**kw: object) -> RegionTable:
    base = dict(
        bases=(100, 200, 300),
        block_lens=(10, 20, 30),
        block_strides=(11, 21, 31),
        num_blocks=(5, 6, 7),
        group_ids=(0, 1, 2),
        names=("a", "b", "c"),
        mem_types=("DRAM", "VRAM", "DRAM"),
    )
    base.update(kw)
    return RegionTable(**base)  # type: ignore[arg-type]


def test_region_table_lengths() -> None:
    t = _table()
    assert len(t) == 3
    assert t.members == () and dict(t.packed) == {}
    assert RegionTable((1, 2), (3, 4), (5, 6)).num_blocks is None
    for name in ("block_lens", "block_strides", "num_blocks", "group_ids", "names", "mem_types"):
        with pytest.raises(GroupMismatchError) as info:
            _table(**{name: (1, 2)})
        _is(info, GroupMismatchError, name, value=2, expected=3)
        with pytest.raises(GroupMismatchError) as info:
            _table(**{name: (1, 2, 3, 4)})
        _is(info, GroupMismatchError, name, value=4, expected=3)


def test_slice_regions() -> None:
    t = _table()
    s = slice_regions(t, 1, 2)
    assert s.bases == (200, 300) and s.block_lens == (20, 30) and s.block_strides == (21, 31)
    assert s.num_blocks == (6, 7) and s.group_ids == (1, 2) and s.names == ("b", "c")
    assert s.mem_types == ("VRAM", "DRAM")
    assert slice_regions(t, 0, 3) == t
    assert slice_regions(t, 3, 0).bases == ()
    assert slice_regions(RegionTable((1, 2), (3, 4), (5, 6)), 1, 1).num_blocks is None
    with pytest.raises(IncompatiblePairError) as info:
        slice_regions(t, 2, 2)
    _is(info, IncompatiblePairError, "num_regions", local=2, remote=3)
    with pytest.raises(IncompatiblePairError) as info:
        slice_regions(t, -1, 1)
    _is(info, IncompatiblePairError, "num_regions", local=1, remote=3)


def test_pp_region_offset() -> None:
    # 8 regions over layers [2, 6): 2 regions per layer, first at 2 * 2 = 4
    assert pp_region_offset(8, 2, 6) == 4
    assert type(pp_region_offset(8, 2, 6)) is int  # an index: slice_regions takes a range from it
    assert pp_region_offset(3, 0, 3) == 0
    assert pp_region_offset(6, 5, 8) == 10  # 2 per layer * 5
    assert pp_region_offset(4, 3, 4) == 12  # one layer: 4 regions per layer * 3
    for n, s, e in [(4, 2, 2), (4, 3, 2), (5, 0, 2)]:
        with pytest.raises(GroupMismatchError) as info:
            pp_region_offset(n, s, e)
        _is(info, GroupMismatchError, "num_regions", value=n, expected=e - s)


def test_transfer_layers() -> None:
    names, regions, groups = transfer_layers([["x", "y"], [], ["z"]], {"x": 0, "y": 1, "z": 2})
    assert names == ("x", "y", "z") and regions == (0, 0, 2) and groups == (0, 1, 2)
    assert transfer_layers([], {}) == ((), (), ())
    with pytest.raises(GroupMismatchError) as info:
        transfer_layers([["x", "y"], ["y", "x", "w"]], {"x": 0, "y": 0, "w": 0})
    _is(info, GroupMismatchError, "region_members", value=["x", "y"])
    with pytest.raises(GroupMismatchError) as info:
        transfer_layers([["x", "q"], ["p"]], {"x": 0})
    _is(info, GroupMismatchError, "region_members", value=["q", "p"])


def _remote(**kw: object) -> RegionTable:
    base = dict(
        bases=(1000, 2000),
        block_lens=(64, 16),
        block_strides=(640, 160),
        num_blocks=(9, 9),
        group_ids=(0, 1),
        names=("row", "solo"),
        members=(("l0", "l1"), ("l2",)),
        packed={"l0": (0, 32), "l1": (32, 32)},
    )
    base.update(kw)
    return RegionTable(**base)  # type: ignore[arg-type]


def test_align_regions_by_layer() -> None:
    # local transfer layers l1, l2, l0 in local regions 0, 1, 0 with pages 32 and 16
    out = align_regions_by_layer(_remote(), ["l1", "l2", "l0"], [0, 1, 0], [32, 16])
    # l1 -> packed row 0 at +32, page 32; l2 -> region 1 whole; l0 -> row 0 at +0, page 32
    assert out.bases == (1032, 2000, 1000)
    assert out.block_lens == (32, 16, 32)
    assert out.block_strides == (640, 160, 640)
    assert out.num_blocks == (9, 9, 9)
    assert out.group_ids == (0, 1, 0)
    assert out.names == ("l1", "l2", "l0")
    assert out.members == (("l1",), ("l2",), ("l0",))
    assert dict(out.packed) == {}
    # no names advertised: none in the result
    assert align_regions_by_layer(_remote(names=None), ["l2"], [0], [16]).names is None
    # a page ending exactly at the row's end is inside it
    ok = align_regions_by_layer(_remote(packed={"l0": (0, 32), "l1": (32, 32)}), ["l1"], [0], [32])
    assert ok.bases == (1032,) and ok.block_lens == (32,)


def test_align_regions_by_layer_refusals() -> None:
    with pytest.raises(IncompatiblePairError) as info:
        align_regions_by_layer(_remote(members=()), ["l0"], [0], [32])
    _is(info, IncompatiblePairError, "region_members", value=None)
    with pytest.raises(IncompatiblePairError) as info:
        align_regions_by_layer(_remote(members=(("l0",),)), ["l0"], [0], [32])
    _is(info, IncompatiblePairError, "region_members", local=2, remote=1)
    with pytest.raises(IncompatiblePairError) as info:
        align_regions_by_layer(_remote(members=(("l0", "l1"), ("l1",))), ["l0"], [0], [32])
    _is(info, IncompatiblePairError, "region_members", value="l1")
    with pytest.raises(IncompatiblePairError) as info:
        align_regions_by_layer(_remote(), ["l0", "l9", "l8"], [0, 0, 0], [32])
    _is(info, IncompatiblePairError, "region_members", value=["l9", "l8"])
    # a layer of a packed row without a layout
    with pytest.raises(IncompatiblePairError) as info:
        align_regions_by_layer(_remote(packed={"l0": (0, 32)}), ["l1"], [0], [32])
    _is(info, IncompatiblePairError, "packed_member_layouts", value="l1")
    # pages escaping the row: past its end, at a negative offset, empty
    for layout in [(40, 32), (-1, 32), (64, 0), (10, 0)]:
        with pytest.raises(IncompatiblePairError) as info:
            align_regions_by_layer(_remote(packed={"l0": layout, "l1": (32, 32)}), ["l0"], [0], [32])
        _is(info, IncompatiblePairError, "packed_member_layouts", value=layout)
    # a page of another size than the local region's
    with pytest.raises(IncompatiblePairError) as info:
        align_regions_by_layer(_remote(), ["l2", "l0"], [1, 0], [24, 16])
    _is(info, IncompatiblePairError, "packed_member_layouts", local=24, remote=32)


def _packed_remote(**kw: object) -> RegionTable:
    base = dict(
        bases=(5000, 6000),
        block_lens=(96, 8),
        block_strides=(960, 80),
        num_blocks=(4, 4),
        group_ids=(0, 1),
        names=("a", "idx"),  # the row is named after its first layer
        packed={"a": (0, 32), "b": (32, 64)},
    )
    base.update(kw)
    return RegionTable(**base)  # type: ignore[arg-type]


def test_split_packed_rows() -> None:
    out = split_packed_rows(_packed_remote(), ["b", "idx", "a"])
    # b: row + 32, page 64; idx: its own region; a: row + 0, page 32
    assert out.bases == (5032, 6000, 5000)
    assert out.block_lens == (64, 8, 32)
    assert out.block_strides == (960, 80, 960)
    assert out.num_blocks == (4, 4, 4)
    assert out.group_ids == (0, 1, 0)
    assert out.names == ("b", "idx", "a")
    assert dict(out.packed) == {}
    # no group ids advertised: fine
    assert split_packed_rows(_packed_remote(group_ids=None), ["a"]).bases == (5000,)


def test_split_packed_rows_refusals() -> None:
    with pytest.raises(IncompatiblePairError) as info:
        split_packed_rows(_packed_remote(names=None), ["a"])
    _is(info, IncompatiblePairError, "region_names", value=None)
    with pytest.raises(IncompatiblePairError) as info:
        split_packed_rows(_packed_remote(packed={}), ["a"])
    _is(info, IncompatiblePairError, "packed_member_layouts", value=0)
    with pytest.raises(IncompatiblePairError) as info:
        split_packed_rows(_packed_remote(names=("a", "b"), packed={"a": (0, 8), "b": (0, 8)}), ["a"])
    _is(info, IncompatiblePairError, "packed_member_layouts", value=2)
    with pytest.raises(UnsupportedError) as info:
        split_packed_rows(_packed_remote(group_ids=(-1, 1)), ["a"])
    _is(info, UnsupportedError, "packed_member_layouts", value=0)
    with pytest.raises(UnsupportedError) as info:
        split_packed_rows(
            _packed_remote(names=("idx", "row"), packed={"row": (0, 8)}, group_ids=(0, -1)), ["row"]
        )
    _is(info, UnsupportedError, "packed_member_layouts", value=1)
    with pytest.raises(IncompatiblePairError) as info:
        split_packed_rows(_packed_remote(), ["a", "zz"])
    _is(info, IncompatiblePairError, "region_names", value="zz")


def test_natural_layer_order() -> None:
    names = ["layers.10.attn", "layers.2.attn", "layers.2.a", "embed"]
    assert sorted(names, key=region_sort_key) == ["embed", "layers.2.a", "layers.2.attn", "layers.10.attn"]


def _packed_producer() -> RegionTable:
    # one packed row of 192 B per block: L2 at 0 (128 B, also viewed by L2.swa, 64 B) and L3 at 128 (64 B)
    return RegionTable(
        bases=(1000,),
        block_lens=(192,),
        block_strides=(192,),
        num_blocks=(4,),
        group_ids=(-1,),
        names=("L2",),
        members=(("L2", "L2.swa", "L3"),),
        packed={"L2": (0, 128), "L2.swa": (0, 64), "L3": (128, 64)},
    )


def test_transfer_layers_and_name_alignment() -> None:
    names, regions, groups = transfer_layers([["L2", "L2.swa"], ["L3"]], {"L2": 0, "L2.swa": 1, "L3": 2})
    assert names == ("L2", "L2.swa", "L3") and regions == (0, 0, 1) and groups == (0, 1, 2)
    with pytest.raises(GroupMismatchError):
        transfer_layers([["L2"], ["L2"]], {"L2": 0})
    # D (PP 1) packs four layers in a 256-byte row; the P stage owns L2, L2.swa and L3.
    d = RegionTable(
        bases=(5000,),
        block_lens=(256,),
        block_strides=(256,),
        num_blocks=(6,),
        group_ids=(-1,),
        names=("L0",),
        members=(("L0", "L2", "L2.swa", "L3"),),
        packed={"L0": (0, 128), "L2": (128, 128), "L2.swa": (0, 64), "L3": (64, 64)},
    )
    aligned = align_regions_by_layer(d, names, (0, 1, 2), (128, 64, 64))
    assert aligned.bases == (5128, 5000, 5064) and aligned.block_lens == (128, 64, 64)
    assert aligned.block_strides == (256,) * 3 and aligned.num_blocks == (6,) * 3
    assert aligned.names == names and aligned.members == (("L2",), ("L2.swa",), ("L3",))
    assert align_regions_by_layer(aligned, names, (0, 1, 2), (128, 64, 64)) == aligned  # a second pass: no-op
    with pytest.raises(IncompatiblePairError) as exc:
        align_regions_by_layer(d, ("L9",), (0,), (128,))
    assert exc.value.field == "region_members" and exc.value.values == {"value": ["L9"]}
    with pytest.raises(IncompatiblePairError) as exc:
        align_regions_by_layer(d, ("L2",), (0,), (64,))
    assert exc.value.field == "packed_member_layouts" and exc.value.values == {"local": 64, "remote": 128}


def test_packed_row_read_by_per_layer_regions() -> None:
    row = RegionTable(
        bases=(1000,),
        block_lens=(192,),
        block_strides=(192,),
        group_ids=(0,),
        names=("L0",),
        packed={"L0": (64, 128)},
    )
    split = split_packed_rows(row, ["L0"])
    assert split.bases == (1064,) and split.block_lens == (128,) and split.block_strides == (192,)
    assert split.names == ("L0",) and not split.packed
    with pytest.raises(UnsupportedError):
        split_packed_rows(_packed_producer(), ["L2"])


def test_pp_window_without_routing() -> None:
    table = RegionTable(bases=tuple(range(0, 800, 100)), block_lens=(10,) * 8, block_strides=(10,) * 8)
    start = pp_region_offset(4, 2, 4)  # a stage with layers 2, 3 and 4 regions: 2 per layer
    assert start == 4 and slice_regions(table, start, 4).bases == (400, 500, 600, 700)
    with pytest.raises(IncompatiblePairError):
        slice_regions(table, 6, 4)


@pytest.mark.parametrize(
    ("heads", "local_tp", "remote_tp", "ok"),
    [
        (2, 1, 2, False),
        (2, 2, 1, False),
        (2, 1, 1, True),
        (2, 2, 4, True),
        (2, 4, 2, True),
        (4, 2, 4, False),
        (4, 2, 2, True),
        (4, 4, 8, True),
    ],
)
def test_csa_linear_pairs_stay_on_one_side_of_the_head_boundary(
    heads: int, local_tp: int, remote_tp: int, ok: bool
) -> None:
    """Below the KV head count a page holds several heads, at or above it one: whole-block CSA-linear pages
    only pair when both TP sizes are on the same side."""
    if ok:
        check_csa_linear_tp_layout(local_tp, remote_tp, heads)
    else:
        with pytest.raises(IncompatiblePairError) as info:
            check_csa_linear_tp_layout(local_tp, remote_tp, heads)
        assert info.value.values == {"local": local_tp, "remote": remote_tp}
