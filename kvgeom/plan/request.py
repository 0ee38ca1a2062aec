"""Per-request transfer plans (pull and push) and the consumer's post-receive step.

``plan_request(pairing, local_ids, remote_ids, num_tokens=...)`` returns a :class:`RequestPlan`: a plain value naming,
for every remote rank, the local table to use (whole, or this source's split), the local and remote
descriptor ids, and the notification; the ranks that only get a notification; how many notifications
the other side should expect; and what the consumer does after the bytes land (``regroup`` for
head-major pages received as finer remote blocks, then ``zero`` ranges for bytes nothing wrote).

Block ids are logical and per KV-cache group; the plan follows vLLM 0.33.0's NIXL connector
(docs/vllm-behaviour.md B.3.7, B.3.8, B.3.9, B.6.10-B.6.12), so in ``compat="vllm"`` pairings the descriptor ids are vLLM's.
``RequestPlan.moves`` resolves a plan into byte moves for the oracle and for humans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from kvgeom.blocks import (
    BlockIds,
    get_mapped_blocks,
    kernel_of,
)
from kvgeom.errors import PlanError
from kvgeom.plan.bind import (
    check_ids,
    check_same_tokens,
    exact_pairs,
    filled_pages_of,
    fine_of,
    intake,
    rank_tables,
    require_num_tokens,
    select_groups,
    sent_groups,
    vllm_pairs,
    zero_pages_of,
)
from kvgeom.plan.dcpbind import dcp_pairs, dcp_zero_rows, vllm_pull_covers
from kvgeom.plan.descids import apply_segments
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.planmemo import memo_of
from kvgeom.plan.receive import post_receive, regroups, zero_rows
from kvgeom.plan.recipe import Recipe, trace
from kvgeom.plan.regionbind import plan_by_region
from kvgeom.plan.requestplan import Regroup, RequestPlan, Transfer

__all__ = ["plan_request"]


def plan_request(
    pairing: Pairing,
    local_ids: BlockIds,
    remote_ids: BlockIds,
    request_id: str = "req",
    remote_request_id: str | None = None,
    num_tokens: int | None = None,
    prefill_tokens: int | None = None,
) -> RequestPlan:
    """Plan one request. ``local_ids`` / ``remote_ids``: logical block ids per group on each side (in
    pull, local = D's blocks to fill, remote = P's blocks; in push the reverse). An empty local list
    as a whole means nothing to transfer here (notification only).

    The request's tokens (:mod:`kvgeom.plan.align`): ``num_tokens`` is the number of tokens D holds blocks for
    (the prompt length on D), ``prefill_tokens`` the number P computed and sends (vLLM's
    ``remote_num_tokens``; fewer than ``num_tokens`` in the N-1 flow of Mamba hybrids, where D recomputes
    the last token). Both modes place the lists on the token axis with them: kvgeom mode transfers the
    overlap, vLLM mode pairs by counts as vLLM does and refuses where that would move the wrong tokens.
    ``num_tokens`` is required whenever the local list holds blocks of an attention group (every group but
    SSM states and one-block rings): no block list tells where a prefix hit left D's list, so a plan made
    without it could pair the wrong tokens; omitted, a :class:`~kvgeom.errors.TokenCountError` names it.
    ``prefill_tokens`` may be omitted where the block counts determine it (P's full-attention lists start
    at token 0); otherwise the :class:`~kvgeom.errors.PlanError` names the argument to pass."""
    local = pairing.local
    kinds = local.group_is_ssm
    empty = (type(local_ids) is list or isinstance(local_ids, (Sequence, np.ndarray))) and len(local_ids) == 0
    lids = intake([[] for _ in kinds] if empty else local_ids, kinds, "local_ids")
    if pairing.region_mapped:
        return plan_by_region(
            pairing, lids, remote_ids, request_id, remote_request_id, num_tokens, prefill_tokens
        )
    rids = intake(remote_ids, kinds, "remote_ids")
    check_ids(lids, local, "local")
    remote = pairing.remotes[pairing.targets[0]]
    check_ids(rids, remote, "remote")
    require_num_tokens(local, lids, num_tokens, "local_ids")
    if pairing.dcp_active:
        return _plan(pairing, lids, rids, request_id, remote_request_id, num_tokens, prefill_tokens)
    # a shape seen twice gets a recipe (kvgeom.plan.recipe): later requests of that shape are one gather
    key = (tuple(x.size for x in lids), tuple(x.size for x in rids), num_tokens, prefill_tokens)
    shapes = memo_of(pairing).shapes
    entry = shapes.get(key)
    if isinstance(entry, _Shape):
        shapes.move_to_end(key)
        return entry.plan(np.concatenate([*lids, *rids]), request_id, remote_request_id)
    plan = _plan(pairing, lids, rids, request_id, remote_request_id, num_tokens, prefill_tokens)
    if entry is None:
        shapes[key] = 1
    elif entry == 1:
        shapes[key] = (
            _Shape.trace(pairing, lids, rids, plan, request_id, remote_request_id, num_tokens, prefill_tokens)
            or 0
        )
    while len(shapes) > _SHAPES_KEPT:
        shapes.popitem(last=False)
    return plan


_SHAPES_KEPT = 256  # request shapes remembered per pairing (a recipe holds 3 int64 per plan integer)


def _flatten(plan: RequestPlan) -> tuple[np.ndarray, tuple[int, ...]]:
    """A plan's integers as one vector, and the sizes of its parts (transfer ids, regroup blocks, zero)."""
    parts = [x for t in plan.transfers for x in (t.local_ids, t.remote_ids)] + [
        r.blocks for r in plan.regroup
    ]
    parts.append(plan.zero.reshape(-1))
    sizes = tuple(int(x.size) for x in parts)
    return np.concatenate([np.asarray(x, dtype=np.int64) for x in parts]), sizes


