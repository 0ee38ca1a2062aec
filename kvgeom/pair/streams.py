"""Transfer streams: which bytes of a local kernel block pair with which bytes of a remote one.

A rank's descriptor table is a list of **streams**, each a run of kernel blocks (one row per block) of
one region, starting at some offset inside the block. Usually stream ``r`` is region ``r`` on both sides.
Three layouts break that, and each is a different list of streams, not a different planner:

* **pipeline stages** (:mod:`kvgeom.model.stages`): a stage holds a slice of the layers, its peer all of them;
* **packed rows** (``EngineConfig.packed_rows``): one row per block holds every layer's page (vLLM
  registers the row as one region, or, on a pipeline stage that routes by layer, one region per layer's
  page);
* a side whose regions are grouped or packed differently from the other's.

vLLM 0.33.0 (``compat="vllm"``) decides by its rules: a push stage routes **by layer name** (each member
layer of each region, with its group: the *transfer layers*) when its model needs the hybrid manager or
packs rows; a stage without that takes a **window** of the peer's regions; a per-layer rank reads a
packed peer's row as one virtual region per layer; packed rows must be packed alike on both sides
(:mod:`kvgeom.pair.layerroute` has those functions). kvgeom mode pairs identical region structures region by
region and everything else layer by layer: each layer both sides hold is one stream per side, at the
layer's page in its region (so rows packed differently, packed against per-layer regions, different block
sizes under routing, or a peer holding another stage's layers all pair).

:func:`registration` is what a vLLM worker registers and advertises for a rank (its regions, their
members and packed layouts, and the transfer layers); :func:`pair_streams` returns both sides' streams as
:class:`~kvgeom.layout.view.EngineView` values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from kvgeom.errors import IncompatiblePairError, UnsupportedError
from kvgeom.layout.geometry import RankGeometry, Region, packed_csa_rows
from kvgeom.layout.view import SHARED_GROUP, EngineView, pseudo
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.stages import stage_range
from kvgeom.modes import CompatLike, policy_of
from kvgeom.pair.layerroute import (
    RegionTable,
    align_regions_by_layer,
    pp_region_offset,
    region_sort_key,
    slice_regions,
    split_packed_rows,
)

__all__ = [
    "Registration",
    "registration",
    "hma_required",
    "region_group_ids",
    "region_mapped",
    "pair_streams",
    "PackedStream",
    "packed_streams",
]


def hma_required(geom: RankGeometry) -> bool:
    """vLLM needs its hybrid KV-cache manager for this model: a layer that is not full attention (a sliding
    window, an SSM state)."""
    return any(
        isinstance(la.spec, MambaSpec) or getattr(la.spec, "sliding_window", None) for la in geom.model.layers
    )


@dataclass(frozen=True)
class Registration:
    """A rank's regions as a vLLM 0.33.0 worker registers and advertises them (pseudo-address bases), whether
    each is MLA (replicated), and, when it routes by layer name, its transfer layers: name, registered
    region and group of each."""

    table: RegionTable
    is_mla: tuple[bool, ...]
    transfer_names: tuple[str, ...] = ()
    transfer_regions: tuple[int, ...] = ()
    transfer_groups: tuple[int, ...] = ()


def _group_id(members: list[tuple[int, str]] | tuple[tuple[int, str], ...]) -> int:
    groups = {g for g, _ in members}
    return groups.pop() if len(groups) == 1 else SHARED_GROUP


def region_group_ids(geom: RankGeometry) -> tuple[int, ...]:
    """Each region's KV-cache group, or ``-1`` when several groups view it (vLLM ``region_group_ids``)."""
    return tuple(_group_id(r.members) for r in geom.regions)


@functools.lru_cache(maxsize=128)
def registration(geom: RankGeometry, mode: str) -> Registration:
    """:func:`_registration`, memoised by value (a geometry is an immutable, hashable value and the
    registration depends on nothing else; the pairings of one engine's ranks share it)."""
    return _registration(geom, mode)


