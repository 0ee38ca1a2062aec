"""After the bytes land: vLLM's post-receive step (block-size regroup and zeroing what the transfer did
not write) and its region-wise zeroing, answered by :func:`kvgeom.plan.align.consumer_zero_rows` and
:func:`kvgeom.plan.regionmap.region_zero_rows`; :mod:`kvgeom_vllm.devicebytes` applies the answers to the
cache tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvgeom.blocks import check_positive_int
from kvgeom.errors import PlanError
from kvgeom.plan.align import consumer_zero_rows
from kvgeom.plan.regionmap import region_zero_rows

from ..devicebytes import ByteRegion, regroup_blocks, zero_rows
from ._common import KVI


@dataclass(frozen=True)
class _Page:
    """One cache tensor as a region of kvgeom's zero rows: ``index`` into the caller's list."""

    index: int
    block_stride: int
    block_len: int


def _page_geometry(cache: Any) -> tuple[int, int, int, int, bool]:
    """``(heads, tokens, head_bytes, block_stride, head_major)`` of an attention cache viewed as
    ``[B, H, N, C]``."""
    _, heads, tokens, c = cache.shape
    esize = cache.element_size()
    head_major = heads == 1 or cache.stride(1) > cache.stride(2)
    return int(heads), int(tokens), int(c) * esize, int(cache.stride(0)) * esize, bool(head_major)


def post_process_device_kv_on_receive(
    self: Any, block_size_ratio: int, block_ids_list: list[tuple[int, list[int], int]], convert: bool = True
) -> None:
    """``post_process_device_kv_on_receive``: per attention group, the blocks that arrived as ``bsr`` finer
    remote pages are regrouped (head-major layouts), then every byte past the ``covered`` remote units is
    zeroed (kvgeom's zero rows: whole stale blocks, and the token tail of the last partly covered one).
    The LBHNC-into-LBNHC permute (``enable_permute_local_kv``, B.6.15) is kvgeom's token-major regroup:
    blocks that arrived as ``bsr`` head-major pages are stored token-major, at every ``bsr``."""
    if len(self.device_kv_caches) == 0:
        return
    bsr = check_positive_int(block_size_ratio, "block_size_ratio", error=PlanError)
    block_contiguous = KVI.KVCacheLayout[self.kv_cache_layout].is_block_contiguous
    for group, block_ids, covered in block_ids_list:
        caches = [
            self.device_kv_caches[name] for name in self.kv_cache_config.transfer_groups[group].layer_names
        ]
        if not caches:
            continue
        ids = np.asarray(block_ids, dtype=np.int64)
        if convert:
            for cache in caches:
                if self.enable_permute_local_kv or block_contiguous:
                    heads, tokens, head_bytes, stride, _ = _page_geometry(cache)
                    regroup_blocks(
                        ByteRegion.at(cache, cache.data_ptr()),
                        ids,
                        stride,
                        bsr,
                        heads,
                        tokens,
                        head_bytes,
                        token_major=bool(self.enable_permute_local_kv),
                    )
        geoms = [_page_geometry(c) for c in caches]
        heads, tokens, head_bytes, _, head_major = geoms[0]
        pages = [_Page(k, g[3], g[0] * g[1] * g[2]) for k, g in enumerate(geoms)]
        rows = consumer_zero_rows(pages, ids, bsr, 0, int(covered), tokens, heads if head_major else 1)
        zero_rows([ByteRegion.at(c, c.data_ptr()) for c in caches], rows)


def region_bytes(self: Any) -> list[ByteRegion]:
    """Every registered region of this rank as flat bytes (its cache tensor's storage, from the region's
    base address)."""
    bases = self.kv_caches_base_addr[self.engine_id][self.tp_rank]
    return [ByteRegion.at(self.device_kv_caches[name], base) for name, base in zip(self.region_names, bases)]


def zero_region_blocks(self: Any, block_ids: Any) -> None:
    """``_zero_region_blocks``: clear pages region by region (:func:`kvgeom.plan.regionmap.region_zero_rows`),
    except the shared host pool another rank writes. In kvgeom mode vLLM hands over kvgeom's whole
    post-receive step here (:class:`kvgeom_vllm.kvgeom_mode.Receive`), which runs instead."""
    apply = getattr(block_ids, "apply", None)
    if apply is not None:
        apply(self)
        return
    if not any(block_ids):
        return
    keep = [
        [] if self._skip_dram_xfer and self.region_mem_types[r] == "DRAM" else list(ids)
        for r, ids in enumerate(block_ids)
    ]
    rows = region_zero_rows(keep, self.block_len_per_layer, self.block_stride_per_layer)
    zero_rows(region_bytes(self), rows)
