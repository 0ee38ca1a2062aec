"""Strided descriptor rows of vLLM's NIXL connector (NIXL >= 1.5's N x 5 form).

A row ``(addr, len, dev, stride, count)`` stands for the ``count`` descriptors ``(addr + k * stride,
len, dev)``; descriptor ids index that expansion in row order (:func:`kvgeom.plan.splits.expand_strided`).
These builders take plain numbers (base addresses, lengths, strides, capacities), so a connector can
call them with real addresses and :mod:`kvgeom.plan.dlist` with pseudo-addresses (``region << 44``).

* :func:`block_strided_rows` -- one region's blocks cut into ``bsr`` sub-blocks (``_block_strided_descs``);
* :func:`fa_local_rows` / :func:`fa_remote_rows` -- the attention part of the local and remote tables
  (``_build_fa_local`` / ``_build_fa_remote``);
* :func:`mamba_local_rows` / :func:`mamba_remote_rows` -- the SSM part, with the TP-replicated (PLE)
  page last (``_build_mamba_local`` / ``_build_mamba_remote``).

Every function returns an ``int64`` N x 5 array; all are vectorised over blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvgeom.blocks import check_positive_int
from kvgeom.errors import GroupMismatchError, IncompatiblePairError, PlanError

__all__ = [
    "block_strided_rows",
    "expand_rows",
    "fa_local_rows",
    "fa_remote_rows",
    "mamba_local_rows",
    "mamba_remote_rows",
    "strided_starts",
    "to_strided",
]


def _rows(rows: list[tuple[int, int, int, int, int]]) -> np.ndarray:
    return np.asarray(rows, dtype=np.int64).reshape(-1, 5)


def expand_rows(rows: np.ndarray) -> np.ndarray:
    """N x 5 strided rows ``(addr, len, dev, stride, count)`` as one ``(addr, len, dev)`` descriptor per
    block, in NIXL's order: row by row, block ``k`` of a row at ``addr + k * stride`` (vLLM 0.32.0's
    descriptor tables are these flat lists)."""
    s = np.asarray(rows, dtype=np.int64).reshape(-1, 5)
    counts = s[:, 4]
    idx = np.repeat(np.arange(len(s)), counts)
    k = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(strided_starts(s), counts)
    out = np.empty((len(idx), 3), dtype=np.int64)
    out[:, 0] = s[idx, 0] + k * s[idx, 3]
    out[:, 1] = s[idx, 1]
    out[:, 2] = s[idx, 2]
    return out


def to_strided(table: np.ndarray) -> np.ndarray:
    """A descriptor table as N x 5 strided rows: each ``(addr, len, dev)`` descriptor becomes a row of one
    block (stride = len); N x 5 rows are returned as they are."""
    t = np.asarray(table, dtype=np.int64)
    if t.ndim == 2 and t.shape[1] == 3:
        out = np.empty((len(t), 5), dtype=np.int64)
        out[:, :3] = t
        out[:, 3] = t[:, 1]
        out[:, 4] = 1
        return out
    return t


def strided_starts(rows: np.ndarray) -> np.ndarray:
    """Flat descriptor index of each row's first descriptor (vLLM ``_strided_desc_starts``)."""
    counts = np.asarray(rows, dtype=np.int64)[:, 4]
    return np.cumsum(counts) - counts


