"""A validated P/D pairing, seen from one local rank: everything fixed at handshake time.

``Pairing.create(local, remotes, mode)`` checks the pair (:mod:`kvgeom.pair.handshake`), computes the TP
mapping, the block-size ratio, and the descriptor tables this rank prepares once: its own whole-region
table (and, when P_TP > D_TP, one split table per source rank) and one table per remote rank. Per-request
plans (:mod:`kvgeom.plan.request`) only pick rows of these tables.

A pairing is a value: what it prepares is computed in :meth:`Pairing.create` and held in its fields
(``views``, the remote ranks' streams; ``tables``, a :class:`PairTables`), never filled in later.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from kvgeom.dtypes import dtype_size
from kvgeom.errors import IncompatiblePairError, UnsupportedError
from kvgeom.layout.card import GeometryCard
from kvgeom.layout.conv import remote_conv_offsets
from kvgeom.layout.geometry import RankGeometry
from kvgeom.layout.runs import Runs
from kvgeom.layout.view import EngineView
from kvgeom.modes import Compat, CompatLike, Policy, policy_of
from kvgeom.pair.handshake import PairShape, check_pair
from kvgeom.pair.route import Route, dcp_pages_differ, routes
from kvgeom.pair.sides import as_geometry, checked_sides
from kvgeom.pair.streams import region_mapped
from kvgeom.pair.tp import TPMapping, compute_tp_mapping, dcp_handshake_targets, needs_split_local_handles
from kvgeom.plan.align import Page, group_pages, streamed_pages
from kvgeom.plan.dlist import Dlist, check_bounds_all, local_dlist, remote_dlist, routed_tables
from kvgeom.plan.pagecut import PageCut, cut_rows, page_cut
from kvgeom.plan.pairplan import PairPlan, pair_plan
from kvgeom.plan.splits import build_local_splits

__all__ = ["Pairing", "PairTables", "LocalKey", "pair_targets", "push_writers"]

LocalKey = tuple[int, int]  # (rows per kernel block, remote rank the table is cut for, or -1: whole table)


@dataclass(frozen=True)
class PairTables:
    """What a pairing prepares once, at handshake: per remote rank its route (:mod:`kvgeom.pair.route`), the
    groups whose ids travel to/from it and its descriptor table; this rank's tables by :data:`LocalKey`;
    per local group the pages of its layers and the pages this pairing fills."""

    routes: Mapping[int, Route] = field(default_factory=dict)
    masks: Mapping[int, tuple[bool, ...]] = field(default_factory=dict)
    local: Mapping[LocalKey, Dlist] = field(default_factory=dict)
    remote: Mapping[int, Dlist] = field(default_factory=dict)
    group_pages: tuple[list[Page], ...] = ()
    zero_pages: tuple[list[Page], ...] = ()


def _spread(local: RankGeometry, remote: RankGeometry, mode: str, compat: CompatLike) -> bool:
    """kvgeom mode pairs a rank with every rank of the other side when DCP pages differ
    (:func:`kvgeom.pair.route.dcp_pages_differ`): any remote rank may hold (pull) or need (push) its tokens."""
    return policy_of(compat).spread_dcp and dcp_pages_differ(local, remote, mode)


def _mappings(lg: RankGeometry, first: RankGeometry) -> tuple[TPMapping, TPMapping | None]:
    """Who reads whom: the pair's TP mapping, and a draft's own (by the draft's heads) when head-sharded
    layers sit next to MLA layers."""
    args = (
        lg.tp_rank,
        lg.tp_size,
        first.tp_size,
        lg.num_kv_heads,
        lg.is_mla,
        lg.group_is_ssm,
        lg.dcp_size,
        first.dcp_size,
    )
    mapping = compute_tp_mapping(*args)
    draft = compute_tp_mapping(*args, head_sharded_kv_heads=_kv_heads(lg)) if lg.has_draft else None
    return mapping, draft


def pair_targets(
    local: RankGeometry | GeometryCard,
    remote: RankGeometry | GeometryCard,
    mode: str,
    compat: Compat | str = Compat.KVGEOM,
    local_rank: int | None = None,
) -> tuple[int, ...]:
    """The remote ranks local rank ``local_rank`` (default: ``local``'s own) talks to, as
    :meth:`Pairing.create` pairs it: vLLM's handshake targets with DCP (:func:`kvgeom.pair.tp.dcp_handshake_targets`),
    widened to every remote rank where kvgeom mode spreads DCP pages. ``remote``: any rank of that engine."""
    lg, rg = as_geometry(local), as_geometry(remote)
    if _spread(lg, rg, mode, compat):
        return tuple(range(rg.tp_size))
    rank = lg.tp_rank if local_rank is None else local_rank
    return dcp_handshake_targets(rank, lg.tp_size, lg.dcp_size, rg.tp_size, rg.dcp_size)


def push_writers(
    producer: RankGeometry | GeometryCard,
    consumer: RankGeometry | GeometryCard,
    compat: Compat | str = Compat.KVGEOM,
) -> tuple[int, ...]:
    """The producer ranks that write to (or notify) decode rank ``consumer.tp_rank`` in push: those whose
    pairing (:func:`pair_targets`, the producer local) names it. ``producer``: any rank of that engine."""
    pg, cg = as_geometry(producer), as_geometry(consumer)
    return tuple(p for p in range(pg.tp_size) if cg.tp_rank in pair_targets(pg, cg, "push", compat, p))


@dataclass(frozen=True, eq=False)
class Pairing:
    """This local rank paired with a remote engine (``remotes``: the remote ranks it talks to). Build it with
    :meth:`create`, which validates the pair and fills ``views`` and ``tables``."""

    local: RankGeometry
    remotes: Mapping[int, RankGeometry]
    mode: str
    compat: Compat
    shape: PairShape
    mapping: TPMapping
    prefix_caching: bool = False
    draft_mapping: TPMapping | None = None
    #: the remote ranks' streams as planned with (:meth:`remote_view`)
    views: Mapping[int, EngineView] = field(default_factory=dict, repr=False)
    tables: PairTables = field(default_factory=PairTables, repr=False)
    #: what every request reads, computed once at handshake after the tables (:mod:`kvgeom.plan.pairplan`)
    plan: PairPlan | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        local: RankGeometry | GeometryCard,
        remotes: Sequence[RankGeometry | GeometryCard] | Mapping[int, RankGeometry | GeometryCard],
        mode: str = "pull",
        compat: Compat | str = Compat.KVGEOM,
        prefix_caching: bool = False,
    ) -> Pairing:
        """Validate and pair. ``remotes`` holds at least this rank's handshake targets (a sequence is
        taken as ranks ``0..n-1`` of the remote engine); ``compat``: a :class:`~kvgeom.pair.handshake.Compat`
        or its spelling (the pairing keeps the member)."""
        compat = Compat.of(compat)
        lg, rg = checked_sides(local, remotes, mode)
        first = next(iter(rg.values()))
        shape = check_pair(lg, first, mode, compat, prefix_caching)
        targets = pair_targets(lg, first, mode, compat)
        missing = [t for t in targets if t not in rg]
        if missing:
            raise IncompatiblePairError(
                "remotes", f"handshake targets {missing} have no card", value=missing, expected=list(targets)
            )
        mapping, draft = _mappings(lg, first)
        if _spread(lg, first, mode, compat):  # every local rank notifies every remote rank
            mapping = replace(mapping, local_consumers=lg.tp_size)
        views = {t: _remote_view(shape, rg[t], t) for t in targets}
        base = cls(
            lg, {t: rg[t] for t in targets}, mode, compat, shape, mapping, prefix_caching, draft, views
        )
        pairing = replace(base, tables=base._prepare())
        pairing._validate_routes()
        return replace(pairing, plan=pair_plan(pairing))

    def _prepare(self) -> PairTables:
        """Every value the pairing prepares once (from its fields and ``views``)."""
        routes = self._routes()
        masks = {rank: self._group_mask(rank, routes[rank]) for rank in self.targets}
        local, remote = self._routed(routes) if self.policy.routed else self._vllm_tables()
        pages = tuple(group_pages(self.local, g) for g in range(len(self.local.groups)))
        zero = tuple(streamed_pages(self.local, self.local_view, g, pages[g]) for g in range(len(pages)))
        return PairTables(routes, masks, local, remote, pages, zero)

    def _validate_routes(self) -> None:
        """Handshake-time checks of what every remote rank exchanges: kvgeom mode derives each route (a
        piece that cannot be gathered is refused now, not at the first request); vLLM mode builds its split
        tables and refuses a pair where vLLM would leave a consumer's group unwritten (push into replicated
        KV heads of a hybrid)."""
        for rank in self.targets:
            needed = tuple(n and self.carries(g) for g, n in enumerate(self.route(rank).groups))
            if self.policy.routed:
                continue
            sent = self.group_mask(rank) if rank in self.transfer_ranks else tuple(False for _ in needed)
            missing = [g for g, (a, b) in enumerate(zip(needed, sent)) if a and not b]
            if missing:
                raise UnsupportedError(
                    "tp_size",
                    f"vLLM 0.33.0 would never send groups {missing} to/from remote rank {rank} "
                    f"({self.mode}, local TP{self.local.tp_size} vs remote TP{self.remote_tp}): that rank's copy "
                    "would stay stale; kvgeom mode plans it",
                    local=self.local.tp_size,
                    remote=self.remote_tp,
                )
        # invariant I6: every row lies inside its registered region, all tables in one vectorised check
        # (in order: each rank's local table, then its remote table; one table shared by ranks of equal
        # views, against the same region sizes, is checked once)
        local_bytes = [r.nbytes for r in self.local.regions]
        todo: dict[tuple[int, tuple[int, ...]], tuple[Dlist, Sequence[int], str]] = {}
        for rank in self.transfer_ranks:
            table = self.local_table(self.local_key(rank))
            todo.setdefault((id(table), tuple(local_bytes)), (table, local_bytes, "local"))
            table, sizes = self.remote_table(rank), tuple(r.nbytes for r in self.remotes[rank].regions)
            todo.setdefault((id(table), sizes), (table, sizes, f"remote rank {rank}"))
        check_bounds_all(list(todo.values()))

    @property
    def policy(self) -> Policy:
        """What this pairing's mode changes (:class:`~kvgeom.modes.Policy`): the planner reads it, never the mode."""
        return policy_of(self.compat)

    # -- ratios -------------------------------------------------------------------------------------
    @property
    def tp_ratio(self) -> int:
        return self.shape.tp_ratio

    @property
    def bsr(self) -> int:
        return self.shape.bsr

    @property
    def permute(self) -> bool:
        """A head-major P moved into a token-major D that permutes in its receive step (B.6.15): pulled into
        this rank, or (kvgeom mode) pushed from it."""
        return self.shape.permute

    @cached_property
    def region_mapped(self) -> bool:
        """P and D group the same regions differently: block lists pair region by region (:mod:`kvgeom.plan.regionmap`)."""
        return region_mapped(
            self.local, self.remotes[self.targets[0]], (self.local_view, self.remote_view(self.targets[0]))
        )

    @cached_property
    def dcp_active(self) -> bool:
        """Either side shards its pages by decode context parallelism: pages pair by global position."""
        return self.local.dcp_size > 1 or self.remote_dcp > 1

    @cached_property
    def remote_dcp(self) -> int:
        return next(iter(self.remotes.values())).dcp_size

    @cached_property
    def page_cut(self) -> PageCut | None:
        """kvgeom mode at a block-size ratio on vLLM's CPU page: both sides' attention blocks cut into one
        finer block's token runs each (:func:`kvgeom.plan.pagecut.page_cut`); ``None`` for any other pair."""
        if not self.policy.token_cut:
            return None
        remote = self.remotes[self.targets[0]]
        view = self.shape.streams[1] if self.shape.streams else EngineView.of(remote)
        return page_cut(self.local, remote, self.local_view, view, self.bsr, self.shape.remote_split)

    @cached_property
    def token_rows(self) -> int:
        """Rows per remote kernel block: 1, or its tokens when kvgeom mode cuts token-major pages whose
        heads differ between the sides (a head slice is then one run per token: Part C item 3), or the
        descriptors of one finer block where it cuts the CPU page by its token runs (:attr:`page_cut`)."""
        spec = self.local.model.attention_spec
        if self.page_cut is not None:
            remote = self.remotes[self.targets[0]]  # a finer block's descriptors, as both sides cut them
            split = remote.engine.kernel // min(self.local.engine.kernel, remote.engine.kernel)
            return self.page_cut[1][0].size // split
        if (
            not self.policy.token_cut
            or spec is None
            or self.permute  # the pull treats the token-major local page as head-major (B.6.15)
            or self.local.engine.kv_layout.value != "token_major"
            or spec.heads_per_rank(self.local.tp_size) == spec.heads_per_rank(self.remote_tp)
        ):
            return 1
        return self.remote_view(self.targets[0]).block_size

    @property
    def local_rows(self) -> int:
        """Rows per local kernel block in this pairing's local tables."""
        return self.bsr * self.token_rows

    @cached_property
    def remote_tp(self) -> int:
        return next(iter(self.remotes.values())).tp_size

    @cached_property
    def local_view(self) -> EngineView:
        """This rank's transfer streams (:mod:`kvgeom.pair.streams`; by default one per region)."""
        return self.shape.streams[0] if self.shape.streams is not None else EngineView.of(self.local)

    def remote_view(self, rank: int) -> EngineView:
        """The remote rank's streams as planned with (rescaled for non-dividing block sizes)."""
        return self.views[rank]

    def zero_pages(self, group: int) -> list[Page]:
        """The local pages of group ``group`` this pairing fills (pull): every page of the group's layers, or,
        when streams pair layer by layer, the pages of the layers this pairing transfers."""
        return self.tables.zero_pages[group]

    def carries(self, group: int) -> bool:
        """Whether any stream carries group ``group`` (under layer-name routing a pipeline stage may hold no
        layer of a group; its ids then stay home)."""
        view = self.local_view
        if not view.num_regions:
            return False
        return not view.transfer_groups or group in view.transfer_groups or self.local.groups[group].is_ssm

    @cached_property
    def needs_split(self) -> bool:
        """Whether each source rank gets its own slice of the local table (P_TP > D_TP, vLLM B.3.3)."""
        return needs_split_local_handles(self.tp_ratio, self.mapping, self.local.is_mla)

    @cached_property
    def targets(self) -> tuple[int, ...]:
        return tuple(self.remotes)

    # -- tables -------------------------------------------------------------------------------------
    def _first_sources(self, ssm: bool) -> tuple[int, ...]:
        for ranks, is_ssm in zip(self.mapping.source_ranks_per_group, self.local.group_is_ssm):
            if is_ssm == ssm:
                return ranks
        return ()

    def route(self, rank: int) -> Route:
        """kvgeom mode: what this rank exchanges with remote rank ``rank`` (:mod:`kvgeom.pair.route`)."""
        return self.tables.routes[rank]

    def _routes(self) -> dict[int, Route]:
        """The route to every target (:func:`kvgeom.pair.route.routes`: what the targets share derived once)."""
        rows = self.token_rows
        lview = self.local_view
        return routes(
            self.local,
            self.remotes[self.targets[0]],
            {rank: tuple(x // rows for x in self.remote_view(rank).block_lens) for rank in self.targets},
            self.mode,
            self.local_rows,
            lview.block_lens,
            lview.region_is_mla,
            frozenset(
                i
                for i, g in enumerate(lview.group_ids)
                if lview.group_streams and self.local.groups[g].is_ssm
            ),
        )

    @cached_property
    def transfer_ranks(self) -> tuple[int, ...]:
        """The remote ranks a request's transfers go to (the others are only notified)."""
        if self.policy.routed:
            return tuple(r for r in self.targets if any(self.group_mask(r)))
        pure_mla = self.local.is_mla and not self.local.has_ssm
        if self.mode == "push" and pure_mla and self.tp_ratio < 0:
            return self.targets  # vLLM writes the replicated latent to every D rank
        return self.mapping.all_source_ranks

    def group_mask(self, rank: int) -> tuple[bool, ...]:
        """Which groups' ids travel to/from remote rank ``rank``."""
        return self.tables.masks[rank]

    def _group_mask(self, rank: int, r: Route) -> tuple[bool, ...]:
        if self.policy.routed:
            mask = r.groups
        elif self.mode == "push" and self.local.is_csa_linear and self.tp_ratio < 0:
            mask = tuple(True for _ in self.local.groups)  # vLLM: every group to every written rank
        elif self.mode == "push" and self.local.is_mla and self.tp_ratio < 0:
            srcs = self.mapping.source_ranks_per_group
            mask = tuple((not ssm) or rank in s for ssm, s in zip(self.local.group_is_ssm, srcs))
        else:
            mask = tuple(rank in s for s in self.mapping.source_ranks_per_group)
        return tuple(m and self.carries(g) for g, m in enumerate(mask))

    def local_key(self, rank: int) -> LocalKey:
        """The local table a transfer to/from remote rank ``rank`` uses."""
        if self.policy.routed:
            return (self.local_rows, rank)
        return (self.bsr, rank if self.needs_split else -1)

    def local_table(self, key: LocalKey) -> Dlist:
        """The local table ``(bsr, -1)`` (whole) or ``(bsr, rank)`` (cut for remote rank ``rank``)."""
        return self.tables.local[key]

    def remote_table(self, rank: int) -> Dlist:
        """Remote rank ``rank``'s table, every row cut to what this rank exchanges with it."""
        return self.tables.remote[rank]

    def _routed(self, routes: Mapping[int, Route]) -> tuple[dict[LocalKey, Dlist], dict[int, Dlist]]:
        """kvgeom mode: this rank's whole table and, per remote rank, both sides' tables cut to its route."""
        cuts = {rank: self._cut_rows(rank, r) for rank, r in routes.items()}
        if self.page_cut is None:
            whole = local_dlist(self.local_view, self.local_rows)
        else:  # the cut attention rows, every state page whole
            first = self.targets[0]
            whole = routed_tables(
                self.local_view,
                self.remote_view(first),
                self.local_rows,
                self.token_rows,
                (),
                None,
                cuts[first],
            )[0]
        local: dict[LocalKey, Dlist] = {(self.local_rows, -1): whole}
        remote: dict[int, Dlist] = {}
        for rank, r in routes.items():
            local[(self.local_rows, rank)], remote[rank] = routed_tables(
                self.local_view,
                self.remote_view(rank),
                self.local_rows,
                self.token_rows,
                r.fa,
                r.ssm,
                cuts[rank],
            )
        return local, remote

    def _cut_rows(self, rank: int, r: Route) -> tuple[Runs, Runs] | None:
        """Both sides' attention rows of :attr:`page_cut` for remote rank ``rank``
        (:func:`kvgeom.plan.pagecut.cut_rows`)."""
        if self.page_cut is None:
            return None
        return cut_rows(self.local, self.remotes[rank], self.page_cut, rank, r)

    def _vllm_tables(self) -> tuple[dict[LocalKey, Dlist], dict[int, Dlist]]:
        """vLLM mode: the whole local table (and one split per source rank when P_TP > D_TP), and each remote
        rank's table."""
        bsr, view = self.bsr, self.local_view
        whole = local_dlist(view, bsr)
        local: dict[LocalKey, Dlist] = {(bsr, -1): whole}
        if self.needs_split:
            splits = build_local_splits(
                whole.runs,  # vLLM's N x 5 rows
                self.mapping,
                whole.num_fa,
                bsr,
                self.local.group_is_ssm,
                view.region_is_mla,
                [view.num_blocks] * view.num_regions,
                num_replicated_tail=view.logical_num_blocks if view.ple_region is not None else 0,
            )
            for src, rows in zip(self.mapping.all_source_ranks, splits):
                local[(bsr, src)] = Dlist.from_pseudo(rows, whole.num_fa)
        attn_reads = len(self._first_sources(ssm=False)) or 1
        draft = self.draft_mapping
        remote: dict[int, Dlist] = {}
        built: dict[EngineView, Dlist] = {}  # by the remote view without its TP rank, which no row depends on
        for rank in self.targets:
            rview = self.remote_view(rank)
            key = replace(rview, tp_rank=0)
            if key not in built:
                built[key] = remote_dlist(
                    view,
                    rview,
                    bsr,
                    attn_reads,
                    self.mapping.rank_offset_factor,
                    self._vllm_ssm_pieces(rview),
                    None
                    if draft is None
                    else (len(draft.source_ranks_per_group[0]), draft.rank_offset_factor),
                )
            remote[rank] = built[key]
        return local, remote

    def _vllm_ssm_pieces(self, view: EngineView) -> tuple[tuple[int, int], ...] | None:
        """vLLM's remote SSM reads: conv pieces scaled by the TP ratio, then the temporal slice (B.2.4)."""
        ssm, local = self.local.ssm, self.local_view
        if ssm is None or view.ssm_sizes is None or local.ssm_sizes is None:
            return None
        local_offset = self.local.tp_rank % max(self.tp_ratio, 1)
        conv = remote_conv_offsets(
            ssm.spec.piece_channels(self.local.tp_size),
            ssm.spec.conv_rows,
            dtype_size(ssm.spec.conv_dtype),
            local_offset,
            self.tp_ratio,
        )
        ssm_read = local.ssm_sizes[1] if self.tp_ratio >= 1 else view.ssm_sizes[1]
        return tuple(conv) + ((view.ssm_sizes[0] + local_offset * ssm_read, ssm_read),)

    def describe(self) -> str:
        m = self.mapping
        lines = [
            f"{self.mode} pairing: local TP{self.local.tp_size} rank {self.local.tp_rank} <-> remote "
            f"TP{self.remote_tp} (tp_ratio {self.tp_ratio}, block-size ratio {self.bsr}"
            f"{f', remote blocks read in {self.shape.remote_split} parts' if self.shape.remote_split > 1 else ''}"
            f"{', head-major remote permuted to token-major on receive' if self.permute else ''})",
            f"  sources per group: {[list(s) for s in m.source_ranks_per_group]}; all: {list(m.all_source_ranks)}; "
            f"rank offset factor {m.rank_offset_factor}; split local tables: {self.needs_split}",
            f"  local table: {len(self.local_table((self.local_rows, -1)))}"
            f" descriptors; remote tables: "
            + ", ".join(f"rank {r}: {len(self.remote_table(r))}" for r in self.targets),
        ]
        if self.plan is not None and self.plan.ranks:
            lines += ["  per-pair plan:", self.plan.describe()]
        return "\n".join(lines)


def _remote_view(shape: PairShape, geom: RankGeometry, rank: int) -> EngineView:
    """Remote rank ``rank``'s streams as planned with (rescaled for non-dividing block sizes)."""
    view = replace(shape.streams[1], tp_rank=rank) if shape.streams is not None else EngineView.of(geom)
    return view.rescaled(shape.remote_split) if shape.remote_split > 1 else view


def _kv_heads(geom: RankGeometry) -> int | None:
    """The KV heads of the model's head-sharded attention layers (``None`` without any)."""
    spec = geom.model.attention_spec
    return spec.num_kv_heads if spec is not None else None
