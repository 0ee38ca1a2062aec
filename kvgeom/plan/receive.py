"""The consumer's receive step: what D does after a request's bytes land (regroups of head-major pages
received as finer blocks, or permuted from another layout; then the zero rows for bytes nothing wrote).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvgeom.blocks import (
    BlockIds,
    as_group_ids,
    check_distinct,
    get_mapped_blocks,
    logical_to_kernel,
)
from kvgeom.errors import PlanError
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.geometry import RankGeometry
from kvgeom.layout.view import EngineView
from kvgeom.model.layers import AttentionSpec
from kvgeom.modes import Compat, CompatLike, policy_of
from kvgeom.pair.rules import check_permute
from kvgeom.plan.align import Page, PageSet, consumer_zero_rows, group_pages
from kvgeom.plan.bind import align_groups, require_num_tokens
from kvgeom.plan.dcpbind import dcp_zero_rows
from kvgeom.plan.requestplan import Regroup

__all__ = ["regroups", "permuted_heads", "zero_rows", "receive_step", "post_receive"]


def regroups(
    consumer: RankGeometry,
    kernel_ids: list[np.ndarray],
    bsr: int,
    pages: Callable[[int], Sequence[Page] | PageSet] | None = None,
    permute: bool = False,
) -> tuple[Regroup, ...]:
    """Head-major blocks that arrived as ``bsr`` finer remote pages are regrouped per head (B.3.9), in the
    regions of each group's ``pages`` (default: every page of the group's layers) holding several heads.
    With ``permute`` (B.6.15) the token-major pages received as head-major bytes are regrouped into token
    order, at every ``bsr``."""
    out = []
    layout = KVLayout.TOKEN_MAJOR if permute else KVLayout.HEAD_MAJOR
    for group, L in zip(consumer.groups, kernel_ids):
        if group.one_block or not L.size or (bsr == 1 and not permute):
            continue
        where = pages(group.index) if pages is not None else group_pages(consumer, group.index)
        if not permute and isinstance(where, PageSet) and where.most_heads <= 1:
            continue  # no page holds several heads: nothing to regroup
        kinds: dict[tuple[str, int, int], list[int]] = {}
        for p in where:
            region = consumer.regions[p.region]
            heads = permuted_heads(consumer, p) if permute else p.heads
            if p.runs and not permute:  # a CPU page: cut by its token runs, its bytes land in place
                continue
            if heads > 1 and p.region not in kinds.get((region.part, heads, p.length), []):
                kinds.setdefault((region.part, heads, p.length), []).append(p.region)
        for (_, heads, length), rs in sorted(kinds.items()):
            out.append(
                Regroup(
                    tuple(rs),
                    L.copy(),
                    bsr,
                    heads,
                    consumer.block_size,
                    length // (heads * consumer.block_size),
                    layout,
                )
            )
    return tuple(out)


def permuted_heads(consumer: RankGeometry, page: Page) -> int:
    """The local KV heads of the attention layer whose page ``page`` is (1 for a latent or a state): the
    heads a token-major page holds per token, which a permute regroups (B.6.15)."""
    region = consumer.regions[page.region]
    for _, name in region.members:
        if region.slot(name)[0] == page.offset:
            spec = consumer.layer_specs[name]
            if isinstance(spec, AttentionSpec):
                return int(spec.heads_per_rank(consumer.tp_size))
    return 1


def zero_rows(
    consumer: RankGeometry,
    kernel_ids: list[np.ndarray],
    units: int,
    spans: list[tuple[int, int, int]],
    pages: Callable[[int], Sequence[Page] | PageSet] | None = None,
) -> np.ndarray:
    """Zero every byte of the consumer's attention blocks outside the units the transfer covered, in the
    pages of each group (``pages``; default: every page of the group's layers)."""
    rows = [np.zeros((0, 3), dtype=np.int64)]
    for group, L, (cpos, _, n) in zip(consumer.groups, kernel_ids, spans):
        if group.one_block or not L.size:
            continue
        where = pages(group.index) if pages is not None else group_pages(consumer, group.index)
        rows.append(consumer_zero_rows(where, L, units, cpos, n, consumer.block_size))
    return np.concatenate(rows)


def receive_step(
    consumer: RankGeometry,
    producer: RankGeometry,
    consumer_ids: BlockIds,
    producer_ids: BlockIds,
    num_tokens: int | None = None,
    prefix_caching: bool = False,
    prefill_tokens: int | None = None,
) -> tuple[tuple[Regroup, ...], np.ndarray]:
    """The post-receive step of a D rank that was written to (push): zero ranges of its own blocks,
        from D's and P's logical ids of the request, aligned by token like the writer's plan (``num_tokens``
        and ``prefill_tokens`` as in :func:`plan_request`: ``num_tokens`` is required whenever the consumer's list
    holds attention blocks). vLLM never zeroes in push (B.6.1 item 9); kvgeom
        does, so no D block holds stale bytes. A token-major D with ``permute_local_kv`` written by a head-major
        P (kvgeom mode's push permute, B.6.15) first regroups every attention block of the request into token
        order (each D block arrived as one head-major page); the zero ranges are then token-major."""
    kinds = consumer.group_is_ssm
    permute = (
        consumer.model.attention_spec is not None and consumer.engine.kv_layout != producer.engine.kv_layout
    )
    if permute:  # a pair the writer could plan: refuses any other layout difference, typed
        check_permute(producer, consumer, "push", "kvgeom")
    dl = as_group_ids(consumer_ids, kinds, "consumer_ids")
    pl = as_group_ids(producer_ids, kinds, "producer_ids")
    check_distinct(dl, "consumer_ids")
    require_num_tokens(consumer, dl, num_tokens, "consumer_ids")
    if consumer.dcp_size > 1 or producer.dcp_size > 1:
        return (), dcp_zero_rows(consumer, producer, dl, pl, num_tokens, prefill_tokens, prefix_caching)
    dk = logical_to_kernel(dl, consumer.ppl, kinds)
    pk = logical_to_kernel(pl, producer.ppl, kinds)
    if producer.block_size % consumer.block_size:
        raise PlanError(
            "block_size",
            "push needs P kernel blocks that are multiples of D's",
            local=consumer.block_size,
            remote=producer.block_size,
        )
    q = producer.block_size // consumer.block_size
    pfine = [k if ssm else get_mapped_blocks(k, q) for k, ssm in zip(pk, kinds)]
    spans = align_groups(
        consumer,
        dl,
        dk,
        producer.logical_block_size,
        pl,
        pfine,
        consumer.block_size,
        num_tokens,
        prefix_caching,
        prefill_tokens,
    )
    return regroups(consumer, dk, 1, permute=permute), zero_rows(consumer, dk, 1, spans)


def post_receive(
    consumer: RankGeometry,
    producer: EngineView,
    consumer_kernel_ids: list[np.ndarray],
    producer_kernel_ids: list[np.ndarray],
    bsr: int,
    compat: CompatLike = Compat.KVGEOM,
    pages: Callable[[int], Sequence[Page] | PageSet] | None = None,
    permute: bool = False,
) -> tuple[tuple[Regroup, ...], np.ndarray]:
    """The consumer's post-receive step (vLLM B.3.9 / B.6.11): regroup head-major blocks that arrived as
    ``bsr`` finer remote pages (``permute``: token-major pages that arrived head-major, B.6.15), then zero
    what the transfer did not write.

    Per attention group ``g`` with kernel ids ``L`` (consumer) and ``R`` (the producer's full list):
    ``covered = min(|L| * bsr, |R|)`` remote-block units; the tokens past ``covered mod bsr`` units of
    block ``L[covered div bsr]`` and all of ``L[ceil(covered / bsr):]`` are zeroed, in the regions that
    hold a layer of group ``g`` (``pages``: the pages of a group, default :func:`~kvgeom.plan.align.group_pages`,
    which a planner caches). vLLM only runs this when ``bsr > 1``, it permutes, or the two ppl differ;
    ``compat="kvgeom"`` always runs it (it zeroes nothing when everything was covered).
    """
    if not policy_of(compat).by_tokens and bsr == 1 and consumer.ppl == producer.ppl and not permute:
        return (), np.zeros((0, 3), dtype=np.int64)
    spans = [(0, 0, min(L.size * bsr, R.size)) for L, R in zip(consumer_kernel_ids, producer_kernel_ids)]
    return (
        regroups(consumer, consumer_kernel_ids, bsr, pages, permute),
        zero_rows(consumer, consumer_kernel_ids, bsr, spans, pages),
    )
