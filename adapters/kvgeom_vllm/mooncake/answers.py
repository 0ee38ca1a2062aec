"""kvgeom's answers to the geometry functions of vLLM 0.33.0's Mooncake connector, one per row of
:data:`kvgeom_vllm.mooncake.table.TABLE`: vLLM's arguments in, kvgeom's answer out in vLLM's types.

The central one is the sender plan: which bytes of its page one P rank writes into which offset of one D
rank's page. vLLM derives it from five cases of the signed TP ratio and two replication flags; kvgeom
states it once, on head ranges: P rank ``p`` holds heads ``[first_unit(p), +units_per_rank)`` of the
model's ``K`` (a :class:`~kvgeom.model.layers.Shard`), D rank ``d`` likewise; the copy is their overlap,
at its offset on each side, and of the P ranks D rank ``d`` pairs with (its handshake targets) that hold
the same overlap, the lowest one sends. A cache whose heads vLLM does not pass (MLA latents, hybrids)
is one replicated unit when the producer replicates it, else ``max(P TP, D TP)`` units (every rank a
whole slice); so are the heads where neither or both sides replicate them (:func:`_units`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvgeom.blocks import logical_to_kernel
from kvgeom.errors import GroupMismatchError, UnsupportedError
from kvgeom.layout.view import SHARED_GROUP
from kvgeom.model.layers import Shard
from kvgeom.pair.tp import handshake_targets, tp_ratio
from kvgeom.plan.exchange import exchange_clipped_blocks, prefill_backoff, prefill_tokens
from kvgeom.plan.regionmap import block_ids_by_region

from ..answers import blocks_per_window
from ..answers._common import KVI

__all__ = [
    "get_tp_ratio",
    "compute_sender_transfer_plan",
    "validate_asymmetric_region_lengths",
    "block_ids_for_region",
    "logical_to_kernel_block_ids",
    "get_sender_transfer_plan",
    "refuse_state_across_tp",
    "transfer_topology",
    "blocks_per_window",
    "get_sw_clipped_blocks",
    "get_remote_prefill_token_count",
]


def get_tp_ratio(local_tp_size: int, remote_tp_size: int) -> int:
    """``_get_tp_ratio``: kvgeom's signed TP ratio."""
    return tp_ratio(int(local_tp_size), int(remote_tp_size))


def _units(local_tp: int, remote_tp: int, replicated: bool, heads: int | None) -> Shard:
    """The units a cache is sharded in, for one P/D pair: the model's KV heads where exactly one side
    replicates them (the slice is then one head); otherwise whole rank slices: one replicated unit, or
    ``max(P TP, D TP)`` units (the same answer as heads where the page divides into them, and defined
    where it does not)."""
    if heads is not None and replicated != Shard(int(heads), 1).replicated(remote_tp):
        return Shard(int(heads), 1)
    return Shard(1, 1) if replicated else Shard(max(local_tp, remote_tp), 1)


def _span(shard: Shard, rank: int, tp: int) -> tuple[int, int]:
    first = shard.first_unit(rank, tp)
    return first, first + shard.units_per_rank(tp)


def _overlap(shard: Shard, p: int, ptp: int, d: int, dtp: int) -> tuple[int, int]:
    (a, b), (c, e) = _span(shard, p, ptp), _span(shard, d, dtp)
    return max(a, c), min(b, e)


