"""The Hugging Face config reader: every shipped card's config.json gives the preset's spec, agrees with
the numbers the cards' authors computed by hand, follows vLLM's cache-dtype rules and block-size
derivation, and names the field at fault in a broken config."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvgeom import presets
from kvgeom.errors import KvgeomError, SpecError, UnsupportedError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import align_hybrid_block_size
from kvgeom.model.hfconfig import apply_cache_dtypes, layer_kinds, read_config
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec

ROOT = Path(__file__).resolve().parents[2]
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
        with pytest.raises(UnsupportedError, match="lightning") as exc:
            layer_kinds(_config(name))
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
    with pytest.raises(SpecError, match="kv_cache_dtype"):
        apply_cache_dtypes(spec, "fp4")


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
    assert str(exc.value).startswith(f"{field}: ")


def test_bad_files_and_values(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        read_config(tmp_path / "missing.json")
    with pytest.raises(SpecError, match="no such file"):
        read_config(tmp_path)  # a directory without config.json
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(SpecError, match="JSON object"):
        read_config(tmp_path / "config.json")
    with pytest.raises(SpecError, match="kv_cache_dtype"):
        read_config(_config("qwen3-8b"), kv_cache_dtype="int3")
    with pytest.raises(SpecError, match="mamba_ssm_cache_dtype"):
        read_config(_config("qwen3-8b"), mamba_ssm_cache_dtype="fp8")


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
