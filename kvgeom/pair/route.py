"""kvgeom mode: what one local rank exchanges with one remote rank, derived from the sharding rule.

vLLM cuts rows by TP ratios (split handles, ``rank_offset_factor``, ``remote_conv_offsets``), which is
right only when every unit is sharded, never replicated, and only from the reader's side. kvgeom
derives every slice from the *consumer's* needs instead: the consumer (D) needs units
``[cu0, cu0 + cn)`` of each sharded piece (KV heads, conv pieces, the temporal state) and gathers them
from its ``n`` sources (the consumer's own TP mapping); source ``j`` supplies consumer bytes
``[j*c, (j+1)*c)`` (``c = cn*ub / n``), which sit at ``cu0*ub + j*c - pu0*ub`` in the producer's copy.
A replicated unit is then read in chunks from identical copies (pull) or written whole to every
replica (push) -- the cases vLLM gets wrong (Mamba2 ``n_groups < TP``, push into replicated KV heads).

``route(...)`` returns, per remote rank, which groups the transfer carries and the ``(local offset,
remote offset, length)`` of each attention region's (sub-)block and of each SSM piece of a state page.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvgeom.dtypes import dtype_size
from kvgeom.errors import UnsupportedError
from kvgeom.layout.geometry import RankGeometry
from kvgeom.model.layers import MambaSpec, Shard
from kvgeom.pair.tp import TPMapping, compute_tp_mapping

__all__ = ["Slice", "Route", "route", "routes", "dcp_pages_differ"]

Slice = tuple[int, int, int]  # (local offset, remote offset, length) within a (sub-)block or state page


@dataclass(frozen=True)
class Route:
    """What the local rank exchanges with ``remote_rank``: ``groups[g]`` says whether group ``g``'s ids
    travel; ``fa[r]`` slices region ``r``'s attention rows; ``ssm`` the conv pieces then the temporal
    state (``None`` without SSM)."""

    remote_rank: int
    groups: tuple[bool, ...]
    fa: tuple[Slice, ...]
    ssm: tuple[Slice, ...] | None


def _unit_slice(
    shard: Shard, unit_bytes: int, c_rank: int, c_tp: int, p_rank: int, p_tp: int, j: int, n: int, what: str
) -> tuple[int, int, int]:
    """``(consumer offset, producer offset, length)`` of what producer ``p_rank`` (source ``j`` of ``n``)
    gives consumer ``c_rank`` of one sharded piece, offsets relative to each side's piece start."""
    cu0, cn = shard.first_unit(c_rank, c_tp), shard.units_per_rank(c_tp)
    pu0, pn = shard.first_unit(p_rank, p_tp), shard.units_per_rank(p_tp)
    need = cn * unit_bytes
    if need % n:
        raise UnsupportedError(
            what, f"{need} B cannot be gathered from {n} sources in equal chunks", value=need, expected=n
        )
    chunk = need // n
    c_off = j * chunk
    p_off = cu0 * unit_bytes + c_off - pu0 * unit_bytes
    if p_off < 0 or p_off + chunk > pn * unit_bytes:
        raise UnsupportedError(
            what,
            f"consumer units [{cu0}, {cu0 + cn}) are not held by producer rank {p_rank} "
            f"(units [{pu0}, {pu0 + pn}))",
            local=(cu0, cn),
            remote=(pu0, pn),
        )
    return c_off, p_off, chunk


#: (name, shard, unit bytes, consumer page offset, producer page offset) of one piece of a state page
_Piece = tuple[str, Shard, int, int, int]


def _ssm_pieces(spec: MambaSpec, c_tp: int, p_tp: int) -> tuple[_Piece, ...]:
    """A state page's sharded pieces, the conv pieces then the temporal state, with where each starts in
    the consumer's and the producer's page (what every route between these TP sizes shares)."""
    row = spec.conv_rows * dtype_size(spec.conv_dtype)
    out, c_base, p_base = [], 0, 0
    for name, piece in zip(spec.piece_names, spec.conv_pieces):
        out.append((f"conv piece {name}", piece, piece.unit_elems * row, c_base, p_base))
        c_base += piece.elems_per_rank(c_tp) * row
        p_base += piece.elems_per_rank(p_tp) * row
    t = spec.temporal
    out.append(("temporal state", t, t.unit_elems * dtype_size(spec.ssm_dtype), c_base, p_base))
    return tuple(out)


