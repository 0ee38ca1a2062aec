"""vLLM 0.33.0's block-outermost allocation of a CSA-linear model and what its NIXL worker registers from it
(docs/vllm-behaviour.md B.6.14, "Allocation").

A CSA-linear model's caches have pages of different sizes, so vLLM lays them out block-outermost (``BLHNC``):
one *row* of ``row_bytes`` per block, the same for every KV-cache group. Every group starts at byte 0 of the
row and holds its layers' pages side by side (each spec's pages together, specs in first-appearance order:
a head-sharded main KV and the MLA compressed keys share one group); ``row_bytes`` is the widest group's sum of
pages rounded up to the pages' common stride alignment. Groups overlay each other, which is safe because a
block id belongs to one group of one request at a time.

The NIXL worker then registers one region per distinct view start (layers visited in registration order):
a view starting where an earlier one started joins that region (MLA views set its length; views of
different groups make its group id -1, *shared*), else it opens a region ``(offset, page, row_bytes)``. When
there is no SSM state, an MLA view registers the whole row instead (its region
starts at byte 0, ``row_bytes`` long), so only ring pages past the row start keep regions of their own. Rings
mark their regions as *scratch* (sorted), sharded states as *SSM* regions (first-seen order), and the
replicated state page records its region and its own page length, which may exceed the region's length.

:func:`packed_row_offsets` is the allocation, :func:`packed_registration` the registration of a model's
layers (values per logical block; :attr:`PackedRegistration.kernel_lens` per kernel block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvgeom.errors import ConfigError, SpecError
from kvgeom.layout.geometry import page_bytes_of
from kvgeom.layout.view import SHARED_GROUP
from kvgeom.model.layers import (
    AttentionSpec,
    CircularBufferSpec,
    LayerSpec,
    MambaSpec,
    MLASpec,
    ReplicatedStateSpec,
)
from kvgeom.model.spec import ModelSpec

__all__ = [
    "RowView",
    "RowRegion",
    "PackedRegistration",
    "packed_row_offsets",
    "packed_groups",
    "packed_registration",
]

"""A region's group id when views of several groups register it (vLLM ``_SHARED_REGION_GROUP_ID``)."""


@dataclass(frozen=True)
class RowView:
    """One layer's page in a block row: ``offset`` and ``length`` bytes, of KV-cache group ``group``."""

    name: str
    group: int
    offset: int
    length: int


@dataclass(frozen=True)
class RowRegion:
    """One registered region of a packed CSA-linear rank: blocks start ``offset`` bytes into each row and
    are ``block_len`` bytes long (the row is the stride); ``members`` are the layers whose views start there."""

    offset: int
    block_len: int
    group: int
    is_mla: bool
    members: tuple[str, ...]


