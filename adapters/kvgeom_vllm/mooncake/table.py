"""The geometry functions of vLLM 0.33.0's Mooncake connector, and the kvgeom call that answers each.

vLLM's ``MooncakeConnector`` (``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py``)
is P-push: D sends P its block lists and registered regions, and P's sender computes the bytes to write in
``send_kv_to_decode``. The geometry it computes on the way, one row each: the signed TP ratio, the head
slice one P rank writes into one D rank (GQA replication on either side), the region-length check of a
TP pair, the refusal of hybrids with recurrent state across TP sizes (kvgeom's addition: vLLM copies the
state page as one slice, which places conv pieces wrongly), the logical-to-kernel block expansion, the
block ids of a region shared by several groups, the handshake targets (vLLM's ``TransferTopology``, here
kvgeom_vllm's), and on the scheduler the sliding-window block counts, their clipping and the prompt tokens
D loads.

Like :mod:`kvgeom_vllm.table` this is data (no vLLM, no torch); :mod:`kvgeom_vllm.mooncake.answers` holds
the adapters and :mod:`kvgeom_vllm.mooncake.connector` installs them. ``CALLS``/``REFUSED`` count per row.
What vLLM's own code still computes: the address arithmetic of ``_build_transfer_params`` (base + id x
block length + kvgeom's offset), its run grouping (``group_concurrent_contiguous``) and the layer-name
alignment and coalescing of packed regions (``_align_transfer_regions``,
``_coalesce_contiguous_transfer_regions``): docs/mooncake.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from kvgeom.errors import KvgeomError

from ..calls import as_vllm_error
from ..table import Entry

__all__ = ["MODULE", "TABLE", "CALLS", "REFUSED", "EXERCISED", "entry", "counted_call", "counts"]

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"
W, S = "MooncakeConnectorWorker", "MooncakeConnectorScheduler"

TABLE: tuple[Entry, ...] = (
    Entry(MODULE, "_get_tp_ratio", "get_tp_ratio", "kvgeom.pair.tp.tp_ratio", kind="function"),
    Entry(
        MODULE,
        "_compute_sender_transfer_plan",
        "compute_sender_transfer_plan",
        "kvgeom.pair.tp.tp_ratio + kvgeom.model.layers.Shard (the heads each rank holds, replication)",
        kind="function",
    ),
    Entry(
        MODULE,
        "_validate_asymmetric_region_lengths",
        "validate_asymmetric_region_lengths",
        "kvgeom.model.layers.Shard.units_per_rank (a head-sharded region scales with the heads per rank)",
        kind="function",
    ),
    Entry(
        MODULE,
        "_block_ids_for_region",
        "block_ids_for_region",
        "kvgeom.plan.regionmap.block_ids_by_region (a shared region: its groups' lists, concatenated)",
        kind="function",
    ),
    Entry(
        MODULE,
        f"{W}._logical_to_kernel_block_ids",
        "logical_to_kernel_block_ids",
        "kvgeom.blocks.logical_to_kernel",
    ),
    Entry(
        MODULE,
        f"{W}._get_sender_transfer_plan",
        "get_sender_transfer_plan",
        "the sender plan row, with the worker's topology (kvgeom_vllm.worker.KvgeomTransferTopology)",
    ),
    Entry(
        MODULE,
        f"{W}._prepare_transfer_regions",
        "prepare_transfer_regions",
        "kvgeom.pair.tp.tp_ratio; a pair of different TP sizes with recurrent state refused "
        "(kvgeom.layout.conv: each rank's conv state is pieces, not one slice of the other's)",
        raises=("AssertionError",),
        kind="wrapper",
    ),
    Entry(
        MODULE,
        f"{W}.transfer_topo",
        "transfer_topology",
        "kvgeom_vllm.worker.KvgeomTransferTopology (kvgeom.pair.tp.dcp_handshake_targets, Shard.replicated)",
        kind="attribute",
    ),
    Entry(
        MODULE,
        f"{S}.blocks_per_sw",
        "blocks_per_window",
        "kvgeom.plan.exchange.sliding_window_blocks",
        kind="attribute",
    ),
    Entry(
        MODULE,
        f"{S}.get_sw_clipped_blocks",
        "get_sw_clipped_blocks",
        "kvgeom.plan.exchange.exchange_clipped_blocks (no SSM clipping: Mooncake sends the state blocks as "
        "given)",
    ),
    Entry(
        MODULE,
        f"{S}._get_remote_prefill_token_count",
        "get_remote_prefill_token_count",
        "kvgeom.plan.exchange.prefill_backoff + prefill_tokens",
    ),
)

EXERCISED: tuple[Entry, ...] = tuple(e for e in TABLE if e.exercised)
CALLS: Counter[str] = Counter()
REFUSED: Counter[str] = Counter()


def entry(qualname: str) -> Entry:
    """The row of a vLLM Mooncake function (by ``qualname``)."""
    for e in TABLE:
        if e.qualname == qualname:
            return e
    raise KeyError(qualname)


_BUILTIN = {"AssertionError": AssertionError, "RuntimeError": RuntimeError, "ValueError": ValueError}


def counted_call(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the adapter of row ``name``: counted; a kvgeom refusal raised also as vLLM's exception class."""
    CALLS[name] += 1
    try:
        return fn(*args, **kwargs)
    except KvgeomError as exc:
        REFUSED[name] += 1
        raised = tuple(_BUILTIN[n] for n in entry(name).raises)
        raise as_vllm_error(exc, *raised).with_traceback(exc.__traceback__) from None


def counts() -> dict[str, tuple[int, int]]:
    """``{qualname: (calls that reached kvgeom, of which refused)}`` for every row."""
    return {e.qualname: (CALLS[e.qualname], REFUSED[e.qualname]) for e in TABLE}
