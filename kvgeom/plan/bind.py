"""Binding a request onto a pairing: its block ids taken in and checked, the token counts required where the
lists do not determine them, and the blocks of each group paired on the token axis (:func:`exact_pairs`:
kvgeom's alignment; :func:`vllm_pairs`: vLLM 0.33.0's block-size map, cross-checked by
:func:`check_same_tokens`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvgeom.blocks import (
    BlockIds,
    _expand,
    as_group_ids,
    check_distinct,
    map_checked,
    prefix_checked,
)
from kvgeom.errors import BlockIdError, PlanError, TokenCountError, UnsupportedError
from kvgeom.layout.geometry import Group, RankGeometry
from kvgeom.layout.view import EngineView
from kvgeom.plan.align import PageSet, list_starts, overlap
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.pairplan import PairPlan, RankTables

__all__ = [
    "select_groups",
    "intake",
    "check_ids",
    "require_num_tokens",
    "cached_blocks",
    "zero_pages_of",
    "filled_pages_of",
    "plan_of",
    "RankTables",
    "rank_tables",
    "sent_groups",
    "fine_of",
    "vllm_pairs",
    "check_same_tokens",
    "lowered_vllm_pairs",
    "is_sliding",
    "align_groups",
    "exact_pairs",
]


def select_groups(ids: list[np.ndarray], groups: Sequence[bool], every: bool = False) -> list[np.ndarray]:
    """``ids`` with the groups not in ``groups`` emptied (``every``: the caller knows all are kept)."""
    if every:
        return ids
    return [g if keep else _NONE for g, keep in zip(ids, groups)]


_NONE = np.zeros(
    0, dtype=np.int64
)  # the ids of a group left out (shared: an empty array has nothing to write)
_NONE.flags.writeable = False


def intake(block_ids: BlockIds, kinds: Sequence[bool], field: str) -> list[np.ndarray]:
    """The request's ids per group, without copies when they are already 1-D ``int64`` arrays (the planner
    never writes to them); anything else goes through :func:`~kvgeom.blocks.as_group_ids`. Negative ids are
    refused by :func:`check_ids`."""
    if (
        isinstance(block_ids, (list, tuple))
        and len(block_ids) == len(kinds)
        and all(isinstance(g, np.ndarray) and g.ndim == 1 and g.dtype == np.int64 for g in block_ids)
    ):
        return list(block_ids)
    return as_group_ids(block_ids, kinds, field)


def check_ids(ids: list[np.ndarray], geom: RankGeometry, side: str) -> None:
    flat = np.concatenate(ids)  # one array per KV-cache group, and every geometry has a group
    if flat.size:  # the common case in one sort: distinct, inside the pool, not negative
        s = np.sort(flat)
        if s[0] >= 0 and s[-1] < geom.logical_num_blocks and not (s[1:] == s[:-1]).any():
            return
        as_group_ids(ids, [False] * len(ids), f"{side}_ids")  # names a negative id
    check_distinct(ids, f"{side}_ids")
    for g, x in enumerate(ids):
        if x.size and int(x.max()) >= geom.logical_num_blocks:
            raise BlockIdError(
                f"{side}_ids[{g}]",
                f"block id {int(x.max())} is past the {side} pool of "
                f"{geom.logical_num_blocks} logical blocks",
                value=int(x.max()),
                expected=geom.logical_num_blocks,
            )


def require_num_tokens(geom: RankGeometry, ids: list[np.ndarray], num_tokens: int | None, side: str) -> None:
    """Refuse a plan of ``geom``'s ``ids`` without ``num_tokens`` when they hold attention blocks to place
    on the token axis (a :class:`~kvgeom.errors.TokenCountError`)."""
    if num_tokens is not None:
        return
    for g, (x, one) in enumerate(zip(ids, geom.group_one_block)):
        if x.size and not one:
            raise TokenCountError(
                "num_tokens",
                f"{side}[{g}] holds {x.size} attention block(s), which only the request's num_tokens (the "
                "tokens D holds blocks for) places on the token axis: a prefix hit on D leaves no trace in "
                "the block lists; got None",
                value=None,
                group=g,
                blocks=int(x.size),
            )


def cached_blocks(pairing: Pairing, count: int, num_tokens: int | None, group: int) -> int:
    """D's cached blocks of a group (its list is the uncached tail of ``ceil(num_tokens / block)``)."""
    if num_tokens is None:
        if pairing.prefix_caching:
            raise PlanError(
                "num_tokens",
                f"group {group}: with prefix caching D's list starts after its cached blocks: "
                "pass num_tokens",
                value=None,
            )
        return 0
    cached = math.ceil(num_tokens / pairing.local.logical_block_size) - count
    if cached < 0:
        raise PlanError(
            f"block_ids[{group}]",
            f"D's {count} blocks are more than num_tokens={num_tokens} need",
            value=count,
        )
    return cached


