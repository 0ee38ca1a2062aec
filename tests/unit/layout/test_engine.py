"""kvgeom.layout.engine.EngineConfig pinned exactly: each check at its boundary with the exact error
class, field and values, each derived number on small values worked out by hand, the JSON form key by key."""

from __future__ import annotations

from typing import Any

import pytest

from kvgeom import ConfigError, EngineConfig
from kvgeom.layout.engine import ConvLayout, KVLayout


def _refused(field: str, value: Any, expected: Any = None, **kwargs: Any) -> None:
    args = {"tp_size": 4, "block_size": 16, "num_blocks": 8, **kwargs}
    with pytest.raises(ConfigError) as info:
        EngineConfig(**args)
    err = info.value
    assert type(err) is ConfigError
    assert err.field == field, str(err)
    want = {"value": value} if expected is None else {"value": value, "expected": expected}
    assert err.values == want, err.values


@pytest.mark.parametrize("name", ["tp_size", "block_size", "num_blocks"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_positive_integers(name: str, bad: Any) -> None:
    _refused(name, bad, **{name: bad})


def test_smallest_engine_and_defaults() -> None:
    e = EngineConfig(1, 1, 1)
    assert (e.tp_rank, e.kernel_block_size, e.kv_layout, e.kv_split, e.conv_layout) == (
        0,
        1,
        KVLayout.HEAD_MAJOR,
        False,
        ConvLayout.DS,
    )
    assert (e.dcp_size, e.pp_size, e.pp_rank, e.packed_rows, e.separate_group) == (1, 1, 0, False, ())


def test_tp_rank_range() -> None:
    assert EngineConfig(4, 16, 8, tp_rank=3).tp_rank == 3
    _refused("tp_rank", 4, 4, tp_rank=4)
    _refused("tp_rank", -1, 4, tp_rank=-1)


def test_kernel_block_size() -> None:
    assert EngineConfig(4, 16, 8).kernel_block_size == 16  # default: the logical block
    assert EngineConfig(4, 16, 8, kernel_block_size=1).kernel_block_size == 1
    assert EngineConfig(4, 16, 8, kernel_block_size=16).kernel_block_size == 16
    for bad in (0, -4, 3, 32, "4", 4.0):
        _refused("kernel_block_size", bad, 16, kernel_block_size=bad)


def test_dcp_pp_packed_separate() -> None:
    assert EngineConfig(4, 16, 8, dcp_size=4).dcp_size == 4
    _refused("dcp_size", 2, 4, dcp_size=2)
    _refused("dcp_size", 0, 4, dcp_size=0)
    assert EngineConfig(4, 16, 8, pp_size=2, pp_rank=1).pp_rank == 1
    for bad in (0, -1, True, "2", 2.0):
        _refused("pp_size", bad, pp_size=bad)
    _refused("pp_rank", 2, 2, pp_size=2, pp_rank=2)
    _refused("pp_rank", -1, 2, pp_size=2, pp_rank=-1)
    _refused("pp_rank", "0", 2, pp_size=2, pp_rank="0")
    _refused("pp_rank", 1, 1, pp_rank=1)
    assert EngineConfig(4, 16, 8, packed_rows=True).packed_rows is True
    _refused("packed_rows", 1, packed_rows=1)
    _refused("packed_rows", None, packed_rows=None)
    e = EngineConfig(4, 16, 8, separate_group=["a", "b"])  # type: ignore[arg-type]
    assert e.separate_group == ("a", "b")
    _refused("separate_group", "ab", separate_group="ab")
    _refused("separate_group", ["a", 1], separate_group=["a", 1])
    _refused("separate_group", (1,), separate_group=(1,))


def test_layouts_by_name() -> None:
    e = EngineConfig(4, 16, 8, kv_layout="token_major", conv_layout="SD")  # type: ignore[arg-type]
    assert e.kv_layout is KVLayout.TOKEN_MAJOR and e.conv_layout is ConvLayout.SD
    assert [m.value for m in KVLayout] == ["head_major", "token_major", "head_kv_major"]
    assert [m.value for m in ConvLayout] == ["DS", "SD"]
    _refused("kv_layout", "HND", kv_layout="HND")
    _refused("conv_layout", "ds", conv_layout="ds")
    _refused("kv_layout", ConvLayout.DS, kv_layout=ConvLayout.DS)


def test_derived_numbers() -> None:
    e = EngineConfig(4, 16, 8, tp_rank=3, kernel_block_size=4, dcp_size=4, pp_size=2, pp_rank=1)
    assert e.kernel == 4
    assert e.ppl == 4  # 16 / 4
    assert e.scheduler_block == 64  # 16 x 4 DCP ranks
    assert e.dcp_rank == 3  # 3 % 4
    assert e.global_rank == 7  # 1 x 4 + 3
    assert e.world_size == 8  # 2 x 4
    plain = EngineConfig(4, 16, 8, tp_rank=3)
    assert (plain.kernel, plain.ppl, plain.scheduler_block, plain.dcp_rank, plain.global_rank) == (
        16,
        1,
        16,
        0,
        3,
    )
    assert plain.world_size == 4


def test_with_rank() -> None:
    e = EngineConfig(4, 16, 8, tp_rank=1, kernel_block_size=8, pp_size=2, pp_rank=1, kv_split=True)
    other = e.with_rank(2)
    assert other == EngineConfig(
        4, 16, 8, tp_rank=2, kernel_block_size=8, pp_size=2, pp_rank=1, kv_split=True
    )
    assert e.with_rank(3, 0) == EngineConfig(
        4, 16, 8, tp_rank=3, kernel_block_size=8, pp_size=2, pp_rank=0, kv_split=True
    )
    assert e.with_rank(0, pp_rank=1).pp_rank == 1


def test_same_but_rank_is_with_rank_equality() -> None:
    e = EngineConfig(4, 16, 8, tp_rank=1, kernel_block_size=8, pp_size=2, pp_rank=1, kv_split=True)
    others = [
        e.with_rank(2),
        e.with_rank(3, 0),
        EngineConfig(4, 16, 8, tp_rank=1, kernel_block_size=8, pp_size=2, pp_rank=1),  # kv_split differs
        EngineConfig(4, 16, 9, tp_rank=1, kernel_block_size=8, pp_size=2, pp_rank=1, kv_split=True),
    ]
    assert [e.same_but_rank(o) for o in others] == [True, True, False, False]
    assert [e.same_but_rank(o) for o in others] == [o.with_rank(e.tp_rank, e.pp_rank) == e for o in others]


def test_json_form() -> None:
    e = EngineConfig(2, 16, 8)
    assert e.to_json() == {
        "tp_size": 2,
        "block_size": 16,
        "num_blocks": 8,
        "tp_rank": 0,
        "kernel_block_size": 16,
        "kv_layout": "head_major",
        "kv_split": False,
        "conv_layout": "DS",
    }
    full = EngineConfig(
        2,
        16,
        8,
        tp_rank=1,
        kernel_block_size=4,
        kv_layout=KVLayout.TOKEN_MAJOR,
        kv_split=True,
        conv_layout=ConvLayout.SD,
        dcp_size=2,
        pp_size=3,
        pp_rank=2,
        packed_rows=True,
        separate_group=("a",),
    )
    d = full.to_json()
    assert d == {
        "tp_size": 2,
        "block_size": 16,
        "num_blocks": 8,
        "tp_rank": 1,
        "kernel_block_size": 4,
        "kv_layout": "token_major",
        "kv_split": True,
        "conv_layout": "SD",
        "dcp_size": 2,
        "pp_size": 3,
        "pp_rank": 2,
        "packed_rows": True,
        "separate_group": ["a"],
    }
    assert EngineConfig.from_json(d) == full and EngineConfig.from_json(e.to_json()) == e
    # each optional key alone
    assert EngineConfig(2, 16, 8, pp_size=2).to_json()["pp_size"] == 2
    assert "pp_rank" not in EngineConfig(2, 16, 8, pp_size=2).to_json()
    assert EngineConfig(2, 16, 8, pp_size=2, pp_rank=1).to_json()["pp_rank"] == 1


def test_from_json_refusals() -> None:
    for bad in ([1], "x", None):
        with pytest.raises(ConfigError) as info:
            EngineConfig.from_json(bad)  # type: ignore[arg-type]
        assert type(info.value) is ConfigError
        assert info.value.field == "engine" and info.value.values == {"value": bad}
    for d in ({"tp_size": 2, "block_size": 16}, {"tp_size": 2, "block_size": 16, "num_blocks": 8, "x": 1}):
        with pytest.raises(ConfigError) as info:
            EngineConfig.from_json(d)
        assert type(info.value) is ConfigError
        assert info.value.field == "engine" and info.value.values == {"value": d}


def test_ranks_and_kernel_refuse_booleans_and_non_integers() -> None:
    """Regression: a boolean kernel block or rank used to pass as 1 / 0, and a string tp_rank raised a raw
    TypeError from the range comparison."""
    _refused("tp_rank", True, 4, tp_rank=True)
    _refused("tp_rank", False, 4, tp_rank=False)
    _refused("tp_rank", "1", 4, tp_rank="1")
    _refused("tp_rank", 1.0, 4, tp_rank=1.0)
    _refused("kernel_block_size", True, 16, kernel_block_size=True)
    _refused("pp_rank", True, 2, pp_size=2, pp_rank=True)
    _refused("pp_rank", False, 2, pp_size=2, pp_rank=False)


def test_packed_rows_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig(tp_size=1, block_size=4, num_blocks=4, packed_rows="yes")  # type: ignore[arg-type]
    assert err.value.field == "packed_rows" and err.value.values == {"value": "yes"}