@dataclass(frozen=True)
class PackedRegistration:
    """The row, the layers' views and the regions vLLM's worker registers from them."""

    row_bytes: int
    views: tuple[RowView, ...]
    regions: tuple[RowRegion, ...]
    scratch: tuple[int, ...]
    ssm: tuple[int, ...]
    ple: tuple[int, int] | None
    """``(region index, page length)`` of the replicated state page (vLLM ``_ple_block_len``), or ``None``."""

    def kernel_lens(self, ppl: int) -> tuple[tuple[int, int], ...]:
        """Per region ``(block_len, block_stride)`` per kernel block: vLLM divides a logical block's length and
        stride by ``ppl`` (physical blocks per logical block)."""
        if ppl < 1 or self.row_bytes % ppl or any(r.block_len % ppl for r in self.regions):
            raise ConfigError(
                "kernel_block_size",
                f"the {self.row_bytes}-byte row and its regions' lengths do not split into {ppl} kernel blocks",
                value=ppl,
                expected=self.row_bytes,
            )
        return tuple((r.block_len // ppl, self.row_bytes // ppl) for r in self.regions)


def packed_row_offsets(
    pages_by_group: Sequence[Sequence[int]], alignment: int = 1
) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """``(row_bytes, offsets)``: every group's pages side by side from byte 0 of a row (``offsets[g][i]`` is
    the start of group ``g``'s ``i``-th page), the row the widest group rounded up to ``alignment``
    (pages ``[256, 256]`` and ``[64, 64]`` -> row 512, offsets ``(0, 256)`` and ``(0, 64)``)."""
    if alignment < 1:
        raise ConfigError("alignment", "needs a positive stride alignment", value=alignment)
    if not pages_by_group or any(not pages for pages in pages_by_group):
        raise ConfigError(
            "groups", "needs at least one group, each with at least one page", value=len(pages_by_group)
        )
    offsets: list[tuple[int, ...]] = []
    widest = 0
    for g, pages in enumerate(pages_by_group):
        arr = np.asarray(pages, dtype=np.int64)
        if (arr < 1).any():
            raise ConfigError(f"groups[{g}]", "pages must be at least one byte", value=[int(x) for x in arr])
        ends = np.cumsum(arr)
        offsets.append(tuple(int(x) for x in ends - arr))
        widest = max(widest, int(ends[-1]))
    return -(-widest // alignment) * alignment, tuple(offsets)


def packed_groups(model: ModelSpec, block_size: int, tp_size: int = 1) -> tuple[tuple[str, ...], ...]:
    """vLLM's KV-cache groups of a CSA-linear model in a block-outermost layout (its packed grouping): one
    bucket of layers per spec, except that full-attention token caches (head-sharded main KV and MLA pages)
    share one bucket, buckets in the order their first layer appears; a token-cache bucket is one
    group (its pages side by side), while a ring or state bucket is split so that each group's pages fit the
    widest bucket's row, ``n = ceil(layers / max(anchor // page, 1))`` groups, group ``i`` holding layers
    ``i, i + n, ...`` (``anchor``: the widest token bucket's pages summed, or the largest state or ring page).
    Sliding-window caches split like states."""
    buckets: dict[object, list[str]] = {}
    for la in model.layers:
        buckets.setdefault(_bucket(la.spec), []).append(la.name)
    specs = {la.name: la.spec for la in model.layers}
    page = {name: page_bytes_of(spec, block_size, tp_size) for name, spec in specs.items()}
    anchor = max(
        page[names[0]] if _is_state(specs[names[0]]) else sum(page[x] for x in names)
        for names in buckets.values()
    )
    groups: list[tuple[str, ...]] = []
    for names in buckets.values():
        n = -(-len(names) // max(anchor // page[names[0]], 1)) if _is_state(specs[names[0]]) else 1
        groups.extend(tuple(names[i::n]) for i in range(n))
    return tuple(groups)


def _bucket(spec: LayerSpec) -> object:
    """vLLM's packed bucket of a layer: full-attention token caches (head-sharded main KV and MLA pages) share
    one slot type, hence one bucket; any other spec is a bucket of its own."""
    if isinstance(spec, (AttentionSpec, MLASpec)) and spec.sliding_window is None:
        return "full-attention tokens"
    return spec


def _by_spec(names: Sequence[str], specs: dict[str, LayerSpec]) -> list[str]:
    """``names`` with each spec's layers together, specs in the order their first layer appears (stable)."""
    first: dict[LayerSpec, int] = {}
    for n in names:
        first.setdefault(specs[n], len(first))
    return sorted(names, key=lambda n: first[specs[n]])


def _is_state(spec: LayerSpec) -> bool:
    """Split like a state bucket: rings, SSM states and sliding-window caches (vLLM's packed grouping)."""
    if isinstance(spec, (CircularBufferSpec, MambaSpec, ReplicatedStateSpec)):
        return True
    return isinstance(spec, MLASpec) and spec.sliding_window is not None


def _check_groups(model: ModelSpec, groups: Sequence[Sequence[str]], specs: dict[str, LayerSpec]) -> None:
    """Every layer of ``model`` in exactly one group, each group's layers of one kind (attention and MLA
    together allowed)."""
    seen: dict[str, int] = {}
    for g, names in enumerate(groups):
        for name in names:
            if name not in specs:
                raise SpecError(
                    "groups", f"layer {name!r} of group {g} is not a layer of {model.name!r}", value=name
                )
            if name in seen:
                raise SpecError("groups", f"layer {name!r} is in groups {seen[name]} and {g}", value=name)
            seen[name] = g
    missing = [name for name in specs if name not in seen]
    if missing:
        raise SpecError("groups", f"layers {missing} are in no group", value=missing)
    for g, names in enumerate(groups):
        kinds = {type(specs[n]) for n in names}
        if len(kinds) > 1 and kinds != {AttentionSpec, MLASpec}:
            raise SpecError(
                f"groups[{g}]",
                "a KV-cache group holds layers of one kind",
                value=sorted(k.__name__ for k in kinds),
            )


def packed_registration(
    model: ModelSpec,
    groups: Sequence[Sequence[str]],
    *,
    block_size: int,
    tp_size: int = 1,
    alignment: int = 1,
    order: Sequence[str] | None = None,
) -> PackedRegistration:
    """vLLM's block-outermost allocation of ``model``'s layers in KV-cache ``groups`` (layer names per group,
    in vLLM's group order) at ``block_size`` and ``tp_size``, and the regions its worker registers visiting
    the layers in ``order`` (default: the model's layer order)."""
    if not model.is_csa_linear:
        raise SpecError(
            "model", "packed CSA-linear registration needs a circular-buffer layer", value=model.name
        )
    specs = {la.name: la.spec for la in model.layers}
    _check_groups(model, groups, specs)
    visit = list(order) if order is not None else list(specs)
    if sorted(visit) != sorted(specs):
        raise SpecError("order", "the registration order must name every layer once", value=visit)
    # within a group each spec's pages lie together, specs in first-appearance order (vLLM's planner)
    placed = [_by_spec(names, specs) for names in groups]
    pages = [[page_bytes_of(specs[n], block_size, tp_size) for n in names] for names in placed]
    row, offsets = packed_row_offsets(pages, alignment)
    where = {
        n: (g, off, page)
        for g, names in enumerate(placed)
        for n, off, page in zip(names, offsets[g], pages[g])
    }
    views = tuple(RowView(n, *where[n]) for n in visit)
    # Without SSM state an MLA view registers the whole row (vLLM: one shared storage, MLA, no Mamba); a
    # head-sharded main-KV view always registers its own page.
    return _row_regions(views, specs, row, whole_rows=model.ssm_spec is None)


def _row_regions(
    views: tuple[RowView, ...], specs: dict[str, LayerSpec], row: int, *, whole_rows: bool
) -> PackedRegistration:
    """The regions registered visiting ``views`` in order: one per distinct start in the row (an MLA view
    of a model without SSM state starts at 0 and spans the ``row``), each with its members, and which
    regions hold SSM states, rings and the replicated state page."""
    starts: list[int] = []
    lens: list[int] = []
    gids: list[int] = []
    mla: list[bool] = []
    members: list[list[str]] = []
    ssm: list[int] = []
    scratch: set[int] = set()
    ple: tuple[int, int] | None = None
    for v in views:
        spec = specs[v.name]
        is_mla = isinstance(spec, MLASpec)
        start, length = (0, row) if whole_rows and is_mla else (v.offset, v.length)
        if start in starts:
            r = starts.index(start)
            mla[r] |= is_mla
            if is_mla:
                lens[r] = length
            if gids[r] != v.group:
                gids[r] = SHARED_GROUP
            members[r].append(v.name)
        else:
            r = len(starts)
            starts.append(start)
            lens.append(length)
            gids.append(v.group)
            mla.append(is_mla)
            members.append([v.name])
        if isinstance(spec, ReplicatedStateSpec):
            ple = (r, v.length)
        elif isinstance(spec, MambaSpec):
            if r not in ssm:
                ssm.append(r)
        elif isinstance(spec, CircularBufferSpec):
            scratch.add(r)
    regions = tuple(
        RowRegion(s, n, g, m, tuple(mem)) for s, n, g, m, mem in zip(starts, lens, gids, mla, members)
    )
    return PackedRegistration(row, views, regions, tuple(sorted(scratch)), tuple(ssm), ple)
