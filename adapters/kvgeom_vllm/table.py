"""The integration's one table: each geometry function of vLLM 0.33.0's NIXL connector, and the kvgeom
call that answers it.

This module imports neither vLLM nor torch: the table is data (docs, the test plugin and the report
read it). :mod:`kvgeom_vllm.answers` holds one adapter per answered row (vLLM's arguments in, kvgeom's
answer out, in vLLM's types); :mod:`kvgeom_vllm.worker` installs them. A row whose ``answer`` is
``None`` is a vLLM feature kvgeom has no equivalent for yet: vLLM's own code still runs there, and
wiring kvgeom in later is one adapter plus its name in that row.

``CALLS`` counts, per row, the calls that reached kvgeom (``REFUSED``: those kvgeom refused with a typed
error). A counter increment per call is the whole cost.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = ["Entry", "FEATURES", "TABLE", "CALLS", "REFUSED", "ANSWERED", "EXERCISED", "entry", "counts", "reset_counts"]

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
TPM = f"{NIXL}.tp_mapping"
BW = f"{NIXL}.base_worker"
SSM = "vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils"
UTILS = "vllm.distributed.kv_transfer.kv_connector.utils"
SCHED = f"{NIXL}.base_scheduler"

# vLLM features kvgeom has no geometry for yet (issue 7, items 1-5). An adapter that meets one of them
# refuses with kvgeom's UnsupportedError naming it, instead of answering wrong.
FEATURES = {
    "dcp": "decode/prefill context parallelism (DCP/PCP)",
    "pp_routing": "pipeline parallelism with layer-name routing",
    "packed_mla": "packed MLA rows (block-outermost layouts)",
    "csa": "CSA-linear models (scratch groups, PLE rows)",
    "region_pull": "region-mapped pulls (different cache-group layouts, per-region capacities)",
    "ssm_clip": "scheduler-side SSM clipping",
}


@dataclass(frozen=True)
class Entry:
    """One vLLM geometry function. ``module``/``qualname`` locate vLLM's object (``Class.method`` or a
    module function); ``answer`` names the adapter in :mod:`kvgeom_vllm.answers` (``None``: vLLM's own,
    ``missing`` says which kvgeom feature it waits for; the two card steps are wrappers in
    :mod:`kvgeom_vllm.handshake`); ``kvgeom`` names the kvgeom call(s) behind it;
    ``raises`` is the exception class vLLM raises there, which kvgeom's refusal also derives from so
    vLLM's callers (and tests) see the type they expect. ``exercised``: vLLM's own connector tests reach
    this row (the test plugin fails a run where an exercised row got no call)."""

    module: str
    qualname: str
    answer: str | None
    kvgeom: str
    raises: str = "AssertionError"
    missing: str | None = None
    exercised: bool = True

    @property
    def name(self) -> str:
        return self.qualname

    @property
    def owner(self) -> str | None:
        """The class the method belongs to (``None`` for a module function)."""
        return self.qualname.split(".")[0] if "." in self.qualname else None

    @property
    def attr(self) -> str:
        return self.qualname.split(".")[-1]


W = "NixlBaseConnectorWorker"
TABLE: tuple[Entry, ...] = (
    # TP mapping: who reads whom
    Entry(TPM, "compute_tp_mapping", "compute_tp_mapping", "kvgeom.tp.compute_tp_mapping"),
    # vLLM calls compute_head_offset only from compute_tp_mapping, which kvgeom answers whole
    Entry(TPM, "compute_head_offset", "compute_head_offset", "kvgeom.tp.head_offset", exercised=False),
    Entry(UTILS, "TransferTopology.tp_ratio", "topology_tp_ratio", "kvgeom.tp.tp_ratio"),
    # called by vLLM's side-channel handshake, which vLLM's unit tests replace by direct add_remote_agent calls
    Entry(UTILS, "TransferTopology.handshake_target_ranks", "handshake_target_ranks", "kvgeom.tp.handshake_targets",
          exercised=False),
    Entry(UTILS, "TransferTopology.target_remote_ranks", "target_remote_ranks", "kvgeom.tp.handshake_targets",
          exercised=False),
    # reached by the handshake checks of attention-only, non-MLA pairs, which the three test files do not build
    Entry(UTILS, "TransferTopology.is_kv_replicated", "is_kv_replicated", "kvgeom.spec.Shard.replicated",
          exercised=False),
    Entry(BW, f"{W}._needs_split_local_xfer_handles", "needs_split_local_xfer_handles",
          "kvgeom.tp.needs_split_local_handles"),
    # block ids
    # vLLM calls it only from _map_block_ids_for_block_size_ratio, which kvgeom answers whole
    Entry(BW, f"{W}.get_mapped_blocks", "get_mapped_blocks", "kvgeom.blocks.get_mapped_blocks", exercised=False),
    Entry(BW, f"{W}._map_block_ids_for_block_size_ratio", "map_block_ids_for_block_size_ratio",
          "kvgeom.blocks.map_block_ids_for_block_size_ratio"),
    Entry(BW, f"{W}._logical_to_kernel_block_ids", "logical_to_kernel_block_ids", "kvgeom.blocks.logical_to_kernel"),
    Entry(BW, f"{W}._apply_prefix_caching", "apply_prefix_caching", "kvgeom.blocks.apply_prefix_caching"),
    Entry(BW, f"{W}._compute_desc_ids", "compute_desc_ids", "kvgeom.descids.compute_desc_ids"),
    # SSM state pages
    Entry(SSM, "derive_mamba_conv_split", "derive_mamba_conv_split", "kvgeom.conv.derive_conv_split",
          raises="NotImplementedError"),
    Entry(SSM, "MambaConvSplitInfo.remote_conv_offsets", "remote_conv_offsets", "kvgeom.conv.remote_conv_offsets"),
    Entry(SSM, "compute_physical_blocks_per_logical", "compute_physical_blocks_per_logical",
          "kvgeom.conv.physical_blocks_per_logical"),
    # descriptor tables (dlists)
    Entry(BW, f"{W}._build_fa_local", "build_fa_local", "kvgeom.dlist.local_dlist"),
    Entry(BW, f"{W}._build_mamba_local", "build_mamba_local", "kvgeom.dlist.local_dlist (SSM rows)"),
    Entry(BW, f"{W}._build_fa_remote", "build_fa_remote", "kvgeom.dlist.remote_dlist"),
    Entry(BW, f"{W}._build_mamba_remote", "build_mamba_remote",
          "kvgeom.dlist.remote_dlist (SSM rows) + kvgeom.conv.remote_conv_offsets"),
    Entry(BW, f"{W}._build_local_splits_from_plan", "build_local_splits_from_plan", "kvgeom.splits.build_local_splits"),
    # registration and handshake
    Entry(BW, f"{W}.register_kv_caches", "register_kv_caches_wrapper",
          "kvgeom.card_of + rank_geometry (the rank's geometry card, checked against the registration)"),
    # vLLM's tests pair hand-made metadata (no card); tests/vllm/test_integration.py pairs card-carrying workers
    Entry(BW, f"{W}.add_remote_agent", "add_remote_agent_wrapper",
          "kvgeom.GeometryCard.from_json + Pairing.create (the peer's card, checked on receipt)", raises="RuntimeError",
          exercised=False),
    # vLLM features kvgeom does not have yet: vLLM's own code answers (one line each to wire in)
    Entry(UTILS, "TransferTopology.dcp_source_ranks", None, "-", missing="dcp"),
    Entry(BW, f"{W}._apply_dcp_prefix_caching", None, "-", missing="dcp"),
    Entry(BW, f"{W}._align_remote_regions_by_layer", None, "-", missing="pp_routing"),
    Entry(BW, f"{W}._split_remote_packed_rows", None, "-", missing="packed_mla"),
    Entry(BW, f"{W}._validate_csa_linear_tp_layout", None, "-", missing="csa"),
    Entry(BW, f"{W}._block_ids_by_region", None, "-", missing="region_pull"),
    Entry(BW, f"{W}._apply_prefix_caching_by_region", None, "-", missing="region_pull"),
    Entry(BW, f"{W}._zero_region_blocks", None, "-", missing="region_pull"),
    Entry(SCHED, "NixlBaseConnectorScheduler.get_exchange_clipped_blocks", None, "-", missing="ssm_clip"),
)

ANSWERED: tuple[Entry, ...] = tuple(e for e in TABLE if e.answer is not None)
EXERCISED: tuple[Entry, ...] = tuple(e for e in ANSWERED if e.exercised)

CALLS: Counter[str] = Counter()
REFUSED: Counter[str] = Counter()


def entry(qualname: str) -> Entry:
    """The table row of a vLLM function (by ``qualname``)."""
    for e in TABLE:
        if e.qualname == qualname:
            return e
    raise KeyError(qualname)


def counts() -> dict[str, tuple[int, int]]:
    """``{qualname: (calls that reached kvgeom, of which refused)}`` for every answered row."""
    return {e.qualname: (CALLS[e.qualname], REFUSED[e.qualname]) for e in ANSWERED}


def reset_counts() -> None:
    CALLS.clear()
    REFUSED.clear()