@dataclass(frozen=True, eq=False)
class _Shape:
    """The plan of every request of one shape: a recipe for its integers and the plan's other fields."""

    recipe: Recipe
    sizes: tuple[int, ...]
    template: RequestPlan
    suffix: str

    @classmethod
    def trace(
        cls,
        pairing: Pairing,
        lids: list[np.ndarray],
        rids: list[np.ndarray],
        plan: RequestPlan,
        request_id: str,
        remote_request_id: str | None,
        num_tokens: int | None,
        prefill_tokens: int | None,
    ) -> _Shape | None:
        vector, sizes = _flatten(plan)

        def run(lg: list[np.ndarray], rg: list[np.ndarray]) -> np.ndarray:
            out, got = _flatten(
                _plan(pairing, lg, rg, request_id, remote_request_id, num_tokens, prefill_tokens)
            )
            if got != sizes:
                raise ValueError("another plan layout")
            return out

        recipe = trace(
            run,
            [x.size for x in lids],
            [x.size for x in rids],
            pairing.local.logical_num_blocks,
            pairing.remotes[pairing.targets[0]].logical_num_blocks,
        )
        if recipe is None or not np.array_equal(recipe.apply(np.concatenate([*lids, *rids])), vector):
            return None
        tag = remote_request_id if remote_request_id is not None else request_id
        suffix = plan.transfers[0].notif[len(tag) :] if plan.transfers else ""
        return cls(recipe, sizes, plan, suffix)

    def plan(self, ids: np.ndarray, request_id: str, remote_request_id: str | None) -> RequestPlan:
        parts = np.split(self.recipe.apply(ids), np.cumsum(self.sizes)[:-1])
        tag = remote_request_id if remote_request_id is not None else request_id
        t = self.template
        transfers = tuple(
            Transfer(x.remote_rank, x.local_table, parts[2 * i], parts[2 * i + 1], tag + self.suffix)
            for i, x in enumerate(t.transfers)
        )
        k = 2 * len(transfers)
        regroup = tuple(
            Regroup(r.regions, parts[k + i], r.bsr, r.heads, r.tokens, r.head_bytes, r.layout)
            for i, r in enumerate(t.regroup)
        )
        return RequestPlan(
            request_id,
            t.mode,
            transfers,
            t.notify_only,
            t.expected_notifications,
            t.consumer_rank,
            regroup,
            parts[-1].reshape(-1, 3),
        )


