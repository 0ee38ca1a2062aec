"""kvgeom's geometry card in vLLM's NIXL handshake.

At registration a kvgeom worker describes its rank as a :class:`kvgeom.GeometryCard`
(:mod:`kvgeom_vllm.card`) and checks that kvgeom's geometry of that card is what vLLM just registered
(groups, region lengths, strides, block counts, SSM pieces). The card travels in
the handshake as one more field of vLLM's agent metadata (``kvgeom_card``, JSON); vLLM peers ignore it.

On receipt, ``add_remote_agent`` reads the peer's card (:meth:`GeometryCard.from_json` rejects a card
that contradicts itself) and pairs it with its own (:meth:`Pairing.create`, in the worker's compat mode):
an incompatible pair is refused on both sides with the same readable message, before any descriptor is
prepared. A peer without a card (plain vLLM) is paired by vLLM's own checks in ``compat="vllm"`` and
refused in ``compat="kvgeom"``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from kvgeom import GeometryCard, Pairing
from kvgeom.errors import IncompatiblePairError, KvgeomError, UnsupportedError
from kvgeom.pair.layerroute import slice_regions

from . import kvgeom_mode
from .answers.regions import _table
from .calls import as_vllm_error
from .card import card_of_worker, check_registration
from .metadata import CARDLESS, KvgeomAgentMetadata
from .table import CALLS, REFUSED

__all__ = ["CARDLESS", "KvgeomAgentMetadata", "card_of_worker", "check_registration", "pair_with_card"]

logger = logging.getLogger("kvgeom_vllm")


def _outside_kvgeom(worker: Any, meta: Any) -> tuple[str, str, Any] | None:
    """What of this set-up kvgeom's pairings do not plan, as ``(field, what, value)``: pipeline-parallel
    stages, KV staged through a host buffer (the registered bytes are not the cache tensors), and vLLM's
    repacking for a CPU attention backend paired with another backend."""
    if int(getattr(worker, "pp_size", 1)) > 1:
        return "pipeline_parallel_size", "pipeline-parallel stages", int(worker.pp_size)
    if getattr(worker, "use_host_buffer", False):
        return "kv_buffer_device", "KV staged through a host buffer", True
    backend = getattr(worker, "backend_name", None)
    if backend == "CPU_ATTN" and getattr(meta, "attn_backend_name", backend) != backend:
        return "attn_backend_name", "repacking between attention backends", meta.attn_backend_name
    return None


def pair_with_card(worker: Any, meta: Any, remote_tp_rank: int, remote_tp_size: int) -> Pairing | None:
    """Check the peer's card against ours (both sides reach the same verdict). ``None`` when either side
    has no card and the worker runs vLLM-compatible."""
    text = getattr(meta, "kvgeom_card", None)
    local: GeometryCard | None = getattr(worker, "kvgeom_card", None)
    outside = _outside_kvgeom(worker, meta)
    if outside is not None:  # a set-up kvgeom's pairings do not plan: vLLM's path, or refused in kvgeom mode
        if worker.kvgeom_compat == "kvgeom":
            field, what, value = outside
            raise IncompatiblePairError(
                field, f"kvgeom mode does not plan {what} yet; use compat 'vllm'", value=value
            )
        return None
    if text is None or local is None:
        if worker.kvgeom_compat == "kvgeom":
            side = "the peer sent no kvgeom geometry card" if text is None else "this rank has no card"
            raise IncompatiblePairError(
                "kvgeom_card",
                f"kvgeom mode needs kvgeom_vllm on both sides: {side}",
                local=local is not None,
                remote=text is not None,
            )
        return None
    remote = GeometryCard.from_json(text)
    if remote.engine.tp_size != remote_tp_size or remote.engine.tp_rank != remote_tp_rank:
        raise IncompatiblePairError(
            "kvgeom_card.engine",
            "the card's TP rank/size differ from the handshake's",
            local=(remote_tp_rank, remote_tp_size),
            remote=(remote.engine.tp_rank, remote.engine.tp_size),
        )
    ranks = {
        r: remote
        if r == remote_tp_rank
        else GeometryCard(remote.engine_id, remote.model, remote.engine.with_rank(r), remote.mode)
        for r in range(remote_tp_size)
    }
    prefix = bool(getattr(worker.vllm_config.cache_config, "enable_prefix_caching", False))
    pairing = Pairing.create(
        local, ranks, mode=local.mode, compat=worker.kvgeom_compat, prefix_caching=prefix
    )
    if pairing.mode == "push" and pairing.permute:
        # kvgeom plans it (the D step is kvgeom.plan.receive.receive_step), but vLLM's push D runs no receive step
        # this drop-in could answer: the head-major pages would stay unpermuted in D's token-major cache
        lay, ray = local.engine.kv_layout.value, remote.engine.kv_layout.value
        raise UnsupportedError(
            "kv_layout",
            "kvgeom_vllm does not run D's receive step in push yet, so the head-major pages P writes would "
            f"stay unpermuted in D's token-major cache; use pull, or kvgeom_nixl's push (local {lay!r}, "
            f"remote {ray!r})",
            local=lay,
            remote=ray,
        )
    return pairing


def _slice_pp_window(worker: Any, meta: Any) -> None:
    """A PP stage (no layer-name routing) reads the window of a PP-1 peer's regions that holds its layers
    (:func:`kvgeom.pair.layerroute.slice_regions` from the stage's :func:`~kvgeom.pair.layerroute.pp_region_offset`).
    vLLM slices inline in ``add_remote_agent``; done here first, its own slicing finds nothing left to do."""
    n = len(worker.block_len_per_layer)
    if (
        worker.pp_size <= 1
        or worker._transfer_layer_region_indices
        or len(meta.kv_caches_base_addr) <= n
        or (meta.packed_member_layouts and not worker._packed_member_layouts)
    ):
        return
    packed = meta.packed_member_layouts
    table = slice_regions(_table(meta), int(worker._remote_region_offset), n)
    meta.kv_caches_base_addr, meta.block_lens = list(table.bases), list(table.block_lens)
    meta.block_strides = list(table.block_strides)
    for attr, value in (
        ("region_num_blocks", table.num_blocks),
        ("region_group_ids", table.group_ids),
        ("region_names", table.names),
        ("region_mem_types", table.mem_types),
    ):
        if getattr(meta, attr) is not None:
            setattr(meta, attr, list(value) if value is not None else None)
    meta.packed_member_layouts = packed


def add_remote_agent_wrapper(add: Any) -> Any:
    """vLLM's ``add_remote_agent``, preceded by the card check and the PP window. When both sides carry a
    card the pair is prepared by :func:`kvgeom_vllm.kvgeom_mode.add_remote_agent` instead of vLLM's code
    (in vLLM-compatible mode on a pairing that refuses what vLLM refuses)."""

    @functools.wraps(add)
    def add_remote_agent(
        self: Any,
        nixl_agent_meta: Any,
        remote_tp_rank: int = 0,
        remote_tp_size: int = 1,
        remote_dcp_size: int = 1,
    ) -> str:
        engine_id = nixl_agent_meta.engine_id
        if (0, remote_tp_rank) in self._remote_agents.get(engine_id, {}):
            return add(self, nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size)
        name = "NixlBaseConnectorWorker.add_remote_agent"
        CALLS[name] += 1
        pairing = None
        try:
            if getattr(nixl_agent_meta, "kvgeom_card", None) is not None or self.kvgeom_compat == "kvgeom":
                pairing = pair_with_card(self, nixl_agent_meta, remote_tp_rank, remote_tp_size)
            _slice_pp_window(self, nixl_agent_meta)
        except KvgeomError as exc:
            REFUSED[name] += 1
            raise as_vllm_error(exc, RuntimeError) from None
        if pairing is not None:
            self.kvgeom_pairings = {**getattr(self, "kvgeom_pairings", {}), engine_id: pairing}
        if pairing is not None:  # both sides carry a card: kvgeom prepares the pair (in either compat mode)
            return kvgeom_mode.add_remote_agent(
                self, nixl_agent_meta, pairing, remote_tp_rank, remote_tp_size, remote_dcp_size
            )
        return add(self, nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size)

    return add_remote_agent
