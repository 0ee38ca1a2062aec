"""SSM state pages: vLLM's conv-state decomposition and the kernel blocks an SSM page spans, answered by
:mod:`kvgeom.layout.conv`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvgeom.errors import ConfigError, SpecError
from kvgeom.layout.conv import derive_conv_split as _kv_derive_conv_split
from kvgeom.layout.conv import physical_blocks_per_logical as _kv_ppl
from kvgeom.layout.conv import remote_conv_offsets as _kv_remote_conv_offsets

from ..calls import counted_call
from ._common import ORIGINAL_CONV_SPLIT_INFO

MAMBA_TYPES = {"MAMBA1": "mamba1", "MAMBA2": "mamba2", "GDN_ATTN": "gdn"}


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class KvgeomConvSplitInfo(ORIGINAL_CONV_SPLIT_INFO):
    """vLLM's ``MambaConvSplitInfo`` whose remote conv offsets come from kvgeom."""

    def remote_conv_offsets(self, local_rank_offset: int, tp_ratio: int) -> list[tuple[int, int]]:
        return counted_call(
            "MambaConvSplitInfo.remote_conv_offsets", remote_conv_offsets, self, local_rank_offset, tp_ratio
        )


def remote_conv_offsets(self: Any, local_rank_offset: int, tp_ratio: int) -> list[tuple[int, int]]:
    return list(
        _kv_remote_conv_offsets(
            self.local_proj_dims, self.conv_rows, self.conv_dtype_size, local_rank_offset, tp_ratio
        )
    )


def derive_mamba_conv_split(mamba_spec: Any, local_tp: int) -> Any:
    """``derive_mamba_conv_split``: the DS conv state's sub-projections, from kvgeom."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    kind = getattr(mamba_spec.mamba_type, "name", str(mamba_spec.mamba_type))
    if kind not in MAMBA_TYPES:
        raise SpecError(
            "mamba_type",
            f"Conv transfer only supports Mamba1, Mamba2 and GDN models, got "
            f"mamba_type={mamba_spec.mamba_type!r}",
            value=str(mamba_spec.mamba_type),
        )
    if not is_conv_state_dim_first():
        raise ConfigError(
            "conv_layout",
            "3-read requires DS conv state layout (VLLM_SSM_CONV_STATE_LAYOUT=DS)",
            value="SD",
            expected="DS",
        )
    conv_shape, temporal_shape = mamba_spec.shapes[0], mamba_spec.shapes[1]
    split = _kv_derive_conv_split(
        MAMBA_TYPES[kind],
        conv_shape,
        temporal_shape,
        int(local_tp),
        dtype_name(mamba_spec.dtypes[0]),
        dtype_name(mamba_spec.dtypes[1]),
    )
    return KvgeomConvSplitInfo(
        conv_rows=split.conv_rows,
        local_proj_dims=split.local_proj_dims,
        conv_dtype_size=split.conv_dtype_size,
        ssm_sizes=split.ssm_sizes,
    )


def compute_physical_blocks_per_logical(ssm_sizes: Sequence[int], block_len: int) -> int:
    return _kv_ppl(ssm_sizes, int(block_len))