def _registration(geom: RankGeometry, mode: str) -> Registration:
    """What vLLM 0.33.0's worker registers for ``geom`` in ``mode`` (``register_kv_caches``): one region per
    region, its members in natural layer order (named after the first); a packed row as one region with each
    layer's ``(offset, page)`` advertised, or, on a pipeline stage, one region per page (per layer when the
    stage routes by layer name). A push worker whose model needs the hybrid manager or packs rows (and
    holds no SSM state) advertises region members; on a pipeline stage it routes by layer name."""
    tracks = mode == "push" and (hma_required(geom) or geom.engine.packed_rows) and not geom.has_ssm
    routing = tracks and geom.pp_size > 1
    rows, packed = _advertised(geom, routing)
    bases, lens, strides, gids, names, members, is_mla = (list(c) for c in zip(*rows)) if rows else ([],) * 7
    nb = geom.num_blocks
    table = RegionTable(
        tuple(bases),
        tuple(lens),
        tuple(strides),
        tuple([nb] * len(bases)),
        tuple(gids),
        tuple(names),
        None,
        tuple(members) if tracks else (),
        packed,
    )
    if not routing:
        return Registration(table, tuple(is_mla))
    regions = tuple(r for r, m in enumerate(members) for _ in m)
    group_of = {name: g for region in geom.regions for g, name in region.members}
    flat = tuple(n for m in members for n in m)
    return Registration(table, tuple(is_mla), flat, regions, tuple(group_of[n] for n in flat))


_Row = tuple[
    int, int, int, int, str, tuple[str, ...], bool
]  # base, length, stride, group id, name, members, MLA


def _advertised(geom: RankGeometry, routing: bool) -> tuple[list[_Row], dict[str, tuple[int, int]]]:
    """The regions vLLM's worker registers for ``geom``, in order, and each packed row's layer pages."""
    rows: list[_Row] = []
    packed: dict[str, tuple[int, int]] = {}

    def add(region: Region, offset: int, length: int, who: list[tuple[int, str]], name: str) -> None:
        members = tuple(n for _, n in who)
        rows.append(
            (
                pseudo(region.index, offset),
                length,
                region.block_stride,
                _group_id(who),
                name,
                members,
                region.is_mla,
            )
        )

    for region in geom.regions:
        n = len(region.members)  # one member is in order already
        order = range(n) if n < 2 else sorted(range(n), key=lambda k: region_sort_key(region.members[k][1]))
        who = [region.members[k] for k in order]
        if not region.slots:
            add(region, 0, region.block_len, who, region.name if region.part != "kv" else who[0][1])
            continue
        slots = [region.slots[k] for k in order]
        if routing:  # one region per layer's page, aliases kept apart
            for (g, name), (off, length) in zip(who, slots):
                add(region, off, length, [(g, name)], name)
        elif geom.pp_size == 1:  # the whole row, each layer's page advertised
            add(region, 0, region.block_len, who, who[0][1])
            packed.update({name: slot for (_, name), slot in zip(who, slots)})
        else:  # one region per page, layers at one address sharing it
            for off in dict.fromkeys(off for off, _ in slots):
                at = [m for m, s in zip(who, slots) if s[0] == off]
                add(region, off, max(s[1] for s in slots if s[0] == off), at, at[0][1])
    return rows, packed


def _view(
    geom: RankGeometry, table: RegionTable, is_mla: tuple[bool, ...], transfer_groups: tuple[int, ...] = ()
) -> EngineView:
    base = EngineView.of(geom)
    if (
        tuple(table.bases) == tuple(pseudo(r) for r in range(geom.num_regions))
        and not transfer_groups
        and tuple(table.block_lens) == base.block_lens
    ):
        return replace(base, group_ids=tuple(table.group_ids or ()))  # stream r is region r
    return replace(
        base,
        block_lens=tuple(table.block_lens),
        block_strides=tuple(table.block_strides),
        region_is_mla=is_mla,
        bases=tuple(table.bases),
        group_ids=tuple(table.group_ids or ()),
        transfer_groups=transfer_groups,
    )


