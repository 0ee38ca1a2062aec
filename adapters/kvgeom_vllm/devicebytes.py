"""Applying kvgeom's byte-level answers to vLLM's cache tensors (torch, any device).

kvgeom says *which* bytes a post-receive step touches: zero rows ``(region, offset, length)`` and regroups
(blocks that arrived as finer remote pages). This module only executes them on the tensors vLLM
registered, as flat ``uint8`` views of their storage, vectorised (one indexed fill per distinct row
length, one gather and scatter per regroup).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ByteRegion", "storage_bytes", "zero_rows", "regroup_blocks"]


def storage_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor's whole storage as a flat ``uint8`` tensor, and the storage's address."""
    storage = tensor.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return flat, int(storage.data_ptr())


@dataclass(frozen=True)
class ByteRegion:
    """A registered region: the flat bytes of its storage and where the region starts in them."""

    flat: torch.Tensor
    start: int

    @classmethod
    def at(cls, tensor: torch.Tensor, base_address: int) -> ByteRegion:
        flat, addr = storage_bytes(tensor)
        return cls(flat, int(base_address) - addr)


def zero_rows(regions: Sequence[ByteRegion], rows: np.ndarray) -> int:
    """Zero ``(region, offset, length)`` rows; returns the bytes zeroed. Rows past a storage's end are a
    bug in the caller and raise ``IndexError``."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    total = 0
    for r in np.unique(rows[:, 0]).tolist():
        sel = rows[rows[:, 0] == r]
        region = regions[r]
        for length in np.unique(sel[:, 2]).tolist():
            if length <= 0:
                continue
            starts = sel[sel[:, 2] == length, 1] + region.start
            idx = torch.from_numpy((starts[:, None] + np.arange(length)[None, :]).reshape(-1))
            if int(idx.max()) >= region.flat.numel() or int(idx.min()) < 0:
                raise IndexError(f"zero row outside region {r}'s storage")
            region.flat.index_fill_(0, idx.to(region.flat.device), 0)
            total += int(idx.numel())
    return total


def regroup_blocks(
    region: ByteRegion,
    block_ids: np.ndarray,
    block_stride: int,
    bsr: int,
    heads: int,
    tokens: int,
    head_bytes: int,
    token_major: bool = False,
) -> None:
    """Blocks ``block_ids`` of a region received as ``bsr`` head-major remote pages ``[heads, tokens // bsr,
    head_bytes]`` each, stored back as one ``[heads, tokens, head_bytes]`` page (``token_major``: as one
    ``[tokens, heads, head_bytes]`` page, the LBHNC-into-LBNHC permute, also at ``bsr`` 1)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if not ids.size or (bsr == 1 and not token_major):
        return
    page = heads * tokens * head_bytes
    starts = region.start + ids * int(block_stride)
    idx = torch.from_numpy(starts[:, None] + np.arange(page)[None, :]).to(region.flat.device)
    got = region.flat[idx.reshape(-1)].reshape(ids.size, bsr, heads, tokens // bsr, head_bytes)
    order = (0, 1, 3, 2, 4) if token_major else (0, 2, 1, 3, 4)
    region.flat[idx.reshape(-1)] = got.permute(*order).reshape(-1)
