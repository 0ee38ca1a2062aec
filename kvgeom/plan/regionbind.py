"""Binding a request whose two sides group the same regions differently: block lists paired region by
region (:mod:`kvgeom.plan.regionmap`), with or without decode context parallelism.
"""

from __future__ import annotations

import math

import numpy as np

from kvgeom.blocks import (
    BlockIds,
    as_group_ids,
    get_mapped_blocks,
    logical_to_kernel,
)
from kvgeom.errors import PlanError, UnsupportedError
from kvgeom.pair.streams import region_group_ids
from kvgeom.plan.align import Page, consumer_zero_rows, list_starts, overlap, page_heads
from kvgeom.plan.bind import cached_blocks, check_ids, is_sliding, plan_of, require_num_tokens
from kvgeom.plan.dcpbind import dcp_units_of, first_position, pair_codes
from kvgeom.plan.descids import apply_segments
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.regionmap import (
    apply_prefix_caching_by_region,
    block_ids_by_region,
    region_zero_ids,
    region_zero_rows,
)
from kvgeom.plan.requestplan import RequestPlan, Transfer

__all__ = ["plan_by_region", "region_plan", "region_dcp_pairs"]


def plan_by_region(
    pairing: Pairing,
    lids: list[np.ndarray],
    remote_ids: BlockIds,
    request_id: str,
    remote_request_id: str | None,
    num_tokens: int | None,
    prefill_tokens: int | None,
) -> RequestPlan:
    """A pull between sides that group the same regions differently (:mod:`kvgeom.plan.regionmap`): each side's
    kernel ids expanded to one list per region, paired region by region (vLLM mode: vLLM's page-position or
    end-trim pairing, refused where it would pair other tokens than the token axis does; kvgeom mode: by
    tokens), descriptor ids with every region its own list, and D's pages nothing filled zeroed per region."""
    local, rank0 = pairing.local, pairing.targets[0]
    remote = pairing.remotes[rank0]
    rids = as_group_ids(remote_ids, remote.group_is_ssm, "remote_ids")
    check_ids(lids, local, "local")
    check_ids(rids, remote, "remote")
    require_num_tokens(local, lids, num_tokens, "local_ids")
    lgid, rgid = region_group_ids(local), region_group_ids(remote)
    l_by = block_ids_by_region(logical_to_kernel(lids, local.ppl, local.group_is_ssm), lgid)
    r_by = block_ids_by_region(logical_to_kernel(rids, remote.ppl, remote.group_is_ssm), rgid)
    if pairing.dcp_active:
        by_rank, pages = region_dcp_pairs(pairing, lids, rids, l_by, r_by, num_tokens, prefill_tokens)
        lens, strides = [x.block_len for x in local.regions], [x.block_stride for x in local.regions]
        return region_plan(
            pairing, by_rank, region_zero_rows(pages, lens, strides), request_id, remote_request_id
        )
    spans, starts = _region_spans(pairing, lids, rids, l_by, r_by, num_tokens, prefill_tokens)
    # a region without a span (vllm mode's shared regions) pairs nothing of its own and is zeroed whole
    full = [s if s is not None else (0, 0, 0) for s in spans]
    if pairing.policy.by_tokens:
        la = [x[c : c + n] for x, (c, _, n) in zip(l_by, full)]
        ra = [x[p : p + n] for x, (_, p, n) in zip(r_by, full)]
    else:
        la, ra = _counted_region_pairs(pairing, lids, l_by, r_by, spans, starts, num_tokens, prefill_tokens)
    by_rank = {rank: (la, ra) for rank in pairing.transfer_ranks} if any(x.size for x in la) else {}
    zero = _region_zero(pairing, l_by, la, spans, full)
    return region_plan(pairing, by_rank, zero, request_id, remote_request_id)


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


def _region_zero(
    pairing: Pairing,
    l_by: list[np.ndarray],
    la: list[np.ndarray],
    spans: list[_Span | None],
    full: list[_Span],
) -> np.ndarray:
    """D's rows nothing fills, per region: past the pages paired (vLLM mode, or a region without a span), or
    the token ranges of D's pages outside the overlap (kvgeom mode)."""
    local = pairing.local
    zero = [np.zeros((0, 3), dtype=np.int64)]
    for r, region in enumerate(local.regions):
        if not pairing.policy.by_tokens or spans[r] is None:
            stale = l_by[r][la[r].size :]
            zero.append(
                np.stack(
                    [
                        np.full(stale.size, r),
                        stale * region.block_stride,
                        np.full(stale.size, region.block_len),
                    ],
                    axis=1,
                )
            )
        else:
            page = Page(r, 0, region.block_len, region.block_stride, page_heads(local, region.members[0][1]))
            zero.append(consumer_zero_rows([page], l_by[r], 1, full[r][0], full[r][2], local.block_size))
    return np.concatenate(zero).astype(np.int64)