def compute_sender_transfer_plan(
    local_tp_rank: int,
    local_tp_size: int,
    remote_tp_rank: int,
    remote_tp_size: int,
    local_kv_block_len: int,
    remote_kv_block_len: int,
    producer_cache_replicated: bool,
    total_num_kv_heads: int | None = None,
) -> tuple[bool, int, int, int]:
    """``_compute_sender_transfer_plan``: ``(send, source offset, destination offset, length)`` of what P
    rank ``local_tp_rank`` writes into D rank ``remote_tp_rank`` (see the module doc)."""
    p, ptp, d, dtp = int(local_tp_rank), int(local_tp_size), int(remote_tp_rank), int(remote_tp_size)
    tp_ratio(ptp, dtp)
    if ptp == dtp:
        return True, 0, 0, int(local_kv_block_len)
    shard = _units(ptp, dtp, bool(producer_cache_replicated), total_num_kv_heads)
    lo, hi = _overlap(shard, p, ptp, d, dtp)
    if hi <= lo:
        return False, 0, 0, 0
    p_first, _ = _span(shard, p, ptp)
    d_first, _ = _span(shard, d, dtp)
    # one unit's bytes, from the page of the side holding fewer units (the slice that is copied whole)
    n_p, n_d = shard.units_per_rank(ptp), shard.units_per_rank(dtp)
    unit = int(remote_kv_block_len) // n_d if n_d < n_p else int(local_kv_block_len) // n_p
    targets = handshake_targets(d, dtp, ptp) if 0 <= d < dtp else (p,)
    holders = [q for q in targets if _overlap(shard, q, ptp, d, dtp) == (lo, hi)]
    send = not holders or p == min(holders) or p not in targets
    return send, (lo - p_first) * unit, (lo - d_first) * unit, (hi - lo) * unit


def validate_asymmetric_region_lengths(
    local_regions: Sequence[Any],
    remote_regions: Sequence[Any],
    local_tp_size: int,
    remote_tp_size: int,
    producer_cache_replicated: bool,
    total_num_kv_heads: int | None = None,
) -> str | None:
    """``_validate_asymmetric_region_lengths``: ``None``, or why the pair's regions cannot be paired. A
    region's length scales with the heads a rank holds (kvgeom's ``heads`` scaling): P's length times
    D's heads per rank equals D's length times P's. A producer that replicates a cache whose heads vLLM
    does not pass has nothing to compare."""
    if len(local_regions) != len(remote_regions):
        return (
            "Mooncake asymmetric TP requires matching KV region counts between producer and consumer "
            f"(kvgeom: producer {len(local_regions)}, consumer {len(remote_regions)})."
        )
    ptp, dtp = int(local_tp_size), int(remote_tp_size)
    if total_num_kv_heads is None and producer_cache_replicated:
        return None
    shard = (
        Shard(int(total_num_kv_heads), 1) if total_num_kv_heads is not None else _units(ptp, dtp, False, None)
    )
    tp_ratio(min(ptp, shard.units), min(dtp, shard.units))
    n_p, n_d = shard.units_per_rank(ptp), shard.units_per_rank(dtp)
    for idx, (lr, rr) in enumerate(zip(local_regions, remote_regions)):
        if int(lr.kv_block_len) * n_d != int(rr.kv_block_len) * n_p:
            return (
                f"Mooncake KV region length mismatch at region {idx}: producer {lr.kv_block_len} bytes for "
                f"{n_p} head(s) per rank, consumer {rr.kv_block_len} for {n_d} (kvgeom: the length scales "
                "with the heads a rank holds)."
            )
    return None


def block_ids_for_region(
    block_ids_by_group: Sequence[Sequence[int]], group_index: int, shared_group_ids: Sequence[int] = ()
) -> list[int]:
    """``_block_ids_for_region``: a region's ids; a region several groups share (``-1``) takes the lists of
    exactly those groups, concatenated."""
    gid = int(group_index)
    if gid == SHARED_GROUP:
        shared = [int(g) for g in shared_group_ids]
        if not shared:
            raise GroupMismatchError(
                "shared_group_ids", "a shared region (-1) names no groups", value=list(shared), expected="≥ 1"
            )
        for g in shared:
            if not 0 <= g < len(block_ids_by_group):
                raise GroupMismatchError(
                    "shared_group_ids",
                    f"group {g} of a request with {len(block_ids_by_group)} groups",
                    value=g,
                    expected=len(block_ids_by_group),
                )
        return block_ids_by_region([block_ids_by_group[g] for g in shared], [SHARED_GROUP])[0].tolist()
    return block_ids_by_region(block_ids_by_group, [gid])[0].tolist()