def _ssm_slices(
    pieces: tuple[_Piece, ...], c_rank: int, c_tp: int, p_rank: int, p_tp: int, j: int, n: int
) -> list[tuple[int, int, int]]:
    """Per piece of :func:`_ssm_pieces`: (consumer, producer) offsets in the page, and length."""
    out = []
    for name, shard, unit_bytes, c_base, p_base in pieces:
        c, p, ln = _unit_slice(shard, unit_bytes, c_rank, c_tp, p_rank, p_tp, j, n, name)
        out.append((c_base + c, p_base + p, ln))
    return out


def dcp_pages_differ(a: RankGeometry, b: RankGeometry, mode: str = "pull") -> bool:
    """Decode context parallelism where a rank's tokens come from (pull with pages of different sizes) or go to
    (push) any rank of the other side, not only those vLLM's closed form names: kvgeom pairs such a rank with
    every rank of the other side, and the units pick what each pair exchanges."""
    return (a.dcp_size > 1 or b.dcp_size > 1) and (
        a.logical_block_size != b.logical_block_size or mode == "push"
    )


def route(
    local: RankGeometry,
    remote: RankGeometry,
    remote_rank: int,
    mode: str,
    local_rows: int,
    remote_row_lens: tuple[int, ...],
    local_lens: tuple[int, ...] | None = None,
    local_is_mla: tuple[bool, ...] | None = None,
    unread: frozenset[int] = frozenset(),
) -> Route:
    """The route between ``local`` and remote rank ``remote_rank`` (``remote``: any rank of that engine).
    ``local_rows``: rows per local kernel block (the block-size ratio, times the tokens per remote block
    when pages are cut per token); ``remote_row_lens``: the remote rows' lengths as planned, one per
    stream; ``local_lens`` / ``local_is_mla``: the local streams' page lengths and kinds (default: one
    stream per local region, :mod:`kvgeom.pair.streams`); ``unread``: streams no token group's ids go through (an
    SSM state's stream of packed rows: its rows are cut whole, to the shorter side, and never referenced)."""
    return routes(
        local, remote, {remote_rank: remote_row_lens}, mode, local_rows, local_lens, local_is_mla, unread
    )[remote_rank]


