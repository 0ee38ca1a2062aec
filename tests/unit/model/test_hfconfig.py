"""The Hugging Face config reader: every shipped card's config.json gives the preset's spec, agrees with
the numbers the cards' authors computed by hand, follows vLLM's cache-dtype rules and block-size
derivation, and names the field at fault in a broken config."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvgeom import EngineConfig, KvgeomError, presets
from kvgeom.errors import SpecError, UnsupportedError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.geometry import align_hybrid_block_size
from kvgeom.model.hfconfig import (
    KV_CACHE_DTYPES,
    SSM_CACHE_DTYPES,
    apply_cache_dtypes,
    layer_kinds,
    load_config,
    model_types,
    read_config,
)
from kvgeom.model.hffamilies import ConfigFields
from kvgeom.model.layers import AttentionSpec, Layer, LayerKind, MambaSpec, MLASpec, Shard
from kvgeom.model.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[3]
HF = ROOT / "tests" / "data" / "hf"
CARDS = {
    p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "kvgeom" / "model" / "presets").glob("*.json"))
}
SUPPORTED = [n for n in CARDS if n != "minimax-text-01"]


def _config(name: str) -> dict[str, Any]:
    return json.loads((HF / name / "config.json").read_text())


def test_fixtures_are_the_cards_fields() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("rebuild", HF / "rebuild.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert sorted(p.name for p in HF.iterdir() if p.is_dir()) == sorted(CARDS)
    for name, card in CARDS.items():
        assert _config(name) == mod.fixture(card), name


@pytest.mark.parametrize("name", SUPPORTED)
def test_reader_gives_the_presets_spec(name: str) -> None:
    preset = presets.load(name)
    ssm = preset.ssm_spec
    # The presets follow vLLM's "auto" SSM dtype rule as the reader does (tests/unit/test_independent_sizes.py).
    spec = read_config(HF / name / "config.json", mamba_ssm_cache_dtype=ssm.ssm_dtype if ssm else "auto")
    assert spec == preset
    assert spec.name == CARDS[name]["name"]  # from _name_or_path


@pytest.mark.parametrize("name", list(CARDS))
def test_layer_pattern_matches_the_cards_layer_list(name: str) -> None:
    expected = ["" if k in ("mlp", "moe") else k for k in CARDS[name]["layers"]]
    if name == "minimax-text-01":
        with pytest.raises(UnsupportedError) as exc:
            layer_kinds(_config(name))
        assert exc.value.field == "attn_type_list" and exc.value.values == {"value": "minimax_text_01"}
        assert exc.value.field == "attn_type_list"
        return
    assert layer_kinds(_config(name)) == expected


def _attention_indices(spec: Any) -> list[int]:
    return sorted({la.index for la in spec.layers if not la.kind.is_ssm})


@pytest.mark.parametrize("name", SUPPORTED)
def test_reader_agrees_with_the_cards_hand_computed_numbers(name: str) -> None:
    """Each card's ``derived`` block was computed by hand from its fields (not by kvgeom)."""
    derived = CARDS[name].get("derived") or {}
    spec = read_config(_config(name))
    ssm, attn = spec.ssm_spec, spec.attention_spec
    checked = 0
    for key, value in derived.items():
        if key in ("attention_layer_indices", "mla_layer_indices_0based"):
            assert _attention_indices(spec) == value
        elif key in ("mamba_conv_channels", "gdn_conv_channels"):
            assert sum(ssm.piece_channels(1)) == value
        elif key == "kda_conv_channels_each_of_q_k_v":
            assert ssm.piece_channels(1) == (value, value, value)
        elif key in (
            "mamba_ssm_state_elems_per_layer",
            "gdn_recurrent_state_elems_per_layer",
            "kda_recurrent_state_elems_per_layer",
        ):
            assert ssm.temporal.units * ssm.temporal.unit_elems == value
        elif key == "mamba_d_inner":
            assert ssm.piece_channels(1)[0] == value
        elif key == "mamba1_conv_state":
            assert [ssm.piece_channels(1)[0], ssm.conv_kernel] == value
        elif key == "mamba1_ssm_state":
            assert [ssm.temporal.units, ssm.temporal.unit_elems] == value
        elif key == "mla_cache_elems_per_token_per_layer":
            assert {la.spec.latent_size for la in spec.layers if isinstance(la.spec, MLASpec)} == {value}
        elif key == "head_dim":
            assert attn.head_size == value
        elif key == "mamba_d_head":
            assert ssm.conv_pieces[0].unit_elems == value
        elif key == "kv_elems_per_token_per_hybrid_layer":  # Zamba2: K and V of 32 heads x 160
            assert attn.num_kv_heads * (attn.head_size + attn.v_size) == value
        else:
            continue
        checked += 1
    assert checked == sum(
        1 for k in derived if not k.endswith("note") and k != "lightning_state_elems_per_layer"
    )


@pytest.mark.parametrize(
    ("name", "ssm_dtype"),
    [
        (
            "nemotron-h-8b",
            "float32",
        ),  # vLLM: NemotronH's SSM cache is float32 unless the config says otherwise
        ("nvidia-nemotron-3-nano-30b-a3b", "float32"),  # the config's mamba_ssm_cache_dtype
        ("qwen3.5-0.8b", "float32"),  # Qwen3.5: the text config's mamba_ssm_dtype
        ("kimi-linear-48b-a3b", "float32"),  # KDA: float32 under auto
        ("falcon-h1-0.5b", "bfloat16"),  # everyone else: the conv (model) dtype
        ("jamba-v0.1", "bfloat16"),
    ],
)
def test_ssm_cache_dtype_auto_follows_vllm(name: str, ssm_dtype: str) -> None:
    spec = read_config(_config(name))
    assert spec.ssm_spec.ssm_dtype == ssm_dtype
    assert spec.ssm_spec.conv_dtype == "bfloat16"
    assert read_config(_config(name), mamba_ssm_cache_dtype="float16").ssm_spec.ssm_dtype == "float16"


def test_kv_cache_dtype_sets_attention_only() -> None:
    spec = read_config(_config("nvidia-nemotron-3-nano-30b-a3b"), kv_cache_dtype="fp8")
    assert {la.spec.dtype for la in spec.layers if isinstance(la.spec, AttentionSpec)} == {"fp8"}
    assert (spec.ssm_spec.conv_dtype, spec.ssm_spec.ssm_dtype) == ("bfloat16", "float32")
    again = apply_cache_dtypes(read_config(_config("nvidia-nemotron-3-nano-30b-a3b")), "fp8")
    assert again == spec
    mla = apply_cache_dtypes(presets.load("deepseek-v2-lite"), "fp8")
    assert {la.spec.dtype for la in mla.layers} == {"fp8"}
    with pytest.raises(SpecError) as exc:
        apply_cache_dtypes(spec, "fp4")
    assert exc.value.field == "kv_cache_dtype" and exc.value.values == {"value": "fp4"}


