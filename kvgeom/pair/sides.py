"""The two sides of a pair as given to :meth:`kvgeom.plan.pairing.Pairing.create`: cards or geometries, checked to
be for the pair's mode, and the remote ranks checked to be ranks of one engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvgeom.errors import IncompatiblePairError
from kvgeom.layout.card import GeometryCard
from kvgeom.layout.geometry import RankGeometry

__all__ = ["as_geometry", "check_one_engine", "checked_sides"]


def as_geometry(x: RankGeometry | GeometryCard) -> RankGeometry:
    return x.geometry if isinstance(x, GeometryCard) else x


def checked_sides(
    local: RankGeometry | GeometryCard,
    remotes: Sequence[RankGeometry | GeometryCard] | Mapping[int, RankGeometry | GeometryCard],
    mode: str,
) -> tuple[RankGeometry, dict[int, RankGeometry]]:
    """The local geometry and the remote ranks' by rank, once the mode, every card's mode and the remote
    engine's consistency are checked (:meth:`Pairing.create`)."""
    if mode not in ("pull", "push"):
        raise IncompatiblePairError("mode", f"must be 'pull' or 'push', got {mode!r}", value=mode)
    items = list(remotes.items() if isinstance(remotes, Mapping) else enumerate(remotes))
    for rank, x in [(-1, local), *items]:
        if isinstance(x, GeometryCard) and x.mode != mode:
            raise IncompatiblePairError(
                "mode",
                f"{'local' if rank < 0 else f'remote rank {rank}'} card is "
                f"for {x.mode}, the pair is planned for {mode}",
                local=mode,
                remote=x.mode,
            )
    rg = {int(k): as_geometry(v) for k, v in items}
    if not rg:
        raise IncompatiblePairError("remotes", "no remote rank given", value=0)
    check_one_engine(rg)
    return as_geometry(local), rg


def check_one_engine(rg: Mapping[int, RankGeometry]) -> None:
    """The remote ranks given are ranks of one engine: same TP size, blocks, model and configuration, each
    at its own position."""
    first = next(iter(rg.values()))
    for rank, g in rg.items():
        if g.tp_size != first.tp_size or g.num_blocks != first.num_blocks:
            raise IncompatiblePairError(
                f"remotes[{rank}]",
                "all ranks of one remote engine must agree on TP size and num_blocks",
                local=(first.tp_size, first.num_blocks),
                remote=(g.tp_size, g.num_blocks),
            )
        if g.tp_rank != rank:
            raise IncompatiblePairError(
                f"remotes[{rank}].tp_rank",
                "card rank differs from its position",
                local=rank,
                remote=g.tp_rank,
            )
        if g.model != first.model:
            raise IncompatiblePairError(
                f"remotes[{rank}].model",
                "all ranks of one remote engine must hold the same model spec",
                local=first.model.dumps()[:200],
                remote=g.model.dumps()[:200],
            )
        if not first.engine.same_but_rank(g.engine):
            raise IncompatiblePairError(
                f"remotes[{rank}].engine",
                "all ranks of one remote engine must share its configuration (apart from the rank)",
                local=first.engine.to_json(),
                remote=g.engine.to_json(),
            )
