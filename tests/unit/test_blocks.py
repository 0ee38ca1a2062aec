"""Exact behaviour of :mod:`kvgeom.blocks` on small hand-derived cases: the id checks' boundaries and
refusals (class, field, values), the expansions, and every branch of the prefix-caching trim."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom import ConfigError, RatioError
from kvgeom.blocks import (
    apply_prefix_caching,
    as_group_ids,
    as_ids,
    check_distinct,
    check_positive_int,
    get_mapped_blocks,
    logical_to_kernel,
    map_block_ids_for_block_size_ratio,
)
from kvgeom.errors import BlockIdError, GroupMismatchError, PlanError


def _eq(got: list[np.ndarray], want: list[list[int]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == np.int64
        assert g.tolist() == w


# check_positive_int


def test_check_positive_int_accepts_integers_at_the_minimum() -> None:
    assert check_positive_int(1, "f") == 1
    assert check_positive_int(7, "f") == 7
    got = check_positive_int(np.int64(3), "f")
    assert got == 3 and isinstance(got, int)
    assert check_positive_int(0, "f", 0) == 0
    assert check_positive_int(2, "f", minimum=2) == 2


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, "1", None])
def test_check_positive_int_refuses_non_integers(value: object) -> None:
    with pytest.raises(RatioError) as err:
        check_positive_int(value, "size")
    assert type(err.value) is RatioError
    assert err.value.field == "size" and err.value.values == {"value": value}


def test_check_positive_int_refuses_values_below_the_minimum() -> None:
    with pytest.raises(RatioError) as err:
        check_positive_int(0, "size")
    assert type(err.value) is RatioError
    assert err.value.field == "size" and err.value.values == {"value": 0}
    assert isinstance(err.value.values["value"], int)
    with pytest.raises(RatioError) as err:
        check_positive_int(np.int64(-1), "size", 0)
    assert err.value.values == {"value": -1} and isinstance(err.value.values["value"], int)
    with pytest.raises(ConfigError) as err:
        check_positive_int(1, "rank", 2, ConfigError)
    assert type(err.value) is ConfigError and err.value.field == "rank" and err.value.values == {"value": 1}
    with pytest.raises(ConfigError) as err:
        check_positive_int("x", "rank", error=ConfigError)
    assert type(err.value) is ConfigError


# as_ids


def test_as_ids_values_and_copies() -> None:
    assert as_ids([], "f").dtype == np.int64 and as_ids([], "f").size == 0
    empty = as_ids(np.zeros((0, 3), dtype=float), "f")  # empty: any shape or dtype
    assert empty.shape == (0,) and empty.dtype == np.int64
    got = as_ids(np.array([3, 0, 2], dtype=np.uint8), "f")
    assert got.dtype == np.int64 and got.tolist() == [3, 0, 2]
    src = np.array([1, 2], dtype=np.int64)
    out = as_ids(src, "f")
    out[0] = 9
    assert src.tolist() == [1, 2]  # a fresh array, never the input


@pytest.mark.parametrize("bad", [[[1]], [1.5], np.array([True, False]), np.array([[1, 2]])])
def test_as_ids_refuses_non_flat_integer_lists(bad: object) -> None:
    with pytest.raises(BlockIdError) as err:
        as_ids(bad, "ids[2]")  # type: ignore[arg-type]
    assert type(err.value) is BlockIdError
    assert err.value.field == "ids[2]" and err.value.values == {}


def test_as_ids_names_the_first_negative_id() -> None:
    with pytest.raises(BlockIdError) as err:
        as_ids([3, -1, -2], "ids")
    assert err.value.field == "ids" and err.value.values == {"value": -1}
    assert "position 1" in str(err.value)
    assert as_ids([0], "ids").tolist() == [0]  # 0 is a valid id


# as_group_ids


def test_as_group_ids_values() -> None:
    _eq(as_group_ids([[1, 2], []], [False, True], "x"), [[1, 2], []])
    _eq(as_group_ids(np.array([[1, 2]]), [False], "x"), [[1, 2]])
    obj = np.empty(2, dtype=object)
    obj[0], obj[1] = [1], [2, 3]
    _eq(as_group_ids(obj, [False, False], "x"), [[1], [2, 3]])
    _eq(as_group_ids((np.array([4]),), [False], "x"), [[4]])


def test_as_group_ids_refusals() -> None:
    with pytest.raises(BlockIdError) as err:
        as_group_ids(np.array([1, 2]), [False], "x")
    assert type(err.value) is BlockIdError and err.value.field == "x" and err.value.values == {}
    for bad in ("ab", b"ab", 5, {1: 2}):
        with pytest.raises(BlockIdError) as err:
            as_group_ids(bad, [False], "x")  # type: ignore[arg-type]
        assert type(err.value) is BlockIdError
        assert err.value.field == "x" and err.value.values == {"value": bad}
    with pytest.raises(BlockIdError) as err:
        as_group_ids(list(range(10)), [False], "x")
    assert err.value.field == "x" and err.value.values == {"value": list(range(8))}
    with pytest.raises(BlockIdError) as err:
        as_group_ids([[1], np.int64(2)], [False, False], "x")  # type: ignore[list-item]
    assert err.value.field == "x"
    with pytest.raises(GroupMismatchError) as err:
        as_group_ids([[1]], [False, True], "x")
    assert type(err.value) is GroupMismatchError
    assert err.value.field == "x" and err.value.values == {"value": 1, "expected": 2}
    with pytest.raises(GroupMismatchError) as err:
        as_group_ids([[1], [2], [3]], [False, True], "x")
    assert err.value.values == {"value": 3, "expected": 2}
    with pytest.raises(BlockIdError) as err:
        as_group_ids([[0], [-4]], [False, True], "x")
    assert err.value.field == "x[1]" and err.value.values == {"value": -4}


# check_distinct


def test_check_distinct_accepts_distinct_ids() -> None:
    assert check_distinct([], "f") is None
    assert check_distinct([np.array([5])], "f") is None
    assert check_distinct([np.array([1, 2]), np.array([3])], "f") is None
    assert check_distinct([np.array([], dtype=np.int64), np.array([7])], "f") is None


def test_check_distinct_names_a_repeat_in_one_group() -> None:
    with pytest.raises(BlockIdError) as err:
        check_distinct([np.array([1, 1])], "f")
    assert type(err.value) is BlockIdError
    assert err.value.field == "f[0]" and err.value.values == {"value": 1, "group": 0}
    # the smallest repeated id is named: sorted [2, 2, 4, 4] -> 2
    with pytest.raises(BlockIdError) as err:
        check_distinct([np.array([3]), np.array([4, 2, 4, 2])], "f")
    assert err.value.field == "f[1]" and err.value.values == {"value": 2, "group": 1}


def test_check_distinct_names_an_id_in_two_groups() -> None:
    with pytest.raises(BlockIdError) as err:
        check_distinct([np.array([1]), np.array([1])], "f")
    assert type(err.value) is BlockIdError
    assert err.value.field == "f[1]" and err.value.values == {"value": 1, "groups": (0, 1)}
    # ids [2 | 3, 2 | 9]: sorted (stable) 2 (group 0), 2 (group 1) -> groups (0, 1)
    with pytest.raises(BlockIdError) as err:
        check_distinct([np.array([2]), np.array([3, 2]), np.array([9])], "f")
    assert err.value.field == "f[1]" and err.value.values == {"value": 2, "groups": (0, 1)}
    # group 2 repeats group 1's id 5 (group 0 has none): groups (1, 2)
    with pytest.raises(BlockIdError) as err:
        check_distinct([np.array([0]), np.array([5]), np.array([6, 5])], "f")
    assert err.value.field == "f[2]" and err.value.values == {"value": 5, "groups": (1, 2)}


# expansions


def test_logical_to_kernel() -> None:
    # docstring example: [[1], [2, 3]], ppl 2 -> [[2, 3], [4, 5, 6, 7]]
    _eq(logical_to_kernel([[1], [2, 3]], 2, [False, False]), [[2, 3], [4, 5, 6, 7]])
    _eq(logical_to_kernel([[1], [2, 3]], 2, [False, True]), [[2, 3], [2, 3]])  # SSM passes through
    _eq(logical_to_kernel([[4, 1]], 1, [False]), [[4, 1]])
    _eq(logical_to_kernel([[1, 1]], 3, [False]), [[3, 4, 5, 3, 4, 5]])  # repeats kept
    with pytest.raises(RatioError) as err:
        logical_to_kernel([[1]], 0, [False])
    assert err.value.field == "ppl" and err.value.values == {"value": 0}
    with pytest.raises(BlockIdError) as err:
        logical_to_kernel([[-1]], 1, [False])
    assert err.value.field == "block_ids[0]"


def test_get_mapped_blocks() -> None:
    assert get_mapped_blocks([3, 1], 3).tolist() == [9, 10, 11, 3, 4, 5]  # b*3 + j, id-major
    assert get_mapped_blocks([2], 1).tolist() == [2]
    assert get_mapped_blocks([], 4).tolist() == []
    with pytest.raises(RatioError) as err:
        get_mapped_blocks([1], 0)
    assert err.value.field == "ratio" and err.value.values == {"value": 0}
    with pytest.raises(BlockIdError) as err:
        get_mapped_blocks([-1], 2)
    assert err.value.field == "ids" and err.value.values == {"value": -1}


def test_map_block_ids_for_block_size_ratio() -> None:
    # [0, 1] at ratio 2 -> [0, 1, 2, 3], clipped to the 3 remote ids
    loc, rem = map_block_ids_for_block_size_ratio([[0, 1]], [[4, 5, 6]], 2, [False])
    _eq(loc, [[0, 1, 2]])
    _eq(rem, [[4, 5, 6]])
    # SSM passes through on both sides
    loc, rem = map_block_ids_for_block_size_ratio([[0, 1], [7]], [[4, 5, 6], [9]], 2, [False, True])
    _eq(loc, [[0, 1, 2], [7]])
    _eq(rem, [[4, 5, 6], [9]])
    # the clip at ratio 1
    loc, rem = map_block_ids_for_block_size_ratio([[1, 2, 3]], [[5]], 1, [False])
    _eq(loc, [[1]])
    # a longer remote list: every mapped id kept ([2] -> [4, 5])
    loc, _ = map_block_ids_for_block_size_ratio([[2]], [[0, 1, 3]], 2, [False])
    _eq(loc, [[4, 5]])
    # notify-only and full prefix hit: local = []
    loc, rem = map_block_ids_for_block_size_ratio([], [[4, 5]], 2, [False])
    assert loc == [] and [r.tolist() for r in rem] == [[4, 5]]
    loc, rem = map_block_ids_for_block_size_ratio([[0]], [[]], 2, [False])
    assert loc == [] and [r.tolist() for r in rem] == [[]]
    loc, _ = map_block_ids_for_block_size_ratio([[], [3]], [[], [8]], 2, [False, True])
    _eq(loc, [[], [3]])  # an SSM slot is something to move


def test_map_block_ids_refusals() -> None:
    with pytest.raises(RatioError) as err:
        map_block_ids_for_block_size_ratio([[0]], [[0]], 0, [False])
    assert err.value.field == "ratio" and err.value.values == {"value": 0}
    with pytest.raises(BlockIdError) as err:
        map_block_ids_for_block_size_ratio([[0]], [[-2]], 1, [False])
    assert err.value.field == "remote_ids[0]"
    with pytest.raises(BlockIdError) as err:
        map_block_ids_for_block_size_ratio([[-3]], [[0]], 1, [False])
    assert err.value.field == "local_ids[0]"


# apply_prefix_caching


def _prefix(dec: list, pre: list, dppl: int, pppl: int, kinds: list[bool], **kw: object) -> tuple:
    d, p = apply_prefix_caching(dec, pre, dppl, pppl, kinds, **kw)  # type: ignore[arg-type]
    return [x.tolist() for x in d], [x.tolist() for x in p]


def test_prefix_without_mamba_takes_the_prefill_tail() -> None:
    assert _prefix([[1, 2]], [[5, 6, 7]], 1, 1, [False]) == ([[1, 2]], [[6, 7]])
    assert _prefix([[1, 2]], [[5, 6]], 1, 1, [False]) == ([[1, 2]], [[5, 6]])  # n_d == n_p
    assert _prefix([[]], [[5, 6]], 1, 1, [False]) == ([[]], [[5, 6]])  # vLLM's prefill[-0:] quirk
    assert _prefix([[1]], [[5, 6, 7]], 2, 1, [False]) == ([[1]], [[7]])  # ppl does not matter here


def test_prefix_without_mamba_refuses_more_decode_blocks() -> None:
    with pytest.raises(PlanError) as err:
        apply_prefix_caching([[0], [1, 2, 3]], [[0], [5, 6]], 1, 1, [False, False])
    assert type(err.value) is PlanError
    assert err.value.field == "decode_ids[1]" and err.value.values == {"value": 3, "expected": 2}


def test_prefix_mamba_ssm_group() -> None:
    k = [False, True]
    assert _prefix([[1], [3]], [[5], [8]], 1, 1, k) == ([[1], [3]], [[5], [8]])  # equal counts kept
    assert _prefix([[1], [3, 4]], [[5], [8]], 1, 1, k) == ([[1], [3]], [[5], [8]])  # one more: decode[:1]
    assert _prefix([[1], [3]], [[5], [8, 9]], 1, 1, k) == ([[1], [3]], [[5], [9]])  # prefill tail
    assert _prefix([[1], []], [[5], [8, 9]], 1, 1, k) == ([[1], []], [[5], [8, 9]])  # tail of 0 keeps all
    with pytest.raises(PlanError) as err:
        apply_prefix_caching([[1], [3, 4, 6]], [[5], [8]], 1, 1, k)
    assert type(err.value) is PlanError
    assert err.value.field == "decode_ids[1]" and err.value.values == {"value": 3, "expected": 1}


def test_prefix_mamba_attention_group() -> None:
    k = [False, True]
    # equal ppl, n_d < n_p: prefill tail
    assert _prefix([[1, 2], [9]], [[5, 6, 7], [8]], 2, 2, k) == ([[1, 2], [9]], [[6, 7], [8]])
    # equal ppl, n_d > n_p: both front-trimmed to 1 (|3 - 1| = 2 <= 1 + 1)
    assert _prefix([[1, 2, 3], [9]], [[5], [8]], 1, 1, k) == ([[1], [9]], [[5], [8]])
    # equal ppl and counts: kept whole
    assert _prefix([[1, 2], [9]], [[5, 6], [8]], 1, 1, k) == ([[1, 2], [9]], [[5, 6], [8]])
    # unequal ppl, n_d < n_p: front trim, not the tail (|2 - 4| = 2 <= 1 + 2)
    assert _prefix([[1, 2], [9]], [[5, 6, 7, 8], [4]], 1, 2, k) == ([[1, 2], [9]], [[5, 6], [4]])
    # at the padding limit: |1 - 4| = 3 <= 1 + 2
    assert _prefix([[1], [9]], [[5, 6, 7, 8], [4]], 1, 2, k) == ([[1], [9]], [[5], [4]])
    assert _prefix([[1, 2, 3, 4], [9]], [[5], [4]], 2, 1, k) == ([[1], [9]], [[5], [4]])


@pytest.mark.parametrize(
    ("dec", "pre", "dppl", "pppl"),
    [
        ([1, 2, 3, 4], [5], 1, 1),  # |4 - 1| = 3 > 2
        ([1], [5, 6, 7, 8, 10], 1, 2),  # |1 - 5| = 4 > 3
        ([1, 2, 3, 4, 6], [5], 2, 1),  # |5 - 1| = 4 > 3
    ],
)
def test_prefix_mamba_attention_refuses_past_the_padding(dec: list, pre: list, dppl: int, pppl: int) -> None:
    with pytest.raises(PlanError) as err:
        apply_prefix_caching([[9], dec], [[8], pre], dppl, pppl, [True, False])
    assert type(err.value) is PlanError
    assert err.value.field == "decode_ids[1]"
    assert err.value.values == {"value": len(dec), "expected": len(pre)}


def test_prefix_has_mamba_overrides_the_group_kinds() -> None:
    # has_mamba=True on an attention-only request: the Mamba rule (front trim within the padding)
    assert _prefix([[1, 2, 3]], [[5]], 1, 1, [False], has_mamba=True) == ([[1]], [[5]])
    with pytest.raises(PlanError):
        apply_prefix_caching([[1, 2, 3]], [[5]], 1, 1, [False])
    # has_mamba=False with an SSM group: every group takes the no-Mamba rule (tail, n_d <= n_p)
    assert _prefix([[1], [3]], [[5, 6], [8, 9]], 1, 2, [False, True], has_mamba=False) == (
        [[1], [3]],
        [[6], [9]],
    )
    with pytest.raises(PlanError) as err:
        apply_prefix_caching([[1], [3, 4]], [[5], [8]], 1, 1, [False, True], has_mamba=False)
    assert err.value.field == "decode_ids[1]" and err.value.values == {"value": 2, "expected": 1}


def test_prefix_refusals_name_their_argument() -> None:
    with pytest.raises(RatioError) as err:
        apply_prefix_caching([[1]], [[1]], 0, 1, [False])
    assert err.value.field == "decode_ppl" and err.value.values == {"value": 0}
    with pytest.raises(RatioError) as err:
        apply_prefix_caching([[1]], [[1]], 1, 0, [False])
    assert err.value.field == "prefill_ppl" and err.value.values == {"value": 0}
    with pytest.raises(BlockIdError) as err:
        apply_prefix_caching([[-1]], [[1]], 1, 1, [False])
    assert err.value.field == "decode_ids[0]"
    with pytest.raises(BlockIdError) as err:
        apply_prefix_caching([[1]], [[-1]], 1, 1, [False])
    assert err.value.field == "prefill_ids[0]"


def test_check_distinct_names_groups_in_order_for_long_lists() -> None:
    # ids 51, 173 and 180 are in both groups; the smallest, 51, is named, first group first (an unstable
    # sort of these 44 ids puts group 1's 51 before group 0's)
    g0 = [1, 40, 17, 125, 51, 6, 179, 122, 180, 158, 69, 29, 130, 173]
    g1 = [
        32,
        53,
        135,
        161,
        59,
        55,
        188,
        89,
        93,
        47,
        57,
        189,
        77,
        196,
        183,
        149,
        65,
        70,
        176,
        143,
        173,
        114,
        180,
        3,
    ]
    g1 += [63, 154, 51, 140, 42, 111]
    with pytest.raises(BlockIdError) as err:
        check_distinct([np.array(g0), np.array(g1)], "f")
    assert err.value.field == "f[1]" and err.value.values == {"value": 51, "groups": (0, 1)}


def test_a_negative_block_id_is_named_with_its_value_even_after_a_zero() -> None:
    from kvgeom import BlockIdError
    from kvgeom.blocks import as_ids

    with pytest.raises(BlockIdError) as err:
        as_ids([0, 5, -3], "ids")
    assert err.value.values == {"value": -3} and "at position 2" in str(err.value)
