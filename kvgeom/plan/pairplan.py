"""The per-pair plan: everything every request of a pairing reads, computed once at handshake.

:meth:`kvgeom.plan.pairing.Pairing.create` builds a :class:`PairPlan` (:func:`pair_plan`) after the pairing's
descriptor tables and holds it in ``Pairing.plan``; a request only gathers its ids through it. Per remote rank
it has the transfer's :class:`RankTables` (the groups sent, both sides' descriptor-id segment tables, the local
table's key and length, and whether a checked request's ids can leave them), per local group the pages the
receive step reads as arrays (:class:`~kvgeom.plan.align.PageSet`), the producer ranks vLLM's push writes a
decode rank from, and a region-mapped pull's pairing bound by region (one group per region, with its own plan).
Nothing in it depends on a request.

This module reads the pairing's fields only (it is imported by :mod:`kvgeom.plan.pairing`, so it takes the
pairing as an untyped value rather than importing the class).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvgeom.pair.tp import compute_tp_mapping, dcp_handshake_targets
from kvgeom.plan.align import PageSet, group_pages, streamed_pages
from kvgeom.plan.descids import Segments, desc_segments
from kvgeom.plan.regionmap import by_region

__all__ = ["PairPlan", "RankTables", "pair_plan"]


@dataclass(frozen=True, eq=False)
class RankTables:
    """What a request's transfer to/from one remote rank reads of the pairing: the groups sent (``keep``,
    ``every``: all of them), both sides' segment tables, the local table's key, both tables' lengths and
    whether ids need bounding per request (``bounded``: not when every id a checked request can bring lies
    inside its segment and its table)."""

    keep: tuple[bool, ...]
    every: bool
    local: Segments
    remote: Segments
    key: tuple[int, int]
    local_rows: int
    remote_rows: int
    bounded: bool


@dataclass(frozen=True, eq=False)
class PairPlan:
    """A pairing's per-pair plan (module doc)."""

    ranks: Mapping[int, RankTables]
    #: the groups some transfer rank's requests carry (the union of their group masks)
    sent_groups: tuple[bool, ...]
    #: per local group, every page of its layers (``zero_pages``: vLLM's receive step) and the pages this pairing
    #: fills (``filled_pages``: kvgeom's); each only where a pull's consumer zeroes by that rule, else empty
    zero_pages: tuple[PageSet, ...]
    filled_pages: tuple[PageSet, ...]
    #: vLLM push with DCP: per decode rank, the producer ranks (mod DCP) whose mappings write it
    push_writers: Mapping[int, frozenset[int]]
    #: a region-mapped pull: the pairing as a request is bound on (one group per region on each side,
    #: :func:`~kvgeom.plan.regionmap.by_region`), whose plan's segment tables give every region its own list
    by_region: Any = None

    def describe(self) -> str:
        """One line per remote rank: its segments, table lengths and whether ids are bounded per request."""
        return "\n".join(
            f"    rank {rank}: groups {[int(k) for k in rt.keep]}, {len(rt.local)} local / {len(rt.remote)} remote "
            f"segments, tables of {rt.local_rows} / {rt.remote_rows} rows"
            f"{'' if rt.bounded else ', ids bounded per request'}"
            for rank, rt in self.ranks.items()
        )


def pair_plan(pairing: Any, regions: bool = False) -> PairPlan:
    """The per-pair plan of ``pairing`` (a :class:`~kvgeom.plan.pairing.Pairing` whose tables are built);
    ``regions``: ``pairing`` is a region-mapped pull bound by region, every region its own list."""
    # a region-mapped pull binds on its pairing by region (``PairPlan.by_region``): no per-group tables
    built: dict[tuple[Any, ...], Segments] = {}
    if regions:
        ranks = {rank: _region_tables(pairing, rank) for rank in pairing.targets}
    elif pairing.region_mapped:
        ranks = {}
    else:
        ranks = {rank: _rank_tables(pairing, rank, built) for rank in pairing.targets}
    masks = [ranks[r].keep for r in pairing.transfer_ranks if r in ranks]
    groups = len(pairing.local.groups)
    tokens = pairing.local.block_size
    # the consumer's receive step zeroes by pages: vLLM's rule reads every page of a group, kvgeom's the
    # pages the pairing fills (only a pull's consumer zeroes)
    pull = pairing.mode == "pull"
    vllm_zero, token_zero = pull and not pairing.policy.by_tokens, pull and pairing.policy.by_tokens
    return PairPlan(
        ranks,
        tuple(any(m[g] for m in masks) for g in range(groups)),
        tuple(PageSet.of(pairing.tables.group_pages[g], tokens) for g in range(groups)) if vllm_zero else (),
        tuple(PageSet.of(pairing.zero_pages(g), tokens) for g in range(groups)) if token_zero else (),
        {r: _push_writers(pairing, r) for r in pairing.targets}
        if pairing.dcp_active and pairing.mode == "push"
        else {},
        _by_region(pairing) if pairing.region_mapped and not regions else None,
    )


