"""kvgeom.model.presets pinned exactly: ``from_card`` on small hand-written cards, every alias of
every field, each default and each fallback (the card's ``derived`` numbers, 2 x hidden for a Mamba2 head
dim), the SSM dtype rule, and the refusals with their class, field and value. Expected specs are worked
out by hand in the comments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvgeom import presets
from kvgeom.errors import SpecError
from kvgeom.model.layers import AttentionSpec, Layer, LayerKind, MambaSpec, MLASpec, Shard
from kvgeom.model.presets import _get, from_card
from kvgeom.model.spec import ModelSpec


def _card(layers: list[str], derived: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    card: dict[str, Any] = {"name": "org/t", "layers": layers, "fields": fields}
    if derived is not None:
        card["derived"] = derived
    return card


def _spec(layers: list[str], derived: dict[str, Any] | None = None, **fields: Any) -> Any:
    return from_card(_card(layers, derived, **fields)).layers[0].spec


def test_get() -> None:
    assert _get({"a": None, "b": 2}, "a", "b") == 2  # None counts as missing
    assert _get({"a": 1, "b": 2}, "a", "b") == 1
    assert _get({"a": 0}, "a", default=5) == 0
    assert _get({}, "a", "b", default=5) == 5
    assert _get({"a": None}, "a") is None


ATT = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512}


def test_attention() -> None:
    model = from_card(_card(["attention", "mlp", "moe", "attention"], **ATT))
    # 512 / 8 = 64 head dim; layers without a cache are skipped but keep their index
    assert model == ModelSpec(
        "org/t",
        (Layer("layers.0.attn", 0, AttentionSpec(2, 64)), Layer("layers.3.attn", 3, AttentionSpec(2, 64))),
    )
    assert _spec(["attention"], num_attention_heads=8, hidden_size=512) == AttentionSpec(8, 64)  # kv = heads
    assert _spec(["attention"], **ATT, head_dim=128).head_size == 128
    assert _spec(["attention"], **ATT, attention_head_dim=96).head_size == 96
    assert _spec(["attention"], **ATT, attention_head_size=80).head_size == 80
    assert (
        _spec(["attention"], **ATT, head_dim=128, attention_head_dim=96, attention_head_size=80).head_size
        == 128
    )
    assert (
        _spec(["attention"], **ATT, head_dim=None, attention_head_dim=96, attention_head_size=80).head_size
        == 96
    )
    # the card's derived head_dim comes before hidden / heads
    assert _spec(["attention"], {"head_dim": 32}, **ATT).head_size == 32
    assert _spec(["attention"], {"head_dim": 32}, **ATT, head_dim=16).head_size == 16
    assert _spec(["attention"], {"other": 1}, **ATT).head_size == 64
    assert _spec(["attention"], {"head_dim": None}, **ATT).head_size == 64
    assert _spec(["attention"], **ATT, sliding_window=64) == AttentionSpec(2, 64, sliding_window=64)
    card = _card(["attention"], **ATT)
    card["derived"] = None  # a card with an empty derived section
    assert from_card(card).layers[0].spec.head_size == 64


def test_dtypes() -> None:
    assert _spec(["attention"], **ATT).dtype == "bfloat16"
    assert _spec(["attention"], **ATT, torch_dtype="float16").dtype == "float16"
    assert _spec(["attention"], **ATT, dtype="float16").dtype == "float16"
    assert _spec(["attention"], **ATT, torch_dtype="float16", dtype="bfloat16").dtype == "float16"
    assert _spec(["mla"], kv_lora_rank=512, qk_rope_head_dim=64, torch_dtype="float16") == MLASpec(
        576, "float16"
    )
    assert _spec(["mla"], kv_lora_rank=512, qk_rope_head_dim=64) == MLASpec(576)  # 512 + 64


def test_text_config() -> None:
    card = {
        "name": "org/v",
        "layers": ["attention"],
        "fields": {"text_config": {**ATT, "torch_dtype": "float16"}},
    }
    assert from_card(card) == ModelSpec(
        "org/v", (Layer("layers.0.attn", 0, AttentionSpec(2, 64, "float16")),)
    )


MAMBA2_KEYS = [
    ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel"),
    ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"),
    ("n_mamba_heads", "mamba_headdim", "mamba_ngroups", "mamba_d_state", "mamba_d_conv"),
]


def _m2(heads: int, head_dim: int, groups: int, state: int, kernel: int, conv: str, ssm: str) -> MambaSpec:
    """Mamba2 written out: x (heads x head_dim), B and C (groups x state); state per head head_dim x state."""
    return MambaSpec(
        LayerKind.MAMBA2,
        (Shard(heads, head_dim), Shard(groups, state), Shard(groups, state)),
        Shard(heads, head_dim * state),
        kernel,
        conv,
        ssm,
        ("x", "B", "C"),
    )


@pytest.mark.parametrize("keys", MAMBA2_KEYS)
def test_mamba2_every_alias(keys: tuple[str, ...]) -> None:
    fields = dict(zip(keys, (8, 4, 2, 16, 3)))
    assert _spec(["mamba2"], **fields, hidden_size=64) == _m2(8, 4, 2, 16, 3, "bfloat16", "bfloat16")
    no_conv = {k: v for k, v in fields.items() if k != keys[4]}
    assert _spec(["mamba2"], **no_conv, hidden_size=64).conv_kernel == 4
    no_dim = {k: v for k, v in fields.items() if k != keys[1]}
    # no head dim: the card's derived mamba_d_head, else 2 x hidden 64 / 8 heads = 16
    assert _spec(["mamba2"], {"mamba_d_head": 6}, **no_dim, hidden_size=64).conv_pieces[0] == Shard(8, 6)
    assert _spec(["mamba2"], **no_dim, hidden_size=64) == _m2(8, 16, 2, 16, 3, "bfloat16", "bfloat16")
    assert _spec(["mamba2"], {"other": 1}, **no_dim, hidden_size=100).conv_pieces[0] == Shard(
        8, 25
    )  # 200 / 8


def test_mamba2_alias_order() -> None:
    both = {
        "mamba_num_heads": 8,
        "mamba_n_heads": 4,
        "n_mamba_heads": 2,
        "mamba_head_dim": 4,
        "mamba_d_head": 2,
    }
    both |= {"mamba_headdim": 1, "n_groups": 2, "mamba_n_groups": 1, "mamba_ngroups": 4}
    both |= {"ssm_state_size": 16, "mamba_d_state": 8, "conv_kernel": 3, "mamba_d_conv": 2}
    assert _spec(["mamba2"], **both) == _m2(8, 4, 2, 16, 3, "bfloat16", "bfloat16")


def test_ssm_dtype_rule() -> None:
    m2 = {"mamba_num_heads": 8, "mamba_head_dim": 4, "n_groups": 2, "ssm_state_size": 16}
    # NemotronH: a float32 temporal state unless the card says otherwise; the conv state: the model dtype
    assert _spec(["mamba2"], **m2, model_type="nemotron_h").ssm_dtype == "float32"
    assert (
        _spec(["mamba2"], **m2, model_type="nemotron_h", mamba_ssm_cache_dtype="bfloat16").ssm_dtype
        == "bfloat16"
    )
    other = _spec(["mamba2"], **m2, model_type="zamba2", torch_dtype="float16")
    assert (other.conv_dtype, other.ssm_dtype) == ("float16", "float16")
    assert _spec(["mamba2"], **m2, mamba_ssm_dtype="float32").ssm_dtype == "float32"
    s = _spec(["mamba2"], **m2, mamba_ssm_cache_dtype="float16", mamba_ssm_dtype="float32")
    assert (s.conv_dtype, s.ssm_dtype) == ("bfloat16", "float16")


def test_mamba1() -> None:
    fields = {"mamba_expand": 2, "hidden_size": 32, "mamba_d_state": 16, "mamba_d_conv": 3}
    # inner = 2 x 32 = 64 channels, each a 16-element state
    assert _spec(["mamba1"], **fields, torch_dtype="float16", mamba_ssm_dtype="float32") == MambaSpec(
        LayerKind.MAMBA1, (Shard(64, 1),), Shard(64, 16), 3, "float16", "float32", ("x",)
    )
    assert _spec(["mamba1"], **{**fields, "mamba_expand": 3}).temporal == Shard(96, 16)


def test_gdn() -> None:
    fields = {
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 8,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 3,
    }
    # Q, K: 2 key heads x 8; V: 4 value heads x 16; state per value head 16 x 8 = 128
    assert _spec(["gdn"], **fields, torch_dtype="float16", mamba_ssm_dtype="float32") == MambaSpec(
        LayerKind.GDN,
        (Shard(2, 8), Shard(2, 8), Shard(4, 16)),
        Shard(4, 128),
        3,
        "float16",
        "float32",
        ("Q", "K", "V"),
    )


def test_kda() -> None:
    lac = {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 3}
    s = Shard(2, 8)
    # KDA keeps a float32 state whatever the card's SSM dtype fields say
    assert _spec(
        ["kda"], linear_attn_config=lac, torch_dtype="float16", mamba_ssm_dtype="bfloat16"
    ) == MambaSpec(LayerKind.KDA, (s, s, s), Shard(2, 64), 3, "float16", "float32", ("Q", "K", "V"))


def test_hybrid_layers_and_names() -> None:
    fields = {
        **ATT,
        "kv_lora_rank": 8,
        "qk_rope_head_dim": 4,
        "mamba_expand": 2,
        "mamba_d_state": 4,
        "mamba_d_conv": 2,
    }
    model = from_card(_card(["attention+mamba1", "mla", "moe"], **fields))
    assert [(la.name, la.index, la.kind) for la in model.layers] == [
        ("layers.0.attn", 0, LayerKind.ATTENTION),
        ("layers.0.mamba", 0, LayerKind.MAMBA1),
        ("layers.1.attn", 1, LayerKind.MLA),
    ]
    assert model.name == "org/t"


def test_unknown_layer_kind() -> None:
    with pytest.raises(SpecError) as info:
        from_card(_card(["attention", "lightning"], **ATT))
    assert type(info.value) is SpecError
    assert info.value.field == "layers[1]" and info.value.values == {"value": "lightning"}
    with pytest.raises(SpecError) as info:
        from_card(_card(["mlp", "attention+conv"], **ATT))
    assert info.value.field == "layers[1]" and info.value.values == {"value": "conv"}


def test_names_and_load() -> None:
    here = Path(presets.__file__).parent
    assert presets.names() == sorted(p.name[: -len(".json")] for p in here.glob("*.json"))
    assert "qwen3-8b" in presets.names() and len(presets.names()) == 21
    with pytest.raises(SpecError) as info:
        presets.load("qwen3-9b")
    assert type(info.value) is SpecError
    assert info.value.field == "model" and info.value.values == {"value": "qwen3-9b"}


# Each preset builder against the card's own config numbers, written out by hand (bytes are checked by
# tests/unit/test_independent_sizes.py; here the spec values the byte totals can hide).
def test_preset_specs_by_hand() -> None:
    jamba = presets.load("jamba-v0.1").ssm_spec  # expand 2 x hidden 4096, state 16, conv 4
    assert jamba == MambaSpec.mamba1(8192, 16, 4, "bfloat16", "bfloat16")
    granite = presets.load("granite-4.0-h-small").ssm_spec  # no head dim: the card's derived mamba_d_head
    assert granite == MambaSpec.mamba2(128, 64, 1, 128, 4)  # derived 64 = 2 x hidden 4096 / 128 heads
    kimi = presets.load("kimi-linear-48b-a3b")
    assert kimi.ssm_spec == MambaSpec.kda(32, 128, 4, "bfloat16", "float32")
    assert kimi.layers[3].spec == MLASpec(512 + 64)
    nemo = presets.load("nemotron-h-8b").ssm_spec  # 128 heads x 64, 8 groups x 128, conv 4, float32 state
    assert nemo == MambaSpec.mamba2(128, 64, 8, 128, 4, "bfloat16", "float32")


def test_fallback_head_dims_floor() -> None:
    """The fallbacks divide with floor division, seen in the value a refusal reports for a negative size."""
    with pytest.raises(SpecError) as info:
        from_card(_card(["attention"], num_attention_heads=2, hidden_size=-7))
    assert info.value.field == "head_size" and info.value.values == {"value": -4}  # -7 // 2
    with pytest.raises(SpecError) as info:
        from_card(_card(["mamba2"], mamba_num_heads=4, n_groups=1, ssm_state_size=2, hidden_size=-3))
    assert info.value.field == "unit_elems" and info.value.values == {"value": -2}  # 2 x -3 // 4


def test_ssm_layer_names_and_cacheless_parts() -> None:
    m2 = {"mamba_num_heads": 8, "mamba_head_dim": 4, "n_groups": 2, "ssm_state_size": 16}
    gdn = {"linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_num_value_heads": 4}
    gdn |= {"linear_value_head_dim": 16, "linear_conv_kernel_dim": 3}
    kda = {"linear_attn_config": {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 3}}
    for kind, fields in (("mamba2", m2), ("gdn", gdn), ("kda", kda)):
        model = from_card(_card(["mlp", kind], **fields))
        assert [(la.name, la.index) for la in model.layers] == [("layers.1.mamba", 1)], kind
    # a part without a cache is skipped alone: the layer's other parts still count
    model = from_card(_card(["moe+attention", "mlp+attention"], **ATT))
    assert [la.name for la in model.layers] == ["layers.0.attn", "layers.1.attn"]
