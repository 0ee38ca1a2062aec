"""TP mapping of vLLM's NIXL connector: who reads from whom (vLLM-compatible; docs/vllm-behaviour.md
B.1, B.3.1, B.3.7).

All values are seen from the **local** rank (the reader in pull mode). With decode context parallelism
(MLA only, :mod:`kvgeom.pair.dcp`) the sources of a sharded remote are the ranks whose pages overlap ours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgeom.blocks import check_positive_int
from kvgeom.errors import ConfigError, PlanError, RatioError, SpecError
from kvgeom.pair.dcp import _check_sizes, dcp_consumer_count, dcp_rank, dcp_source_ranks

__all__ = [
    "TPMapping",
    "tp_ratio",
    "compute_tp_mapping",
    "head_offset",
    "handshake_targets",
    "dcp_handshake_targets",
    "needs_split_local_handles",
    "consumers_per_producer",
]


def tp_ratio(local_tp: int, remote_tp: int) -> int:
    """vLLM's signed TP ratio: ``local_tp // remote_tp`` if ``local_tp >= remote_tp``, else
    ``-(remote_tp // local_tp)``. :class:`RatioError` if neither size divides the other."""
    local_tp = check_positive_int(local_tp, "local_tp")
    remote_tp = check_positive_int(remote_tp, "remote_tp")
    if local_tp >= remote_tp:
        if local_tp % remote_tp:
            raise RatioError(
                "remote_tp",
                f"local TP {local_tp} is not a multiple of remote TP {remote_tp}",
                local=local_tp,
                remote=remote_tp,
            )
        return local_tp // remote_tp
    if remote_tp % local_tp:
        raise RatioError(
            "remote_tp",
            f"remote TP {remote_tp} is not a multiple of local TP {local_tp}",
            local=local_tp,
            remote=remote_tp,
        )
    return -(remote_tp // local_tp)


@dataclass(frozen=True)
class TPMapping:
    """Which remote ranks a local rank reads, per KV-cache group (vLLM ``TPMapping``).

    ``rank_to_attention_slot`` holds ``(rank, slot)`` pairs in vLLM's dict order (ascending rank):
    ``slot`` is the position of the rank's head slice among the attention sources.
    """

    source_ranks_per_group: tuple[tuple[int, ...], ...]
    all_source_ranks: tuple[int, ...]
    rank_to_attention_slot: tuple[tuple[int, int], ...]
    rank_offset_factor: int
    local_consumers: int

    def slot_of(self, rank: int) -> int:
        """The attention slot of remote ``rank``; :class:`PlanError` if the rank is not a source."""
        for r, slot in self.rank_to_attention_slot:
            if r == rank:
                return slot
        raise PlanError(
            "rank",
            f"remote rank {rank} is not a source of this mapping {list(self.all_source_ranks)}",
            value=rank,
        )

    def to_json(self) -> dict[str, Any]:
        """Plain JSON value, in the golden files' schema (tuples become lists)."""
        return {
            "source_ranks_per_group": [list(g) for g in self.source_ranks_per_group],
            "all_source_ranks": list(self.all_source_ranks),
            "rank_to_attention_slot": [[r, s] for r, s in self.rank_to_attention_slot],
            "rank_offset_factor": self.rank_offset_factor,
            "local_consumers": self.local_consumers,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TPMapping:
        """Inverse of :meth:`to_json` (``local_consumers`` defaults to 1 when absent)."""
        try:
            return cls(
                source_ranks_per_group=tuple(
                    tuple(int(r) for r in g) for g in data["source_ranks_per_group"]
                ),
                all_source_ranks=tuple(int(r) for r in data["all_source_ranks"]),
                rank_to_attention_slot=tuple((int(r), int(s)) for r, s in data["rank_to_attention_slot"]),
                rank_offset_factor=int(data["rank_offset_factor"]),
                local_consumers=int(data.get("local_consumers", 1)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError("mapping", f"malformed TP mapping JSON: {exc!r}") from None


def _check_rank(local_rank: int, local_tp: int) -> int:
    local_rank = check_positive_int(local_rank, "local_rank", 0, ConfigError)
    if local_rank >= local_tp:
        raise ConfigError(
            "local_rank",
            f"rank {local_rank} out of range for local TP {local_tp}",
            value=local_rank,
            expected=local_tp,
        )
    return local_rank


def compute_tp_mapping(
    local_rank: int,
    local_tp: int,
    remote_tp: int,
    num_kv_heads: int,
    is_mla: bool,
    group_is_ssm: Sequence[bool],
    local_dcp_size: int = 1,
    remote_dcp_size: int = 1,
    head_sharded_kv_heads: int | None = None,
) -> TPMapping:
    """TP mapping of one local rank (vLLM ``compute_tp_mapping``). With ``K = num_kv_heads``:

    0. ``head_sharded_kv_heads`` (a GQA draft under an MLA target) maps head-sharded KV with that many
       heads: ``is_mla`` becomes false and ``K`` the draft's heads.
    1. attention sources: MLA with ``remote_dcp_size > 1`` -> :func:`kvgeom.pair.dcp.dcp_source_ranks`; else MLA
       or ``local_tp >= remote_tp`` -> ``[local_rank*remote_tp // local_tp]``; else
       ``a = remote_tp // local_tp``, candidates ``local_rank*a + j`` (``j < a``), head of ``p`` =
       ``p*K // remote_tp``, first rank per distinct head kept (GQA dedup), ascending.
    2. SSM sources (only with an SSM group): all ``a`` candidates if ``local_tp < remote_tp``, else the
       attention sources.
    3. ``all_source_ranks = sorted(attn | ssm)``; per group the SSM or the attention list.
    4. ``rank_to_attention_slot``, over ``all_source_ranks`` ascending: the index of the last attention
       source holding the rank's head (``p*K // remote_tp``), else 0 (with GQA dedup an attention source
       gets its own index; DCP sources of an MLA model all hold "head" 0 and share the last index).
    5. ``rank_offset_factor``: 0 if MLA or ``local_tp <= remote_tp``; ``local_rank*K//local_tp -
       attn[0]*K//remote_tp`` if ``local_tp > K``; else ``local_rank % (local_tp // remote_tp)``.
    6. ``local_consumers``: :func:`kvgeom.pair.dcp.dcp_consumer_count` (``max(1, tp_ratio)`` without DCP).
    """
    tp_ratio(local_tp, remote_tp)
    local_rank = _check_rank(local_rank, local_tp)
    if head_sharded_kv_heads is not None:
        is_mla = False
        num_kv_heads = head_sharded_kv_heads
    k = check_positive_int(num_kv_heads, "num_kv_heads", error=SpecError)
    if local_tp >= remote_tp:
        candidates = [local_rank * remote_tp // local_tp]
    else:
        a = remote_tp // local_tp
        candidates = [local_rank * a + j for j in range(a)]
    attn = _attention_sources(
        local_rank, local_tp, remote_tp, k, is_mla, candidates, local_dcp_size, remote_dcp_size
    )
    has_ssm = any(group_is_ssm)
    ssm = (candidates if local_tp < remote_tp else attn) if has_ssm else []
    all_ranks = tuple(sorted(set(attn) | set(ssm)))
    head_slot = {p * k // remote_tp: i for i, p in enumerate(attn)}  # the last source of a head wins
    slots = tuple((r, head_slot.get(r * k // remote_tp, 0)) for r in all_ranks)
    offset = _rank_offset_factor(local_rank, local_tp, remote_tp, k, is_mla, attn)
    return TPMapping(
        source_ranks_per_group=tuple(tuple(ssm if s else attn) for s in group_is_ssm),
        all_source_ranks=all_ranks,
        rank_to_attention_slot=slots,
        rank_offset_factor=offset,
        local_consumers=dcp_consumer_count(local_tp, local_dcp_size, remote_tp, remote_dcp_size),
    )


def _attention_sources(
    local_rank: int,
    local_tp: int,
    remote_tp: int,
    k: int,
    is_mla: bool,
    candidates: list[int],
    local_dcp_size: int,
    remote_dcp_size: int,
) -> list[int]:
    """Step 1 of :func:`compute_tp_mapping`: the attention source ranks (DCP sources of an MLA model; one
    rank; or the first candidate of each distinct head, ascending)."""
    if is_mla and remote_dcp_size > 1:
        return list(
            dcp_source_ranks(dcp_rank(local_rank, local_dcp_size), local_dcp_size, remote_tp, remote_dcp_size)
        )
    if is_mla or local_tp >= remote_tp:
        return [local_rank * remote_tp // local_tp]
    seen: set[int] = set()
    attn = []
    for p in candidates:
        head = p * k // remote_tp
        if head not in seen:
            seen.add(head)
            attn.append(p)
    return attn


def _rank_offset_factor(
    local_rank: int, local_tp: int, remote_tp: int, k: int, is_mla: bool, attn: list[int]
) -> int:
    """Step 5 of :func:`compute_tp_mapping`."""
    if is_mla or local_tp <= remote_tp:
        return 0
    if local_tp > k:
        return local_rank * k // local_tp - attn[0] * k // remote_tp
    return local_rank % (local_tp // remote_tp)


def head_offset(local_rank: int, local_tp: int, remote_tp: int, num_kv_heads: int) -> int:
    """Head slice index of this rank inside its source rank's heads (vLLM ``compute_head_offset``).

    Step 5 of :func:`compute_tp_mapping` without the MLA exemption, with ``src = local_rank*remote_tp //
    local_tp``: 0 if ``local_tp <= remote_tp``; ``local_rank*K//local_tp - src*K//remote_tp`` if
    ``local_tp > K`` (local head replication); else ``local_rank % (local_tp // remote_tp)``.
    """
    tp_ratio(local_tp, remote_tp)
    local_rank = _check_rank(local_rank, local_tp)
    k = check_positive_int(num_kv_heads, "num_kv_heads", error=SpecError)
    if local_tp <= remote_tp:
        return 0
    if local_tp > k:
        src = local_rank * remote_tp // local_tp
        return local_rank * k // local_tp - src * k // remote_tp
    return local_rank % (local_tp // remote_tp)


def handshake_targets(local_rank: int, local_tp: int, remote_tp: int) -> tuple[int, ...]:
    """Remote ranks this rank fetches metadata from: ``r = tp_ratio``; ``r > 0`` -> ``(local_rank // r,)``;
    ``r < 0`` -> ``local_rank*|r| + i`` for ``i < |r|`` (all of them, even for MLA, so they are notified)."""
    r = tp_ratio(local_tp, remote_tp)
    local_rank = _check_rank(local_rank, local_tp)
    if r > 0:
        return (local_rank // r,)
    return tuple(local_rank * -r + i for i in range(-r))


def dcp_handshake_targets(
    local_rank: int, local_tp: int, local_dcp_size: int, remote_tp: int, remote_dcp_size: int
) -> tuple[int, ...]:
    """Remote ranks a rank fetches metadata from (vLLM ``handshake_target_ranks``): the DCP source ranks
    when the remote shards its cache, else the TP rule of :func:`handshake_targets`."""
    if remote_dcp_size > 1:
        return dcp_source_ranks(
            dcp_rank(local_rank, local_dcp_size), local_dcp_size, remote_tp, remote_dcp_size
        )
    _check_sizes(local_dcp_size, remote_dcp_size)
    return handshake_targets(local_rank, local_tp, remote_tp)


def needs_split_local_handles(tp_ratio: int, mapping: TPMapping, use_mla: bool) -> bool:
    """Whether per-source-rank local split handles are needed (vLLM ``_needs_split_local_xfer_handles``):
    ``tp_ratio < 0 and (not use_mla or len(mapping.all_source_ranks) > 1)``."""
    return tp_ratio < 0 and (not use_mla or len(mapping.all_source_ranks) > 1)


def consumers_per_producer(producer_tp: int, consumer_tp: int) -> int:
    """Notifications a producer rank waits for per request: ``consumer_tp // producer_tp`` when
    ``consumer_tp > producer_tp``, else 1."""
    producer_tp = check_positive_int(producer_tp, "producer_tp")
    consumer_tp = check_positive_int(consumer_tp, "consumer_tp")
    big, small = max(producer_tp, consumer_tp), min(producer_tp, consumer_tp)
    if big % small:
        raise RatioError(
            "consumer_tp",
            f"producer TP {producer_tp} and consumer TP {consumer_tp} do not divide",
            local=consumer_tp,
            remote=producer_tp,
        )
    return consumer_tp // producer_tp if consumer_tp > producer_tp else 1
