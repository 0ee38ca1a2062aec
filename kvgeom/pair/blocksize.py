"""Block sizes of a P/D pair, in plain numbers: the block-size ratio, and reading remote blocks as finer
units.

A pair transfers at the remote's kernel-block granularity: the local kernel block must hold a whole
number ``bsr = local // remote`` of remote kernel blocks (each local block is read as ``bsr`` remote
ones). When the sizes do not divide, a pull can still pair them by viewing every remote block as
``split = remote // gcd`` finer blocks of ``gcd`` tokens (vLLM 0.33.0 does it for hybrid MLA + SSM
models, vLLM PR 41570's ``_split_remote_blocks``), provided each remote page cuts into ``split`` equal
token slices: pages that abut (stride equal to length), lengths divisible by ``split``, no page that is
copied whole (a replicated state page), and at most ``max_split`` pieces per block on either side.

:func:`kvgeom.pair.handshake.block_size_ratio` applies the same rules to two rank geometries; these take the
numbers a handshake advertises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvgeom.blocks import check_positive_int
from kvgeom.errors import ConfigError, RatioError

__all__ = ["block_size_ratio", "kernel_blocks_per_logical", "remote_block_split", "MAX_BLOCK_SPLIT"]

MAX_BLOCK_SPLIT = 128
"""The most pieces vLLM cuts a block into when pairing non-dividing block sizes."""


def block_size_ratio(local_block_size: int, remote_block_size: int) -> int:
    """``local // remote`` kernel tokens; :class:`RatioError` unless the remote block divides the local
    one."""
    local = check_positive_int(local_block_size, "block_size")
    remote = check_positive_int(remote_block_size, "remote_block_size")
    if local % remote:
        raise RatioError(
            "block_size",
            f"Local block size {local} is not divisible by remote block size {remote} (kernel tokens)",
            local=local,
            remote=remote,
        )
    return local // remote


def kernel_blocks_per_logical(block_size: int, kernel_block_size: int) -> int:
    """Kernel blocks per logical block (vLLM's ``physical_blocks_per_logical``): ``block_size //
    kernel_block_size``; :class:`ConfigError` unless the kernel block divides the logical one."""
    block = check_positive_int(block_size, "block_size", error=ConfigError)
    kernel = check_positive_int(kernel_block_size, "kernel_block_size", error=ConfigError)
    if block % kernel:
        raise ConfigError(
            "kernel_block_size",
            f"kernel block of {kernel} tokens does not divide the {block}-token logical block",
            value=kernel,
            expected=block,
        )
    return block // kernel


def remote_block_split(
    local_block_size: int,
    remote_block_size: int,
    remote_block_lens: Sequence[int],
    remote_block_strides: Sequence[int],
    whole_pages: bool = False,
    max_split: int = MAX_BLOCK_SPLIT,
) -> int:
    """Pieces each remote block is read as so that the pair's block sizes divide: 1 when they already
    divide, or when the remote pages cannot be cut (non-abutting pages, a length not divisible by the
    split, ``whole_pages``: a page copied whole, more than ``max_split`` pieces on either side). Example:
    local 36, remote 20 tokens -> gcd 4, each remote block read as 5 blocks of 4 tokens."""
    local = check_positive_int(local_block_size, "block_size")
    remote = check_positive_int(remote_block_size, "remote_block_size")
    if local % remote == 0:
        return 1
    unit = math.gcd(local, remote)
    split = remote // unit
    if max(split, local // unit) > max_split:
        return 1
    lens = [int(x) for x in remote_block_lens]
    if whole_pages or lens != [int(x) for x in remote_block_strides] or any(x % split for x in lens):
        return 1
    return split
