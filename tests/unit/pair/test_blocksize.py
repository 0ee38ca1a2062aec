"""kvgeom.pair.blocksize: the block-size ratio and the remote block split, in the numbers a handshake carries."""

from __future__ import annotations

import pytest

from kvgeom.errors import ConfigError, RatioError
from kvgeom.pair.blocksize import (
    MAX_BLOCK_SPLIT,
    block_size_ratio,
    kernel_blocks_per_logical,
    remote_block_split,
)


def test_ratio_of_dividing_block_sizes() -> None:
    assert block_size_ratio(64, 16) == 4 and block_size_ratio(16, 16) == 1


@pytest.mark.parametrize("local,remote", [(16, 64), (36, 20)])
def test_ratio_refuses_a_remote_block_that_does_not_divide(local: int, remote: int) -> None:
    with pytest.raises(RatioError) as info:
        block_size_ratio(local, remote)
    assert info.value.field == "block_size"
    assert info.value.values == {"local": local, "remote": remote}


def test_split_into_gcd_units() -> None:
    # 36 and 20 tokens: gcd 4, a remote block is read as 5 blocks of 4 tokens (then local // 4 = 9 divides)
    assert remote_block_split(36, 20, [200, 400], [200, 400]) == 5
    assert remote_block_split(20, 36, [360], [360]) == 9
    assert remote_block_split(64, 16, [100], [100]) == 1  # already divides


@pytest.mark.parametrize(
    "lens,strides,whole", [([200], [208], False), ([202], [202], False), ([200], [200], True)]
)
def test_split_declined_when_a_page_cannot_be_cut(lens: list[int], strides: list[int], whole: bool) -> None:
    assert remote_block_split(36, 20, lens, strides, whole_pages=whole) == 1


def test_split_declined_past_the_piece_limit() -> None:
    big = MAX_BLOCK_SPLIT + 1
    assert remote_block_split(big, 1 * big + 1, [big + 1], [big + 1]) == 1
    assert remote_block_split(3, 2, [4], [4]) == 2


def test_kernel_blocks_per_logical() -> None:
    assert kernel_blocks_per_logical(64, 16) == 4 and kernel_blocks_per_logical(16, 16) == 1
    with pytest.raises(ConfigError) as exc:
        kernel_blocks_per_logical(48, 32)
    assert exc.value.field == "kernel_block_size" and exc.value.values == {"value": 32, "expected": 48}


def _raises(cls, fn, *args, **kwargs):
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    assert type(info.value) is cls
    return info.value


def test_block_size_ratio_values():
    assert block_size_ratio(8, 4) == 2
    assert type(block_size_ratio(8, 4)) is int
    assert block_size_ratio(4, 4) == 1
    assert block_size_ratio(16, 1) == 16


def test_block_size_ratio_refusals():
    err = _raises(RatioError, block_size_ratio, 6, 4)  # 6 % 4 = 2
    assert err.field == "block_size"
    assert err.values == {"local": 6, "remote": 4}
    err = _raises(RatioError, block_size_ratio, 0, 4)
    assert err.field == "block_size" and err.values == {"value": 0}
    err = _raises(RatioError, block_size_ratio, 4, 0)
    assert err.field == "remote_block_size" and err.values == {"value": 0}
    assert block_size_ratio(1, 1) == 1  # minimum 1 is allowed on both sides


def test_kernel_blocks_per_logical_values_and_refusals():
    assert kernel_blocks_per_logical(16, 4) == 4
    assert type(kernel_blocks_per_logical(16, 4)) is int
    assert kernel_blocks_per_logical(16, 16) == 1
    assert kernel_blocks_per_logical(1, 1) == 1
    err = _raises(ConfigError, kernel_blocks_per_logical, 16, 6)  # 16 % 6 = 4
    assert err.field == "kernel_block_size"
    assert err.values == {"value": 6, "expected": 16}
    err = _raises(ConfigError, kernel_blocks_per_logical, 0, 4)
    assert err.field == "block_size" and err.values == {"value": 0}
    err = _raises(ConfigError, kernel_blocks_per_logical, 16, 0)
    assert err.field == "kernel_block_size" and err.values == {"value": 0}
    err = _raises(ConfigError, kernel_blocks_per_logical, "16", 4)
    assert err.field == "block_size"


def test_remote_block_split_worked_example():
    # local 36, remote 20: gcd 4, each remote block read as 20 // 4 = 5 blocks (local side 36 // 4 = 9)
    assert remote_block_split(36, 20, [100, 200], [100, 200]) == 5
    assert type(remote_block_split(36, 20, [100, 200], [100, 200])) is int
    # 21 % 20 == 1: gcd 1, each remote block read as 20 one-token blocks
    assert remote_block_split(21, 20, [40], [40]) == 20
    # dividing sizes: no split
    assert remote_block_split(40, 20, [100], [100]) == 1
    assert remote_block_split(20, 20, [7], [7]) == 1


def test_remote_block_split_max_split_boundary():
    # split 5 and local pieces 9: max is 9, so max_split 9 allows it, 8 does not
    assert remote_block_split(36, 20, [100], [100], max_split=9) == 5
    assert remote_block_split(36, 20, [100], [100], max_split=8) == 1
    # remote side largest: local 4, remote 6 -> gcd 2, split 3, local pieces 2
    assert remote_block_split(4, 6, [6], [6], max_split=3) == 3
    assert remote_block_split(4, 6, [6], [6], max_split=2) == 1
    # the default max is vLLM's 128: local 127, remote 128 -> gcd 1, split 128 (allowed) ...
    assert MAX_BLOCK_SPLIT == 128
    assert remote_block_split(127, 128, [256], [256]) == 128
    # ... local 129, remote 128 -> local pieces 129 > 128 -> not split
    assert remote_block_split(129, 128, [256], [256]) == 1


def test_remote_block_split_uncuttable_pages():
    assert remote_block_split(36, 20, [100], [200]) == 1  # pages do not abut
    assert remote_block_split(36, 20, [100, 102], [100, 102]) == 1  # 102 % 5 != 0
    assert remote_block_split(36, 20, [100], [100], whole_pages=True) == 1
    assert remote_block_split(36, 20, [100], [100], whole_pages=False) == 5


def test_remote_block_split_refusals():
    err = _raises(RatioError, remote_block_split, 0, 20, [1], [1])
    assert err.field == "block_size" and err.values == {"value": 0}
    err = _raises(RatioError, remote_block_split, 36, 0, [1], [1])
    assert err.field == "remote_block_size" and err.values == {"value": 0}
