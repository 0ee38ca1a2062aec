"""What every adapter shares: vLLM's types (imported here, never by the core) and conversions between
vLLM's values and kvgeom's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvgeom.pair.tp import TPMapping as KvTPMapping
from kvgeom.plan.strided import expand_rows

from ..version import profile


def _vllm() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1 import ssm_conv_transfer_utils as ssm
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import tp_mapping
    from vllm.v1 import kv_cache_interface as kvi

    return tp_mapping, ssm, kvi


TPM, SSM, KVI = _vllm()
ORIGINAL_CONV_SPLIT_INFO = SSM.MambaConvSplitInfo
SHARED_REGION = -1  # vLLM's group id of a region that several KV-cache groups view


def is_ssm_type(spec_type: type) -> bool:
    return issubclass(spec_type, KVI.MambaSpec)


def is_attention_type(spec_type: type) -> bool:
    return issubclass(spec_type, KVI.AttentionSpec)


def group_is_ssm(spec_types: Sequence[type], n: int | None = None) -> tuple[bool, ...]:
    kinds = tuple(is_ssm_type(t) for t in spec_types)
    return kinds if n is None else kinds[:n]


def representative_type(spec: Any) -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_representative_spec_type

    return get_representative_spec_type(spec)


def to_kvgeom_mapping(m: Any) -> KvTPMapping:
    """vLLM's ``TPMapping`` (dict of attention slots) as kvgeom's (pairs in the dict's order)."""
    if isinstance(m, KvTPMapping):
        return m
    return KvTPMapping(
        source_ranks_per_group=tuple(tuple(int(r) for r in g) for g in m.source_ranks_per_group),
        all_source_ranks=tuple(int(r) for r in m.all_source_ranks),
        rank_to_attention_slot=tuple((int(r), int(s)) for r, s in dict(m.rank_to_attention_slot).items()),
        rank_offset_factor=int(m.rank_offset_factor),
        local_consumers=int(getattr(m, "local_consumers", 1)),
    )


def to_vllm_mapping(m: KvTPMapping) -> Any:
    return TPM.TPMapping(
        source_ranks_per_group=m.source_ranks_per_group,
        all_source_ranks=m.all_source_ranks,
        rank_to_attention_slot=dict(m.rank_to_attention_slot),
        rank_offset_factor=m.rank_offset_factor,
        local_consumers=m.local_consumers,
    )


def lists(groups: Sequence[np.ndarray]) -> list[list[int]]:
    """kvgeom's per-group arrays as vLLM's lists of ints."""
    return [np.asarray(g).tolist() for g in groups]


def rows(strided: np.ndarray) -> np.ndarray:
    """kvgeom's N x 5 strided rows as the installed vLLM's descriptor table, in its dtype (``uint64``):
    the rows themselves (0.33.0), or one ``(addr, len, dev)`` row per block of each, in the rows' order
    (0.32.0, whose tables are plain descriptor lists; :func:`kvgeom.plan.strided.expand_rows`)."""
    out = np.asarray(strided, dtype=np.int64)
    if not profile().strided_descs:
        out = expand_rows(out)
    return out.astype(np.uint64)
