"""Where each logical coordinate of a request lives on one engine rank: an independent model.

This module restates kvgeom's physical layout from first principles, per element, for clarity. It
reads from :func:`~kvgeom.layout.allocate.rank_geometry` only what is *allocated* (region sizes, which layer
views which region, the groups) and uses the specs' sharding rules (:class:`~kvgeom.model.layers.Shard`); it
never calls the planner's address arithmetic (dlists, descriptor ids, plans).

Layout facts (kernel block ``kb``, ``ppl = block_size // kb``):

* attention token ``t`` of group ``g`` is in the request's logical block ``i = (t - first) // B``,
  pool id ``ids[g][i]``, kernel block ``id * ppl + ((t - first) % B) // kb``, position ``n = t % kb``;
  with decode context parallelism (``dcp`` ranks) entry ``j`` of rank ``d``'s list holds the tokens of
  global page ``(first / (B * dcp) + j) * dcp + d``;
  kernel block ``b`` of a region starts at byte ``b * block_stride``;
* packed K|V page: head-major ``[H, kb, C]`` or token-major ``[kb, H, C]`` with
  ``C = (head_size + head_size_v) * e`` bytes per token-head, K bytes first; split K/V regions hold
  ``[H, kb, head_size * e]`` (or token-major) each; local head ``j`` is global head
  ``first_unit(rank, tp) + j``;
* MLA page ``[kb, latent * e]``;
* a packed row (block-outermost layout) holds each member layer's page at its ``Region.slot`` offset
  inside the kernel block; a pipeline stage's rank holds (and is checked on) its stage's layers only;
* an SSM state sits in its slot ``s`` at byte ``s * page`` (``page = block_stride * ppl``): the conv
  pieces in order (DS: channel-major, ``conv_kernel - 1`` rows per channel; SD: row-major over all
  channels), then the temporal state at ``conv_bytes``;
* a ring (circular buffer) fills the start of its one block's page the same way on every rank: entry-major,
  ``entry_size * e`` bytes per entry; a replicated state (PLE) page the same on every rank: channel-major,
  ``conv_kernel - 1`` rows per channel. Both are needed whole: D holds P's ring and state as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvgeom.dtypes import dtype_size
from kvgeom.layout.engine import ConvLayout, KVLayout
from kvgeom.layout.geometry import RankGeometry, Region
from kvgeom.model.layers import AttentionSpec, CircularBufferSpec, MambaSpec, MLASpec, ReplicatedStateSpec
from kvgeom.testing._coords import CoordSpace, LayoutError

__all__ = [
    "OUTSIDE",
    "PADDING",
    "NEEDED",
    "OPTIONAL",
    "RankImage",
    "rank_image",
    "region_arrays",
    "byte_places",
    "block_span",
    "reported_bytes",
    "LayoutError",
]

OUTSIDE, PADDING, NEEDED, OPTIONAL = 0, 1, 2, 3
"""Byte roles: outside the request's blocks; padding inside them (no coordinate); a coordinate the
request needs; a coordinate it may hold or not (tokens at or past ``num_tokens``)."""


@dataclass
class RankImage:
    """One rank's bytes for one request: per region, the coordinate tag each byte should hold
    (``-1``: none) and its role."""

    rank: int
    tags: list[np.ndarray]
    role: list[np.ndarray]

    @classmethod
    def empty(cls, geom: RankGeometry) -> RankImage:
        return cls(geom.global_rank, region_arrays(geom, -1, np.int64), region_arrays(geom, 0, np.int8))

    def put(self, region: int, offsets: np.ndarray, tags: np.ndarray, role: np.ndarray | int) -> None:
        offsets, tags = np.broadcast_arrays(offsets, tags)
        role = np.broadcast_to(role, offsets.shape)
        if offsets.size and int(offsets.max()) >= self.tags[region].size:
            raise LayoutError(
                f"regions[{region}]",
                f"rank {self.rank}: content at byte {int(offsets.max())} past the region's "
                f"{self.tags[region].size} bytes",
                value=int(offsets.max()),
                expected=int(self.tags[region].size),
            )
        self.tags[region][offsets] = tags
        self.role[region][offsets] = role

    def claim(self, region: int, start: int, length: int) -> None:
        """Mark ``[start, start + length)`` as the request's (padding until content is put there)."""
        view = self.role[region][start : start + length]
        view[view == OUTSIDE] = PADDING


def region_arrays(geom: RankGeometry, fill: int, dtype: type) -> list[np.ndarray]:
    """One array per region, ``nbytes`` long, filled with ``fill``: separate arrays, or, where regions share rows
    (:attr:`~kvgeom.layout.geometry.Region.row_offset`, vLLM's packed CSA-linear rows), views of one array of the
    rank's rows, so that a byte written through one region is seen through every region that aliases it."""
    sizes = [r.nbytes for r in geom.regions]
    if all(r.row_offset is None for r in geom.regions):
        return [np.full(n, fill, dtype=dtype) for n in sizes]
    offsets = [r.row_offset or 0 for r in geom.regions]
    rows: np.ndarray = np.full(max(o + n for o, n in zip(offsets, sizes)), fill, dtype=dtype)
    return [rows[o : o + n] for o, n in zip(offsets, sizes)]