# -- vLLM's block-size derivation ------------------------------------------------------------------------
@pytest.mark.parametrize(("tp", "block"), [(1, 4192), (2, 4192), (4, 2112)])
def test_nemotron3_nano_fp8_block_size_32(tp: int, block: int) -> None:
    """vLLM issue 41037's case, by hand. Attention: 2 KV heads x (128 + 128) x 1 B (fp8) = 512 B/token at
    TP1, 256 at TP2 and TP4 (one head per rank, replicated at TP4). Mamba2 state per rank: conv
    (4096 + 2*8*128) / TP channels x 3 rows x 2 B (bf16) plus 64/TP heads x 64 x 128 x 4 B (fp32):
    2 134 016 B at TP1, 1 067 008 at TP2, 533 504 at TP4. Blocks are multiples of 32 (the asked size):
    32 * ceil(2134016 / (32*512)) = 32 * 131 = 4192; TP2 the same; 32 * ceil(533504 / (32*256)) = 2112."""
    model = read_config(_config("nvidia-nemotron-3-nano-30b-a3b"), kv_cache_dtype="fp8")
    assert model.ssm_spec.state_bytes(tp) == {1: 2134016, 2: 1067008, 4: 533504}[tp]
    assert model.attention_spec.token_bytes(tp) == {1: 512, 2: 256, 4: 256}[tp]
    assert align_hybrid_block_size(model, tp, 32, 16) == block
    geom = rank_geometry(model, EngineConfig(tp_size=tp, block_size=block, num_blocks=4))
    assert geom.page_bytes == block * model.attention_spec.token_bytes(tp) >= model.ssm_spec.state_bytes(tp)


def test_qwen35_block_size_from_vllms_own_test() -> None:
    """vLLM's tests/v1/worker/test_gpu_model_runner.py aligns Qwen3.5-0.8B at TP1 (MultipleOf(16)) to 544."""
    assert align_hybrid_block_size(read_config(_config("qwen3.5-0.8b")), 1, 16, 16) == 544


def test_block_size_kernel_lcm_and_mla_minimum() -> None:
    nano = read_config(_config("nvidia-nemotron-3-nano-30b-a3b"), kv_cache_dtype="fp8")
    # 2112 is a multiple of 16 and 64 but not of 128: rounded up to the lcm of the backends' kernel blocks
    assert align_hybrid_block_size(nano, 4, 32, 16, kernel_block_sizes=(16, 64)) == 2112
    assert align_hybrid_block_size(nano, 4, 32, 16, kernel_block_sizes=(16, 128)) == 2176
    kimi = read_config(_config("kimi-linear-48b-a3b"))
    # MLA 576 x 2 B = 1152 B/token; KDA state 3 x 4096 x 3 x 2 B + 32 x 128 x 128 x 4 B = 2 170 880 B
    assert align_hybrid_block_size(kimi, 1, 16, 16) == 16 * 118  # ceil(2170880 / 18432) = 118
    assert align_hybrid_block_size(kimi, 1, 16, 16, mla_alignment=128) == 128 * 15  # ceil(2170880/147456)


