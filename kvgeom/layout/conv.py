"""Mamba conv-state decomposition and hetero-TP conv offsets (vLLM-compatible; docs/vllm-behaviour.md
B.3.10, B.6.1 item 1).

The conv state is in the DS layout ``(conv_dim_local, conv_rows)`` (dim-first), so each sub-projection
(Mamba1 ``x``; Mamba2 ``x|B|C``; GDN/KDA ``Q|K|V``) is one contiguous byte range of the page.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvgeom.blocks import check_positive_int
from kvgeom.dtypes import dtype_size
from kvgeom.errors import SpecError

__all__ = ["ConvSplit", "derive_conv_split", "remote_conv_offsets", "physical_blocks_per_logical"]

MAMBA_TYPES = ("mamba1", "mamba2", "gdn", "kda")


@dataclass(frozen=True)
class ConvSplit:
    """Local conv sub-projections: dims (elements), byte sizes and ``(offset, size)`` in the page,
    plus ``ssm_sizes = (conv_bytes, ssm_bytes)`` of one state page (per rank)."""

    local_proj_dims: tuple[int, ...]
    proj_bytes: tuple[int, ...]
    local_conv_offsets: tuple[tuple[int, int], ...]
    ssm_sizes: tuple[int, int]
    conv_rows: int
    conv_dtype_size: int


def _shape(shape: Sequence[int], field: str, ndim: int) -> tuple[int, ...]:
    dims = tuple(int(x) for x in shape)
    if len(dims) < ndim or any(x <= 0 for x in dims):
        raise SpecError(field, f"must have >= {ndim} positive dims, got {list(shape)}", value=list(shape))
    return dims


def _mamba1_dims(c: int, temporal: tuple[int, ...], tp: int) -> tuple[int, ...]:
    if temporal[0] != c:
        raise SpecError(
            "temporal_shape",
            f"Mamba1 temporal state dim ({temporal[0]}) doesn't match conv dim ({c}); both should be "
            "intermediate_size/TP",
            value=temporal[0],
            expected=c,
        )
    return (c,)


def _mamba2_dims(c: int, temporal: tuple[int, ...], tp: int) -> tuple[int, ...]:
    inter = temporal[0] * tp * temporal[1]
    rem = c * tp - inter
    if rem <= 0 or rem % 2:
        raise SpecError(
            "conv_shape",
            f"Mamba2 conv dim ({c}*tp={tp}) doesn't decompose into intermediate_size={inter} + "
            f"2*groups*state: remainder={rem} must be positive and even",
            value=c,
            expected=inter,
        )
    return (inter // tp, rem // 2 // tp, rem // 2 // tp)


def _gdn_dims(c: int, temporal: tuple[int, ...], tp: int) -> tuple[int, ...]:
    v = temporal[0] * temporal[1]
    rem = c - v
    if rem <= 0 or rem % 2:
        raise SpecError(
            "conv_shape",
            f"GDN/KDA conv dim ({c}) doesn't decompose into 2*key_dim_local + value_dim_local={v}: "
            f"remainder={rem} must be positive and even",
            value=c,
            expected=v,
        )
    return (rem // 2, rem // 2, v)


_CONV_DIMS: dict[str, Callable[[int, tuple[int, ...], int], tuple[int, ...]]] = {
    "mamba1": _mamba1_dims,
    "mamba2": _mamba2_dims,
    "gdn": _gdn_dims,
    "kda": _gdn_dims,
}
"""Each Mamba type's conv pieces per rank from the local conv dim ``C``, the temporal shape and TP (one row
per type of :data:`MAMBA_TYPES`; see :func:`derive_conv_split`)."""


def derive_conv_split(
    mamba_type: str,
    conv_shape: Sequence[int],
    temporal_shape: Sequence[int],
    local_tp: int,
    conv_dtype: str,
    ssm_dtype: str,
) -> ConvSplit:
    """Decompose the local conv state (vLLM ``derive_mamba_conv_split``); ``conv_shape = (C, rows)``.

    - mamba1: dims ``(C,)``; requires ``temporal_shape[0] == C``.
    - mamba2: temporal ``(heads, head_dim, ...)``; ``I = heads*tp*head_dim``; ``rem = C*tp - I`` must be
      positive and even; ``G = rem/2``; dims ``(I//tp, G//tp, G//tp)`` (floor division, as vLLM: the
      pieces need not add up to ``C``).
    - gdn / kda: temporal ``(v_heads, v_dim, k_dim)``; ``V = v_heads*v_dim``; ``rem = C - V`` must be
      positive and even; dims ``(rem/2, rem/2, V)``.

    ``proj_bytes = dims * rows * e_conv``; ``local_conv_offsets`` = cumulative ``(offset, size)``;
    ``ssm_sizes = (prod(conv_shape)*e_conv, prod(temporal_shape)*e_ssm)``. :class:`SpecError` where vLLM
    asserted.
    """
    if mamba_type not in MAMBA_TYPES:
        raise SpecError(
            "mamba_type", f"unknown Mamba type {mamba_type!r}; known: {MAMBA_TYPES}", value=mamba_type
        )
    tp = check_positive_int(local_tp, "local_tp", error=SpecError)
    conv = _shape(conv_shape, "conv_shape", 2)
    temporal = _shape(temporal_shape, "temporal_shape", 1 if mamba_type == "mamba1" else 2)
    e_conv = dtype_size(conv_dtype, "conv_dtype")
    e_ssm = dtype_size(ssm_dtype, "ssm_dtype")
    c, rows = conv[0], conv[1]
    dims = _CONV_DIMS[mamba_type](c, temporal, tp)
    row_bytes = rows * e_conv
    sizes = tuple(d * row_bytes for d in dims)
    starts = (0, *tuple(sum(sizes[: i + 1]) for i in range(len(sizes) - 1)))
    return ConvSplit(
        local_proj_dims=dims,
        proj_bytes=sizes,
        local_conv_offsets=tuple(zip(starts, sizes, strict=True)),
        ssm_sizes=(math.prod(conv) * e_conv, math.prod(temporal) * e_ssm),
        conv_rows=rows,
        conv_dtype_size=e_conv,
    )


def remote_conv_offsets(
    local_proj_dims: Sequence[int],
    conv_rows: int,
    conv_dtype_size: int,
    local_rank_offset: int,
    tp_ratio: int,
) -> tuple[tuple[int, int], ...]:
    """``(offset, size)`` of this local rank's conv pieces inside one remote conv page (vLLM
    ``remote_conv_offsets``), with ``s_k = dims_k * rows * e`` the local piece bytes:

    - ``tp_ratio >= 1``: the remote piece is ``tp_ratio`` times the local one: read
      ``(sum_{k'<k} tp_ratio*s_k' + local_rank_offset*s_k, s_k)``.
    - ``tp_ratio < 0``: the remote page is read whole, pieces ``s_k // |tp_ratio|`` at cumulative offsets
      (``local_rank_offset`` is ignored).

    Like vLLM this assumes every piece scales with TP (wrong for Mamba2 with n_groups < TP, B.6.1 item 1).
    """
    rows = check_positive_int(conv_rows, "conv_rows", error=SpecError)
    e = check_positive_int(conv_dtype_size, "conv_dtype_size", error=SpecError)
    if isinstance(tp_ratio, bool) or not isinstance(tp_ratio, int) or tp_ratio == 0:
        raise SpecError("tp_ratio", f"must be a non-zero integer, got {tp_ratio!r}", value=tp_ratio)
    sizes = [check_positive_int(d, "local_proj_dims", 0, SpecError) * rows * e for d in local_proj_dims]
    out: list[tuple[int, int]] = []
    if tp_ratio >= 1:
        off = check_positive_int(local_rank_offset, "local_rank_offset", 0, SpecError)
        if off >= tp_ratio:
            raise SpecError(
                "local_rank_offset", f"must be < tp_ratio {tp_ratio}, got {off}", value=off, expected=tp_ratio
            )
        base = 0
        for s in sizes:
            out.append((base + off * s, s))
            base += tp_ratio * s
    else:
        base = 0
        for s in sizes:
            piece = s // -tp_ratio
            out.append((base, piece))
            base += piece
    return tuple(out)


def physical_blocks_per_logical(ssm_sizes: Sequence[int], block_len: int) -> int:
    """Kernel blocks one Mamba state page spans: ``ceil((ssm_sizes[0] + ssm_sizes[1]) / block_len)``
    (vLLM ``compute_physical_blocks_per_logical``)."""
    blen = check_positive_int(block_len, "block_len", error=SpecError)
    if len(ssm_sizes) != 2 or any(int(x) < 0 for x in ssm_sizes):
        raise SpecError("ssm_sizes", f"must be (conv_bytes, ssm_bytes) >= 0, got {list(ssm_sizes)}")
    return -(-(int(ssm_sizes[0]) + int(ssm_sizes[1])) // blen)