def routes(
    local: RankGeometry,
    remote: RankGeometry,
    row_lens: Mapping[int, tuple[int, ...]],
    mode: str,
    local_rows: int,
    local_lens: tuple[int, ...] | None = None,
    local_is_mla: tuple[bool, ...] | None = None,
    unread: frozenset[int] = frozenset(),
) -> dict[int, Route]:
    """:func:`route` to every remote rank of ``row_lens`` (each rank's ``remote_row_lens``), the consumer's
    TP mapping computed once per consumer rank (once in a pull: the local rank consumes from every rank)."""
    pull = mode == "pull"
    c_geom, p_geom = (local, remote) if pull else (remote, local)
    c_tp, p_tp = c_geom.tp_size, p_geom.tp_size
    kinds = local.group_is_ssm
    spec = local.model.attention_spec
    draft = (
        spec.num_kv_heads if local.is_mla and spec is not None else None
    )  # head-sharded layers next to MLA
    spread = dcp_pages_differ(c_geom, p_geom, mode)
    lens = local_lens if local_lens is not None else tuple(r.block_len for r in local.regions)
    mla = local_is_mla if local_is_mla is not None else local.region_is_mla
    pieces = _ssm_pieces(local.ssm.spec, c_tp, p_tp) if local.ssm is not None else ()
    cmaps: dict[int, TPMapping] = {}
    out: dict[int, Route] = {}
    for remote_rank, remote_row_lens in row_lens.items():
        c_rank = local.tp_rank if pull else remote_rank
        p_rank = remote_rank if pull else local.tp_rank
        if c_rank not in cmaps:
            cmaps[c_rank] = compute_tp_mapping(
                c_rank,
                c_tp,
                p_tp,
                local.num_kv_heads,
                local.is_mla,
                kinds,
                c_geom.dcp_size,
                p_geom.dcp_size,
                head_sharded_kv_heads=draft,
            )
        cmap = cmaps[c_rank]
        groups = _route_groups(local, cmap, spread, p_rank)
        attn_src = next((s for s, ssm in zip(cmap.source_ranks_per_group, kinds) if not ssm), ())
        side = _Sides(pull, c_rank, c_tp, p_rank, p_tp, attn_src, draft)
        fa = tuple(
            _region_slice(local, side, r, length // local_rows, rlen, is_mla, r in unread)
            for r, (length, is_mla, rlen) in enumerate(zip(lens, mla, remote_row_lens))
        )
        ssm = None
        if local.ssm is not None:
            ssm_src = next((s for s, is_ssm in zip(cmap.source_ranks_per_group, kinds) if is_ssm), ())
            if p_rank in ssm_src:
                slices = _ssm_slices(pieces, c_rank, c_tp, p_rank, p_tp, ssm_src.index(p_rank), len(ssm_src))
                ssm = tuple((c, p, ln) if pull else (p, c, ln) for c, p, ln in slices)
        out[remote_rank] = Route(remote_rank, groups, fa, ssm)
    return out


def _route_groups(local: RankGeometry, cmap: TPMapping, spread: bool, p_rank: int) -> tuple[bool, ...]:
    """Per group, whether its ids travel between the consumer and producer rank ``p_rank``: the producer is
    one of the group's sources (or, ``spread``, any producer rank may hold a token of the consumer's); the
    replicated state page travels whole from the first of its sources only."""
    kinds = local.group_is_ssm
    groups = tuple(
        (spread and not ssm) or p_rank in srcs for srcs, ssm in zip(cmap.source_ranks_per_group, kinds)
    )
    if local.ple is not None:
        g = local.ple.group
        groups = groups[:g] + (p_rank == cmap.source_ranks_per_group[g][0],) + groups[g + 1 :]
    return groups


@dataclass(frozen=True)
class _Sides:
    """Who consumes and who produces in one route: ranks, TP sizes, the attention sources of the consumer,
    and the KV heads of head-sharded layers next to MLA (``draft``)."""

    pull: bool
    c_rank: int
    c_tp: int
    p_rank: int
    p_tp: int
    attn_src: tuple[int, ...]
    draft: int | None


def _region_slice(
    local: RankGeometry, side: _Sides, r: int, llen: int, rlen: int, is_mla: bool, unread: bool
) -> Slice:
    """``(local offset, remote offset, length)`` of region ``r``'s rows (``llen`` local bytes per row, ``rlen``
    remote): a chunk of a replicated row from each source, the row whole, or the consumer's head slice."""
    spec = local.model.attention_spec
    c_len, p_len = (llen, rlen) if side.pull else (rlen, llen)
    src, n = side.attn_src, len(side.attn_src)
    # identical copies on every source (a draft's latent; a CSA-linear model's compressed keys and rings
    # next to a head-sharded main KV): a chunk from each; a CSA page that does not divide is read whole
    replicated = is_mla and side.p_rank in src and n > 1 and not unread
    if replicated and (side.draft is not None or local.is_csa_linear):
        if c_len % n == 0 and c_len == p_len:
            ch, j = c_len // n, src.index(side.p_rank)
            return (j * ch, j * ch, ch)
        if side.draft is not None:
            raise UnsupportedError(
                f"regions[{r}].block_len",
                f"a {c_len}-byte replicated page cannot be gathered from {n} sources in equal chunks",
                local=llen,
                remote=rlen,
            )
    if (
        is_mla
        or spec is None
        or unread
        or side.p_rank not in src
        or (spec.heads_per_rank(side.c_tp) == spec.heads_per_rank(side.p_tp) and n == 1)
    ):  # the row as it is: a replicated latent, or the same heads on both sides
        if c_len != p_len and side.p_rank in src and spec is not None and not unread:
            raise UnsupportedError(
                f"regions[{r}].block_len",
                "rows of different lengths cannot be paired",
                local=llen,
                remote=rlen,
            )
        return (0, 0, min(c_len, p_len))
    heads = spec.heads_per_rank(side.c_tp)
    c, p, ln = _unit_slice(
        spec.heads,
        c_len // heads,
        side.c_rank,
        side.c_tp,
        side.p_rank,
        side.p_tp,
        src.index(side.p_rank),
        n,
        f"regions[{r}] heads",
    )
    return (c, p, ln) if side.pull else (p, c, ln)
