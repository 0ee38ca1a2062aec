"""A validated P/D pairing, seen from one local rank: everything fixed at handshake time.

``Pairing.create(local, remotes, mode)`` checks the pair (:mod:`kvgeom.handshake`), computes the TP
mapping, the block-size ratio, and the descriptor tables this rank prepares once: its own whole-region
table (and, when P_TP > D_TP, one split table per source rank) and one table per remote rank. Per-request
plans (:mod:`kvgeom.plan`) only pick rows of these tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from .card import GeometryCard
from .conv import remote_conv_offsets
from .dlist import Dlist, EngineView, local_dlist, remote_dlist
from .dtypes import dtype_size
from .errors import IncompatiblePairError
from .geometry import RankGeometry
from .handshake import Compat, PairShape, check_pair
from .shards import ssm_piece_reads
from .splits import build_local_splits, expand_strided
from .tp import TPMapping, compute_tp_mapping, handshake_targets, needs_split_local_handles

__all__ = ["Pairing", "LocalKey"]

LocalKey = tuple[int, int]  # (bsr, source index or -1 for the whole table)


def _as_geometry(x: RankGeometry | GeometryCard) -> RankGeometry:
    return x.geometry if isinstance(x, GeometryCard) else x


@dataclass(frozen=True, eq=False)
class Pairing:
    """This local rank paired with a remote engine (``remotes``: the remote ranks it talks to)."""

    local: RankGeometry
    remotes: Mapping[int, RankGeometry]
    mode: str
    compat: Compat
    shape: PairShape
    mapping: TPMapping
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def create(cls, local: RankGeometry | GeometryCard, remotes: Sequence[RankGeometry | GeometryCard] |
               Mapping[int, RankGeometry | GeometryCard], mode: str = "pull", compat: Compat = "kvgeom",
               prefix_caching: bool = False) -> Pairing:
        """Validate and pair. ``remotes`` holds at least this rank's handshake targets (a sequence is
        taken as ranks ``0..n-1`` of the remote engine)."""
        if mode not in ("pull", "push"):
            raise IncompatiblePairError("mode", f"must be 'pull' or 'push', got {mode!r}", value=mode)
        lg = _as_geometry(local)
        items = list(remotes.items() if isinstance(remotes, Mapping) else enumerate(remotes))
        for rank, x in [(-1, local), *items]:
            if isinstance(x, GeometryCard) and x.mode != mode:
                raise IncompatiblePairError("mode", f"{'local' if rank < 0 else f'remote rank {rank}'} card is "
                                            f"for {x.mode}, the pair is planned for {mode}", local=mode,
                                            remote=x.mode)
        rg = {int(k): _as_geometry(v) for k, v in items}
        if not rg:
            raise IncompatiblePairError("remotes", "no remote rank given", value=0)
        first = next(iter(rg.values()))
        for rank, g in rg.items():
            if g.tp_size != first.tp_size or g.num_blocks != first.num_blocks:
                raise IncompatiblePairError(
                    f"remotes[{rank}]", "all ranks of one remote engine must agree on TP size and num_blocks",
                    local=(first.tp_size, first.num_blocks), remote=(g.tp_size, g.num_blocks))
            if g.tp_rank != rank:
                raise IncompatiblePairError(f"remotes[{rank}].tp_rank", "card rank differs from its position",
                                            local=rank, remote=g.tp_rank)
        shape = check_pair(lg, first, mode, compat, prefix_caching)
        targets = handshake_targets(lg.tp_rank, lg.tp_size, first.tp_size)
        missing = [t for t in targets if t not in rg]
        if missing:
            raise IncompatiblePairError("remotes", f"handshake targets {missing} have no card", value=missing,
                                        expected=list(targets))
        mapping = compute_tp_mapping(lg.tp_rank, lg.tp_size, first.tp_size, lg.num_kv_heads, lg.is_mla,
                                     lg.group_is_ssm)
        return cls(lg, {t: rg[t] for t in targets}, mode, compat, shape, mapping)

    # -- ratios -------------------------------------------------------------------------------------
    @property
    def tp_ratio(self) -> int:
        return self.shape.tp_ratio

    @property
    def bsr(self) -> int:
        return self.shape.bsr

    @property
    def remote_tp(self) -> int:
        return next(iter(self.remotes.values())).tp_size

    @cached_property
    def local_view(self) -> EngineView:
        return EngineView.of(self.local)

    def remote_view(self, rank: int) -> EngineView:
        """The remote rank's numbers as planned with (rescaled for non-dividing block sizes)."""
        view = EngineView.of(self.remotes[rank])
        return view.rescaled(self.shape.remote_split) if self.shape.remote_split > 1 else view

    @property
    def needs_split(self) -> bool:
        """Whether each source rank gets its own slice of the local table (P_TP > D_TP, vLLM B.3.3)."""
        return needs_split_local_handles(self.tp_ratio, self.mapping, self.local.is_mla)

    @property
    def targets(self) -> tuple[int, ...]:
        return tuple(self.remotes)

    # -- tables -------------------------------------------------------------------------------------
    def _first_sources(self, ssm: bool) -> tuple[int, ...]:
        for ranks, is_ssm in zip(self.mapping.source_ranks_per_group, self.local.group_is_ssm):
            if is_ssm == ssm:
                return ranks
        return ()

    def local_table(self, key: LocalKey) -> Dlist:
        """The local table ``(bsr, -1)`` (whole) or ``(bsr, p)`` (split for source index ``p``)."""
        if key not in self._cache:
            bsr, p = key
            whole = self._cache.get((bsr, -1)) or local_dlist(self.local_view, bsr)
            self._cache[(bsr, -1)] = whole
            if p >= 0:
                splits = build_local_splits(
                    whole.pseudo_addresses(), self.mapping, whole.num_fa, bsr, self.local.group_is_ssm,
                    self.local.region_is_mla, [self.local.num_blocks] * self.local.num_regions,
                    allow_sharded_ratio=self.compat == "kvgeom")
                for i, s in enumerate(splits):
                    self._cache[(bsr, i)] = Dlist.from_pseudo(expand_strided(s), whole.num_fa)
        return self._cache[key]

    def remote_table(self, rank: int) -> Dlist:
        """Remote rank ``rank``'s table, attention rows cut to this local rank's share (vLLM B.2.4)."""
        key = ("remote", rank)
        if key not in self._cache:
            view = self.remote_view(rank)
            attn_reads = len(self._first_sources(ssm=False)) or 1
            self._cache[key] = remote_dlist(self.local_view, view, self.bsr, attn_reads,
                                            self.mapping.rank_offset_factor, self._ssm_pieces(rank, view))
        return self._cache[key]

    def _ssm_pieces(self, rank: int, view: EngineView) -> tuple[tuple[int, int], ...] | None:
        """What remote rank ``rank`` sends of each SSM piece: vLLM's TP-ratio scaling in ``vllm`` mode,
        the sharding rule (:mod:`kvgeom.shards`, right for replicated pieces too) in ``kvgeom`` mode."""
        ssm, local = self.local.ssm, self.local_view
        if ssm is None or view.ssm_sizes is None or local.ssm_sizes is None:
            return None
        if self.compat == "kvgeom":
            sources = self._first_sources(ssm=True)
            p = sources.index(rank) if rank in sources else 0
            return ssm_piece_reads(ssm.spec, self.local.tp_rank, self.local.tp_size, rank, self.remote_tp, p,
                                   max(len(sources), 1) if self.tp_ratio < 0 else 1)
        local_offset = self.local.tp_rank % max(self.tp_ratio, 1)
        conv = remote_conv_offsets(ssm.spec.piece_channels(self.local.tp_size), ssm.spec.conv_rows,
                                   dtype_size(ssm.spec.conv_dtype), local_offset, self.tp_ratio)
        ssm_read = local.ssm_sizes[1] if self.tp_ratio >= 1 else view.ssm_sizes[1]
        return tuple(conv) + ((view.ssm_sizes[0] + local_offset * ssm_read, ssm_read),)

    def local_key(self, source_index: int) -> LocalKey:
        return (self.bsr, source_index if self.needs_split else -1)

    def describe(self) -> str:
        m = self.mapping
        lines = [
            f"{self.mode} pairing: local TP{self.local.tp_size} rank {self.local.tp_rank} <-> remote "
            f"TP{self.remote_tp} (tp_ratio {self.tp_ratio}, block-size ratio {self.bsr}"
            f"{f', remote blocks read in {self.shape.remote_split} parts' if self.shape.remote_split > 1 else ''})",
            f"  sources per group: {[list(s) for s in m.source_ranks_per_group]}; all: {list(m.all_source_ranks)}; "
            f"rank offset factor {m.rank_offset_factor}; split local tables: {self.needs_split}",
            f"  local table: {len(self.local_table((self.bsr, -1)))}"
            f" descriptors; remote tables: "
            + ", ".join(f"rank {r}: {len(self.remote_table(r))}" for r in self.targets),
        ]
        return "\n".join(lines)