def region_plan(
    pairing: Pairing,
    by_rank: dict[int, tuple[list[np.ndarray], list[np.ndarray]]],
    zero: np.ndarray,
    request_id: str,
    remote_request_id: str | None,
) -> RequestPlan:
    """A region-mapped pull's plan: one transfer per remote rank of ``by_rank`` (its kernel ids per region, on
    each side), descriptor ids with every region its own list; ``zero`` rows of D's pages nothing filled."""
    local = pairing.local
    tag = remote_request_id if remote_request_id is not None else request_id
    expected = pairing.mapping.local_consumers
    transfers = []
    for rank, (la, ra) in by_rank.items():
        lseg, rseg = plan_of(pairing).region_segments[rank]
        rows = pairing.token_rows  # kvgeom mode cuts token-major pages per token when heads differ
        lx = [get_mapped_blocks(x, rows) for x in la] if rows > 1 else la
        rx = [get_mapped_blocks(x, rows) for x in ra] if rows > 1 else ra
        transfers.append(
            Transfer(
                rank,
                pairing.local_key(rank),
                apply_segments(lseg, lx),
                apply_segments(rseg, rx),
                f"{tag}:{expected}",
            )
        )
    sent = {t.remote_rank for t in transfers}
    return RequestPlan(
        request_id,
        "pull",
        tuple(transfers),
        tuple(r for r in pairing.targets if r not in sent),
        expected,
        local.tp_rank,
        (),
        zero,
    )


def region_dcp_pairs(
    pairing: Pairing,
    lids: list[np.ndarray],
    rids: list[np.ndarray],
    l_by: list[np.ndarray],
    r_by: list[np.ndarray],
    num_tokens: int | None,
    prefill_tokens: int | None,
) -> tuple[dict[int, tuple[list[np.ndarray], list[np.ndarray]]], list[np.ndarray]]:
    """A region-mapped pull with decode context parallelism: per remote rank with pages to read, each region's D
    and P kernel ids, and D's pages to zero per region (pure MLA, equal kernel blocks, every region one group's
    pages on each side in kvgeom mode). kvgeom mode places each region's pages on the token axis by global page
    position (:func:`kvgeom.pair.dcp.dcp_units`): every remote rank sends the pages P computed that it holds, and D's
    pages holding no computed token are zeroed. vLLM mode pairs as vLLM 0.33.0 does: each region by page
    position per remote rank (:func:`~kvgeom.plan.regionmap.apply_prefix_caching_by_region` from ``prefill_tokens``
    and D's cached pages), then zeroes each region past the pages all ranks matched
    (:func:`~kvgeom.plan.regionmap.region_zero_ids`). With a logical block of one kernel block on both sides (the
    handshake refuses others in vLLM mode) a page position is a token range on both sides, so vLLM's pairs are
    the token axis's (docs/vllm-behaviour.md)."""
    local = pairing.local
    remote = pairing.remotes[pairing.targets[0]]
    lgid, rgid = region_group_ids(local), region_group_ids(remote)
    if not any(x.size for x in l_by):
        return {}, l_by  # every list empty: nothing to read or zero
    by_rank: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    if pairing.policy.by_tokens:
        units = [
            dcp_units_of(
                local, remote, lids[lg], rids[rg], num_tokens, prefill_tokens, pairing.prefix_caching, lg
            )
            for lg, rg in zip(lgid, rgid)
        ]
        for rank in pairing.transfer_ranks:
            mine = [u["ok"] & (u["p_rank"] == pairing.remotes[rank].dcp_rank) for u in units]
            la = [u["c_fine"][m] for u, m in zip(units, mine)]
            if any(x.size for x in la):
                by_rank[rank] = (la, [u["p_fine"][m] for u, m in zip(units, mine)])
        return by_rank, [u["c_fine"][~u["ok"]] for u in units]
    if prefill_tokens is None:
        raise PlanError(
            "prefill_tokens",
            "vLLM 0.33.0 pairs differently grouped regions with decode context parallelism by page position "
            "from the tokens P computed: pass prefill_tokens",
            value=None,
        )
    first = [first_position(local, x.size, num_tokens, pairing.prefix_caching, g) for g, x in enumerate(lids)]
    total = math.ceil(prefill_tokens / remote.block_size)
    matched = []
    for rank in pairing.transfer_ranks:
        la, ra = apply_prefix_caching_by_region(
            l_by, r_by, [first[g] for g in lgid], total, rank, local.dcp_size, local.dcp_rank, remote.dcp_size
        )
        matched.append(la)
        if any(x.size for x in la):
            by_rank[rank] = (la, ra)
    return by_rank, region_zero_ids(l_by, matched)
