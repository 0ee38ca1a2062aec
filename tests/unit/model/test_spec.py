"""kvgeom.model.spec and kvgeom.dtypes pinned exactly: the sharding rule at its boundaries, every
size formula on small numbers worked out by hand, every refusal's class, field and values, and the JSON
form key by key."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgeom.dtypes import DTYPE_BYTES, dtype_size
from kvgeom.errors import SpecError
from kvgeom.model.layers import AttentionSpec, Layer, LayerKind, MambaSpec, MLASpec, Shard
from kvgeom.model.spec import ModelSpec


def _raises(fn: Any, *args: Any, **kwargs: Any) -> SpecError:
    with pytest.raises(SpecError) as info:
        fn(*args, **kwargs)
    assert type(info.value) is SpecError
    return info.value


# -- dtypes ------------------------------------------------------------------------------------------
def test_dtype_sizes() -> None:
    assert DTYPE_BYTES == {
        "float32": 4,
        "float": 4,
        "bfloat16": 2,
        "float16": 2,
        "half": 2,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "fp8": 1,
        "fp8_e4m3": 1,
        "fp8_e5m2": 1,
        "int8": 1,
        "uint8": 1,
    }
    assert dtype_size("torch.float32") == 4 and dtype_size("half") == 2
    err = _raises(dtype_size, "torch.float12")
    assert err.field == "dtype" and err.values == {"value": "torch.float12"}
    err = _raises(dtype_size, "float12", "conv_dtype")
    assert err.field == "conv_dtype" and err.values == {"value": "float12"}


# -- layer kinds and shards --------------------------------------------------------------------------
def test_layer_kinds() -> None:
    assert [k.value for k in LayerKind] == [
        "attention",
        "sliding_window",
        "mla",
        "mamba1",
        "mamba2",
        "gdn",
        "kda",
        "circular_buffer",
        "replicated_state",
    ]
    # a replicated state page is a state (one slot per request); a ring is not, but is one block too
    assert [k.is_ssm for k in LayerKind] == [False, False, False, True, True, True, True, False, True]
    assert [k.one_block for k in LayerKind] == [False, False, False, True, True, True, True, True, True]
    assert LayerKind.parse("gdn") is LayerKind.GDN
    err = _raises(LayerKind.parse, "conv")
    assert err.field == "kind" and err.values == {"value": "conv"}
    err = _raises(LayerKind.parse, "conv", "layers[2].kind")
    assert err.field == "layers[2].kind"


@pytest.mark.parametrize(("units", "elems"), [(0, 1), (1, 0), (-1, 1), (True, 1), (2.0, 1), (1, "2")])
def test_shard_refuses_non_positive_integers(units: Any, elems: Any) -> None:
    err = _raises(Shard, units, elems)
    bad = (
        ("units", units)
        if not (isinstance(units, int) and not isinstance(units, bool) and units > 0)
        else None
    )
    field, value = bad or ("unit_elems", elems)
    assert err.field == field and err.values == {"value": value}


def test_shard_rule() -> None:
    s = Shard(1, 1)  # the smallest shard is valid
    assert (s.units, s.unit_elems) == (1, 1)
    eight = Shard(8, 3)
    # a rank of TP t holds max(1, 8 // t) units, from unit rank * 8 // t
    assert [eight.units_per_rank(t) for t in (1, 2, 8, 16)] == [8, 4, 1, 1]
    assert [eight.first_unit(r, 4) for r in range(4)] == [0, 2, 4, 6]
    assert [eight.first_unit(r, 16) for r in (0, 1, 2, 15)] == [0, 0, 1, 7]  # replicated: 2 ranks per unit
    assert eight.elems_per_rank(2) == 12 and eight.elems_per_rank(16) == 3
    assert [eight.replicated(t) for t in (4, 8, 16)] == [False, False, True]
    for tp in (1, 2, 8, 16, 32):  # one divides the other
        eight.check_tp(tp, "x")
    for tp in (3, 6, 12):
        err = _raises(eight.check_tp, tp, "conv piece B")
        assert err.field == "conv piece B" and err.values == {"units": 8, "tp": tp}


# -- attention and MLA -------------------------------------------------------------------------------
def test_attention_spec() -> None:
    a = AttentionSpec(4, 8)
    assert (a.dtype, a.head_size_v, a.sliding_window) == ("bfloat16", None, None)
    assert a.kind is LayerKind.ATTENTION and a.v_size == 8 and a.heads == Shard(4, 1)
    assert AttentionSpec(4, 8, sliding_window=1).kind is LayerKind.SLIDING_WINDOW
    # heads per rank x (K 8 + V 16) elements x 4 bytes
    b = AttentionSpec(4, 8, "float32", head_size_v=16)
    assert b.v_size == 16
    assert [b.heads_per_rank(t) for t in (1, 2, 8)] == [4, 2, 1]
    assert [b.token_bytes(t) for t in (1, 2, 8)] == [4 * 24 * 4, 2 * 24 * 4, 24 * 4]
    assert AttentionSpec(2, 8, "fp8").token_bytes(1) == 2 * 16


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"num_kv_heads": 0}, "num_kv_heads", 0),
        ({"head_size": 0}, "head_size", 0),
        ({"head_size_v": 0}, "head_size_v", 0),
        ({"sliding_window": 0}, "sliding_window", 0),
        ({"sliding_window": True}, "sliding_window", True),
        ({"dtype": "float12"}, "dtype", "float12"),
    ],
)
def test_attention_spec_refusals(kwargs: dict[str, Any], field: str, value: Any) -> None:
    err = _raises(AttentionSpec, **{"num_kv_heads": 4, "head_size": 8, **kwargs})
    assert err.field == field and err.values == {"value": value}


def test_mla_spec() -> None:
    m = MLASpec(10)
    assert (m.dtype, m.sliding_window, m.kind) == ("bfloat16", None, LayerKind.MLA)
    assert MLASpec(10, "float32").token_bytes(4) == 40  # the same latent on every rank
    assert _raises(MLASpec, 0).values == {"value": 0}
    err = _raises(MLASpec, 10, "float12")
    assert err.field == "dtype" and err.values == {"value": "float12"}


# -- SSM states --------------------------------------------------------------------------------------
def test_mamba_constructors_defaults() -> None:
    m1 = MambaSpec.mamba1(6, 5)
    assert m1 == MambaSpec(LayerKind.MAMBA1, (Shard(6, 1),), Shard(6, 5), 4, "bfloat16", "bfloat16", ("x",))
    assert MambaSpec.mamba1(6, 5, 3, "float16").ssm_dtype == "float16"  # ssm dtype follows the conv dtype
    assert MambaSpec.mamba1(6, 5, 3, "float16", "float32").ssm_dtype == "float32"
    m2 = MambaSpec.mamba2(4, 3, 2, 5)
    assert m2 == MambaSpec(
        LayerKind.MAMBA2,
        (Shard(4, 3), Shard(2, 5), Shard(2, 5)),
        Shard(4, 15),
        4,
        "bfloat16",
        "bfloat16",
        ("x", "B", "C"),
    )
    assert MambaSpec.mamba2(4, 3, 2, 5, 2, "float16").ssm_dtype == "float16"
    g = MambaSpec.gdn(2, 3, 4, 5)
    assert g == MambaSpec(
        LayerKind.GDN,
        (Shard(2, 3), Shard(2, 3), Shard(4, 5)),
        Shard(4, 15),
        4,
        "bfloat16",
        "bfloat16",
        ("Q", "K", "V"),
    )
    assert MambaSpec.gdn(2, 3, 4, 5, 2, "float16").ssm_dtype == "float16"
    k = MambaSpec.kda(2, 3)
    s = Shard(2, 3)
    assert k == MambaSpec(LayerKind.KDA, (s, s, s), Shard(2, 9), 4, "bfloat16", "float32", ("Q", "K", "V"))


def test_mamba_sizes() -> None:
    # Mamba2: 8 heads x 4, 2 groups x 16 state, kernel 3 (2 rows), float16 conv, float32 state
    m = MambaSpec.mamba2(8, 4, 2, 16, 3, "float16", "float32")
    assert m.conv_rows == 2
    assert m.piece_channels(1) == (32, 32, 32)
    assert m.piece_channels(2) == (16, 16, 16)
    assert m.piece_channels(4) == (8, 16, 16)  # B and C: 1 group per rank, replicated
    assert m.conv_shape(4) == (40, 2)
    assert m.piece_bytes(4) == (8 * 2 * 2, 16 * 2 * 2, 16 * 2 * 2)
    assert m.conv_bytes(4) == 32 + 64 + 64
    assert m.ssm_bytes(4) == 2 * 64 * 4  # 2 heads x 4 x 16 elements, 4 bytes
    assert m.state_bytes(4) == 160 + 512
    assert m.replicated_pieces(2) == (False, False, False)
    assert m.replicated_pieces(4) == (False, True, True)
    m.check_tp(8)
    err = _raises(m.check_tp, 3)
    assert err.field == "conv piece x" and err.values == {"units": 8, "tp": 3}
    odd = MambaSpec(LayerKind.MAMBA2, (Shard(4, 1), Shard(3, 1)), Shard(4, 1), 2, piece_names=("a", "b"))
    err = _raises(odd.check_tp, 2)
    assert err.field == "conv piece b" and err.values == {"units": 3, "tp": 2}
    temporal = MambaSpec(LayerKind.MAMBA2, (Shard(4, 1),), Shard(3, 1), 2)
    err = _raises(temporal.check_tp, 2)
    assert err.field == "temporal state" and err.values == {"units": 3, "tp": 2}


def test_mamba_post_init() -> None:
    m = MambaSpec("gdn", (Shard(2, 1), Shard(3, 1)), Shard(2, 1), 2)  # a kind by name; kernel 2 is the least
    assert m.kind is LayerKind.GDN and m.piece_names == ("conv0", "conv1")
    assert (m.conv_dtype, m.ssm_dtype) == ("bfloat16", "bfloat16")
    err = _raises(MambaSpec, LayerKind.ATTENTION, (Shard(2, 1),), Shard(2, 1), 2)
    assert err.field == "kind" and err.values == {"value": "attention"}
    err = _raises(MambaSpec, "conv", (Shard(2, 1),), Shard(2, 1), 2)
    assert err.field == "kind" and err.values == {"value": "conv"}
    err = _raises(MambaSpec, "mamba1", (), Shard(2, 1), 2)
    assert err.field == "conv_pieces" and err.values == {"value": ()}
    err = _raises(MambaSpec, "mamba1", (Shard(2, 1),), Shard(2, 1), 1)
    assert err.field == "conv_kernel" and err.values == {"value": 1}
    err = _raises(MambaSpec, "mamba1", (Shard(2, 1),), Shard(2, 1), 2, "float12")
    assert err.field == "conv_dtype" and err.values == {"value": "float12"}
    err = _raises(MambaSpec, "mamba1", (Shard(2, 1),), Shard(2, 1), 2, "float16", "float12")
    assert err.field == "ssm_dtype" and err.values == {"value": "float12"}
    err = _raises(MambaSpec, "mamba1", (Shard(2, 1),), Shard(2, 1), 2, piece_names=("a", "b"))
    assert err.field == "piece_names" and err.values == {"value": 2, "expected": 1}


# -- layers and models -------------------------------------------------------------------------------
SSM = MambaSpec.mamba2(8, 4, 2, 16, 3)
ATTN = AttentionSpec(4, 8)
MLA = MLASpec(10)


def test_model_spec_from_layers_and_properties() -> None:
    m = ModelSpec.from_layers("m", [None, SSM, ATTN, None, MLA, None])
    assert m.layers == (
        Layer("layers.1.mamba", 1, SSM),
        Layer("layers.2.attn", 2, ATTN),
        Layer("layers.4.attn", 4, MLA),
    )
    assert m.layers[0].kind is LayerKind.MAMBA2
    assert m.num_hidden_layers == 5  # highest cache-holding index 4, + 1
    assert m.kinds == {LayerKind.MAMBA2, LayerKind.ATTENTION, LayerKind.MLA}
    assert m.has_ssm and m.is_mla and m.ssm_spec is SSM and m.attention_spec is ATTN and m.num_kv_heads == 4
    plain = ModelSpec.from_layers("p", [MLA])
    assert not plain.has_ssm and plain.ssm_spec is None and plain.attention_spec is None
    assert plain.num_kv_heads == 1 and plain.num_hidden_layers == 1
    assert not ModelSpec.from_layers("a", [ATTN]).is_mla
    ssm_only = ModelSpec.from_layers("s", [SSM, SSM])
    assert ssm_only.has_ssm and ssm_only.num_kv_heads == 1 and ssm_only.attention_spec is None
    # the first attention / SSM layer in order
    two = ModelSpec("t", (Layer("a", 0, MLA), Layer("b", 1, ATTN), Layer("c", 2, AttentionSpec(2, 8))))
    assert two.attention_spec is ATTN


def test_model_spec_refusals() -> None:
    err = _raises(ModelSpec, "m", ())
    assert err.field == "layers" and err.values == {"value": 0}
    err = _raises(ModelSpec, "m", (Layer("a", 0, ATTN), Layer("a", 1, ATTN)))
    assert err.field == "layers" and err.values == {"value": ["a", "a"]}
    other = MambaSpec.mamba2(8, 4, 2, 16, 4)
    err = _raises(ModelSpec, "m", (Layer("a", 0, SSM), Layer("b", 1, other)))
    assert err.field == "layers" and err.values == {"value": 2}
    ModelSpec("m", (Layer("a", 0, SSM), Layer("b", 1, MambaSpec.mamba2(8, 4, 2, 16, 3))))  # equal specs


def test_json_form_key_by_key() -> None:
    m = ModelSpec("m", (Layer("l0", 0, SSM), Layer("l1", 3, AttentionSpec(4, 8, "fp8", 16, 32))))
    d = m.to_json()
    assert d == {
        "name": "m",
        "layers": [
            {
                "name": "l0",
                "index": 0,
                "spec": {
                    "kind": "mamba2",
                    "conv_pieces": [[8, 4], [2, 16], [2, 16]],
                    "temporal": [8, 64],
                    "conv_kernel": 3,
                    "conv_dtype": "bfloat16",
                    "ssm_dtype": "bfloat16",
                    "piece_names": ["x", "B", "C"],
                },
            },
            {
                "name": "l1",
                "index": 3,
                "spec": {
                    "kind": "sliding_window",
                    "num_kv_heads": 4,
                    "head_size": 8,
                    "dtype": "fp8",
                    "head_size_v": 16,
                    "sliding_window": 32,
                },
            },
        ],
    }
    assert ModelSpec.from_json(json.loads(json.dumps(d))) == m
    assert m.dumps() == json.dumps(d, sort_keys=True, separators=(",", ":"))
    assert m.dumps().startswith('{"layers":[{"index":0,"name":"l0","spec":{"conv_dtype":"bfloat16"')
    mla = ModelSpec("x", (Layer("l", 0, MLA),)).to_json()["layers"][0]["spec"]
    assert mla == {"kind": "mla", "latent_size": 10, "dtype": "bfloat16", "sliding_window": None}
    # piece_names may be left out: the defaults conv0.. apply; a missing name reads as ""
    spec = dict(d["layers"][0]["spec"])
    del spec["piece_names"]
    back = ModelSpec.from_json({"layers": [{"name": "a", "index": 0, "spec": spec}]})
    assert back.name == "" and back.ssm_spec.piece_names == ("conv0", "conv1", "conv2")
    assert back.layers[0].index == 0 and isinstance(back.layers[0].index, int)


def test_from_json_refusals() -> None:
    err = _raises(ModelSpec.from_json, [1])
    assert err.field == "model" and err.values == {"value": "list"}
    err = _raises(ModelSpec.from_json, {"name": "m"})
    assert err.field == "model" and err.values == {"value": "dict"}
    la: dict[str, Any] = {"name": "a", "spec": {"kind": "mla", "latent_size": 4}}
    err = _raises(ModelSpec.from_json, {"layers": [la]})
    assert err.field == "layers[0]" and err.values == {"value": la}
    ok = {"name": "a", "index": 0, "spec": {"kind": "mla", "latent_size": 4}}
    for spec, field in (
        ([1], "layers[1]"),
        ({"latent_size": 4}, "layers[1]"),
        ({"kind": "conv"}, "layers[1].kind"),
        ({"kind": "mla", "latent": 4}, "layers[1]"),
        ({"kind": "attention", "num_kv_heads": 4}, "layers[1]"),
        ({"kind": "gdn", "conv_pieces": [[1, 2, 3]], "temporal": [1, 1], "conv_kernel": 2}, "layers[1]"),
    ):
        bad = {"name": "b", "index": 1, "spec": spec}
        err = _raises(ModelSpec.from_json, {"layers": [ok, bad]})
        assert err.field == field, (spec, err.field)
        if field == "layers[1]":
            assert err.values == {"value": spec}
    err = _raises(ModelSpec.from_json, {"layers": [{"name": "a", "index": 0, "spec": {"kind": "mla"}}]})
    assert err.field == "layers[0]"
    got = ModelSpec.from_json(
        {
            "layers": [
                ok,
                {"name": 5, "index": "2", "spec": {"kind": "attention", "num_kv_heads": 1, "head_size": 2}},
            ]
        }
    )
    assert got.layers[1] == Layer("5", 2, AttentionSpec(1, 2))


def test_units_per_rank_is_whole_units() -> None:
    # 8 units over TP 3: 8 // 3 = 2 whole units per rank (the rule refuses such a TP elsewhere)
    assert Shard(8, 3).units_per_rank(3) == 2 and type(Shard(8, 3).units_per_rank(2)) is int
    assert Shard(8, 3).elems_per_rank(3) == 6


def test_field_names_of_small_specs() -> None:
    err = _raises(MLASpec, 0)
    assert err.field == "latent_size" and err.values == {"value": 0}
    assert ModelSpec.from_layers("named", [MLA]).name == "named"
