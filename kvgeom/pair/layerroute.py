"""Matching regions by layer name: pipeline-parallel producers and packed (block-outermost) rows.

Without help, a transfer pairs region ``i`` of P with region ``i`` of D. Three cases break that:

* **pipeline parallelism (push producer, PP > 1)**: a P stage holds a contiguous slice of the layers, D
  (PP 1) all of them. Without hybrid groups the stage takes D's regions ``[regions_per_layer *
  start_layer, + local regions)`` (:func:`slice_regions`). With hybrid groups (HMA) or packed rows,
  regions are matched **by name**: the stage's *transfer layers* (each member of each region, in region
  order, with its own group; :func:`transfer_layers`) each get the D region holding that layer
  (:func:`align_regions_by_layer`), and descriptor ids follow the transfer layers (layer-name routing,
  :func:`kvgeom.plan.descids.desc_segments` path 1). vLLM PR 41218.
* **packed rows**: a block-outermost layout (``BLHNC``) of an MLA model holds every layer's page of a
  block in one row; vLLM registers the row once, so one descriptor moves a block of every layer. A peer
  with per-layer regions reads the row as one *virtual region* per layer at the layer's offset in the
  row (:func:`split_packed_rows`).

Regions are described by :class:`RegionTable`, the fields a NIXL handshake advertises. Every function
returns a new table and refuses (:class:`~kvgeom.errors.IncompatiblePairError`) what vLLM asserts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvgeom.errors import GroupMismatchError, IncompatiblePairError, UnsupportedError
from kvgeom.layout.view import SHARED_GROUP

__all__ = [
    "RegionTable",
    "region_sort_key",
    "transfer_layers",
    "align_regions_by_layer",
    "split_packed_rows",
    "slice_regions",
    "pp_region_offset",
]


_DIGITS = re.compile(r"(\d+)")


def region_sort_key(layer_name: str) -> tuple[tuple[int, int | str], ...]:
    """Natural layer order: digit runs compare as integers and sort before text (``layers.2`` before
    ``layers.10``), the order vLLM registers regions in (except CSA-linear models: registration order)."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in _DIGITS.split(layer_name))