def plan_of(pairing: Pairing) -> PairPlan:
    """The pairing's per-pair plan (every pairing :meth:`Pairing.create` builds has one)."""
    if pairing.plan is None:
        raise PlanError(
            "pairing", "build pairings with Pairing.create (it computes the per-pair plan)", value=None
        )
    return pairing.plan


def zero_pages_of(pairing: Pairing, group: int) -> PageSet:
    """Every page of the local rank's layers of ``group`` (prepared by the pairing: a shape, not a request),
    as the arrays the receive step reads."""
    return plan_of(pairing).zero_pages[group]


def filled_pages_of(pairing: Pairing, group: int) -> PageSet:
    """:meth:`Pairing.zero_pages` (the pages of ``group`` this pairing fills) as the arrays the receive
    step reads."""
    return plan_of(pairing).filled_pages[group]


def rank_tables(pairing: Pairing, rank: int) -> RankTables:
    """:class:`~kvgeom.plan.pairplan.RankTables` of the transfer to/from ``rank`` (the per-pair plan's)."""
    return plan_of(pairing).ranks[rank]


def sent_groups(pairing: Pairing) -> tuple[bool, ...]:
    """The groups some transfer rank's requests carry (the union of their group masks)."""
    return plan_of(pairing).sent_groups


def vllm_pairs(
    pairing: Pairing,
    lg: list[np.ndarray],
    rg: list[np.ndarray],
    rview: EngineView,
    fine: list[np.ndarray] | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """vLLM's pairing of one source's lists: block-size-ratio map, then prefix trimming (B.3.5, B.3.6).
    ``fine``: ``lg`` already expanded by the block-size ratio (:func:`fine_of`), where the caller has it."""
    local, kinds, bsr = pairing.local, pairing.local.group_is_ssm, pairing.bsr
    if bsr > 1:
        if fine is None:
            lg, rg = map_checked(lg, rg, bsr, kinds)
        else:  # the local ids already at the remote granularity: vLLM's map is a clip
            lg = [x if ssm else f[: r.size] for x, f, r, ssm in zip(lg, fine, rg, kinds)]
            if all(m.size == 0 for m in lg):
                lg = []
        if not lg or not any(x.size for x in lg):
            return [], []
    if not any(x.size for x in lg):
        return [], []
    if pairing.mode == "pull":
        return prefix_checked(lg, rg, local.ppl, rview.ppl, kinds)
    rg, lg = prefix_checked(rg, lg, rview.ppl, local.ppl, kinds)
    return lg, rg


def check_same_tokens(
    lg: list[np.ndarray],
    rg: list[np.ndarray],
    el: list[np.ndarray],
    er: list[np.ndarray],
    kinds: Sequence[bool],
) -> None:
    """vLLM mode never reproduces a silent corruption: its count-based pairing of attention blocks must
    pair the same tokens as kvgeom's token alignment, else the request is refused."""
    for g, ssm in enumerate(kinds):
        if ssm:
            continue
        a = lg[g] if lg else np.zeros(0, np.int64)
        b = rg[g] if rg else np.zeros(0, np.int64)
        if a.size and not (_same(a, el[g]) and _same(b, er[g])):
            raise UnsupportedError(
                f"block_ids[{g}]",
                "vLLM 0.33.0 pairs these blocks by count and would move the wrong tokens "
                f"(local {a[:4].tolist()}... <- remote {b[:4].tolist()}..., by token: local {el[g][:4].tolist()}... "
                f"<- remote {er[g][:4].tolist()}...); kvgeom mode plans it",
                local=a.tolist()[:8],
                remote=b.tolist()[:8],
            )


def lowered_vllm_pairs(
    counted: tuple[list[np.ndarray], list[np.ndarray]],
    el: list[np.ndarray],
    er: list[np.ndarray],
    kinds: Sequence[bool],
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The one plan's pairs (``el``, ``er``: by token position, state slots by vLLM's slot rule) lowered
    into vLLM mode: vLLM's count-based pairs (``counted``) are the boundary check. Where vLLM pairs a group's
    attention blocks otherwise, :func:`check_same_tokens` refuses the request; a group vLLM leaves without
    local blocks keeps vLLM's (empty) pairs; a state group's slots must agree, as both take them by vLLM's
    slot rule (a :class:`~kvgeom.errors.PlanError` if not: a planner bug, never a silent difference)."""
    lg, rg = counted
    check_same_tokens(lg, rg, el, er, kinds)
    out_l, out_r = [], []
    for g, ssm in enumerate(kinds):
        if not lg[g].size:
            out_l.append(lg[g])
            out_r.append(rg[g])
            continue
        if ssm and not (_same(lg[g], el[g]) and _same(rg[g], er[g])):
            raise PlanError(
                f"block_ids[{g}]",
                "the plan's state slots differ from vLLM's slot rule",
                local=lg[g].tolist()[:8],
                remote=el[g].tolist()[:8],
            )
        out_l.append(el[g])
        out_r.append(er[g])
    return out_l, out_r


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal`` of two 1-D ``int64`` arrays, without its conversions."""
    return a.shape == b.shape and (a is b or bool((a == b).all()))


def fine_of(
    kernel_ids: list[np.ndarray],
    bsr: int,
    kinds: Sequence[bool],
    logical: list[np.ndarray] | None = None,
    ppl: int = 1,
) -> list[np.ndarray]:
    """A side's kernel ids at the other side's (``bsr`` times finer) granularity; SSM groups unchanged.
    With its ``logical`` ids (``ppl`` kernel blocks each) given, each group is one expansion of them by
    ``ppl * bsr`` (the same ids: ``(b * ppl + i) * bsr + j = b * ppl * bsr + (i * bsr + j)``)."""
    if bsr == 1:
        return list(kernel_ids)
    if logical is not None:
        return [k if ssm else _expand(b, ppl * bsr) for k, b, ssm in zip(kernel_ids, logical, kinds)]
    return [k if ssm else _expand(k, bsr) for k, ssm in zip(kernel_ids, kinds)]


def is_sliding(group: Group) -> bool:
    return getattr(group.spec, "sliding_window", None) is not None


def align_groups(
    consumer: RankGeometry,
    c_logical: list[np.ndarray],
    c_fine: list[np.ndarray],
    producer_block: int,
    p_logical: list[np.ndarray],
    p_fine: list[np.ndarray],
    fine_tokens: int,
    num_tokens: int | None,
    prefix_caching: bool,
    prefill_tokens: int | None = None,
) -> list[tuple[int, int, int]]:
    """Per group, ``(consumer position, producer position, count)`` of the fine units both hold (SSM and
    ring groups: ``(0, 0, 0)``, they are paired by slot)."""
    full = [
        g.index for g in consumer.groups if not g.one_block and not is_sliding(g) and p_logical[g.index].size
    ]
    hint = p_logical[full[0]].size * producer_block if full else None  # where P's computed tokens end
    out = []
    for g, group in enumerate(consumer.groups):
        if group.one_block:
            out.append((0, 0, 0))
            continue
        c0, p0 = list_starts(
            c_logical[g].size,
            consumer.logical_block_size,
            p_logical[g].size,
            producer_block,
            num_tokens,
            prefix_caching,
            is_sliding(group),
            g,
            prefill_tokens,
            p_end_hint=hint,
        )
        out.append(overlap(c0 // fine_tokens, c_fine[g].size, p0 // fine_tokens, p_fine[g].size))
    return out


def exact_pairs(
    pairing: Pairing,
    lids: list[np.ndarray],
    rids: list[np.ndarray],
    lk: list[np.ndarray],
    rk: list[np.ndarray],
    num_tokens: int | None,
    prefill_tokens: int | None = None,
    lfine: list[np.ndarray] | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray], list[tuple[int, int, int]]]:
    """kvgeom mode: the local and remote fine ids of every group, paired by token (attention) or by
    state slot (SSM, vLLM's slot rule), and each attention group's coverage on the consumer. ``lfine``:
    :func:`fine_of` ``lk``, where the caller has it."""
    local, kinds, bsr, pull = pairing.local, pairing.local.group_is_ssm, pairing.bsr, pairing.mode == "pull"
    remote = pairing.remotes[pairing.targets[0]]
    rview = pairing.remote_view(pairing.targets[0])
    if lfine is None:
        lfine = fine_of(lk, bsr, kinds)
    rblock = rview.block_size * rview.ppl  # the remote's logical block in tokens (unchanged by a rescale)
    # the consumer's lists first: D's in pull, the remote's in push
    c_side = (
        (local, lids, lfine, rblock, rids, rk)
        if pull
        else (remote, rids, rk, local.logical_block_size, lids, lfine)
    )
    spans = align_groups(*c_side, rview.block_size, num_tokens, pairing.prefix_caching, prefill_tokens)
    empty = [_NONE] * len(lk)
    ssm_l, ssm_r = (select_groups(lk, kinds), select_groups(rk, kinds))
    if pull:
        ssm_l, ssm_r = prefix_checked(ssm_l, ssm_r, local.ppl, rview.ppl, kinds)
    else:
        ssm_r, ssm_l = prefix_checked(ssm_r, ssm_l, rview.ppl, local.ppl, kinds)
    lsel, rsel = list(empty), list(empty)
    one = local.group_one_block
    for g, (ssm, (cpos, ppos, n)) in enumerate(zip(kinds, spans)):
        if ssm:
            lsel[g], rsel[g] = ssm_l[g], ssm_r[g]
        elif one[g]:  # a ring: the request's one block, whole
            lsel[g], rsel[g] = lk[g], rk[g]
        elif pull:
            lsel[g], rsel[g] = lfine[g][cpos : cpos + n], rk[g][ppos : ppos + n]
        else:
            lsel[g], rsel[g] = lfine[g][ppos : ppos + n], rk[g][cpos : cpos + n]
    return lsel, rsel, spans
