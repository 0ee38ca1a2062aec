"""vLLM's CPU attention page at a block-size ratio, in kvgeom mode: both sides' kernel blocks cut by their token
runs (:mod:`kvgeom.layout.tokenruns`: per token chunk, per head its K rows, then its V rows), so that descriptor
``k`` of a finer block and descriptor ``j * U + k`` of a coarser one hold the same bytes of chunk ``j`` and
nothing is regrouped after the transfer (:class:`~kvgeom.plan.pairing.Pairing` builds its tables from the cut)."""

from __future__ import annotations

from kvgeom.dtypes import dtype_size
from kvgeom.errors import UnsupportedError
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.geometry import RankGeometry, Region
from kvgeom.layout.runs import Runs
from kvgeom.layout.tokenruns import TokenRun, layer_token_runs, page_token_runs, unit_runs
from kvgeom.layout.view import EngineView, pseudo_bases
from kvgeom.model.layers import AttentionSpec
from kvgeom.pair.route import Route
from kvgeom.plan.dlist import cut_fa_rows

__all__ = ["PageCut", "cut_rows", "page_cut"]

#: per side (local, then remote), per attention stream: its kernel block's unit runs (:func:`unit_runs`)
PageCut = tuple[tuple[Runs, ...], tuple[Runs, ...]]


def page_cut(
    local: RankGeometry,
    remote: RankGeometry,
    local_view: EngineView,
    remote_view: EngineView,
    bsr: int,
    remote_split: int,
) -> PageCut | None:
    """The cut of a pair whose local page is ``head_kv_major`` at a block-size ratio (``bsr`` or
    ``remote_split`` > 1), or ``None``: per attention stream of each side, its kernel block cut into
    descriptors of one finer block's token runs each. Refused (``UnsupportedError``) where a side's streams
    are not its regions, or the two sides' pages cut into different numbers of runs."""
    spec = local.model.attention_spec
    if (
        spec is None
        or local.is_mla
        or local.engine.kv_layout is not KVLayout.HEAD_KV_MAJOR
        or (bsr == 1 and remote_split == 1)
    ):
        return None
    unit = min(local.engine.kernel, remote.engine.kernel)
    sides = []
    for geom, view in ((local, local_view), (remote, remote_view)):
        if view.bases or view.transfer_groups or view.num_regions != geom.num_regions:
            raise UnsupportedError(
                "regions",
                "kvgeom mode cuts the CPU attention page by its token runs with one stream per region",
                local=local_view.num_regions,
                remote=view.num_regions,
            )
        sides.append(tuple(_region_runs(geom, r) for r in geom.regions))
    counts = {sum(rows for _, rows, _, _ in runs) for side in sides for runs in side}
    if len(counts) != 1:
        raise UnsupportedError(
            "regions",
            "the CPU attention pages of the two sides cut into different numbers of token runs",
            value=sorted(counts),
        )
    return tuple(  # type: ignore[return-value]
        tuple(unit_runs(runs, geom.engine.kernel, unit) for runs in side)
        for geom, side in zip((local, remote), sides)
    )


def cut_rows(
    local: RankGeometry, remote: RankGeometry, cut: PageCut, rank: int, r: Route
) -> tuple[Runs, Runs]:
    """Both sides' attention rows of ``cut`` for remote rank ``rank`` (``remote``), whose route ``r`` must move
    whole rows (the same heads on both sides, one source)."""
    if any(lo or ro for lo, ro, _ in r.fa):
        raise UnsupportedError(
            "tp_size",
            f"remote rank {rank} gives part of each row (route {list(r.fa)}): the CPU attention page is "
            "cut by its token runs only where one remote rank holds the local heads",
            local=local.tp_size,
            remote=remote.tp_size,
        )
    sides = [
        cut_fa_rows(
            pseudo_bases(geom.num_regions),
            [x.block_stride for x in geom.regions],
            [x.num_blocks for x in geom.regions],
            units,
        )
        for geom, units in ((local, cut[0]), (remote, cut[1]))
    ]
    return sides[0], sides[1]


def _region_runs(geom: RankGeometry, region: Region) -> tuple[TokenRun, ...]:
    """The token runs of ``region``'s attention page: its first attention member's, or, in a region no
    attention layer views (its attention rows are moved but never read), the model's attention page."""
    for _, name in region.members:
        if isinstance(geom.layer_specs[name], AttentionSpec):
            return layer_token_runs(geom, name)
    spec = geom.model.attention_spec
    if spec is None:  # not reached: page_cut plans only models with attention
        return ()
    e = dtype_size(spec.dtype)
    return page_token_runs(
        geom.engine.kv_layout,
        spec.heads_per_rank(geom.tp_size),
        geom.engine.kernel,
        spec.head_size * e,
        spec.v_size * e,
        e,
        region.part if region.part in ("k", "v") else "kv",
    )
