"""The integration's one table: each geometry function of vLLM 0.33.0's NIXL connector, and the kvgeom
call that answers it.

This module imports neither vLLM nor torch: the table is data (docs, the test plugin and the report
read it). :mod:`kvgeom_vllm.answers` holds one adapter per row (vLLM's arguments in, kvgeom's answer out,
in vLLM's types); :mod:`kvgeom_vllm.worker` installs them on vLLM's classes. Every row is answered:
there is no geometry step of vLLM's NIXL worker left to vLLM's own code.

``CALLS`` counts, per row, the calls that reached kvgeom (``REFUSED``: those kvgeom refused with a typed
error). A counter increment per call is the whole cost.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = [
    "Entry",
    "TABLE",
    "CALLS",
    "REFUSED",
    "ANSWERED",
    "EXERCISED",
    "KINDS",
    "entry",
    "counts",
    "reset_counts",
]

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
TPM = f"{NIXL}.tp_mapping"
BW = f"{NIXL}.base_worker"
SSM = "vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils"
UTILS = "vllm.distributed.kv_transfer.kv_connector.utils"
SCHED = f"{NIXL}.base_scheduler"

KINDS = ("method", "base", "static", "property", "function", "attribute", "wrapper")
"""How a row's answer is installed: a method of vLLM's class, a method of vLLM's base worker that vLLM's
pull/push subclasses extend (installed below them), a static method, a property, a module function, an
attribute vLLM computes in ``__init__`` (recomputed there by kvgeom), or a wrapper around vLLM's method
(the handshake's card check, and kvgeom mode's per-request paths)."""

_ALL = ("AssertionError", "RuntimeError", "NotImplementedError")


@dataclass(frozen=True)
class Entry:
    """One vLLM geometry function. ``module``/``qualname`` locate vLLM's object (``Class.member`` or a
    module function); ``answer`` names the adapter in :mod:`kvgeom_vllm.answers` (the card steps: in
    :mod:`kvgeom_vllm.handshake`); ``kvgeom`` names the kvgeom call(s) behind it; ``raises`` the exception
    classes vLLM raises there, which kvgeom's refusal also derives from so that vLLM's callers (and tests)
    see the types they expect. ``exercised``: vLLM's own connector tests reach this row (the test plugin
    fails a run where an exercised row got no call)."""

    module: str
    qualname: str
    answer: str
    kvgeom: str
    raises: tuple[str, ...] = ("AssertionError",)
    exercised: bool = True
    kind: str = "method"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.qualname}: kind {self.kind!r} not in {KINDS}")

    @property
    def name(self) -> str:
        return self.qualname

    @property
    def owner(self) -> str | None:
        """The class the member belongs to (``None`` for a module function)."""
        return self.qualname.split(".")[0] if "." in self.qualname else None

    @property
    def attr(self) -> str:
        return self.qualname.split(".")[-1]


W = "NixlBaseConnectorWorker"
T = "TransferTopology"
S = "NixlBaseConnectorScheduler"
TABLE: tuple[Entry, ...] = (
    # -- who reads whom: TP mapping, topology, decode context parallelism
    Entry(
        TPM, "compute_tp_mapping", "compute_tp_mapping", "kvgeom.pair.tp.compute_tp_mapping", kind="function"
    ),
    # vLLM calls compute_head_offset only from compute_tp_mapping, which kvgeom answers whole
    Entry(
        TPM,
        "compute_head_offset",
        "compute_head_offset",
        "kvgeom.pair.tp.head_offset",
        kind="function",
        exercised=False,
    ),
    Entry(UTILS, f"{T}.tp_ratio", "topology_tp_ratio", "kvgeom.pair.tp.tp_ratio"),
    Entry(
        UTILS, f"{T}.block_size_ratio", "topology_block_size_ratio", "kvgeom.pair.blocksize.block_size_ratio"
    ),
    Entry(
        UTILS,
        f"{T}.local_physical_heads",
        "topology_local_physical_heads",
        "kvgeom.model.layers.Shard.units_per_rank",
        kind="attribute",
    ),
    # vLLM's compute_tp_mapping and handshake_target_ranks ask these; kvgeom answers both whole
    Entry(
        UTILS,
        f"{T}.dcp_rank",
        "topology_dcp_rank",
        "kvgeom.pair.dcp.dcp_rank",
        kind="property",
        exercised=False,
    ),
    Entry(
        UTILS,
        f"{T}.dcp_source_ranks",
        "dcp_source_ranks",
        "kvgeom.pair.dcp.dcp_source_ranks",
        exercised=False,
    ),
    Entry(
        UTILS,
        f"{T}.dcp_consumer_count",
        "dcp_consumer_count",
        "kvgeom.pair.dcp.dcp_consumer_count",
        exercised=False,
    ),  # vLLM's mapping asks kvgeom.pair.tp.compute_tp_mapping, which counts consumers itself
    # called by vLLM's side-channel handshake (vLLM's unit tests call add_remote_agent directly instead)
    Entry(
        UTILS,
        f"{T}.handshake_target_ranks",
        "handshake_target_ranks",
        "kvgeom.pair.tp.dcp_handshake_targets",
        exercised=False,
    ),
    Entry(
        UTILS,
        f"{T}.target_remote_ranks",
        "target_remote_ranks",
        "kvgeom.pair.tp.handshake_targets",
        exercised=False,
    ),
    # vLLM's handshake validation asks it; kvgeom.compat.vllm.advertised answers the validation whole
    Entry(
        UTILS,
        f"{T}.is_kv_replicated",
        "is_kv_replicated",
        "kvgeom.model.layers.Shard.replicated",
        exercised=False,
    ),
    Entry(
        UTILS,
        f"{T}.replicates_kv_cache",
        "replicates_kv_cache",
        "kvgeom.model.layers.Shard.replicated",
        exercised=False,
    ),
    Entry(
        UTILS,
        f"{T}.local_replicates_kv_cache",
        "topology_local_replicates_kv_cache",
        "kvgeom.model.layers.Shard.replicated",
        kind="property",
        exercised=False,
    ),
    Entry(
        BW,
        f"{W}._needs_split_local_xfer_handles",
        "needs_split_local_xfer_handles",
        "kvgeom.pair.tp.needs_split_local_handles",
    ),
    # -- handshake validation (a card-carrying peer is also paired on both cards, see the wrapper rows)
    Entry(
        BW,
        f"{W}._validate_remote_parallel_config",
        "validate_remote_parallel_config",
        "kvgeom.pair.dcp.check_parallel_pair",
        raises=("NotImplementedError",),
        exercised=False,
    ),
    Entry(
        BW,
        f"{W}._validate_remote_agent_handshake",
        "validate_remote_agent_handshake",
        "kvgeom.compat.vllm.advertised.check_advertised_pair",
        raises=_ALL,
    ),
    Entry(
        BW,
        f"{W}._validate_csa_linear_tp_layout",
        "validate_csa_linear_tp_layout",
        "kvgeom.pair.rules.check_csa_linear_tp_layout",
        raises=("ValueError",),
    ),
    # -- advertised regions: layer order, routing, packed rows, block sizes
    Entry(
        BW, "_region_sort_key", "region_sort_key", "kvgeom.pair.layerroute.region_sort_key", kind="function"
    ),
    Entry(BW, f"{W}._set_region_layers", "set_region_layers", "kvgeom.pair.layerroute.transfer_layers"),
    Entry(
        BW,
        f"{W}._align_remote_regions_by_layer",
        "align_remote_regions_by_layer",
        "kvgeom.pair.layerroute.align_regions_by_layer",
    ),
    Entry(
        BW,
        f"{W}._split_remote_packed_rows",
        "split_remote_packed_rows",
        "kvgeom.pair.layerroute.split_packed_rows",
        raises=("AssertionError", "NotImplementedError"),
    ),
    Entry(BW, f"{W}._split_remote_blocks", "split_remote_blocks", "kvgeom.pair.blocksize.remote_block_split"),
    Entry(
        BW,
        f"{W}._sync_block_size_with_kernel",
        "sync_block_size_with_kernel",
        "kvgeom.pair.blocksize.kernel_blocks_per_logical",
    ),
    # -- block ids
    # vLLM calls it only from _map_block_ids_for_block_size_ratio, which kvgeom answers whole
    Entry(
        BW, f"{W}.get_mapped_blocks", "get_mapped_blocks", "kvgeom.blocks.get_mapped_blocks", exercised=False
    ),
    Entry(
        BW,
        f"{W}._map_block_ids_for_block_size_ratio",
        "map_block_ids_for_block_size_ratio",
        "kvgeom.blocks.map_block_ids_for_block_size_ratio",
    ),
    Entry(
        BW,
        f"{W}._logical_to_kernel_block_ids",
        "logical_to_kernel_block_ids",
        "kvgeom.blocks.logical_to_kernel",
    ),
    Entry(BW, f"{W}._apply_prefix_caching", "apply_prefix_caching", "kvgeom.blocks.apply_prefix_caching"),
    Entry(
        BW,
        f"{W}._apply_dcp_prefix_caching",
        "apply_dcp_prefix_caching",
        "kvgeom.pair.dcp.apply_dcp_prefix_caching",
        raises=("ValueError",),
    ),
    Entry(
        BW,
        f"{W}._block_ids_by_region",
        "block_ids_by_region",
        "kvgeom.plan.regionmap.block_ids_by_region",
        raises=("IndexError",),
        kind="static",
    ),
    Entry(
        BW,
        f"{W}._apply_prefix_caching_by_region",
        "apply_prefix_caching_by_region",
        "kvgeom.plan.regionmap.apply_prefix_caching_by_region",
        raises=("AssertionError", "ValueError"),
    ),
    Entry(BW, f"{W}._compute_desc_ids", "compute_desc_ids", "kvgeom.plan.descids.compute_desc_ids"),
    # -- SSM state pages
    Entry(
        SSM,
        "derive_mamba_conv_split",
        "derive_mamba_conv_split",
        "kvgeom.layout.conv.derive_conv_split",
        raises=("NotImplementedError", "AssertionError"),
        kind="function",
    ),
    Entry(
        SSM,
        "MambaConvSplitInfo.remote_conv_offsets",
        "remote_conv_offsets",
        "kvgeom.layout.conv.remote_conv_offsets",
    ),
    Entry(
        SSM,
        "compute_physical_blocks_per_logical",
        "compute_physical_blocks_per_logical",
        "kvgeom.layout.conv.physical_blocks_per_logical",
        kind="function",
    ),
    # -- descriptor tables (NIXL's strided rows)
    Entry(
        BW,
        f"{W}._block_strided_descs",
        "block_strided_descs",
        "kvgeom.plan.strided.block_strided_rows",
        kind="static",
        exercised=False,
    ),  # called by _build_fa_local, which kvgeom answers whole
    # called by _build_local_splits_from_plan (answered whole) and by mixed-memory registration (HiSparse)
    Entry(
        BW,
        f"{W}._strided_desc_starts",
        "strided_desc_starts",
        "kvgeom.plan.strided.strided_starts",
        kind="static",
        exercised=False,
    ),
    Entry(BW, f"{W}._build_fa_local", "build_fa_local", "kvgeom.plan.strided.fa_local_rows"),
    Entry(BW, f"{W}._build_mamba_local", "build_mamba_local", "kvgeom.plan.strided.mamba_local_rows"),
    Entry(BW, f"{W}._build_fa_remote", "build_fa_remote", "kvgeom.plan.strided.fa_remote_rows"),
    Entry(
        BW,
        f"{W}._build_mamba_remote",
        "build_mamba_remote",
        "kvgeom.plan.strided.mamba_remote_rows + kvgeom.layout.conv.remote_conv_offsets",
        raises=("AssertionError", "ValueError"),
    ),
    Entry(
        BW,
        f"{W}._build_local_splits_from_plan",
        "build_local_splits_from_plan",
        "kvgeom.plan.splits.build_local_splits",
    ),
    # -- after the bytes land
    Entry(
        BW,
        f"{W}.post_process_device_kv_on_receive",
        "post_process_device_kv_on_receive",
        "kvgeom.plan.align.consumer_zero_rows + regroup (kvgeom_vllm.devicebytes)",
    ),
    Entry(
        BW,
        f"{W}._zero_region_blocks",
        "zero_region_blocks",
        "kvgeom.plan.regionmap.region_zero_rows (kvgeom mode: the plan's regroup and zero rows)",
    ),
    # -- the scheduler: which blocks and tokens a request exchanges
    Entry(
        SCHED,
        f"{S}.blocks_per_sw",
        "blocks_per_window",
        "kvgeom.plan.exchange.sliding_window_blocks",
        kind="attribute",
    ),
    Entry(
        UTILS,
        "clip_ssm_state_blocks",
        "clip_ssm_state_blocks",
        "kvgeom.plan.exchange.clip_ssm_state_blocks",
        kind="function",
        exercised=False,
    ),  # called by get_exchange_clipped_blocks, which kvgeom answers whole
    Entry(
        SCHED,
        f"{S}.get_exchange_clipped_blocks",
        "get_exchange_clipped_blocks",
        "kvgeom.plan.exchange.exchange_clipped_blocks",
    ),
    Entry(SCHED, f"{S}._prefill_backoff", "prefill_backoff", "kvgeom.plan.exchange.prefill_backoff"),
    Entry(
        SCHED,
        f"{S}._get_remote_prefill_token_count",
        "get_remote_prefill_token_count",
        "kvgeom.plan.exchange.prefill_tokens",
    ),
    # -- the per-request path: kvgeom's plan when both sides carry a card (always in kvgeom mode); for a peer
    # without a card vLLM's own per-request code runs on the answers above. vLLM's tests pair no cards.
    Entry(
        f"{NIXL}.pull_worker",
        "NixlPullConnectorWorker._read_blocks_for_req",
        "read_blocks_for_req",
        "kvgeom.plan_request on the pairing (+ the plan's post-receive step at completion)",
        raises=_ALL,
        kind="wrapper",
        exercised=False,
    ),
    Entry(
        f"{NIXL}.push_worker",
        "NixlPushConnectorWorker._xfer_blocks_for_req",
        "xfer_blocks_for_req",
        "kvgeom.plan_request on the pairing",
        raises=_ALL,
        kind="wrapper",
        exercised=False,
    ),
    # -- the rank's geometry card, in registration and handshake
    Entry(
        BW,
        f"{W}.register_kv_caches",
        "register_kv_caches",
        "kvgeom.compat.vllm.registration.discover_regions + kvgeom.pair.layerroute.pp_region_offset; then the rank's geometry card "
        "(kvgeom_vllm.card, checked against the regions)",
        raises=("AssertionError", "NotImplementedError"),
        kind="base",
    ),
    # vLLM's tests pair hand-made metadata (no card); tests/vllm/test_integration.py pairs card-carrying workers
    Entry(
        BW,
        f"{W}.add_remote_agent",
        "add_remote_agent_wrapper",
        "kvgeom.GeometryCard.from_json + Pairing.create (the peer's card, checked on receipt; the pair's tables "
        "prepared from the pairing); kvgeom.pair.layerroute.slice_regions (a PP stage's window)",
        raises=("RuntimeError",),
        kind="wrapper",
    ),
)

ANSWERED: tuple[Entry, ...] = TABLE
EXERCISED: tuple[Entry, ...] = tuple(e for e in TABLE if e.exercised)

CALLS: Counter[str] = Counter()
REFUSED: Counter[str] = Counter()


def entry(qualname: str) -> Entry:
    """The table row of a vLLM function (by ``qualname``)."""
    for e in TABLE:
        if e.qualname == qualname:
            return e
    raise KeyError(qualname)


def counts() -> dict[str, tuple[int, int]]:
    """``{qualname: (calls that reached kvgeom, of which refused)}`` for every row."""
    return {e.qualname: (CALLS[e.qualname], REFUSED[e.qualname]) for e in TABLE}


def reset_counts() -> None:
    CALLS.clear()
    REFUSED.clear()
