"""Binding a request whose two sides group the same regions differently (:mod:`kvgeom.plan.regionmap`): the
request's lists expanded to one list per region, planned by the general planner (:mod:`kvgeom.plan.request`) on
the pairing bound by region (``PairPlan.by_region``: every region its own group), and vLLM 0.33.0's rule for
such pulls (:data:`BY_REGION`: page position or end-trim, refused where it would pair other tokens than the
token axis does; with DCP by page position per remote rank), the boundary of vLLM mode.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvgeom.errors import PlanError, UnsupportedError
from kvgeom.pair.streams import region_group_ids
from kvgeom.plan.align import list_starts, overlap
from kvgeom.plan.bind import cached_blocks, is_sliding, plan_of
from kvgeom.plan.dcpbind import first_position, pair_codes
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.regionmap import (
    apply_prefix_caching_by_region,
    block_ids_by_region,
    region_zero_ids,
    region_zero_rows,
)
from kvgeom.plan.requestplan import Regroup

__all__ = ["bound_by_region", "BY_REGION"]


def bound_by_region(
    pairing: Pairing, lids: list[np.ndarray], rids: list[np.ndarray]
) -> tuple[Pairing, list[np.ndarray], list[np.ndarray], tuple[int, ...]]:
    """A region-mapped pull's request as the planner binds it: the pairing bound by region, each side's
    logical ids one list per region (its group's, or a shared region's every group's), and per region the
    group a refusal names."""
    lgid = region_group_ids(pairing.local)
    rgid = region_group_ids(pairing.remotes[pairing.targets[0]])
    bound = plan_of(pairing).by_region
    return bound, block_ids_by_region(lids, lgid), block_ids_by_region(rids, rgid), lgid


_Span = tuple[int, int, int]  # (first local page, first remote page, pages) of a region's overlap


def _region_spans(
    pairing: Pairing,
    lids: list[np.ndarray],
    rids: list[np.ndarray],
    l_by: list[np.ndarray],
    r_by: list[np.ndarray],
    num_tokens: int | None,
    prefill_tokens: int | None,
) -> tuple[list[_Span | None], list[int]]:
    """Per region, the overlap of both sides' pages on the token axis (``None``: a region viewed by several
    groups, vLLM mode only) and the token its local list starts at."""
    local, remote = pairing.local, pairing.remotes[pairing.targets[0]]
    kb = local.block_size  # equal kernel blocks on both sides (handshake)
    spans: list[_Span | None] = []
    starts: list[int] = []
    for r, (lg, rg) in enumerate(zip(region_group_ids(local), region_group_ids(remote))):
        if lg < 0 or rg < 0:  # vLLM mode only (kvgeom mode refuses shared regions at handshake)
            spans.append(None)
            starts.append(0)
            continue
        c0, p0 = list_starts(
            lids[lg].size,
            local.logical_block_size,
            rids[rg].size,
            remote.logical_block_size,
            num_tokens,
            pairing.prefix_caching,
            is_sliding(local.groups[lg]),
            r,
            prefill_tokens,
        )
        spans.append(overlap(c0 // kb, l_by[r].size, p0 // kb, r_by[r].size))
        starts.append(c0)
    return spans, starts


def _counted_region_pairs(
    pairing: Pairing,
    lids: list[np.ndarray],
    l_by: list[np.ndarray],
    r_by: list[np.ndarray],
    spans: list[_Span | None],
    starts: list[int],
    num_tokens: int | None,
    prefill_tokens: int | None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """vLLM's pairing of differently grouped regions (page position from the token counts, or end-trim),
    refused where it pairs other pages than the token axis does or leaves a page P computed unread."""
    local, rank0 = pairing.local, pairing.targets[0]
    remote = pairing.remotes[rank0]
    lgid, rgid = region_group_ids(local), region_group_ids(remote)
    computed, total = None, None
    tokens = prefill_tokens  # vLLM's remote_num_tokens: without it vLLM end-trims each region
    if tokens is not None and min(lgid) >= 0 and min(rgid) >= 0:
        counts = [cached_blocks(pairing, x.size, num_tokens, g) for g, x in enumerate(lids)]
        computed = [counts[g] * local.ppl for g in lgid]
        total = math.ceil(tokens / remote.block_size)
    elif any(x.size for x in l_by) and remote.ppl != local.ppl:
        raise UnsupportedError(
            "prefill_tokens",
            "vLLM 0.33.0 pairs differently grouped regions of different "
            "logical block sizes only by page position, from the request's token counts",
            local=local.ppl,
            remote=remote.ppl,
        )
    la, ra = apply_prefix_caching_by_region(l_by, r_by, computed, total, remote_rank=rank0)
    computed_tokens = prefill_tokens if prefill_tokens is not None else num_tokens
    kb = local.block_size
    for r, span in enumerate(spans):
        if span is None:
            continue
        c, p, n = span  # vLLM's pairs must be the token axis's, and leave no page holding a computed token
        exact, got = pair_codes(l_by[r][c : c + n], r_by[r][p : p + n]), pair_codes(la[r], ra[r])
        positions = np.arange(c, c + n)
        left = ~np.isin(l_by[r][positions], la[r])
        if computed_tokens is not None:
            left &= starts[r] + positions * kb < computed_tokens
        if not np.isin(got, exact).all() or left.any():
            raise UnsupportedError(
                f"regions[{r}]",
                "vLLM 0.33.0 would pair other pages of this region than the "
                "token axis does, or leave pages P computed unread; kvgeom mode plans it",
                local=la[r].tolist()[:8],
                remote=ra[r].tolist()[:8],
            )
    return la, ra


class _ByRegion:
    """vLLM 0.33.0's rule for a pull between sides that group the same regions differently (the methods of
    :class:`kvgeom.plan.request._VllmRule`, on a binding ``b`` by region whose ``grouped`` is the request as
    named by the pairing's groups)."""

    def bind(self, b: Any) -> Any:
        """Without DCP: each region's overlap on the token axis (what vLLM's pairs are checked against); with
        DCP: every transfer rank's pairs by page position, and the pages each matched."""
        pairing, lids, rids = b.grouped
        if not b.dcp:
            return _region_spans(pairing, lids, rids, b.lk, b.rk, b.num_tokens, b.prefill_tokens)
        return _dcp_by_position(pairing, lids, b.lk, b.rk, b.num_tokens, b.prefill_tokens)

    def pairs(self, b: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        pairing, lids, _ = b.grouped
        spans, starts = b.exact
        return _counted_region_pairs(pairing, lids, b.lk, b.rk, spans, starts, b.num_tokens, b.prefill_tokens)

    def dcp_pairs(self, b: Any, rank: int, rt: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        by_rank: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = b.exact[0]
        return by_rank.get(rank, ([], []))

    def receive(self, b: Any) -> tuple[tuple[Regroup, ...], np.ndarray]:
        """D's pages past those vLLM paired, zeroed whole, region by region (with DCP: past the pages all
        remote ranks matched)."""
        regions = b.pairing.local.regions
        lens, strides = [x.block_len for x in regions], [x.block_stride for x in regions]
        if b.dcp:
            return (), region_zero_rows(region_zero_ids(b.lk, b.exact[1]), lens, strides)
        la = b.counted()[0]
        return (), region_zero_rows([x[y.size :] for x, y in zip(b.lk, la)], lens, strides)


BY_REGION = _ByRegion()


def _dcp_by_position(
    pairing: Pairing,
    lids: list[np.ndarray],
    l_by: list[np.ndarray],
    r_by: list[np.ndarray],
    num_tokens: int | None,
    prefill_tokens: int | None,
) -> tuple[dict[int, tuple[list[np.ndarray], list[np.ndarray]]], list[list[np.ndarray]]]:
    """vLLM's region-mapped pull with decode context parallelism: each region by page position per remote rank
    (:func:`~kvgeom.plan.regionmap.apply_prefix_caching_by_region` from ``prefill_tokens`` and D's cached pages),
    and the pages each rank matched (D zeroes each region past the pages all ranks matched). With a logical
    block of one kernel block on both sides (the handshake refuses others in vLLM mode) a page position is a
    token range on both sides, so vLLM's pairs are the token axis's (docs/vllm-behaviour.md)."""
    local = pairing.local
    remote = pairing.remotes[pairing.targets[0]]
    if not any(x.size for x in l_by):  # every list empty: nothing to read or zero
        return {}, []
    if prefill_tokens is None:
        raise PlanError(
            "prefill_tokens",
            "vLLM 0.33.0 pairs differently grouped regions with decode context parallelism by page position "
            "from the tokens P computed: pass prefill_tokens",
            value=None,
        )
    first = [first_position(local, x.size, num_tokens, pairing.prefix_caching, g) for g, x in enumerate(lids)]
    total = math.ceil(prefill_tokens / remote.block_size)
    lgid = region_group_ids(local)
    by_rank, matched = {}, []
    for rank in pairing.transfer_ranks:
        la, ra = apply_prefix_caching_by_region(
            l_by, r_by, [first[g] for g in lgid], total, rank, local.dcp_size, local.dcp_rank, remote.dcp_size
        )
        matched.append(la)
        if any(x.size for x in la):
            by_rank[rank] = (la, ra)
    return by_rank, matched