def _group_is_ssm(kv_cache_config: Any) -> list[bool]:
    return [isinstance(g.kv_cache_spec, KVI.MambaSpec) for g in kv_cache_config.transfer_groups]


def logical_to_kernel_block_ids(self: Any, block_ids: list[list[int]]) -> list[list[int]]:
    """``_logical_to_kernel_block_ids``: attention groups' logical ids expanded to kernel ids, state groups
    unchanged."""
    ppl = int(self._physical_blocks_per_logical_kv_block)
    kinds = _group_is_ssm(self.kv_cache_config)[: len(block_ids)]
    return [g.tolist() for g in logical_to_kernel(block_ids, ppl, kinds)]


def get_sender_transfer_plan(
    self: Any, local_kv_block_len: int, remote_kv_block_len: int, remote_tp_rank: int, remote_tp_size: int
) -> tuple[bool, int, int, int]:
    """``_get_sender_transfer_plan``: the sender plan of this P rank (heads passed unless MLA or hybrid,
    as vLLM does)."""
    heads = (
        None
        if self.use_mla or self.kv_cache_config.has_mamba_layers
        else self.transfer_topo.total_num_kv_heads
    )
    return compute_sender_transfer_plan(
        self.tp_rank,
        self.tp_size,
        remote_tp_rank,
        remote_tp_size,
        local_kv_block_len,
        remote_kv_block_len,
        self._producer_cache_is_replicated(),
        heads,
    )


def refuse_state_across_tp(self: Any, remote_tp_size: int) -> None:
    """A pair of different TP sizes of a model with recurrent state: :class:`UnsupportedError`. vLLM's
    Mooncake copy writes each P rank's state page as one slice of D's, but a rank's conv state is several
    pieces (Mamba2's x, B, C; GDN's q, k, v) each sharded on its own (:mod:`kvgeom.layout.conv`), so the
    slices would land between the wrong channels."""
    if not self.kv_cache_config.has_mamba_layers:
        return
    if tp_ratio(int(self.tp_size), int(remote_tp_size)) != 1:
        raise UnsupportedError(
            "remote_tp_size",
            "vLLM's Mooncake transfer copies a recurrent-state page as one slice per rank; across TP "
            f"sizes ({self.tp_size} -> {remote_tp_size}) the conv-state pieces would land wrong",
            local=int(self.tp_size),
            remote=int(remote_tp_size),
        )


def transfer_topology(topology: Any) -> Any:
    """The worker's ``transfer_topo``: the same fields in kvgeom_vllm's topology class (handshake targets,
    replication and head counts answered by kvgeom)."""
    import dataclasses

    from ..worker import KvgeomTransferTopology

    if isinstance(topology, KvgeomTransferTopology):
        return topology
    fields = {f.name: getattr(topology, f.name) for f in dataclasses.fields(topology) if f.init}
    return KvgeomTransferTopology(**fields)


def get_sw_clipped_blocks(self: Any, block_ids: Any) -> list[list[int]]:
    """``get_sw_clipped_blocks``: the transfer groups' lists (vLLM's selection), a sliding-window group's
    clipped to its last ``blocks_per_sw`` (kvgeom); state lists are sent as given."""
    if len(block_ids) == 0:
        return []
    kcc = self.kv_cache_config
    if len(block_ids) == len(kcc.transfer_group_ids):
        selected = list(block_ids)
    else:
        selected = list(kcc.select_transfer_block_ids(block_ids))
    if len(selected) == 0 or not self._is_hma_required:
        return selected
    clipped = exchange_clipped_blocks(selected, self.blocks_per_sw, [None] * len(selected), clip_ssm=False)
    return [c.tolist() for c in clipped]


def get_remote_prefill_token_count(self: Any, num_prompt_tokens: int) -> int:
    """``_get_remote_prefill_token_count``: the prompt tokens D loads (one fewer for a Mamba hybrid or a
    bounded-replay window; Mooncake has no lookahead tokens)."""
    return prefill_tokens(
        int(num_prompt_tokens), prefill_backoff(bool(self._has_mamba), bool(self._bounded_replay))
    )