# -- broken configs name the field ----------------------------------------------------------------------
def _broken(name: str, edit: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(_config(name))
    edit(cfg)
    return cfg


@pytest.mark.parametrize(
    ("name", "edit", "field"),
    [
        ("qwen3-8b", lambda c: c.pop("num_hidden_layers"), "num_hidden_layers"),
        ("qwen3-8b", lambda c: c.update(num_key_value_heads=7), "num_key_value_heads"),
        ("qwen3-8b", lambda c: c.update(num_key_value_heads="eight"), "num_key_value_heads"),
        ("qwen3-8b", lambda c: c.update(num_attention_heads=0), "num_attention_heads"),
        ("qwen3-8b", lambda c: c.update(model_type="qwen9"), "model_type"),
        ("qwen3-8b", lambda c: c.pop("model_type"), "model_type"),
        ("llama-3.1-70b", lambda c: c.update(hidden_size=8100), "hidden_size"),
        ("nemotron-h-8b", lambda c: c.update(hybrid_override_pattern="M-M*"), "hybrid_override_pattern"),
        ("nemotron-h-8b", lambda c: c.update(hybrid_override_pattern="X" * 52), "hybrid_override_pattern"),
        ("nemotron-h-8b", lambda c: c.pop("mamba_num_heads"), "mamba_num_heads"),
        ("nemotron-h-8b", lambda c: c.update(n_groups=3), "n_groups"),
        ("nemotron-h-8b", lambda c: c.update(ssm_state_size=True), "ssm_state_size"),
        ("falcon-h1-0.5b", lambda c: c.update(mamba_d_ssm=1000), "mamba_d_ssm"),
        ("jamba-v0.1", lambda c: c.update(attn_layer_offset=9), "attn_layer_offset"),
        ("zamba2-2.7b", lambda c: c["layers_block_type"].append("mamba"), "layers_block_type"),
        ("granite-4.0-h-tiny", lambda c: c["layer_types"].__setitem__(3, "conv"), "layer_types[3]"),
        ("qwen3-next-80b-a3b", lambda c: c.update(linear_num_value_heads=24), "linear_num_value_heads"),
        (
            "qwen3.5-0.8b",
            lambda c: c["text_config"].pop("linear_key_head_dim"),
            "text_config.linear_key_head_dim",
        ),
        (
            "kimi-linear-48b-a3b",
            lambda c: c["linear_attn_config"]["kda_layers"].append(4),
            "linear_attn_config.full_attn_layers",
        ),
        (
            "kimi-linear-48b-a3b",
            lambda c: c["linear_attn_config"]["kda_layers"].append(40),
            "linear_attn_config.kda_layers",
        ),
        ("deepseek-v3", lambda c: c.pop("kv_lora_rank"), "kv_lora_rank"),
        ("deepseek-v3", lambda c: c.update(torch_dtype="float12"), "torch_dtype"),
    ],
)
def test_broken_config_names_the_field(name: str, edit: Any, field: str) -> None:
    with pytest.raises(KvgeomError) as exc:
        read_config(_broken(name, edit))
    assert exc.value.field == field, str(exc.value)


def test_bad_files_and_values(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as exc:
        read_config(tmp_path / "missing.json")
    assert exc.value.field == "model" and exc.value.values == {"value": str(tmp_path / "missing.json")}
    with pytest.raises(SpecError) as exc:
        read_config(tmp_path)  # a directory without config.json
    assert exc.value.field == "model" and exc.value.values == {"value": str(tmp_path / "config.json")}
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecError) as exc:
        read_config(tmp_path)
    assert exc.value.field == "model" and exc.value.values == {"value": str(tmp_path / "config.json")}
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(SpecError) as exc:
        read_config(tmp_path / "config.json")
    assert exc.value.field == "model" and exc.value.values == {"value": str(tmp_path / "config.json")}
    with pytest.raises(SpecError) as exc:
        read_config(_config("qwen3-8b"), kv_cache_dtype="int3")
    assert exc.value.field == "kv_cache_dtype" and exc.value.values == {"value": "int3"}
    with pytest.raises(SpecError) as exc:
        read_config(_config("qwen3-8b"), mamba_ssm_cache_dtype="fp8")
    assert exc.value.field == "mamba_ssm_cache_dtype" and exc.value.values == {"value": "fp8"}


def test_a_directory_and_name_default(tmp_path: Path) -> None:
    cfg = _config("qwen3-8b")
    cfg.pop("_name_or_path")
    (tmp_path / "Qwen3-8B").mkdir()
    (tmp_path / "Qwen3-8B" / "config.json").write_text(json.dumps(cfg))
    spec = read_config(tmp_path / "Qwen3-8B")
    assert spec.name == "Qwen3-8B" and len(spec.layers) == 36


def test_sliding_window_layers() -> None:
    mistral = {
        "model_type": "mistral",
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "sliding_window": 4096,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    spec = read_config(mistral, "m")
    assert [la.spec.sliding_window for la in spec.layers] == [4096, None]
    qwen = {
        **_config("qwen3-8b"),
        "use_sliding_window": True,
        "sliding_window": 1024,
        "max_window_layers": 30,
    }
    windows = [la.spec.sliding_window for la in read_config(qwen).layers]
    assert windows == [None] * 30 + [1024] * 6
    mamba = read_config(_config("zamba2-2.7b"))
    assert isinstance(mamba.ssm_spec, MambaSpec) and mamba.ssm_spec.piece_names == ("x", "B", "C")


# kvgeom.model.hfconfig pinned field by field: each family's reader on small hand-written configs,
# every key it reads, each default, and each refusal with its exact class, field and values.
#
# Expected specs are written out from the formulas in docs/models.md (inner = expand x hidden, head_dim =
# hidden / heads, ...), computed by hand in the comments, never taken from the reader's own output.


def _raises(exc: type[Exception], fn: Any, *args: Any, **kwargs: Any) -> Any:
    """The error ``fn`` raises, checked to be exactly of class ``exc``."""
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert type(info.value) is exc, type(info.value)
    return info.value


def _refused(cfg: Any, field: str, **values: Any) -> SpecError:
    err = _raises(SpecError, read_config, cfg)
    assert err.field == field, str(err)
    for k, v in values.items():
        assert err.values[k] == v, (k, err.values)
    return err


# -- ConfigFields ---------------------------------------------------------------------------------------
F = {"a": 3, "b": None, "c": 4.0, "d": True, "e": 4.5, "s": "7", "z": 0, "five": 5}


def test_fields_name_has_get() -> None:
    f = ConfigFields(F, "p.")
    assert f.name("a") == "p.a"
    assert ConfigFields(F).name("a") == "a"  # default prefix: none
    assert f.has("a") and f.has("z") and not f.has("b") and not f.has("missing")
    assert f.get("a", 7) == 3 and f.get("b", 7) == 7 and f.get("missing", 7) == 7
    assert f.get("missing") is None and f.get("b") is None
    assert f.get("z", 7) == 0  # 0 is a value, not a missing key


def test_fields_num_first_present_key_and_defaults() -> None:
    f = ConfigFields(F, "p.")
    assert f.num("b", "a") == 3  # b is None: skipped
    assert f.num("a", "five") == 3  # the first present wins
    assert f.num("missing", "five") == 5
    c = f.num("c")  # an integral float is read as the integer
    assert c == 4 and isinstance(c, int)
    d = f.num("missing", default=5.0)
    assert d == 5 and isinstance(d, int)
    assert f.num("missing", default=0) == 0  # the default is not checked against the minimum
    assert f.num("z", minimum=0) == 0
    assert f.num("five", minimum=5) == 5  # the minimum itself is accepted


def test_fields_num_refusals() -> None:
    f = ConfigFields(F, "p.")
    err = _raises(SpecError, f.num, "missing", "b")
    assert err.field == "p.missing" and err.values == {"value": None}
    err = _raises(SpecError, f.num, "z")  # minimum 1 by default
    assert err.field == "p.z" and err.values == {"value": 0, "expected": 1}
    err = _raises(SpecError, f.num, "five", minimum=6)
    assert err.field == "p.five" and err.values == {"value": 5, "expected": 6}
    for key, value in (("d", True), ("e", 4.5), ("s", "7")):
        err = _raises(SpecError, f.num, key)
        assert err.field == f"p.{key}" and err.values == {"value": value}
    assert _raises(SpecError, ConfigFields({"f": False}).num, "f", minimum=0).values == {"value": False}


def test_fields_lists() -> None:
    data = {"l": [0, 2], "n": "x", "m": [1, 1.5], "s": ["a", "b"], "t": ["a", 1]}
    f = ConfigFields(data, "p.")
    assert f.int_list("l") == [0, 2]  # minimum 0 by default
    err = _raises(SpecError, f.int_list, "l", minimum=1)
    assert err.field == "p.l[0]" and err.values == {"value": 0, "expected": 1}
    err = _raises(SpecError, f.int_list, "m")
    assert err.field == "p.m[1]" and err.values == {"value": 1.5}
    for key, value in (("n", "x"), ("missing", None)):
        err = _raises(SpecError, f.int_list, key)
        assert err.field == f"p.{key}" and err.values == {"value": value}
    out = f.str_list("s")
    assert out == ["a", "b"] and out is not data["s"]
    for key, value in (("t", ["a", 1]), ("n", "x"), ("missing", None)):
        err = _raises(SpecError, f.str_list, key)
        assert err.field == f"p.{key}" and err.values == {"value": value}


# -- families and their layer patterns -------------------------------------------------------------
ALL_TYPES = [
    "deepseek_v2",
    "deepseek_v3",
    "falcon_h1",
    "granite",
    "granitemoe",
    "granitemoehybrid",
    "jamba",
    "kimi_k2",
    "kimi_linear",
    "llama",
    "minimax_m1",
    "minimax_text_01",
    "mistral",
    "mixtral",
    "nemotron_h",
    "olmo2",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "qwen3_moe",
    "qwen3_next",
    "zamba2",
]


def test_model_types_is_the_sorted_family_list() -> None:
    assert model_types() == ALL_TYPES


# Two layers of each family, written so that each pattern rule shows.
TWO_LAYERS: dict[str, tuple[dict[str, Any], list[str]]] = {
    **{t: ({}, ["attention", "attention"]) for t in ("llama", "mistral", "mixtral", "granite")},
    **{t: ({}, ["attention", "attention"]) for t in ("granitemoe", "phi3", "olmo2")},
    **{t: ({}, ["attention", "attention"]) for t in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")},
    **{t: ({}, ["mla", "mla"]) for t in ("deepseek_v2", "deepseek_v3", "kimi_k2")},
    "jamba": ({"attn_layer_period": 2, "attn_layer_offset": 1}, ["mamba1", "attention"]),
    "nemotron_h": ({"hybrid_override_pattern": "*M"}, ["attention", "mamba2"]),
    "falcon_h1": ({}, ["attention+mamba2", "attention+mamba2"]),
    "zamba2": ({"layers_block_type": ["hybrid", "mamba"]}, ["attention+mamba2", "mamba2"]),
    "granitemoehybrid": ({"layer_types": ["attention", "mamba"]}, ["attention", "mamba2"]),
    **{
        t: ({"full_attention_interval": 2}, ["gdn", "attention"])
        for t in ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
    },
    "kimi_linear": ({"linear_attn_config": {"kda_layers": [2]}}, ["mla", "kda"]),
}


@pytest.mark.parametrize("model_type", sorted(TWO_LAYERS))
def test_each_family_pattern(model_type: str) -> None:
    extra, kinds = TWO_LAYERS[model_type]
    assert layer_kinds({"model_type": model_type, "num_hidden_layers": 2, **extra}) == kinds


@pytest.mark.parametrize("model_type", ["minimax_text_01", "minimax_m1"])
def test_minimax_is_unsupported(model_type: str) -> None:
    err = _raises(UnsupportedError, layer_kinds, {"model_type": model_type, "num_hidden_layers": 2})
    assert err.field == "attn_type_list" and err.values == {"value": model_type}
    err = _raises(UnsupportedError, read_config, {"text_config": {"model_type": model_type}})
    assert err.field == "text_config.attn_type_list"


def test_block_types_every_name() -> None:
    types = ["mamba", "linear_attention", "attention", "full_attention", "sliding_attention", "hybrid"]
    cfg = {"model_type": "granitemoehybrid", "num_hidden_layers": 8, "layer_types": [*types, "mlp", "moe"]}
    # ssm names -> the family's SSM (mamba2); sliding -> "attention" in the card vocabulary; mlp/moe -> no cache
    expected = ["mamba2", "mamba2", "attention", "attention", "attention", "attention+mamba2", "", ""]
    assert layer_kinds(cfg) == expected


def test_block_types_refusals() -> None:
    base = {"model_type": "granitemoehybrid", "num_hidden_layers": 3}
    err = _raises(SpecError, layer_kinds, {**base, "layer_types": ["mamba", "conv", "mamba"]})
    assert err.field == "layer_types[1]" and err.values == {"value": "conv"}
    err = _raises(SpecError, layer_kinds, {**base, "layer_types": ["mamba", "mamba"]})
    assert err.field == "layer_types" and err.values == {"value": 2, "expected": 3}
    err = _raises(SpecError, layer_kinds, {**base, "layer_types": ["mamba"] * 4})
    assert err.values == {"value": 4, "expected": 3}
    err = _raises(SpecError, layer_kinds, {**base, "layer_types": "mamba"})
    assert err.field == "layer_types" and err.values == {"value": "mamba"}
    # prefixed inside a VLM wrapper's text_config
    err = _raises(SpecError, layer_kinds, {"text_config": {**base, "layer_types": ["mamba"]}})
    assert err.field == "text_config.layer_types"


def test_nemotron_patterns() -> None:
    base = {"model_type": "nemotron_h", "num_hidden_layers": 4}
    assert layer_kinds({**base, "hybrid_override_pattern": "M*-E"}) == ["mamba2", "attention", "", ""]
    two = {"model_type": "nemotron_h", "num_hidden_layers": 2}
    # layers_block_type wins over layer_types and over the pattern string
    both = {**two, "layers_block_type": ["mamba", "mamba"], "layer_types": ["attention", "attention"]}
    assert layer_kinds({**both, "hybrid_override_pattern": "**"}) == ["mamba2", "mamba2"]
    assert layer_kinds({**two, "layer_types": ["attention", "mamba"], "hybrid_override_pattern": "MM"}) == [
        "attention",
        "mamba2",
    ]
    assert layer_kinds({**two, "layers_block_type": ["attention", "mamba"]}) == ["attention", "mamba2"]


def test_nemotron_pattern_refusals() -> None:
    base = {"model_type": "nemotron_h", "num_hidden_layers": 3}
    err = _raises(SpecError, layer_kinds, base)
    assert err.field == "hybrid_override_pattern" and err.values == {"value": None}
    err = _raises(SpecError, layer_kinds, {**base, "hybrid_override_pattern": 5})
    assert err.field == "hybrid_override_pattern" and err.values == {"value": 5}
    err = _raises(SpecError, layer_kinds, {**base, "hybrid_override_pattern": "MX*"})
    assert err.field == "hybrid_override_pattern" and err.values == {"value": "MX*"}
    err = _raises(SpecError, layer_kinds, {**base, "hybrid_override_pattern": "M*"})
    assert err.field == "hybrid_override_pattern" and err.values == {"value": 2, "expected": 3}
    err = _raises(SpecError, layer_kinds, {"text_config": {**base, "hybrid_override_pattern": "M*"}})
    assert err.field == "text_config.hybrid_override_pattern"


def test_jamba_patterns() -> None:
    base = {"model_type": "jamba", "num_hidden_layers": 6}
    # attention where i % period == offset: period 4, offset 1 -> layers 1 and 5
    kinds = layer_kinds({**base, "attn_layer_period": 4, "attn_layer_offset": 1})
    assert kinds == ["mamba1", "attention", "mamba1", "mamba1", "mamba1", "attention"]
    # offset 0 is allowed (minimum 0); offset = period - 1 is the last allowed
    kinds = layer_kinds({**base, "attn_layer_period": 2, "attn_layer_offset": 0})
    assert kinds == ["attention", "mamba1"] * 3
    kinds = layer_kinds({**base, "attn_layer_period": 3, "attn_layer_offset": 2})
    assert kinds == ["mamba1", "mamba1", "attention"] * 2
    listed = {**base, "num_hidden_layers": 2, "layers_block_type": ["attention", "mamba"]}
    assert layer_kinds({**listed, "attn_layer_period": 1, "attn_layer_offset": 0}) == ["attention", "mamba1"]


def test_jamba_pattern_refusals() -> None:
    base = {"model_type": "jamba", "num_hidden_layers": 4}
    err = _raises(SpecError, layer_kinds, {**base, "attn_layer_period": 2, "attn_layer_offset": 2})
    assert err.field == "attn_layer_offset" and err.values == {"value": 2, "expected": 2}
    err = _raises(SpecError, layer_kinds, {**base, "attn_layer_period": 2, "attn_layer_offset": -1})
    assert err.field == "attn_layer_offset" and err.values == {"value": -1, "expected": 0}
    err = _raises(SpecError, layer_kinds, {**base, "attn_layer_offset": 0})
    assert err.field == "attn_layer_period" and err.values == {"value": None}
    err = _raises(SpecError, layer_kinds, {**base, "attn_layer_period": 2})
    assert err.field == "attn_layer_offset" and err.values == {"value": None}


def test_gdn_patterns() -> None:
    base = {"model_type": "qwen3_next", "num_hidden_layers": 8}
    # attention where (i + 1) % interval == 0: interval 4 -> layers 3 and 7
    kinds = layer_kinds({**base, "full_attention_interval": 4})
    assert kinds == ["gdn", "gdn", "gdn", "attention"] * 2
    assert layer_kinds({**base, "full_attention_interval": 1}) == ["attention"] * 8
    two = {"model_type": "qwen3_5", "num_hidden_layers": 2, "full_attention_interval": 1}
    assert layer_kinds({**two, "layer_types": ["linear_attention", "full_attention"]}) == ["gdn", "attention"]
    err = _raises(SpecError, layer_kinds, {"text_config": {**base}})
    assert err.field == "text_config.full_attention_interval"


def _kimi(n: int, **lac: Any) -> dict[str, Any]:
    return {"model_type": "kimi_linear", "num_hidden_layers": n, "linear_attn_config": lac}


def test_kimi_patterns() -> None:
    # kda_layers / full_attn_layers are 1-indexed
    assert layer_kinds(_kimi(3, kda_layers=[1, 3], full_attn_layers=[2])) == ["kda", "mla", "kda"]
    assert layer_kinds(_kimi(3, kda_layers=[2])) == ["mla", "kda", "mla"]
    assert layer_kinds(_kimi(3, kda_layers=[3])) == ["mla", "mla", "kda"]  # the last layer is in range
    assert layer_kinds(_kimi(2, kda_layers=[], full_attn_layers=[1, 2])) == ["mla", "mla"]
    assert layer_kinds(_kimi(1, kda_layers=[])) == ["mla"]


def test_kimi_refusals() -> None:
    err = _raises(SpecError, layer_kinds, {"model_type": "kimi_linear", "num_hidden_layers": 2})
    assert err.field == "linear_attn_config" and err.values == {"value": None}
    err = _raises(SpecError, layer_kinds, {**_kimi(2), "linear_attn_config": [1]})
    assert err.field == "linear_attn_config" and err.values == {"value": [1]}
    err = _raises(SpecError, layer_kinds, _kimi(3, kda_layers=[1, 4]))
    assert err.field == "linear_attn_config.kda_layers" and err.values == {"value": 4, "expected": 3}
    err = _raises(SpecError, layer_kinds, _kimi(3, kda_layers=[0]))
    assert err.field == "linear_attn_config.kda_layers[0]" and err.values == {"value": 0, "expected": 1}
    # an overlap with a complete union, then a gap without an overlap: each side of the check alone
    err = _raises(SpecError, layer_kinds, _kimi(3, kda_layers=[1, 2], full_attn_layers=[2, 3]))
    assert err.field == "linear_attn_config.full_attn_layers" and err.values == {
        "value": [2, 3],
        "expected": 3,
    }
    err = _raises(SpecError, layer_kinds, _kimi(3, kda_layers=[1], full_attn_layers=[3]))
    assert err.field == "linear_attn_config.full_attn_layers" and err.values == {"value": [3], "expected": 3}
    err = _raises(SpecError, layer_kinds, _kimi(2, kda_layers=[1], full_attn_layers=[0]))
    assert err.field == "linear_attn_config.full_attn_layers[0]"
    err = _raises(SpecError, layer_kinds, {"text_config": _kimi(3, kda_layers=[1, 4])})
    assert err.field == "text_config.linear_attn_config.kda_layers"


LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512}


def test_dense_layer_types_and_a_family_without_ssm() -> None:
    cfg = {**LLAMA, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}
    spec = read_config(cfg, "m")
    # 512 / 8 = 64 head dim; no num_key_value_heads: one KV head per attention head
    assert [la.spec for la in spec.layers] == [AttentionSpec(8, 64, sliding_window=64), AttentionSpec(8, 64)]
    assert layer_kinds({**cfg, "layer_types": ["mamba", "attention"]}) == ["none", "attention"]
    err = _raises(SpecError, read_config, {**cfg, "layer_types": ["mamba", "attention"]})
    assert err.field == "model_type" and err.values == {"value": "none"}


def test_qwen_dense_sliding_windows() -> None:
    base = {**LLAMA, "model_type": "qwen3", "num_hidden_layers": 4, "sliding_window": 64}

    def windows(**kw: Any) -> list[int | None]:
        return [la.spec.sliding_window for la in read_config({**base, **kw}).layers]

    assert windows() == [None] * 4  # use_sliding_window defaults to off
    assert windows(use_sliding_window=False, max_window_layers=0) == [None] * 4
    assert windows(use_sliding_window=True, max_window_layers=2) == [None, None, 64, 64]
    assert windows(use_sliding_window=True, max_window_layers=0) == [64] * 4  # minimum 0
    assert windows(use_sliding_window=True) == [None] * 4  # max_window_layers defaults to all layers
    assert windows(use_sliding_window=True, max_window_layers=3) == [None, None, None, 64]
    assert windows(layer_types=["full_attention", "sliding_attention"] * 2) == [None, 64] * 2
    err = _raises(SpecError, read_config, {**base, "use_sliding_window": True, "max_window_layers": -1})
    assert err.field == "max_window_layers" and err.values == {"value": -1, "expected": 0}
    cfg = {**base, "use_sliding_window": True, "max_window_layers": 2}
    del cfg["sliding_window"]
    err = _raises(SpecError, read_config, cfg)
    assert err.field == "sliding_window" and err.values == {"value": None}


# -- attention and MLA specs ------------------------------------------------------------------------
def _attn(**kw: Any) -> AttentionSpec:
    spec = read_config({**LLAMA, "num_hidden_layers": 1, **kw}, "m").layers[0].spec
    assert isinstance(spec, AttentionSpec)
    return spec


def test_attention_fields() -> None:
    assert _attn(num_key_value_heads=2) == AttentionSpec(2, 64, "bfloat16")  # 512 / 8 heads
    assert _attn() == AttentionSpec(8, 64)  # KV heads default to the attention heads
    assert _attn(num_key_value_heads=8) == AttentionSpec(8, 64)
    assert _attn(head_dim=128).head_size == 128
    assert _attn(attention_head_dim=96).head_size == 96
    assert _attn(attention_head_size=80).head_size == 80
    assert _attn(head_dim=128, attention_head_dim=96, attention_head_size=80).head_size == 128
    assert _attn(attention_head_dim=96, attention_head_size=80).head_size == 96
    assert _attn(attention_hidden_size=256).head_size == 32  # 256 / 8, before hidden_size
    assert _attn(hidden_size=504, head_dim=7).head_size == 7  # head_dim: hidden_size not checked
    assert _attn(num_attention_heads=1, hidden_size=3).head_size == 3


def test_attention_refusals() -> None:
    err = _refused({**LLAMA, "num_key_value_heads": 3}, "num_key_value_heads", value=3, expected=8)
    assert err.values == {"value": 3, "expected": 8}
    err = _refused({**LLAMA, "hidden_size": 500}, "hidden_size")
    assert err.values == {"value": 500, "expected": 8}
    err = _refused({**LLAMA, "attention_hidden_size": 500}, "hidden_size")
    assert err.values == {"value": 500, "expected": 8}
    cfg = {k: v for k, v in LLAMA.items() if k != "hidden_size"}
    err = _refused(cfg, "attention_hidden_size")
    assert err.values == {"value": None}
    cfg = {k: v for k, v in LLAMA.items() if k != "num_attention_heads"}
    _refused(cfg, "num_attention_heads", value=None)
    _refused({**LLAMA, "num_key_value_heads": 0}, "num_key_value_heads", value=0, expected=1)
    _refused({**LLAMA, "head_dim": 0}, "head_dim", value=0, expected=1)
    _refused({**LLAMA, "attention_head_size": 0}, "attention_head_size", value=0, expected=1)


def test_mla_latent() -> None:
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    spec = read_config(cfg)
    # 512 + 64 = 576; the name falls back to the model type
    assert spec == ModelSpec(
        "deepseek_v3", (Layer("layers.0.attn", 0, MLASpec(576)), Layer("layers.1.attn", 1, MLASpec(576)))
    )
    assert read_config(cfg, kv_cache_dtype="fp8").layers[1].spec == MLASpec(576, "fp8")
    _refused({**cfg, "kv_lora_rank": None}, "kv_lora_rank", value=None)
    _refused({**cfg, "qk_rope_head_dim": 0}, "qk_rope_head_dim", value=0, expected=1)


# -- SSM specs -----------------------------------------------------------------------------------------
def _mamba2_spec(
    heads: int, head_dim: int, groups: int, state: int, kernel: int, conv: str, ssm: str
) -> MambaSpec:
    """Mamba2 written out: conv pieces x (heads x head_dim), B and C (groups x state); state per head
    head_dim x state."""
    return MambaSpec(
        LayerKind.MAMBA2,
        (Shard(heads, head_dim), Shard(groups, state), Shard(groups, state)),
        Shard(heads, head_dim * state),
        kernel,
        conv,
        ssm,
        ("x", "B", "C"),
    )


# each family's own key names for (heads, head_dim, groups, state, conv)
MAMBA2_KEYS = {
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel"),
    "falcon_h1": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"),
    "zamba2": ("n_mamba_heads", "mamba_headdim", "mamba_ngroups", "mamba_d_state", "mamba_d_conv"),
    "granitemoehybrid": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"),
}

ONE_SSM_LAYER = {
    "nemotron_h": {"hybrid_override_pattern": "M"},
    "falcon_h1": {},
    "zamba2": {"layers_block_type": ["mamba"]},
    "granitemoehybrid": {"layer_types": ["mamba"]},
}


def _mamba2_cfg(family: str, values: tuple[Any, ...], **kw: Any) -> dict[str, Any]:
    cfg = {
        "model_type": family,
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "num_attention_heads": 4,
        **ONE_SSM_LAYER[family],
        **dict(zip(MAMBA2_KEYS[family], values)),
        **kw,
    }
    return {k: v for k, v in cfg.items() if v is not None}


def _ssm(cfg: dict[str, Any], **kw: Any) -> MambaSpec:
    spec = read_config(cfg, **kw).ssm_spec
    assert spec is not None
    return spec


@pytest.mark.parametrize("family", sorted(MAMBA2_KEYS))
def test_mamba2_keys_of_each_family(family: str) -> None:
    # NemotronH keeps its temporal state in float32 under "auto"; the others the model dtype
    ssm = "float32" if family == "nemotron_h" else "float16"
    spec = _ssm(_mamba2_cfg(family, (8, 4, 2, 16, 3), torch_dtype="float16"))
    assert spec == _mamba2_spec(8, 4, 2, 16, 3, "float16", ssm)
    # no conv kernel: 4
    assert _ssm(_mamba2_cfg(family, (8, 4, 2, 16, None))).conv_kernel == 4
    # no head dim: mamba_expand (default 2) x hidden_size 64 = 128 over 8 heads = 16
    assert _ssm(_mamba2_cfg(family, (8, None, 2, 16, 3))).temporal == Shard(8, 16 * 16)
    err = _raises(SpecError, read_config, _mamba2_cfg(family, (8, 4, 3, 16, 3)))
    assert err.field == MAMBA2_KEYS[family][2] and err.values == {"value": 3, "expected": 8}
    for i in (0, 2, 3):
        values = [8, 4, 2, 16, 3]
        values[i] = None
        err = _raises(SpecError, read_config, _mamba2_cfg(family, tuple(values)))
        assert err.field == MAMBA2_KEYS[family][i] and err.values == {"value": None}


def test_mamba2_inner_size() -> None:
    def nemo(**kw: Any) -> dict[str, Any]:
        return _mamba2_cfg("nemotron_h", (8, None, 2, 16, 3), **kw)

    assert _ssm(nemo(mamba_head_dim="auto")).conv_pieces[0] == Shard(8, 16)  # 2 x 64 / 8
    assert _ssm(nemo(mamba_expand=3)).conv_pieces[0] == Shard(8, 24)  # 3 x 64 / 8
    assert _ssm(nemo(expand=1)).conv_pieces[0] == Shard(8, 8)  # 1 x 64 / 8
    assert _ssm(nemo(mamba_expand=1, expand=4)).conv_pieces[0] == Shard(8, 8)  # mamba_expand first
    assert _ssm(nemo(hidden_size=60)).conv_pieces[0] == Shard(8, 15)  # 2 x 60 / 8
    err = _raises(SpecError, read_config, nemo(hidden_size=34))  # 68 % 8 = 4
    assert err.field == "mamba_num_heads" and err.values == {"value": 8, "expected": 68}
    cfg = nemo()
    del cfg["hidden_size"]
    err = _raises(SpecError, read_config, cfg)
    assert err.field == "hidden_size" and err.values == {"value": None}


def test_falcon_mamba_d_ssm_cross_check() -> None:
    cfg = _mamba2_cfg("falcon_h1", (8, 4, 2, 16, 3), mamba_d_ssm=32)  # 8 x 4 = 32
    assert _ssm(cfg) == _mamba2_spec(8, 4, 2, 16, 3, "bfloat16", "bfloat16")
    err = _raises(SpecError, read_config, {**cfg, "mamba_d_ssm": 33})
    assert err.field == "mamba_d_ssm" and err.values == {"value": 33, "expected": 32}
    # computed head dim: 2 x 64 = 128 = mamba_d_ssm
    cfg = _mamba2_cfg("falcon_h1", (8, None, 2, 16, 3), mamba_d_ssm=128)
    assert _ssm(cfg).conv_pieces[0] == Shard(8, 16)
    err = _raises(SpecError, read_config, {**cfg, "mamba_d_ssm": 0})
    assert err.field == "mamba_d_ssm" and err.values == {"value": 0, "expected": 1}
    # Falcon-H1: every layer is attention + Mamba2, in this order
    spec = read_config({**cfg, "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 8}, "f")
    assert [(la.name, la.index, la.kind) for la in spec.layers] == [
        ("layers.0.attn", 0, LayerKind.ATTENTION),
        ("layers.0.mamba", 0, LayerKind.MAMBA2),
        ("layers.1.attn", 1, LayerKind.ATTENTION),
        ("layers.1.mamba", 1, LayerKind.MAMBA2),
    ]
    assert spec.layers[0].spec == AttentionSpec(2, 8)


JAMBA = {
    "model_type": "jamba",
    "num_hidden_layers": 2,
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 32,
    "mamba_expand": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 3,
}


def test_mamba1() -> None:
    spec = read_config(JAMBA, "j")
    # inner = 2 x 32 = 64 channels; state 64 x 16; conv kernel 3; attention 32 / 4 = 8 head dim
    expected_ssm = MambaSpec(
        LayerKind.MAMBA1, (Shard(64, 1),), Shard(64, 16), 3, "bfloat16", "bfloat16", ("x",)
    )
    assert spec == ModelSpec(
        "j", (Layer("layers.0.mamba", 0, expected_ssm), Layer("layers.1.attn", 1, AttentionSpec(2, 8)))
    )
    cfg = {**JAMBA, "torch_dtype": "float16", "mamba_expand": 3}
    del cfg["mamba_d_conv"]
    ssm = _ssm(cfg)
    assert ssm.conv_kernel == 4 and ssm.temporal == Shard(96, 16)  # 3 x 32 = 96
    assert (ssm.conv_dtype, ssm.ssm_dtype) == ("float16", "float16")
    for key in ("mamba_expand", "hidden_size", "mamba_d_state"):
        _refused({**JAMBA, key: None}, key, value=None)


QWEN_NEXT = {
    "model_type": "qwen3_next",
    "num_hidden_layers": 2,
    "full_attention_interval": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 3,
}


def test_gdn() -> None:
    # conv pieces Q, K (2 key heads x 8) and V (4 value heads x 16); state per value head 16 x 8 = 128
    expected = MambaSpec(
        LayerKind.GDN,
        (Shard(2, 8), Shard(2, 8), Shard(4, 16)),
        Shard(4, 128),
        3,
        "bfloat16",
        "bfloat16",
        ("Q", "K", "V"),
    )
    spec = read_config(QWEN_NEXT, "q")
    assert spec == ModelSpec(
        "q", (Layer("layers.0.mamba", 0, expected), Layer("layers.1.attn", 1, AttentionSpec(2, 16)))
    )
    assert _ssm({**QWEN_NEXT, "linear_conv_kernel_dim": None}).conv_kernel == 4
    assert _ssm({**QWEN_NEXT, "linear_num_value_heads": 2}).conv_pieces[2] == Shard(2, 16)  # equal heads
    _refused({**QWEN_NEXT, "linear_num_value_heads": 3}, "linear_num_value_heads", value=3, expected=2)
    for key in ("linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim"):
        _refused({**QWEN_NEXT, key: None}, key, value=None)


def test_qwen35_ssm_dtype_rule_and_text_config() -> None:
    text = {**QWEN_NEXT, "model_type": "qwen3_5_text"}
    cfg = {"model_type": "qwen3_5", "text_config": text}
    assert _ssm(cfg).ssm_dtype == "bfloat16"  # no mamba_ssm_dtype: the model dtype
    ssm = _ssm({**cfg, "text_config": {**text, "mamba_ssm_dtype": "float32"}})
    assert (ssm.conv_dtype, ssm.ssm_dtype) == ("bfloat16", "float32")
    # qwen3_next keeps the model dtype whatever the config says
    assert _ssm({**QWEN_NEXT, "mamba_ssm_dtype": "float32"}).ssm_dtype == "bfloat16"
    err = _raises(SpecError, read_config, {**cfg, "text_config": {**text, "linear_num_value_heads": 3}})
    assert err.field == "text_config.linear_num_value_heads" and err.values == {"value": 3, "expected": 2}
    assert read_config(cfg).name == "qwen3_5_text"  # the text config's model type


KIMI = {
    **_kimi(2, kda_layers=[1], full_attn_layers=[2], num_heads=2, head_dim=8, short_conv_kernel_size=3),
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
}


def test_kda() -> None:
    # three conv pieces of 2 heads x 8; a state of 8 x 8 per head; float32 under "auto"
    s = Shard(2, 8)
    expected = MambaSpec(LayerKind.KDA, (s, s, s), Shard(2, 64), 3, "bfloat16", "float32", ("Q", "K", "V"))
    spec = read_config(KIMI, "k")
    assert spec == ModelSpec(
        "k", (Layer("layers.0.mamba", 0, expected), Layer("layers.1.attn", 1, MLASpec(40)))
    )  # MLA 32 + 8
    lac = {k: v for k, v in KIMI["linear_attn_config"].items() if k != "short_conv_kernel_size"}
    assert _ssm({**KIMI, "linear_attn_config": lac}).conv_kernel == 4
    assert _ssm(KIMI, mamba_ssm_cache_dtype="bfloat16").ssm_dtype == "bfloat16"
    for key in ("num_heads", "head_dim"):
        lac = {k: v for k, v in KIMI["linear_attn_config"].items() if k != key}
        _refused({**KIMI, "linear_attn_config": lac}, f"linear_attn_config.{key}", value=None)


# -- dtypes ----------------------------------------------------------------------------------------------
NEMO = _mamba2_cfg("nemotron_h", (8, 4, 2, 16, 3), hybrid_override_pattern="M*", num_hidden_layers=2)


def test_nemotron_ssm_cache_dtype_rule() -> None:
    assert _ssm(NEMO).ssm_dtype == "float32"
    assert _ssm({**NEMO, "mamba_ssm_cache_dtype": "bfloat16"}).ssm_dtype == "bfloat16"
    assert _ssm(NEMO, mamba_ssm_cache_dtype="float16").ssm_dtype == "float16"  # the flag beats the rule
    assert _ssm(NEMO, mamba_ssm_cache_dtype="float16").conv_dtype == "bfloat16"
    err = _raises(SpecError, read_config, {**NEMO, "mamba_ssm_cache_dtype": "float12"})
    assert err.field == "mamba_ssm_cache_dtype" and err.values == {"value": "float12"}
    err = _raises(SpecError, read_config, {"text_config": {**NEMO, "mamba_ssm_cache_dtype": "float12"}})
    assert err.field == "text_config.mamba_ssm_cache_dtype"


def test_cache_dtype_flags() -> None:
    spec = read_config(NEMO, kv_cache_dtype="fp8")
    assert spec.attention_spec == AttentionSpec(4, 16, "fp8")  # 64 / 4 heads
    assert (spec.ssm_spec.conv_dtype, spec.ssm_spec.ssm_dtype) == ("bfloat16", "float32")
    spec = read_config(
        {**NEMO, "torch_dtype": "float16"}, kv_cache_dtype="auto", mamba_ssm_cache_dtype="auto"
    )
    assert spec.attention_spec.dtype == "float16" and spec.ssm_spec.ssm_dtype == "float32"
    # an explicit flag value equal to "auto"'s result is accepted
    assert read_config(NEMO, mamba_ssm_cache_dtype="auto").ssm_spec.ssm_dtype == "float32"
    for flag, bad in (("kv_cache_dtype", "int3"), ("mamba_ssm_cache_dtype", "fp8")):
        err = _raises(SpecError, read_config, NEMO, **{flag: bad})
        assert err.field == flag and err.values == {"value": bad}
    assert KV_CACHE_DTYPES == ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
    assert SSM_CACHE_DTYPES == ("auto", "float32", "bfloat16", "float16")
    for value in KV_CACHE_DTYPES[1:]:
        assert read_config(NEMO, kv_cache_dtype=value).attention_spec.dtype == value
    for value in SSM_CACHE_DTYPES[1:]:
        assert read_config(NEMO, mamba_ssm_cache_dtype=value).ssm_spec.ssm_dtype == value


def _dtype(cfg: dict[str, Any]) -> str:
    spec = read_config(cfg, "m").layers[0].spec
    assert isinstance(spec, AttentionSpec)
    return spec.dtype


def test_model_dtype_precedence() -> None:
    inner = {k: v for k, v in LLAMA.items()}
    assert _dtype(inner) == "bfloat16"  # nothing given
    assert _dtype({**inner, "torch_dtype": "float16"}) == "float16"
    assert _dtype({**inner, "torch_dtype": "torch.float16"}) == "float16"  # the prefix is dropped
    assert _dtype({**inner, "dtype": "float16"}) == "float16"
    assert _dtype({**inner, "torch_dtype": "float16", "dtype": "bfloat16"}) == "float16"
    assert _dtype({**inner, "torch_dtype": "float32"}) == "bfloat16"  # vLLM serves float32 as bfloat16
    assert _dtype({**inner, "torch_dtype": "torch.float32"}) == "bfloat16"
    assert _dtype({**inner, "torch_dtype": "fp8"}) == "fp8"
    # in a wrapper: the text config's torch_dtype, then its dtype, then the outer torch_dtype, then dtype
    assert _dtype({"text_config": {**inner, "dtype": "float16"}, "torch_dtype": "bfloat16"}) == "float16"
    assert _dtype({"text_config": inner, "torch_dtype": "float16", "dtype": "bfloat16"}) == "float16"
    assert _dtype({"text_config": inner, "dtype": "float16"}) == "float16"
    assert _dtype({"text_config": {**inner, "torch_dtype": "float16", "dtype": "bfloat16"}}) == "float16"
    err = _raises(SpecError, read_config, {**inner, "torch_dtype": "float12"})
    assert err.field == "torch_dtype" and err.values == {"value": "float12"}
    err = _raises(SpecError, read_config, {"text_config": inner, "torch_dtype": "float12"})
    assert err.field == "text_config.torch_dtype" and err.values == {"value": "float12"}


# -- the config's envelope, names and files --------------------------------------------------------
def test_text_fields_refusals() -> None:
    err = _raises(SpecError, read_config, [1, 2])
    assert err.field == "config" and err.values == {"value": [1, 2]}
    err = _raises(SpecError, layer_kinds, "llama")
    assert err.field == "config" and err.values == {"value": "llama"}
    err = _raises(SpecError, read_config, {"num_hidden_layers": 1})
    assert err.field == "model_type" and err.values == {"value": None}
    err = _raises(SpecError, read_config, {"model_type": 5})
    assert err.field == "model_type" and err.values == {"value": 5}
    err = _raises(SpecError, read_config, {"model_type": "qwen9"})
    assert err.field == "model_type" and err.values == {"value": "qwen9"}
    err = _raises(SpecError, read_config, {"text_config": {"num_hidden_layers": 1}})
    assert err.field == "text_config.model_type" and err.values == {"value": None}
    # the outer model type serves a text config without one
    assert layer_kinds({"model_type": "llama", "text_config": {"num_hidden_layers": 2}}) == ["attention"] * 2
    # a text_config that is not an object is ignored
    assert layer_kinds({**LLAMA, "text_config": "x"}) == ["attention"] * 2


def test_layers_names_and_empty_models() -> None:
    spec = read_config(NEMO)
    assert [(la.name, la.index) for la in spec.layers] == [("layers.0.mamba", 0), ("layers.1.attn", 1)]
    err = _raises(SpecError, read_config, {**NEMO, "hybrid_override_pattern": "--"})
    assert err.field == "num_hidden_layers" and err.values == {"value": 0}
    err = _raises(SpecError, read_config, {"text_config": {**NEMO, "hybrid_override_pattern": "-E"}})
    assert err.field == "text_config.num_hidden_layers"
    # the name: the argument, else _name_or_path, else the model type
    assert read_config({**NEMO, "_name_or_path": "org/n"}, "given").name == "given"
    assert read_config({**NEMO, "_name_or_path": "org/n"}).name == "org/n"
    assert read_config({**NEMO, "_name_or_path": ""}).name == "nemotron_h"


def test_paths_and_names(tmp_path: Path) -> None:
    d = tmp_path / "My-Model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(NEMO))
    assert read_config(d).name == "My-Model"  # a directory: its own name
    assert read_config(d / "config.json").name == "My-Model"  # a file: its directory's name
    assert read_config(str(d / "config.json")).name == "My-Model"
    assert read_config(d, "x").name == "x"
    (d / "config.json").write_text(json.dumps({**NEMO, "_name_or_path": "org/n"}))
    assert read_config(d).name == "org/n"
    assert read_config(d, "x").name == "x"
    assert read_config(d) == read_config({**NEMO, "_name_or_path": "org/n"})


def test_load_config_refusals(tmp_path: Path) -> None:
    def refused(path: Path, shown: Path) -> None:
        err = _raises(SpecError, load_config, path)
        assert err.field == "model" and err.values == {"value": str(shown)}

    refused(tmp_path / "missing.json", tmp_path / "missing.json")
    refused(tmp_path, tmp_path / "config.json")  # a directory without config.json
    (tmp_path / "config.json").mkdir()  # a config.json that is a directory: unreadable
    refused(tmp_path, tmp_path / "config.json")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes(b'{"a": "\xff"}')  # not UTF-8
    refused(bad, bad / "config.json")
    (bad / "config.json").write_text("{not json")
    refused(bad / "config.json", bad / "config.json")
    (bad / "config.json").write_text("[1]")
    refused(bad, bad / "config.json")
    (bad / "config.json").write_text('{"a": 1}')
    assert load_config(bad) == {"a": 1} and load_config(str(bad / "config.json")) == {"a": 1}


def test_apply_cache_dtypes() -> None:
    model = read_config(NEMO, "n")
    assert apply_cache_dtypes(model) is model
    assert apply_cache_dtypes(model, "auto", "auto") is model
    ssm, attn = model.layers[0].spec, model.layers[1].spec
    out = apply_cache_dtypes(model, kv_cache_dtype="fp8")
    assert out == ModelSpec("n", (model.layers[0], Layer("layers.1.attn", 1, AttentionSpec(4, 16, "fp8"))))
    out = apply_cache_dtypes(model, mamba_ssm_cache_dtype="bfloat16")
    assert out.layers[1].spec == attn
    assert (
        out.layers[0] == Layer("layers.0.mamba", 0, _mamba2_spec(8, 4, 2, 16, 3, "bfloat16", "bfloat16"))
        and ssm.ssm_dtype == "float32"
    )
    out = apply_cache_dtypes(model, "float16", "float16")
    assert (out.layers[0].spec.ssm_dtype, out.layers[0].spec.conv_dtype) == ("float16", "bfloat16")
    assert out.layers[1].spec.dtype == "float16" and out.name == "n"
    mla = read_config(KIMI, "k")
    assert apply_cache_dtypes(mla, "fp8").layers[1].spec == MLASpec(40, "fp8")
    for kw, field, bad in (
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype", "int3"),
        ({"mamba_ssm_cache_dtype": "fp8"}, "mamba_ssm_cache_dtype", "fp8"),
    ):
        err = _raises(SpecError, apply_cache_dtypes, model, **kw)
        assert err.field == field and err.values == {"value": bad}


def test_missing_field_message_lists_the_alternatives() -> None:
    f = ConfigFields({}, "p.")
    assert str(_raises(SpecError, f.num, "a")) == "p.a: missing from the config"
    assert str(_raises(SpecError, f.num, "a", "b")) == "p.a: missing from the config (or b)"
    assert str(_raises(SpecError, f.num, "a", "b", "c")) == "p.a: missing from the config (or b, c)"


def test_qwen_dense_has_no_ssm_layers() -> None:
    cfg = {**LLAMA, "model_type": "qwen3", "layer_types": ["mamba", "full_attention"]}
    err = _raises(SpecError, read_config, cfg)
    assert err.field == "model_type" and err.values == {"value": "none"}
    assert layer_kinds(cfg) == ["none", "attention"]


def test_qwen_sliding_window_off_unless_asked() -> None:
    # max_window_layers alone does not turn sliding windows on
    cfg = {
        **LLAMA,
        "model_type": "qwen2",
        "num_hidden_layers": 4,
        "sliding_window": 64,
        "max_window_layers": 2,
    }
    assert [la.spec.sliding_window for la in read_config(cfg).layers] == [None] * 4
    cfg["use_sliding_window"] = None  # null: off
    assert [la.spec.sliding_window for la in read_config(cfg).layers] == [None] * 4


def test_mamba1_ssm_dtype_flag() -> None:
    ssm = _ssm(JAMBA, mamba_ssm_cache_dtype="float32")
    assert (ssm.conv_dtype, ssm.ssm_dtype) == ("bfloat16", "float32")
    ssm = _ssm({**JAMBA, "torch_dtype": "float16"}, mamba_ssm_cache_dtype="bfloat16")
    assert (ssm.conv_dtype, ssm.ssm_dtype) == ("float16", "bfloat16")


def _qwen3(**extra: object) -> dict[str, object]:
    return {
        "model_type": "qwen3",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "max_window_layers": 2,
        "torch_dtype": "bfloat16",
        **extra,
    }


def test_qwen_sliding_windows_only_when_the_config_asks() -> None:
    from kvgeom.model.hfconfig import read_config

    def windows(config: dict[str, object]) -> list[int | None]:
        return [la.spec.sliding_window for la in read_config(config).layers]

    assert windows(_qwen3()) == [None] * 4  # no use_sliding_window: full attention everywhere
    assert windows(_qwen3(use_sliding_window=True)) == [None, None, 8, 8]


def test_attention_head_size_from_the_attention_hidden_size() -> None:
    """Zamba2-style configs size attention by ``attention_hidden_size`` (here 2 x hidden) when no head
    dimension is given: 128 / 4 heads = 32 elements per head."""
    from kvgeom.model.hfconfig import read_config

    config = _qwen3(attention_hidden_size=128)
    del config["head_dim"]
    assert {la.spec.head_size for la in read_config(config).layers} == {32}


def test_mamba2_inner_size_from_mamba_expand() -> None:
    """Mamba2 without a head dimension: inner = mamba_expand x hidden (here 4 x 64 = 256, 8 heads of 32)."""
    from kvgeom.model.hfconfig import read_config

    config = {
        "model_type": "nemotron_h",
        "num_hidden_layers": 2,
        "hybrid_override_pattern": "M*",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_num_heads": 8,
        "n_groups": 2,
        "ssm_state_size": 4,
        "conv_kernel": 4,
        "mamba_expand": 4,
        "torch_dtype": "bfloat16",
    }
    ssm = read_config(config).ssm_spec
    assert ssm is not None and ssm.temporal.units * ssm.temporal.unit_elems == 8 * 32 * 4


def test_falcon_inner_size_that_disagrees_with_the_heads_is_refused_with_its_value() -> None:
    from kvgeom.errors import SpecError
    from kvgeom.model.hfconfig import read_config

    config = {
        "model_type": "falcon_h1",
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_n_groups": 1,
        "mamba_d_state": 4,
        "mamba_d_conv": 4,
        "mamba_d_ssm": 100,
        "torch_dtype": "bfloat16",
    }
    with pytest.raises(SpecError) as err:
        read_config(config)
    assert err.value.field == "mamba_d_ssm" and err.value.values["value"] == 100
