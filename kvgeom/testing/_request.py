"""What the oracle checks a transfer for: one :class:`Request` and the engines' ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from kvgeom.errors import KvgeomError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import RankGeometry
from kvgeom.model.spec import ModelSpec

__all__ = ["Request", "RequestError", "check_side", "engine_geometries"]


class RequestError(KvgeomError):
    """A :class:`Request` does not fit the engines (wrong block counts, overlapping or out-of-pool ids): a
    :class:`~kvgeom.errors.KvgeomError` whose ``field`` names the request's field (``d_ids[0]``, ``num_tokens``)
    and whose ``values`` hold what was given and what was expected."""


def _ids(x: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(i) for i in g) for g in x)


@dataclass(frozen=True)
class Request:
    """One request to move from P to D.

    ``num_tokens`` is the request's length on D (D holds ``ceil(num_tokens / D block)`` blocks);
    ``prefill_tokens`` (default ``num_tokens``) the tokens P computed: in the N-1 flow of Mamba hybrids P
    stops short and D recomputes the rest (:mod:`kvgeom.plan.exchange`). ``p_ids[g]`` are P's logical block
    ids of group ``g`` (attention groups: ``ceil(prefill_tokens / P block)`` blocks covering every
    computed token; SSM groups: one state slot); ``d_ids[g]`` D's (``ceil(num_tokens / D block)``
    blocks), without its ``prefix_blocks`` leading blocks that are already cached (their tokens are not
    transferred). All groups of one engine share one pool: ids are distinct across groups on one side.
    """

    num_tokens: int
    p_ids: tuple[tuple[int, ...], ...]
    d_ids: tuple[tuple[int, ...], ...]
    prefix_blocks: int = 0
    prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "p_ids", _ids(self.p_ids))
        object.__setattr__(self, "d_ids", _ids(self.d_ids))
        if self.num_tokens < 1 or self.prefix_blocks < 0:
            bad = "num_tokens" if self.num_tokens < 1 else "prefix_blocks"
            raise RequestError(
                bad,
                f"num_tokens must be >= 1 and prefix_blocks >= 0, got {self.num_tokens}, {self.prefix_blocks}",
                value=getattr(self, bad),
            )
        if self.prefill_tokens is not None and not 1 <= self.prefill_tokens <= self.num_tokens:
            raise RequestError(
                "prefill_tokens",
                f"must lie in [1, num_tokens={self.num_tokens}], got {self.prefill_tokens}",
                value=self.prefill_tokens,
                expected=(1, self.num_tokens),
            )

    @property
    def p_tokens(self) -> int:
        """The tokens P computed (``prefill_tokens``, default ``num_tokens``)."""
        return self.num_tokens if self.prefill_tokens is None else self.prefill_tokens

    @classmethod
    def simple(
        cls,
        model: ModelSpec,
        p_engine: EngineConfig,
        d_engine: EngineConfig,
        num_tokens: int,
        prefix_blocks: int = 0,
        first_id: int = 1,
        prefill_tokens: int | None = None,
    ) -> Request:
        """Consecutive ids from ``first_id`` on both sides (block 0 stays free as a neighbour)."""
        sides = []
        computed = num_tokens if prefill_tokens is None else prefill_tokens
        for engine, tokens, prefix in ((p_engine, computed, 0), (d_engine, num_tokens, prefix_blocks)):
            groups = engine_geometries(model, engine)[0].groups
            nxt, ids = first_id, []
            for g in groups:
                n = 1 if g.one_block else math.ceil(tokens / engine.scheduler_block) - prefix
                ids.append(tuple(range(nxt, nxt + n)))
                nxt += n
            sides.append(tuple(ids))
        return cls(num_tokens, sides[0], sides[1], prefix_blocks, prefill_tokens)


def check_side(name: str, ids: tuple[tuple[int, ...], ...], geom: RankGeometry, want: int) -> None:
    if len(ids) != len(geom.groups):
        raise RequestError(
            name,
            f"{len(ids)} groups of ids, the model has {len(geom.groups)} groups",
            value=len(ids),
            expected=len(geom.groups),
        )
    seen: set[int] = set()
    for g, (group, gids) in enumerate(zip(geom.groups, ids)):
        n = 1 if group.one_block else want
        if len(gids) != n:
            raise RequestError(
                f"{name}[{g}]",
                f"({group.kind.value}): {len(gids)} ids, expected {n}",
                value=len(gids),
                expected=n,
            )
        bad = [i for i in gids if not 0 <= i < geom.logical_num_blocks]
        if bad:
            raise RequestError(
                f"{name}[{g}]",
                f"ids {bad} outside the pool of {geom.logical_num_blocks} blocks",
                value=bad,
                expected=geom.logical_num_blocks,
            )
        if seen & set(gids) or len(set(gids)) != len(gids):
            raise RequestError(f"{name}[{g}]", "ids repeat within the engine's pool", value=list(gids))
        seen |= set(gids)


@lru_cache(maxsize=512)
def _geometry(model: ModelSpec, engine: EngineConfig) -> RankGeometry:
    return rank_geometry(model, engine)


def engine_geometries(model: ModelSpec, engine: EngineConfig) -> list[RankGeometry]:
    """Every rank of the engine ``engine`` (its ``tp_rank`` and ``pp_rank`` are ignored), stage by stage:
    rank ``pp_rank * tp_size + tp_rank`` at that index."""
    return [
        _geometry(model, engine.with_rank(r, s)) for s in range(engine.pp_size) for r in range(engine.tp_size)
    ]