def _vllm_streams(local: RankGeometry, remote: RankGeometry, mode: str) -> tuple[EngineView, EngineView]:
    """vLLM 0.33.0's handling of the peer's advertised regions (``add_remote_agent``), its refusals typed."""
    _refuse_vllm_peer_stages(local, remote, mode)
    mine, theirs = registration(local, mode), registration(remote, mode)
    _refuse_vllm_local_stages(local, remote, mode)
    routing = bool(mine.transfer_regions)
    if routing:
        _refuse_vllm_layer_routing(local, remote)
    table = _peer_table(local, mine, theirs.table)
    _check_same_regions(mine, table, routing)
    if routing:
        picks = mine.transfer_regions
        sub = RegionTable(
            tuple(mine.table.bases[r] for r in picks),
            tuple(mine.table.block_lens[r] for r in picks),
            tuple(mine.table.block_strides[r] for r in picks),
            group_ids=mine.transfer_groups,
        )
        is_mla = tuple(mine.is_mla[r] for r in picks)
        lview = _view(local, sub, is_mla, mine.transfer_groups)
        return lview, replace(_view(remote, table, is_mla), transfer_groups=mine.transfer_groups)
    return _view(local, mine.table, mine.is_mla), _view(remote, table, mine.is_mla)


def _refuse_vllm_peer_stages(local: RankGeometry, remote: RankGeometry, mode: str) -> None:
    """vLLM 0.33.0 pairs with no peer in pipeline stages."""
    if remote.pp_size > 1:
        why = (
            "its push connector refuses a decode engine in pipeline stages"
            if mode == "push"
            else "its pull connector keeps one table per remote TP rank, so a prefill engine's stages overwrite each "
            "other's"
        )
        raise UnsupportedError(
            "pp_size",
            f"vLLM 0.33.0 pairs only with a peer without pipeline stages: {why} "
            "(kvgeom mode pairs each stage)",
            local=local.pp_size,
            remote=remote.pp_size,
        )


def _refuse_vllm_local_stages(local: RankGeometry, remote: RankGeometry, mode: str) -> None:
    """The models vLLM 0.33.0 does not run in pipeline stages."""
    if local.pp_size > 1:
        if mode == "pull" and hma_required(local):
            raise UnsupportedError(
                "pp_size",
                "vLLM 0.33.0's pull connector does not run pipeline stages of models "
                "that need the hybrid KV-cache manager (its push connector routes them by layer "
                "name)",
                local=local.pp_size,
                remote=remote.pp_size,
            )
        if local.has_ssm:
            raise UnsupportedError(
                "pp_size",
                "vLLM 0.33.0 does not run pipeline stages of SSM hybrids",
                local=local.pp_size,
                remote=remote.pp_size,
            )


def _refuse_vllm_layer_routing(local: RankGeometry, remote: RankGeometry) -> None:
    """What vLLM 0.33.0's routing of regions by layer name does not pair."""
    if local.block_size != remote.block_size:
        raise UnsupportedError(
            "block_size",
            "vLLM 0.33.0 routes pipeline stages by layer name only between identical P/D block sizes",
            local=local.block_size,
            remote=remote.block_size,
        )
    if remote.tp_size > local.tp_size and not local.is_mla:
        raise UnsupportedError(
            "tp_size",
            "vLLM 0.33.0 routes attention layers by name only when decode TP is not greater than prefill TP",
            local=local.tp_size,
            remote=remote.tp_size,
        )


def _peer_table(local: RankGeometry, mine: Registration, table: RegionTable) -> RegionTable:
    """The peer's advertised regions as this rank reads them: aligned by layer name (routing), its packed rows
    split to this rank's regions, or the slice of this rank's pipeline stage."""
    if mine.transfer_regions:
        return align_regions_by_layer(
            table, mine.transfer_names, mine.transfer_regions, mine.table.block_lens
        )
    if table.packed and not mine.table.packed:
        return split_packed_rows(table, mine.table.names or ())
    if local.pp_size > 1 and len(table) > len(mine.table):
        start, end = stage_range(local.model.num_hidden_layers, local.pp_rank, local.pp_size)
        return slice_regions(table, pp_region_offset(len(mine.table), start, end), len(mine.table))
    return table


