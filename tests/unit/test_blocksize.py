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
    with pytest.raises(RatioError, match="not divisible") as info:
        block_size_ratio(local, remote)
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
    with pytest.raises(ConfigError, match="does not divide"):
        kernel_blocks_per_logical(48, 32)