def _plan(
    pairing: Pairing,
    lids: list[np.ndarray],
    rids: list[np.ndarray],
    request_id: str,
    remote_request_id: str | None,
    num_tokens: int | None,
    prefill_tokens: int | None,
) -> RequestPlan:
    """The general planner, on checked ids."""
    local, mode = pairing.local, pairing.mode
    kinds = local.group_is_ssm
    any_local = any(x.size for x in lids)
    rview = pairing.remote_view(pairing.targets[0])
    lk = kernel_of(lids, local.ppl, kinds)
    rk = kernel_of(rids, rview.ppl, kinds)
    tag = remote_request_id if remote_request_id is not None else request_id
    bsr = pairing.bsr
    # pull: P frees after the D ranks reading it have read (D_TP/P_TP, or DCP's count); push: D ends after P_TP
    expected = pairing.mapping.local_consumers
    notif = f"{tag}:{expected}" if mode == "pull" else f"{tag}:{local.tp_size}"
    dcp = pairing.dcp_active
    lfine = fine_of(lk, bsr, kinds, lids, local.ppl) if any_local and not dcp else lk
    exact = (
        exact_pairs(pairing, lids, rids, lk, rk, num_tokens, prefill_tokens, lfine)
        if any_local and not dcp
        else None
    )
    aligned = exact if pairing.policy.by_tokens else None
    transfers = []
    if dcp and any_local and not pairing.policy.by_tokens and mode == "pull":
        vllm_pull_covers(pairing, lids, rids, num_tokens, prefill_tokens)
    rows = pairing.token_rows  # 1 unless kvgeom mode cuts token-major pages per token
    paired: tuple[list[np.ndarray], list[np.ndarray]] | None = None
    for rank in pairing.transfer_ranks if any_local else ():
        rt = rank_tables(pairing, rank)
        keep, every = rt.keep, rt.every
        if dcp:
            lg, rg = dcp_pairs(
                pairing,
                rank,
                select_groups(lids, keep, every),
                select_groups(rids, keep, every),
                num_tokens,
                prefill_tokens,
            )
        elif aligned is not None:
            lg, rg = select_groups(aligned[0], keep, every), select_groups(aligned[1], keep, every)
        else:
            if paired is None:  # vLLM's count-based pairing works group by group: once for every group sent
                sent_keep = sent_groups(pairing)
                sent_all = all(sent_keep)
                paired = vllm_pairs(
                    pairing,
                    select_groups(lk, sent_keep, sent_all),
                    select_groups(rk, sent_keep, sent_all),
                    rview,
                    select_groups(lfine, sent_keep, sent_all),
                )
                if exact is not None and paired[0]:
                    check_same_tokens(
                        paired[0],
                        paired[1],
                        select_groups(exact[0], sent_keep, sent_all),
                        select_groups(exact[1], sent_keep, sent_all),
                        kinds,
                    )
            lg, rg = (
                (select_groups(paired[0], keep, every), select_groups(paired[1], keep, every))
                if paired[0]
                else ([], [])
            )
        if not lg or not any(x.size for x in lg):
            continue
        for g, (a, b) in enumerate(zip(lg, rg)):
            if a.size != b.size:
                raise PlanError(
                    f"block_ids[{g}]",
                    f"{a.size} local and {b.size} remote blocks cannot be paired",
                    local=int(a.size),
                    remote=int(b.size),
                )
        if rows > 1:  # token-major pages cut per token: every attention unit becomes its token rows
            lg = [x if ssm else get_mapped_blocks(x, rows) for x, ssm in zip(lg, kinds)]
            rg = [x if ssm else get_mapped_blocks(x, rows) for x, ssm in zip(rg, kinds)]
        r_desc = apply_segments(rt.remote, rg, checked=True)
        l_desc = apply_segments(rt.local, lg, checked=True)
        if r_desc.size != l_desc.size:
            raise PlanError(
                "descriptor ids",
                f"{l_desc.size} local ids vs {r_desc.size} remote ids",
                local=int(l_desc.size),
                remote=int(r_desc.size),
            )
        key = rt.key
        if not dcp and rt.bounded:  # every id a checked request brings lies inside both tables
            transfers.append(Transfer(rank, key, l_desc, r_desc, notif))
            continue
        for side, ids, n in (("local", l_desc, rt.local_rows), ("remote", r_desc, rt.remote_rows)):
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
                raise PlanError(
                    f"{side} descriptor ids",
                    f"id outside the {n}-row table",
                    value=int(ids.max()),
                    expected=n,
                )
        transfers.append(Transfer(rank, key, l_desc, r_desc, notif))
    sent = {t.remote_rank for t in transfers}
    notify_only = tuple(r for r in pairing.targets if r not in sent)
    regroup: tuple[Regroup, ...] = ()
    zero = np.zeros((0, 3), dtype=np.int64)
    if mode == "pull" and any_local:
        if dcp and pairing.policy.by_tokens:
            zero = dcp_zero_rows(
                local,
                pairing.remotes[pairing.targets[0]],
                lids,
                rids,
                num_tokens,
                prefill_tokens,
                pairing.prefix_caching,
            )
        elif aligned is not None:
            filled = partial(filled_pages_of, pairing)
            regroup = regroups(local, lk, bsr, filled, pairing.permute)
            zero = zero_rows(local, lk, bsr, aligned[2], filled)
        else:
            regroup, zero = post_receive(
                local,
                rview,
                lk,
                rk,
                bsr,
                pairing.policy,
                pages=partial(zero_pages_of, pairing),
                permute=pairing.permute,
            )
    return RequestPlan(
        request_id,
        mode,
        tuple(transfers),
        notify_only,
        expected,
        local.tp_rank if mode == "pull" else -1,
        regroup,
        zero,
    )
