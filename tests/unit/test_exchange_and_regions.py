"""What a request exchanges (kvgeom.plan.exchange), region-mapped pulls (kvgeom.plan.regionmap) and layer-name
routing / packed rows (kvgeom.pair.layerroute): examples worked by hand, including vLLM 0.33.0's documented
ones."""

from __future__ import annotations

import math

import pytest

from kvgeom.errors import GroupMismatchError, IncompatiblePairError, PlanError, UnsupportedError
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
from kvgeom.plan.exchange import (
    clip_ssm_state_blocks,
    exchange_clipped_blocks,
    prefill_backoff,
    prefill_tokens,
    sliding_window_blocks,
)
from kvgeom.plan.regionmap import (
    apply_prefix_caching_by_region,
    block_ids_by_region,
    region_zero_ids,
    region_zero_rows,
)


def lists(groups: list) -> list:
    return [g.tolist() for g in groups]


def test_ssm_lists_keep_the_running_state_only() -> None:
    assert clip_ssm_state_blocks([0, 0, 7, 8, 9], 2).tolist() == [7]  # placeholders, state, 2 scratch slots
    assert clip_ssm_state_blocks([0, 6, 7, 8, 9], 2).tolist() == [7]  # the previous state is dropped too
    assert clip_ssm_state_blocks([5], 2).tolist() == [5]  # scratch slots not allocated yet
    assert clip_ssm_state_blocks([], 2).tolist() == []
    assert lists(exchange_clipped_blocks([[1, 2, 3], [0, 0, 7, 8, 9]], [0, 0], [None, 2])) == [[1, 2, 3], [7]]
    assert lists(exchange_clipped_blocks([[1], [7, 8]], [0, 0], [None, 2], clip_ssm=False)) == [[1], [7, 8]]
    assert lists(exchange_clipped_blocks([[1, 2, 3], [7, 8, 9]], [2, 0], [None, 2])) == [[2, 3], [7]]
    assert exchange_clipped_blocks([], [0], [None]) == []
    with pytest.raises(GroupMismatchError):
        exchange_clipped_blocks([[1]], [0, 0], [None, 1])


def test_window_and_backoff() -> None:
    assert sliding_window_blocks(2048, 16) == 129 and sliding_window_blocks(0, 16) == 0
    assert sliding_window_blocks(20, 16) == 3
    assert prefill_backoff(has_mamba=True) == 1 and prefill_backoff(False) == 0
    assert prefill_backoff(False, bounded_replay=True) == 1
    assert prefill_backoff(True, num_prefill_lookahead_tokens=4) == 3
    assert prefill_tokens(17, 1) == 16 and prefill_tokens(1, 1) == 1 and prefill_tokens(10, 0) == 10


def test_regions_expand_groups() -> None:
    assert lists(block_ids_by_region([[0], [2]], [-1])) == [[0, 2]]
    assert lists(block_ids_by_region([[1, 2], [5]], [1, 0, -1])) == [[5], [1, 2], [1, 2, 5]]
    with pytest.raises(GroupMismatchError):
        block_ids_by_region([[1]], [1])


@pytest.mark.parametrize(("local_ppl", "remote_ppl"), [(1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("num_tokens", [160, 224])
@pytest.mark.parametrize("cached", [0, 1])
def test_region_pull_ignores_allocation_padding(
    local_ppl: int, remote_ppl: int, num_tokens: int, cached: int
) -> None:
    """D groups a host region (cached prefix of ``cached`` logical blocks) and an indexer region apart, P
    keeps both in one group; 64-token kernel pages; D's and P's logical blocks pad past the request."""
    pages = math.ceil(num_tokens / 64)
    local_count = math.ceil(num_tokens / (64 * local_ppl))
    remote_count = math.ceil(num_tokens / (64 * remote_ppl))
    host = [b * local_ppl + j for b in range(30 + cached, 30 + local_count) for j in range(local_ppl)]
    indexer = [b * local_ppl + j for b in range(40, 40 + local_count) for j in range(local_ppl)]
    remote = [b * remote_ppl + j for b in range(10, 10 + remote_count) for j in range(remote_ppl)]
    local_by_region = block_ids_by_region([host, indexer], [0, 1])
    remote_by_region = block_ids_by_region([remote], [0, 0])
    dec, pre = apply_prefix_caching_by_region(
        local_by_region, remote_by_region, [cached * local_ppl, 0], pages
    )
    first = 10 * remote_ppl
    assert lists(pre) == [
        list(range(first + cached * local_ppl, first + pages)),
        list(range(first, first + pages)),
    ]
    assert lists(dec) == [
        list(range((30 + cached) * local_ppl, 30 * local_ppl + pages)),
        list(range(40 * local_ppl, 40 * local_ppl + pages)),
    ]
    zero = region_zero_ids(local_by_region, [dec])
    assert lists(zero) == [
        list(range(base * local_ppl + pages, (base + local_count) * local_ppl)) for base in (30, 40)
    ]


def test_region_prefix_without_counts_end_trims() -> None:
    dec, pre = apply_prefix_caching_by_region([[5, 6], [7]], [[1, 2, 3], [4, 8]])
    assert lists(dec) == [[5, 6], [7]] and lists(pre) == [[2, 3], [8]]
    dec, pre = apply_prefix_caching_by_region([[], []], [[1], [2]])
    assert lists(dec) == [[], []] and lists(pre) == [[], []]
    with pytest.raises(PlanError):
        apply_prefix_caching_by_region([[5, 6]], [[1]])


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
    with pytest.raises(IncompatiblePairError, match="lacks"):
        align_regions_by_layer(d, ("L9",), (0,), (128,))
    with pytest.raises(IncompatiblePairError, match="packed page"):
        align_regions_by_layer(d, ("L2",), (0,), (64,))


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


def test_region_zero_rows_clear_each_page_in_its_own_region() -> None:
    rows = region_zero_rows([[3, 0], [], [2]], block_lens=[100, 50, 64], block_strides=[128, 50, 64])
    assert rows.tolist() == [[0, 384, 100], [0, 0, 100], [2, 128, 64]]
    assert region_zero_rows([], [1], [1]).shape == (0, 3)
    with pytest.raises(GroupMismatchError):
        region_zero_rows([[1], [2]], [8], [8])
