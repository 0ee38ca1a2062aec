"""Exact values and refusals of kvgeom.pair.blocksize and kvgeom.layout.conv on small hand-derived inputs."""

from __future__ import annotations

import pytest

from kvgeom.errors import SpecError
from kvgeom.layout.conv import derive_conv_split, physical_blocks_per_logical, remote_conv_offsets


def _raises(cls, fn, *args, **kwargs):
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    assert type(info.value) is cls
    return info.value


# ---------------------------------------------------------------- blocksize


# ---------------------------------------------------------------- conv


def test_derive_conv_split_mamba1():
    # conv (C=8, rows=4) bf16 (2 B): one piece of 8*4*2 = 64 B; temporal (8, 16) fp32: 8*16*4 = 512 B
    s = derive_conv_split("mamba1", (8, 4), (8, 16), 1, "bfloat16", "float32")
    assert s.local_proj_dims == (8,)
    assert s.proj_bytes == (64,)
    assert s.local_conv_offsets == ((0, 64),)
    assert s.ssm_sizes == (64, 512)
    assert s.conv_rows == 4 and s.conv_dtype_size == 2
    # mamba1 needs only a 1-dim temporal shape
    assert derive_conv_split("mamba1", (8, 4), (8,), 1, "float32", "float32").ssm_sizes == (128, 32)
    err = _raises(SpecError, derive_conv_split, "mamba1", (8, 4), (7, 16), 1, "bfloat16", "float32")
    assert err.field == "temporal_shape" and err.values == {"value": 7, "expected": 8}


def test_derive_conv_split_mamba2():
    # temporal (heads 2, head_dim 4, state 16), tp 2: I = 2*2*4 = 16; C = 12: rem = 24 - 16 = 8, G = 4
    # dims (16//2, 4//2, 4//2) = (8, 2, 2); rows 3, e 2: row bytes 6 -> sizes (48, 12, 12)
    s = derive_conv_split("mamba2", (12, 3), (2, 4, 16), 2, "float16", "float32")
    assert s.local_proj_dims == (8, 2, 2)
    assert s.proj_bytes == (48, 12, 12)
    assert s.local_conv_offsets == ((0, 48), (48, 12), (60, 12))
    assert s.ssm_sizes == (12 * 3 * 2, 2 * 4 * 16 * 4)
    assert all(isinstance(x, int) for x in s.local_proj_dims + s.proj_bytes)
    # tp 1, I = 8: C = 10 -> rem 2 -> dims (8, 1, 1)
    assert derive_conv_split("mamba2", (10, 1), (2, 4), 1, "int8", "int8").local_proj_dims == (8, 1, 1)
    for c in (8, 9):  # rem 0 (not positive), rem 1 (odd)
        err = _raises(SpecError, derive_conv_split, "mamba2", (c, 1), (2, 4), 1, "int8", "int8")
        assert err.field == "conv_shape" and err.values == {"value": c, "expected": 8}
    # mamba2 needs a 2-dim temporal shape
    err = _raises(SpecError, derive_conv_split, "mamba2", (10, 1), (8,), 1, "int8", "int8")
    assert err.field == "temporal_shape" and err.values == {"value": [8]}


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_derive_conv_split_gdn_kda(kind):
    # temporal (v_heads 2, v_dim 4, k_dim 8): V = 8; C = 16 -> rem 8 -> dims (4, 4, 8)
    s = derive_conv_split(kind, (16, 2), (2, 4, 8), 4, "float32", "bfloat16")
    assert s.local_proj_dims == (4, 4, 8)
    assert s.proj_bytes == (32, 32, 64)
    assert s.local_conv_offsets == ((0, 32), (32, 32), (64, 64))
    assert s.ssm_sizes == (16 * 2 * 4, 2 * 4 * 8 * 2)
    assert all(isinstance(x, int) for x in s.local_proj_dims + s.proj_bytes)
    assert derive_conv_split(kind, (10, 1), (2, 4), 1, "int8", "int8").local_proj_dims == (1, 1, 8)
    for c in (8, 9):
        err = _raises(SpecError, derive_conv_split, kind, (c, 1), (2, 4), 1, "int8", "int8")
        assert err.field == "conv_shape" and err.values == {"value": c, "expected": 8}