def _check_same_regions(mine: Registration, table: RegionTable, routing: bool) -> None:
    """Both sides' transfer regions: the same packed rows, the same count, the same caches in order."""
    if mine.table.packed and not routing and dict(mine.table.packed) != dict(table.packed):
        raise IncompatiblePairError(
            "packed_rows",
            "packed KV rows differ between P and D (use the same layout "
            "and block size on both sides; kvgeom mode pairs them layer by layer)",
            local=dict(mine.table.packed),
            remote=dict(table.packed),
        )
    expected = mine.transfer_names or mine.table.names or ()
    if len(table) != len(expected):
        raise IncompatiblePairError(
            "num_regions", "both sides must register the same regions", local=len(expected), remote=len(table)
        )
    if table.names is not None and tuple(table.names) != tuple(expected):
        raise IncompatiblePairError(
            "region_names",
            "the transfer regions name different caches in another order",
            local=list(expected)[:8],
            remote=list(table.names)[:8],
        )


def _structure(geom: RankGeometry) -> list[tuple[object, ...]]:
    """Which layers view each region, where in its blocks (groups may differ: :mod:`kvgeom.plan.regionmap`)."""
    return [(tuple(n for _, n in r.members), tuple(o for o, _ in r.slots), r.part) for r in geom.regions]


def _pages(geom: RankGeometry) -> dict[str, tuple[int, int, int, int]]:
    """``{layer: (region, offset, page, stride)}`` of every attention layer ``geom`` holds."""
    out = {}
    for region in geom.regions:
        if region.part != "kv":
            continue
        for _, name in region.members:
            off, length = region.slot(name)
            out[name] = (region.index, off, length, region.block_stride)
    return out


@dataclass(frozen=True)
class PackedStream:
    """A stream of a packed CSA-linear rank in kvgeom mode: group ``group``'s page (``length`` bytes) at the
    start of region ``region``'s blocks; ``kind`` says how it follows TP (``"heads"``: a head-sharded page,
    cut by heads; ``"whole"``: compressed keys or a ring, the same bytes at every TP; ``"state"``: only SSM
    state pages start there, which travel as SSM pieces, so no token group's ids go through it)."""

    region: int
    group: int
    length: int
    kind: str


def packed_streams(geom: RankGeometry) -> tuple[PackedStream, ...]:
    """kvgeom mode's streams of a packed CSA-linear rank (``EngineConfig.packed_rows``). vLLM's regions
    alias one row per block and each token group's ids go through every region, which is harmless only
    when both sides' regions start at the same bytes of the row (equal TP sizes). kvgeom sends each group
    through its own pages: region ``r`` is stream ``r`` for the first token group viewing it (or, where only
    states do, for the state's group: unread), so the SSM and replicated-page rows keep their region indices;
    each further token group viewing a region (a ring next to the main KV at byte 0 of the row) gets one more
    stream over it, after all regions, so that its page is cut by its own rule."""
    specs = geom.layer_specs
    first: list[PackedStream] = []
    more: list[PackedStream] = []
    for region in geom.regions:
        tokens = [(g, n) for g, n in region.members if not geom.groups[g].is_ssm]
        if not tokens:
            first.append(PackedStream(region.index, region.members[0][0], region.block_len, "state"))
            continue
        for k, (g, n) in enumerate(tokens):
            kind = "heads" if isinstance(specs[n], AttentionSpec) else "whole"
            length = region.block_len if isinstance(specs[n], MLASpec) else geom.layer_page(n)
            (first if k == 0 else more).append(PackedStream(region.index, g, length, kind))
    return (*first, *more)


def _packed_view(geom: RankGeometry, streams: tuple[PackedStream, ...]) -> EngineView:
    return replace(
        EngineView.of(geom),
        bases=tuple(pseudo(s.region) for s in streams),
        block_lens=tuple(s.length for s in streams),
        block_strides=tuple(geom.regions[s.region].block_stride for s in streams),
        region_is_mla=tuple(s.kind != "heads" for s in streams),
        group_ids=tuple(s.group for s in streams),
        group_streams=True,
    )


