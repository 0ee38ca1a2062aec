"""A rank's transfer streams as numbers (:class:`EngineView`), and the one pseudo-address.

A **pseudo-address** names byte ``offset`` of region ``region`` as ``region << 44 | offset``, so that
address-free tables and routes can reuse address arithmetic; :func:`pseudo` and :func:`unpseudo` are the
only encoder and decoder. :data:`SHARED_GROUP` is the group id of a region several KV-cache groups view.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = ["EngineView", "OFFSET_MASK", "REGION_SHIFT", "SHARED_GROUP", "pseudo", "pseudo_bases", "unpseudo"]

REGION_SHIFT = 44
OFFSET_MASK = (1 << REGION_SHIFT) - 1
SHARED_GROUP = -1  # a region's group id when several KV-cache groups view it


def pseudo(region: int, offset: int = 0) -> int:
    """A pseudo-address: byte ``offset`` of region ``region`` (``region << 44 | offset``)."""
    return (region << REGION_SHIFT) | offset


def unpseudo(address: int) -> tuple[int, int]:
    """``(region, offset)`` of a pseudo-address."""
    return address >> REGION_SHIFT, address & OFFSET_MASK


def pseudo_bases(count: int) -> list[int]:
    """The first byte of each of ``count`` regions as a pseudo-address."""
    return [pseudo(r) for r in range(count)]


@dataclass(frozen=True)
class EngineView:
    """The transfer-relevant numbers of one rank (what a handshake tells the peer).

    Built from a :class:`~kvgeom.layout.geometry.RankGeometry` by :meth:`of`; kept separate so that a peer's
    advertised numbers can be rescaled (non-dividing block sizes) without touching its geometry.

    The per-region tuples describe the rank's **streams**: runs of kernel blocks, one row per block, as a
    transfer pairs them (:mod:`kvgeom.pair.streams`). By default stream ``r`` is region ``r``; ``bases`` (one
    pseudo-address ``region << 44 | offset`` each) lets a stream start inside a region's block (a layer's
    page in a packed row) and several streams view one region (a region's member layers, each with its own
    group: ``transfer_groups``, vLLM's layer-name routing). ``group_ids`` are the streams' KV-cache groups
    (``-1``: several) where they differ (region-mapped descriptor ids).
    """

    tp_size: int
    tp_rank: int
    block_size: int
    ppl: int
    num_blocks: int
    block_lens: tuple[int, ...]
    block_strides: tuple[int, ...]
    region_is_mla: tuple[bool, ...]
    ssm_region_indices: tuple[int, ...]
    ssm_sizes: tuple[int, int] | None
    conv_offsets: tuple[tuple[int, int], ...] | None
    bases: tuple[int, ...] = ()
    group_ids: tuple[int, ...] = ()
    transfer_groups: tuple[int, ...] = ()
    scratch_region_indices: tuple[int, ...] = ()
    ple_region: int | None = None
    ple_len: int = 0
    group_streams: bool = False
    """Each token group's ids go only through the streams of its ``group_ids`` (kvgeom mode's packed
    CSA-linear rows: :func:`kvgeom.pair.streams.packed_streams`)."""

    @classmethod
    def of(
        cls, geom: Any
    ) -> EngineView:  # a RankGeometry (not imported: geometry imports this module's constants)
        return cls(
            geom.tp_size,
            geom.tp_rank,
            geom.block_size,
            geom.ppl,
            geom.num_blocks,
            tuple(r.block_len for r in geom.regions),
            tuple(r.block_stride for r in geom.regions),
            geom.region_is_mla,
            geom.ssm_region_indices,
            geom.ssm.sizes if geom.ssm else None,
            geom.ssm.conv_offsets if geom.ssm else None,
            scratch_region_indices=geom.scratch_region_indices,
            ple_region=geom.ple.region if geom.ple else None,
            ple_len=geom.ple.length // geom.ppl if geom.ple else 0,
        )

    @property
    def num_regions(self) -> int:
        return len(self.block_lens)

    @property
    def logical_num_blocks(self) -> int:
        return self.num_blocks // self.ppl

    @property
    def num_conv_pieces(self) -> int:
        return len(self.conv_offsets) if self.conv_offsets else 0

    def region_bytes(self) -> tuple[int, ...]:
        return tuple(self.num_blocks * s for s in self.block_strides)

    def pseudo_bases(self) -> list[int]:
        """Each stream's first byte as a pseudo-address (``region << 44 | offset``)."""
        return list(self.bases) if self.bases else pseudo_bases(self.num_regions)

    def rescaled(self, split: int) -> EngineView:
        """The same memory seen at ``split``-times finer blocks (vLLM B.6.7): block size / split, ppl and
        block counts x split, lengths / split, strides := lengths."""
        lens = tuple(x // split for x in self.block_lens)
        return replace(
            self,
            block_size=self.block_size // split,
            ppl=self.ppl * split,
            num_blocks=self.num_blocks * split,
            block_lens=lens,
            block_strides=lens,
        )