def test_derive_conv_split_refusals():
    err = _raises(SpecError, derive_conv_split, "mamba3", (8, 4), (8,), 1, "int8", "int8")
    assert err.field == "mamba_type" and err.values == {"value": "mamba3"}
    err = _raises(SpecError, derive_conv_split, "mamba1", (8, 4), (8,), 0, "int8", "int8")
    assert err.field == "local_tp" and err.values == {"value": 0}
    err = _raises(SpecError, derive_conv_split, "mamba1", (8,), (8,), 1, "int8", "int8")
    assert err.field == "conv_shape" and err.values == {"value": [8]}
    err = _raises(SpecError, derive_conv_split, "mamba1", (8, 0), (8,), 1, "int8", "int8")
    assert err.field == "conv_shape" and err.values == {"value": [8, 0]}
    err = _raises(SpecError, derive_conv_split, "mamba1", (8, 4), (0,), 1, "int8", "int8")
    assert err.field == "temporal_shape"
    err = _raises(SpecError, derive_conv_split, "mamba1", (8, 4), (8,), 1, "nope", "int8")
    assert err.field == "conv_dtype" and err.values == {"value": "nope"}
    err = _raises(SpecError, derive_conv_split, "mamba1", (8, 4), (8,), 1, "int8", "nope")
    assert err.field == "ssm_dtype" and err.values == {"value": "nope"}
    # 1 is a valid dim everywhere
    assert derive_conv_split("mamba1", (1, 1), (1,), 1, "int8", "int8").ssm_sizes == (1, 1)


def test_remote_conv_offsets_head_split():
    # dims (4, 1, 1), rows 2, e 2: local pieces s = (16, 4, 4); remote pieces are tp_ratio times larger
    # tp_ratio 2, offset 1: (0 + 16, 16), (32 + 4, 4), (40 + 4, 4)
    assert remote_conv_offsets((4, 1, 1), 2, 2, 1, 2) == ((16, 16), (36, 4), (44, 4))
    assert remote_conv_offsets((4, 1, 1), 2, 2, 0, 2) == ((0, 16), (32, 4), (40, 4))
    # tp_ratio 1: the local layout itself
    assert remote_conv_offsets((4, 1, 1), 2, 2, 0, 1) == ((0, 16), (16, 4), (20, 4))
    # a zero dim is allowed (a piece of 0 bytes)
    assert remote_conv_offsets((0, 1), 1, 1, 0, 1) == ((0, 0), (0, 1))


def test_remote_conv_offsets_whole_page():
    # tp_ratio -2: pieces s // 2 = (8, 2, 2) at cumulative offsets; the rank offset is ignored
    assert remote_conv_offsets((4, 1, 1), 2, 2, 5, -2) == ((0, 8), (8, 2), (10, 2))
    assert all(isinstance(x, int) for p in remote_conv_offsets((4, 1, 1), 2, 2, 5, -2) for x in p)
    assert remote_conv_offsets((4, 1, 1), 2, 2, 0, -1) == ((0, 16), (16, 4), (20, 4))


def test_remote_conv_offsets_refusals():
    err = _raises(SpecError, remote_conv_offsets, (4,), 2, 2, 2, 2)
    assert err.field == "local_rank_offset" and err.values == {"value": 2, "expected": 2}
    err = _raises(SpecError, remote_conv_offsets, (4,), 2, 2, 1, 1)
    assert err.field == "local_rank_offset" and err.values == {"value": 1, "expected": 1}
    err = _raises(SpecError, remote_conv_offsets, (4,), 2, 2, -1, 2)
    assert err.field == "local_rank_offset" and err.values == {"value": -1}
    for bad in (0, True, 2.0):
        err = _raises(SpecError, remote_conv_offsets, (4,), 2, 2, 0, bad)
        assert err.field == "tp_ratio" and err.values == {"value": bad}
    err = _raises(SpecError, remote_conv_offsets, (4,), 0, 2, 0, 1)
    assert err.field == "conv_rows" and err.values == {"value": 0}
    err = _raises(SpecError, remote_conv_offsets, (4,), 2, 0, 0, 1)
    assert err.field == "conv_dtype_size" and err.values == {"value": 0}
    err = _raises(SpecError, remote_conv_offsets, (4, -1), 2, 2, 0, 1)
    assert err.field == "local_proj_dims" and err.values == {"value": -1}


def test_physical_blocks_per_logical():
    # ceil((64 + 512) / 64) = 9; ceil(577 / 64) = 10
    assert physical_blocks_per_logical((64, 512), 64) == 9
    assert physical_blocks_per_logical((65, 512), 64) == 10
    assert physical_blocks_per_logical((64, 0), 64) == 1
    assert physical_blocks_per_logical((0, 65), 64) == 2
    assert physical_blocks_per_logical((0, 0), 1) == 0
    assert physical_blocks_per_logical((3, 4), 1) == 7
    err = _raises(SpecError, physical_blocks_per_logical, (1, 1), 0)
    assert err.field == "block_len" and err.values == {"value": 0}
    for bad in ((1, 2, 3), (1,), (-1, 4), (4, -1)):
        err = _raises(SpecError, physical_blocks_per_logical, bad, 64)
        assert err.field == "ssm_sizes"