@dataclass(frozen=True)
class RegionTable:
    """A rank's advertised regions: base addresses, block lengths and strides, per-region block counts
    and group ids (``None``: not advertised), names, memory types, member layers, and the packed rows'
    ``{layer: (offset in row, page bytes)}``."""

    bases: tuple[int, ...]
    block_lens: tuple[int, ...]
    block_strides: tuple[int, ...]
    num_blocks: tuple[int, ...] | None = None
    group_ids: tuple[int, ...] | None = None
    names: tuple[str, ...] | None = None
    mem_types: tuple[str, ...] | None = None
    members: tuple[tuple[str, ...], ...] = ()
    packed: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.bases)
        for name in ("block_lens", "block_strides", "num_blocks", "group_ids", "names", "mem_types"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise GroupMismatchError(
                    name, f"{len(value)} entries for {n} regions", value=len(value), expected=n
                )

    def __len__(self) -> int:
        return len(self.bases)

    def _take(self, picks: Sequence[int]) -> dict[str, Any]:
        def pick(values: Sequence[Any] | None) -> tuple[Any, ...] | None:
            return None if values is None else tuple(values[i] for i in picks)

        return dict(
            bases=pick(self.bases),
            block_lens=pick(self.block_lens),
            block_strides=pick(self.block_strides),
            num_blocks=pick(self.num_blocks),
            group_ids=pick(self.group_ids),
            names=pick(self.names),
            mem_types=pick(self.mem_types),
        )


def transfer_layers(
    region_members: Sequence[Sequence[str]], group_of_layer: Mapping[str, int]
) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """The transfer layers of layer-name routing (vLLM ``_set_region_layers``): every member layer of every
    region, in region order, as ``(names, region of each, group of each)``. A layer in two regions or in
    no group is refused."""
    names = [name for members in region_members for name in members]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise GroupMismatchError("region_members", f"layers {dup} span several regions", value=dup)
    missing = [n for n in names if n not in group_of_layer]
    if missing:
        raise GroupMismatchError(
            "region_members", f"layers {missing} belong to no KV-cache group", value=missing
        )
    regions = tuple(r for r, members in enumerate(region_members) for _ in members)
    return tuple(names), regions, tuple(int(group_of_layer[n]) for n in names)


def align_regions_by_layer(
    remote: RegionTable,
    layer_names: Sequence[str],
    layer_regions: Sequence[int],
    local_block_lens: Sequence[int],
) -> RegionTable:
    """The remote's regions in this stage's transfer-layer order (vLLM ``_align_remote_regions_by_layer``):
    remote region of each of ``layer_names`` (found by its members), with a packed remote row narrowed to
    the layer's page (``base += offset``, ``len = page``, which must equal the local region's length and lie
    inside the row). The result has one region per transfer layer, named after it."""
    by_layer = _region_of_layer(remote)
    missing = [n for n in layer_names if n not in by_layer]
    if missing:
        raise IncompatiblePairError("region_members", f"the remote lacks layers {missing}", value=missing)
    picks = [by_layer[n] for n in layer_names]
    packed_regions = {by_layer[n] for n in remote.packed if n in by_layer}
    fields = remote._take(picks)
    bases, lens = list(fields["bases"]), list(fields["block_lens"])
    for k, name in enumerate(layer_names):
        if picks[k] not in packed_regions:
            continue
        offset, page = _packed_page(remote, name, lens[k], int(local_block_lens[layer_regions[k]]))
        bases[k] += offset
        lens[k] = page
    fields.update(
        bases=tuple(bases), block_lens=tuple(lens), names=None if remote.names is None else tuple(layer_names)
    )
    return RegionTable(**fields, members=tuple((n,) for n in layer_names), packed={})


def _region_of_layer(remote: RegionTable) -> dict[str, int]:
    """The remote region of each layer its members name (every layer in one region only)."""
    if not remote.members:
        raise IncompatiblePairError(
            "region_members",
            "the remote advertised no region members: routing by region "
            "index would move another layer's cache",
            value=None,
        )
    if len(remote.members) != len(remote):
        raise IncompatiblePairError(
            "region_members",
            f"{len(remote.members)} member lists for {len(remote)} regions",
            local=len(remote),
            remote=len(remote.members),
        )
    by_layer: dict[str, int] = {}
    for r, members in enumerate(remote.members):
        for name in members:
            if name in by_layer:
                raise IncompatiblePairError(
                    "region_members", f"the remote lists layer {name!r} in several regions", value=name
                )
            by_layer[name] = r
    return by_layer


def _packed_page(remote: RegionTable, name: str, row_len: int, local_len: int) -> tuple[int, int]:
    """``(offset, page)`` of packed layer ``name`` in its ``row_len``-byte remote row, checked inside the row
    and as long as the local page."""
    if name not in remote.packed:
        raise IncompatiblePairError(
            "packed_member_layouts", f"packed remote layer {name!r} has no layout", value=name
        )
    offset, page = remote.packed[name]
    if not 0 <= offset < offset + page <= row_len:
        raise IncompatiblePairError(
            "packed_member_layouts",
            f"layer {name!r}'s page [{offset}, {offset + page}) escapes its {row_len}-byte row",
            value=(offset, page),
        )
    if page != local_len:
        raise IncompatiblePairError(
            "packed_member_layouts",
            f"layer {name!r}: packed page of {page} B vs local page of {local_len} B",
            local=local_len,
            remote=page,
        )
    return offset, page


def split_packed_rows(remote: RegionTable, local_region_names: Sequence[str]) -> RegionTable:
    """A remote packed row read by per-layer local regions (vLLM ``_split_remote_packed_rows``): one
    virtual region per local region name, ``(row base + offset, page, row stride)`` for a layer of the row,
    the named remote region unchanged otherwise. A shared (multi-group) row is refused."""
    if remote.names is None:
        raise IncompatiblePairError("region_names", "the remote advertised no region names", value=None)
    rows = [r for r, name in enumerate(remote.names) if name in remote.packed]
    if len(rows) != 1:
        raise IncompatiblePairError(
            "packed_member_layouts", f"expected one packed row, found {len(rows)}", value=len(rows)
        )
    row = rows[0]
    if remote.group_ids is not None and remote.group_ids[row] == SHARED_GROUP:
        raise UnsupportedError(
            "packed_member_layouts",
            "reading multi-group packed KV rows into per-layer regions "
            "is not supported; use the same KV cache layout on P and D",
            value=row,
        )
    index = {name: r for r, name in enumerate(remote.names)}
    picks, offsets, pages = [], [], []
    for name in local_region_names:
        if name in remote.packed:
            off, page = remote.packed[name]
            picks.append(row)
            offsets.append(off)
            pages.append(page)
        elif name in index:
            r = index[name]
            picks.append(r)
            offsets.append(0)
            pages.append(remote.block_lens[r])
        else:
            raise IncompatiblePairError(
                "region_names", f"the remote has no region for layer {name!r}", value=name
            )
    fields = remote._take(picks)
    fields.update(
        bases=tuple(b + o for b, o in zip(fields["bases"], offsets)),
        block_lens=tuple(pages),
        names=tuple(local_region_names),
    )
    return replace(remote, **fields, packed={})


def pp_region_offset(num_regions: int, start_layer: int, end_layer: int) -> int:
    """First remote region of a PP stage holding layers ``[start_layer, end_layer)`` without routing:
    ``regions_per_layer * start_layer`` (every layer registers the same number of regions)."""
    layers = end_layer - start_layer
    if layers <= 0 or num_regions % layers:
        raise GroupMismatchError(
            "num_regions",
            f"{num_regions} regions do not split over {layers} layers",
            value=num_regions,
            expected=layers,
        )
    return num_regions // layers * start_layer


def slice_regions(remote: RegionTable, start: int, count: int) -> RegionTable:
    """Remote regions ``[start, start + count)``: a PP stage's window of a PP-1 peer's regions."""
    if start < 0 or start + count > len(remote):
        raise IncompatiblePairError(
            "num_regions",
            f"regions [{start}, {start + count}) of a peer with {len(remote)}",
            local=count,
            remote=len(remote),
        )
    return replace(remote, **remote._take(range(start, start + count)))