def block_strided_rows(
    base: int, block_len: int, block_stride: int, num_blocks: int, bsr: int, device: int = 0
) -> np.ndarray:
    """``num_blocks`` blocks ``block_stride`` apart, each cut into ``bsr`` sub-blocks of ``block_len``
    bytes: one row when the sub-blocks are evenly spaced (``bsr == 1`` or ``block_stride == bsr *
    block_len``), else one row per block (a padded block: sub-blocks abut only inside it)."""
    bsr = check_positive_int(bsr, "block_size_ratio")
    if bsr == 1 or block_stride == bsr * block_len:
        return _rows([(base, block_len, device, block_stride // bsr, num_blocks * bsr)])
    out = np.empty((num_blocks, 5), dtype=np.int64)
    out[:, 0] = base + np.arange(num_blocks, dtype=np.int64) * block_stride
    out[:, 1], out[:, 2], out[:, 3], out[:, 4] = block_len, device, block_len, bsr
    return out


def fa_local_rows(
    bases: Sequence[int],
    block_lens: Sequence[int],
    block_strides: Sequence[int],
    region_num_blocks: Sequence[int],
    bsr: int = 1,
    device: int = 0,
    region_indices: Sequence[int] | None = None,
) -> np.ndarray:
    """The local attention rows: per region (per transfer layer's region under layer-name routing,
    ``region_indices``), its ``region_num_blocks`` kernel blocks at ``bsr`` sub-blocks each."""
    if not len(bases):
        raise PlanError("bases", "local KV cache base addresses must not be empty", value=0)
    regions = range(len(bases)) if not region_indices else region_indices
    parts = [
        block_strided_rows(
            int(bases[i]),
            int(block_lens[i]) // bsr,
            int(block_strides[i]),
            int(region_num_blocks[i]),
            bsr,
            device,
        )
        for i in regions
    ]
    return np.concatenate(parts)


def fa_remote_rows(
    remote_bases: Sequence[int],
    remote_block_strides: Sequence[int],
    remote_region_num_blocks: Sequence[int],
    local_block_lens: Sequence[int],
    local_replicated: Sequence[bool],
    bsr: int,
    reads: int,
    rank_offset_factor: int,
    device: int = 0,
    local_region_of: Sequence[int] | None = None,
    draft_regions: Sequence[int] = (),
    draft_reads: int = 1,
    draft_offset_factor: int = 0,
) -> np.ndarray:
    """One row per remote region ``i``, as this rank reads it: with ``L`` the matching local region's
    length (``local_region_of[i]``, or ``i``) and ``rkv = L // bsr`` (``L := rkv`` when ``bsr > 1``), a
    replicated (MLA) region is read whole from offset 0; a split region in ``reads`` slices at offset
    ``rank_offset_factor * rkv`` (a GQA draft region under an MLA target uses ``draft_reads`` and
    ``draft_offset_factor``). Row ``(base_i + offset, L // reads, dev, stride_i, capacity_i)``."""
    if not len(remote_bases):
        raise PlanError("remote_bases", "remote KV cache base addresses must not be empty", value=0)
    bsr = check_positive_int(bsr, "block_size_ratio")
    n = len(remote_bases)
    local = (
        np.arange(n)
        if local_region_of is None or not len(local_region_of)
        else np.asarray(local_region_of, dtype=np.int64)
    )
    if local.size != n:
        raise GroupMismatchError(
            "local_region_of",
            f"{local.size} local regions for {n} remote regions",
            value=int(local.size),
            expected=n,
        )
    lens = np.asarray(local_block_lens, dtype=np.int64)[local]
    rkv = lens // bsr
    length = rkv if bsr > 1 else lens
    replicated = np.asarray(
        [bool(local_replicated[i]) if i < len(local_replicated) else False for i in local.tolist()],
        dtype=bool,
    )
    draft = np.isin(local, np.asarray(list(draft_regions), dtype=np.int64))
    r = np.where(replicated, 1, np.where(draft, draft_reads, reads))
    off = np.where(replicated, 0, np.where(draft, draft_offset_factor, rank_offset_factor) * rkv)
    out = np.empty((n, 5), dtype=np.int64)
    out[:, 0] = np.asarray(remote_bases, dtype=np.int64) + off
    out[:, 1] = length // r
    out[:, 2] = device
    out[:, 3] = np.asarray(remote_block_strides, dtype=np.int64)
    out[:, 4] = np.asarray(remote_region_num_blocks, dtype=np.int64)
    return out


def _ssm_rows(
    bases: Sequence[int],
    strides: Sequence[int],
    regions: Sequence[int],
    pieces: Sequence[tuple[int, int]],
    ppl: int,
    nbl: int,
    device: int,
) -> list[tuple[int, int, int, int, int]]:
    rows = []
    for i in regions:
        stride = int(strides[i]) * ppl
        rows += [(int(bases[i]) + off, size, device, stride, nbl) for off, size in pieces]
    return rows


def mamba_local_rows(
    bases: Sequence[int],
    block_strides: Sequence[int],
    ssm_region_indices: Sequence[int],
    conv_offsets: Sequence[tuple[int, int]],
    ssm_sizes: tuple[int, int],
    ppl: int,
    logical_num_blocks: int,
    device: int = 0,
    ple_region: int | None = None,
    ple_block_len: int | None = None,
) -> np.ndarray:
    """The local SSM rows: per SSM region (every region when ``ssm_region_indices`` is empty), one row per
    conv piece ``(base + offset, size)`` then the temporal state ``(base + conv_bytes, ssm_bytes)``, each
    over ``logical_num_blocks`` state pages ``block_stride * ppl`` apart; then the replicated (PLE) page
    ``(base, ple_block_len * ppl)`` of region ``ple_region``."""
    regions = ssm_region_indices or range(len(bases))
    pieces = list(conv_offsets) + [(int(ssm_sizes[0]), int(ssm_sizes[1]))]
    rows = _ssm_rows(bases, block_strides, regions, pieces, ppl, logical_num_blocks, device)
    if ple_region is not None:
        if ple_block_len is None:
            raise PlanError("ple_block_len", "a replicated state region needs its page length", value=None)
        rows.append(
            (
                int(bases[ple_region]),
                ple_block_len * ppl,
                device,
                int(block_strides[ple_region]) * ppl,
                logical_num_blocks,
            )
        )
    return _rows(rows)


def mamba_remote_rows(
    remote_bases: Sequence[int],
    remote_block_strides: Sequence[int],
    remote_num_blocks: int,
    remote_ppl: int,
    remote_ssm_sizes: tuple[int, int],
    ssm_region_indices: Sequence[int],
    conv_reads: Sequence[tuple[int, int]],
    local_ssm_bytes: int,
    tp_ratio: int,
    local_rank: int,
    device: int = 0,
    ple_region: int | None = None,
    local_ple_len: int | None = None,
    remote_ple_len: int | None = None,
) -> np.ndarray:
    """The remote SSM rows as this rank reads them (vLLM ``_build_mamba_remote``): per SSM region (indexed
    by the **local** SSM region list, every region when empty) the conv reads ``conv_reads`` (``(offset,
    size)`` in the remote page, :func:`kvgeom.layout.conv.remote_conv_offsets`), then the temporal slice at
    ``remote_conv_bytes + (local_rank % max(tp_ratio, 1)) * read`` (``read`` = this rank's temporal bytes
    if ``tp_ratio >= 1``, else the remote's whole), over the remote's logical blocks; then the replicated
    page, whose local and remote lengths (``*_ple_len``, already times each side's ppl) must match
    (:class:`IncompatiblePairError`)."""
    rppl = check_positive_int(remote_ppl, "remote_ppl")
    nbl = remote_num_blocks // rppl
    local_offset = local_rank % max(tp_ratio, 1)
    read = local_ssm_bytes if tp_ratio >= 1 else int(remote_ssm_sizes[1])
    pieces = list(conv_reads) + [(int(remote_ssm_sizes[0]) + local_offset * read, read)]
    regions = ssm_region_indices or range(len(remote_bases))
    rows = _ssm_rows(remote_bases, remote_block_strides, regions, pieces, rppl, nbl, device)
    if ple_region is not None:
        if local_ple_len is None or remote_ple_len is None or local_ple_len != remote_ple_len:
            raise IncompatiblePairError(
                "ple_block_len",
                "PLE pages require identical P/D geometry: replicated state pages are copied whole",
                local=local_ple_len,
                remote=remote_ple_len,
            )
        rows.append(
            (
                int(remote_bases[ple_region]),
                remote_ple_len,
                device,
                int(remote_block_strides[ple_region]) * rppl,
                nbl,
            )
        )
    return _rows(rows)