def reported_bytes(geom: RankGeometry) -> list[np.ndarray] | None:
    """Where regions share rows, which bytes each region reports (so that a byte seen through several
    regions is judged once): a byte belongs to the shortest region whose block holds it (the most specific
    view: a state page's own region before the main-KV page it overlaps), ties to the lower index; bytes in no
    region's block to the first region that views them (region 0 for every byte of the rows; a later region for
    the bytes its span reaches past the last row, so that a write there is judged too). ``None`` for regions of
    their own (each reports all of its bytes)."""
    if all(r.row_offset is None for r in geom.regions):
        return None
    owner = region_arrays(geom, -1, np.int64)
    for r in sorted(geom.regions, key=lambda r: (r.block_len, r.index)):
        view = owner[r.index].reshape(-1, r.block_stride)[:, : r.block_len]
        view[view < 0] = r.index
    for r in geom.regions:  # past every region's block: the first region viewing the byte
        owner[r.index][owner[r.index] < 0] = r.index
    return [o == r.index for r, o in zip(geom.regions, owner)]


def block_span(region: Region, block: int, ppl: int) -> tuple[int, int]:
    """``(start, length)`` in ``region``'s bytes of logical block ``block`` (``ppl`` kernel blocks): its rows,
    ``ppl * block_stride`` bytes; where regions share rows, the part of them from the region's start to the
    end of the block's rows (the bytes before it belong to the region at the row's start, the bytes after it
    to the next block)."""
    span = ppl * region.block_stride
    return block * span, span - (region.row_offset or 0)


def byte_places(geom: RankGeometry, region: int) -> tuple[int, np.ndarray]:
    """``(region, offsets)`` naming each byte of ``region`` by place: its own, or, where regions share rows,
    region 0's row bytes (the same place through every aliasing region)."""
    r = geom.regions[region]
    if r.row_offset is None:
        return region, np.arange(r.nbytes, dtype=np.int64)
    return 0, r.row_offset + np.arange(r.nbytes, dtype=np.int64)


def _regions_of(geom: RankGeometry, layer: str) -> list[Region]:
    found = [r for r in geom.regions if any(name == layer for _, name in r.members)]
    if not found:
        raise LayoutError("layer", f"{layer!r} views no region of rank {geom.tp_rank}", value=layer)
    return found


def rank_image(
    geom: RankGeometry, space: CoordSpace, ids: Sequence[Sequence[int]], first_token: int, num_tokens: int
) -> RankImage:
    """Expected bytes of rank ``geom`` holding a request whose attention blocks ``ids[g]`` start at token
    ``first_token`` (a multiple of the logical block) and whose SSM groups hold one slot ``ids[g][0]``."""
    img = RankImage.empty(geom)
    ppl = geom.ppl
    for gids in ids:  # a pool id belongs to the request in every region, whichever layers view it
        for block in gids:
            for region in geom.regions:
                img.claim(region.index, *block_span(region, block, ppl))

    for group, gids in zip(geom.groups, ids, strict=True):
        blocks = np.asarray(gids, dtype=np.int64)
        for layer in group.layers:
            spec = next(la.spec for la in geom.model.layers if la.name == layer)
            for region in _regions_of(geom, layer):
                if isinstance(spec, MambaSpec):
                    for slot in blocks:
                        _place_state(img, geom, spec, layer, region, int(slot), space)
                elif isinstance(spec, (CircularBufferSpec, ReplicatedStateSpec)):
                    for slot in blocks:
                        _place_replicated(img, geom, spec, layer, region, int(slot), space)
                else:
                    _place_tokens(img, geom, spec, layer, region, blocks, first_token, num_tokens, space)
    return img