def _kvgeom_packed_streams(local: RankGeometry, remote: RankGeometry) -> tuple[EngineView, EngineView]:
    mine, theirs = packed_streams(local), packed_streams(remote)
    here = [(s.region, s.group, s.kind) for s in mine]
    there = [(s.region, s.group, s.kind) for s in theirs]
    if here != there:
        raise IncompatiblePairError(
            "regions",
            "the two sides' packed rows register regions viewed by different groups (their pages line up "
            "differently at these TP sizes)",
            local=here[:8],
            remote=there[:8],
        )
    return _packed_view(local, mine), _packed_view(remote, theirs)


def _kvgeom_streams(local: RankGeometry, remote: RankGeometry) -> tuple[EngineView, EngineView]:
    """Region by region when both sides lay their regions out alike, else layer by layer (each layer both
    hold, at its page); packed CSA-linear rows by :func:`packed_streams`."""
    if packed_csa_rows(local) and packed_csa_rows(remote):
        return _kvgeom_packed_streams(local, remote)
    lview, rview = EngineView.of(local), EngineView.of(remote)
    if _structure(local) == _structure(remote):
        if local.engine.separate_group:  # a group of its own has its own regions: its ids go only there
            gids = region_group_ids(local)
            return replace(lview, group_ids=gids), replace(rview, group_ids=gids)
        return lview, rview
    if local.has_ssm or remote.has_ssm:
        raise UnsupportedError(
            "pp_size",
            "kvgeom pairs SSM state regions by index: both sides must hold the same "
            "layers in the same regions",
            local=local.pp_rank,
            remote=remote.pp_rank,
        )
    if any(r.part != "kv" for r in (*local.regions, *remote.regions)):
        raise UnsupportedError("kv_split", "split K/V regions pair region by region only", value=True)
    theirs = _pages(remote)
    group_of = {name: g for region in local.regions for g, name in region.members}
    lb, ll, ls, lm, rb, rl, rs, groups = ([] for _ in range(8))
    for region in local.regions:
        for _, name in sorted(region.members, key=lambda m: region_sort_key(m[1])):
            if name not in theirs:
                continue  # another stage of the peer holds it
            off, length = region.slot(name)
            r, roff, rlen, rstride = theirs[name]
            lb.append(pseudo(region.index, off))
            ll.append(length)
            ls.append(region.block_stride)
            lm.append(region.is_mla)
            groups.append(group_of[name])
            rb.append(pseudo(r, roff))
            rl.append(rlen)
            rs.append(rstride)
    t = tuple(groups)
    return (
        replace(
            lview,
            bases=tuple(lb),
            block_lens=tuple(ll),
            block_strides=tuple(ls),
            region_is_mla=tuple(lm),
            transfer_groups=t,
            group_ids=t,
        ),
        replace(
            rview,
            bases=tuple(rb),
            block_lens=tuple(rl),
            block_strides=tuple(rs),
            region_is_mla=tuple(lm),
            transfer_groups=t,
            group_ids=t,
        ),
    )


def region_mapped(local: RankGeometry, remote: RankGeometry, streams: tuple[EngineView, EngineView]) -> bool:
    """Both sides register the same regions (stream ``r`` is region ``r``) but group them differently: block
    lists then pair region by region (:mod:`kvgeom.plan.regionmap`)."""
    identity = all(
        not v.bases and not v.transfer_groups and v.num_regions == g.num_regions
        for v, g in zip(streams, (local, remote))
    )
    return identity and region_group_ids(local) != region_group_ids(remote)


def pair_streams(
    local: RankGeometry, remote: RankGeometry, mode: str, compat: CompatLike
) -> tuple[EngineView, EngineView]:
    """Both sides' streams for a pair (``remote``: any rank of the peer's stage): vLLM's rules in
    ``compat="vllm"``, region or layer pairing in ``compat="kvgeom"`` (module docstring)."""
    if not policy_of(compat).routed:
        return _vllm_streams(local, remote, mode)
    return _kvgeom_streams(local, remote)