def _by_region(pairing: Any) -> Any:
    """A region-mapped pull as a request is bound on: the pairing with one group per region on both sides
    (:func:`~kvgeom.plan.regionmap.by_region`), the same views and descriptor tables, the pages of each
    region, and a per-pair plan whose segment tables give every region its own list."""
    local = by_region(pairing.local)
    pages = tuple(group_pages(local, r) for r in range(local.num_regions))
    zero = tuple(streamed_pages(local, pairing.local_view, r, pages[r]) for r in range(len(pages)))
    bound = replace(
        pairing,
        local=local,
        remotes={t: by_region(g) for t, g in pairing.remotes.items()},
        tables=replace(pairing.tables, group_pages=pages, zero_pages=zero),
        plan=None,
    )
    return replace(bound, plan=pair_plan(bound, regions=True))


def _segments(pairing: Any, side: str, rank: int, built: dict[tuple[Any, ...], Segments]) -> Segments:
    """The descriptor-id segment table of one side of the transfer to/from ``rank`` (``built``: the tables
    this build made so far, by their arguments: ranks whose views agree share one)."""
    kinds, rows = pairing.local.group_is_ssm, pairing.token_rows
    if side == "remote":
        v = pairing.remote_view(rank)
        ratio = rows if rows > 1 else None
        pieces = v.num_conv_pieces or 3
    else:
        v, g = pairing.local_view, pairing.local
        ratio, pieces = pairing.local_rows, g.ssm.num_pieces if g.ssm else 3
    args = (
        len(kinds),
        v.num_blocks,
        v.num_regions,
        ratio,
        v.ppl,
        tuple(kinds),
        tuple(v.ssm_region_indices) or None,
        pieces,
    )
    kw = dict(
        region_group_ids=tuple(v.group_ids) or None,
        transfer_layer_group_ids=tuple(v.transfer_groups),
        scratch_groups=tuple(pairing.local.scratch_groups),
        scratch_region_indices=tuple(v.scratch_region_indices),
        ple_group=pairing.local.ple.group if pairing.local.ple else None,
        group_streams=v.group_streams,
    )
    key = (*args, *kw.values())
    if key not in built:
        built[key] = desc_segments(*args, **kw)
    return built[key]


def _bounded(pairing: Any, side: str, rank: int, seg: Segments) -> bool:
    """Whether every descriptor id a checked request can bring on ``side`` of the transfer to/from ``rank``
    lies inside its segment and its table, whatever the request: each group's largest possible id (its
    pool, at the granularity the planner brings it to) below every capacity of its segments, and every
    segment's last id inside the table."""
    kinds = pairing.local.group_is_ssm
    if side == "local":
        geom, n = pairing.local, len(pairing.local_table(pairing.local_key(rank)))
        fine = geom.ppl * pairing.local_rows
    else:
        geom, n = pairing.remotes[pairing.targets[0]], len(pairing.remote_table(rank))
        fine = pairing.remote_view(rank).ppl * pairing.token_rows
    nb = geom.logical_num_blocks
    bound = np.asarray([nb if ssm else nb * fine for ssm in kinds], dtype=np.int64)[seg.group]
    return bool(((seg.offset >= 0) & (bound <= seg.capacity) & (seg.offset + bound <= n)).all())


def _rank_tables(pairing: Any, rank: int, built: dict[tuple[Any, ...], Segments]) -> RankTables:
    keep = pairing.group_mask(rank)
    key = pairing.local_key(rank)
    local, remote = _segments(pairing, "local", rank, built), _segments(pairing, "remote", rank, built)
    return RankTables(
        keep,
        all(keep),
        local,
        remote,
        key,
        len(pairing.local_table(key)),
        len(pairing.remote_table(rank)),
        _bounded(pairing, "local", rank, local) and _bounded(pairing, "remote", rank, remote),
    )


def _region_tables(pairing: Any, rank: int) -> RankTables:
    """A region-mapped pull's :class:`RankTables` for remote rank ``rank`` (``pairing`` bound by region): every
    region (group) sent, each its own list on both sides (cut per token where kvgeom mode cuts token-major
    pages)."""
    n = pairing.local.num_regions
    rows = pairing.token_rows
    flat = [False] * n
    lseg, rseg = (
        desc_segments(
            n,
            v.num_blocks,
            n,
            rows if rows > 1 else None,
            v.ppl,
            flat,
            region_group_ids=list(range(n)),
            uses_region_group_mapping=n > 1,
        )
        for v in (pairing.local_view, pairing.remote_view(rank))
    )
    key = pairing.local_key(rank)
    return RankTables(
        (True,) * n,
        True,
        lseg,
        rseg,
        key,
        len(pairing.local_table(key)),
        len(pairing.remote_table(rank)),
        _bounded(pairing, "local", rank, lseg) and _bounded(pairing, "remote", rank, rseg),
    )


def _push_writers(pairing: Any, rank: int) -> frozenset[int]:
    """vLLM's push: the producer ranks (mod DCP) whose TP mappings send to decode rank ``rank``."""
    local, d = pairing.local, pairing.remotes[rank]
    writers = set()
    for q in range(local.tp_size):
        m = compute_tp_mapping(
            q,
            local.tp_size,
            d.tp_size,
            local.num_kv_heads,
            local.is_mla,
            local.group_is_ssm,
            local.dcp_size,
            d.dcp_size,
        )
        every = local.is_mla and not local.has_ssm and pairing.tp_ratio < 0
        targets = dcp_handshake_targets(q, local.tp_size, local.dcp_size, d.tp_size, d.dcp_size)
        if rank in (targets if every else m.all_source_ranks):
            writers.add(q % local.dcp_size)
    return frozenset(writers)