def _place_tokens(
    img: RankImage,
    geom: RankGeometry,
    spec: AttentionSpec | MLASpec,
    layer: str,
    region: Region,
    blocks: np.ndarray,
    first_token: int,
    num_tokens: int,
    space: CoordSpace,
) -> None:
    eng = geom.engine
    bs, kb, ppl = eng.block_size, eng.kernel, eng.ppl
    pos = np.arange(blocks.size * bs, dtype=np.int64)  # position within the request's blocks
    # list entry j of DCP rank d holds global page (first + j) * dcp + d (dcp 1: the request's j-th block)
    first_block = first_token // eng.scheduler_block
    tokens = ((first_block + pos // bs) * eng.dcp_size + eng.dcp_rank) * bs + pos % bs
    kblock = blocks[pos // bs] * ppl + (pos % bs) // kb
    n = pos % kb
    role = np.where(tokens < num_tokens, NEEDED, OPTIONAL)[:, None]
    offset, page = region.slot(layer)  # a packed row holds each layer's page at its own offset
    block_start = kblock * region.block_stride + offset
    if isinstance(spec, MLASpec):
        width = spec.latent_size * dtype_size(spec.dtype)
        _check_fits(region, kb * width, page)
        b = np.arange(width)
        img.put(
            region.index,
            (block_start + n * width)[:, None] + b[None, :],
            space.tag(layer, "latent", tokens[:, None], b[None, :]),
            role,
        )
        return
    e = dtype_size(spec.dtype)
    k_bytes, v_bytes = spec.head_size * e, spec.v_size * e
    parts = {"kv": [(0, 0, k_bytes), (1, k_bytes, v_bytes)], "k": [(0, 0, k_bytes)], "v": [(1, 0, v_bytes)]}
    pieces = parts[region.part]
    c = sum(size for _, _, size in pieces)  # bytes per token-head in this region
    heads = spec.heads.units_per_rank(geom.tp_size)
    first_head = spec.heads.first_unit(geom.tp_rank, geom.tp_size)
    _check_fits(region, heads * kb * c, page)
    for j in range(heads):
        for kv, inner, size in pieces:
            b = np.arange(size)
            if eng.kv_layout is KVLayout.HEAD_MAJOR:  # [heads, tokens, K|V]
                where = (j * kb * c + n * c + inner)[:, None] + b[None, :]
            elif eng.kv_layout is KVLayout.HEAD_KV_MAJOR and not kv:  # CPU page, K half: [head_size, tokens]
                where = j * kb * c + ((b // e)[None, :] * kb + n[:, None]) * e + (b % e)[None, :]
            elif eng.kv_layout is KVLayout.HEAD_KV_MAJOR:  # CPU page, V half: [tokens, head_size] rows
                where = (j * kb * c + inner * kb + n * size)[:, None] + b[None, :]
            else:  # [tokens, heads, K|V]
                where = (n * heads * c + j * c + inner)[:, None] + b[None, :]
            img.put(
                region.index,
                np.asarray(block_start)[..., None] + where,
                space.tag(layer, "kv", tokens[:, None], first_head + j, kv, b[None, :]),
                role,
            )


def _check_fits(region: Region, content: int, page: int) -> None:
    if content > page:
        raise LayoutError(
            f"regions[{region.index}]",
            f"({region.name}): {content} content bytes per kernel block exceed the page of {page} bytes",
            value=content,
            expected=page,
        )


def _place_state(
    img: RankImage,
    geom: RankGeometry,
    spec: MambaSpec,
    layer: str,
    region: Region,
    slot: int,
    space: CoordSpace,
) -> None:
    tp, rank = geom.tp_size, geom.tp_rank
    page = region.block_stride * geom.ppl
    base = slot * page
    e = dtype_size(spec.conv_dtype)
    rows = spec.conv_rows
    channels = [p.elems_per_rank(tp) for p in spec.conv_pieces]
    conv_dim = sum(channels)
    r = np.arange(rows)[None, :, None]
    b = np.arange(e)[None, None, :]
    start = 0
    for name, piece, count in zip(spec.piece_names, spec.conv_pieces, channels):
        c = np.arange(count)[:, None, None]
        global_channel = piece.first_unit(rank, tp) * piece.unit_elems + c
        if geom.engine.conv_layout is ConvLayout.DS:
            offsets = (start + c) * rows * e + r * e + b
        else:
            offsets = r * conv_dim * e + (start + c) * e + b
        img.put(region.index, base + offsets, space.tag(layer, name, global_channel, r, b), NEEDED)
        start += count
    conv_bytes = conv_dim * rows * e
    es = dtype_size(spec.ssm_dtype)
    count = spec.temporal.elems_per_rank(tp)
    if conv_bytes + count * es > page:
        raise LayoutError(
            layer,
            f"a {conv_bytes + count * es}-byte state does not fit its {page}-byte page",
            value=conv_bytes + count * es,
            expected=page,
        )
    i = np.arange(count)[:, None]
    b2 = np.arange(es)[None, :]
    global_elem = spec.temporal.first_unit(rank, tp) * spec.temporal.unit_elems + i
    img.put(
        region.index, base + conv_bytes + i * es + b2, space.tag(layer, "temporal", global_elem, b2), NEEDED
    )


def _place_replicated(
    img: RankImage,
    geom: RankGeometry,
    spec: CircularBufferSpec | ReplicatedStateSpec,
    layer: str,
    region: Region,
    slot: int,
    space: CoordSpace,
) -> None:
    """A page every rank holds whole: a ring (entries x entry bytes) or a replicated state (channels x rows x
    bytes), from the start of slot ``slot``'s page."""
    page = region.block_stride * geom.ppl
    dims: tuple[int, ...]
    if isinstance(spec, CircularBufferSpec):
        width = spec.entry_size * dtype_size(spec.dtype)
        dims = (spec.capacity, width)
        part = "ring"
    else:
        e = dtype_size(spec.dtype)
        dims = (spec.channels, spec.conv_rows, e)
        part = "state"
    size = int(np.prod(dims))
    if size > page:
        raise LayoutError(
            layer, f"a {size}-byte page does not fit its {page}-byte slot", value=size, expected=page
        )
    index = np.unravel_index(np.arange(size), dims)
    img.put(region.index, slot * page + np.arange(size), space.tag(layer, part, *index), NEEDED)
