"""An independent source for what the byte oracle shares with the core.

The oracle takes element sizes, state and page sizes and the layer of each region from ``kvgeom.model.spec`` /
``kvgeom.layout.geometry``, so a wrong number there fools core and oracle alike. Here every number comes from
elsewhere:

* dtype sizes from torch and numpy themselves;
* per layer, the cache bytes of every shipped preset, derived in this file from its ``config.json``
  (``tests/data/hf``) with the shape formulas written out below (vLLM 0.33.0's state-shape rules, in our
  own words) and the layer kinds of the card's hand-written ``layers`` list, at TP 1, 2 and 4: attention
  bytes per token, MLA latent bytes, conv rows x channels and the temporal state.

tests/vllm/test_shapes.py checks the same numbers against vLLM 0.33.0's own calculators.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvgeom import presets
from kvgeom.dtypes import DTYPE_BYTES
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec

ROOT = Path(__file__).resolve().parents[3]
HF = ROOT / "tests" / "data" / "hf"
CARDS = {
    p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "kvgeom" / "model" / "presets").glob("*.json"))
}
PRESETS = [n for n in CARDS if n != "minimax-text-01"]  # lightning attention: no kvgeom spec

TORCH_NAMES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "float": "float32",
    "half": "float16",
}


@pytest.mark.parametrize("name", sorted(DTYPE_BYTES))
def test_dtype_sizes_are_torch_element_sizes(name: str) -> None:
    import torch

    assert (
        DTYPE_BYTES[name] == torch.empty(0, dtype=getattr(torch, TORCH_NAMES.get(name, name))).element_size()
    )


@pytest.mark.parametrize("name", ["float32", "float16", "int8", "uint8"])
def test_dtype_sizes_are_numpy_item_sizes(name: str) -> None:
    assert DTYPE_BYTES[name] == np.dtype(name).itemsize


# -- the per-layer byte model ----------------------------------------------------------------------
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # IEEE sizes, written out


def _fields(name: str) -> dict[str, Any]:
    config = json.loads((HF / name / "config.json").read_text())
    return {**config, **config.get("text_config", {})}


def _model_dtype(f: dict[str, Any]) -> str:
    dtype = str(f.get("torch_dtype") or f.get("dtype") or "bfloat16")
    return "bfloat16" if dtype == "float32" else dtype  # vLLM serves float32 checkpoints in bfloat16


def _ssm_dtype(f: dict[str, Any], dtype: str) -> str:
    """vLLM 0.33.0's "auto" SSM cache dtype: NemotronH float32 unless its config says otherwise; Qwen3.5
    its ``mamba_ssm_dtype``; KDA float32; the rest the model dtype."""
    kind = f["model_type"]
    if kind == "nemotron_h":
        return str(f.get("mamba_ssm_cache_dtype", "float32"))
    if kind.startswith("qwen3_5"):
        return str(f.get("mamba_ssm_dtype", dtype))
    if kind == "kimi_linear":
        return "float32"
    return dtype


def _first(f: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if f.get(k) is not None:
            return f[k]
    raise KeyError(keys)


def _attention(f: dict[str, Any], tp: int, dtype: str) -> int:
    """K and V of the KV heads a rank holds (a head replicated when TP exceeds the head count)."""
    kv = int(f["num_key_value_heads"])
    head_dim = (
        f.get("head_dim")
        or f.get("attention_head_dim")
        or f.get("attention_head_size")
        or int(f.get("attention_hidden_size", f["hidden_size"])) // int(f["num_attention_heads"])
    )
    return 2 * max(1, kv // tp) * int(head_dim) * BYTES[dtype]


def _ssm(f: dict[str, Any], part: str, tp: int, dtype: str, ssm_dtype: str) -> tuple[int, int]:
    """(conv state bytes, temporal state bytes) of one SSM layer on one rank."""
    b, s = BYTES[dtype], BYTES[ssm_dtype]
    if part == "mamba2":
        heads = int(_first(f, "mamba_num_heads", "mamba_n_heads", "n_mamba_heads"))
        try:
            head_dim = int(_first(f, "mamba_head_dim", "mamba_d_head", "mamba_headdim"))
        except KeyError:  # the inner size (expand x hidden, expand 2 by default) split over the heads
            head_dim = int(f.get("mamba_expand", 2)) * int(f["hidden_size"]) // heads
        groups = int(_first(f, "n_groups", "mamba_n_groups", "mamba_ngroups"))
        state = int(_first(f, "ssm_state_size", "mamba_d_state"))
        kernel = int(_first(f, "conv_kernel", "mamba_d_conv"))
        groups_per_rank = groups // tp if groups % tp == 0 else 1  # fewer groups than ranks: replicated
        channels = heads * head_dim // tp + 2 * groups_per_rank * state
        return (kernel - 1) * channels * b, heads // tp * head_dim * state * s
    if part == "mamba1":
        inner = int(f["mamba_expand"]) * int(f["hidden_size"]) // tp
        return (int(f["mamba_d_conv"]) - 1) * inner * b, inner * int(f["mamba_d_state"]) * s
    if part == "gdn":  # conv over q, k (K heads) and v (V heads); the state is per V head, dk x dv
        nk, dk = int(f["linear_num_key_heads"]), int(f["linear_key_head_dim"])
        nv, dv = int(f["linear_num_value_heads"]), int(f["linear_value_head_dim"])
        channels = (2 * nk * dk + nv * dv) // tp
        return (int(f["linear_conv_kernel_dim"]) - 1) * channels * b, nv // tp * dk * dv * s
    if part == "kda":  # three short convs (q, k, v) of heads x head_dim; a head_dim x head_dim state per head
        c = f["linear_attn_config"]
        heads, hd = int(c["num_heads"]) // tp, int(c["head_dim"])
        return (int(c["short_conv_kernel_size"]) - 1) * 3 * heads * hd * b, heads * hd * hd * s
    raise AssertionError(part)


def _expected(name: str, tp: int) -> list[tuple[int, str, int | tuple[int, int]]]:
    f = _fields(name)
    dtype = _model_dtype(f)
    ssm_dtype = _ssm_dtype(f, dtype)
    out: list[tuple[int, str, int | tuple[int, int]]] = []
    for i, kind in enumerate(CARDS[name]["layers"]):
        for part in kind.split("+"):
            if part == "attention":
                out.append((i, "attention", _attention(f, tp, dtype)))
            elif part == "mla":
                out.append((i, "mla", (int(f["kv_lora_rank"]) + int(f["qk_rope_head_dim"])) * BYTES[dtype]))
            elif part in ("mamba2", "mamba1", "gdn", "kda"):
                out.append((i, "ssm", _ssm(f, part, tp, dtype, ssm_dtype)))
    return out


def _actual(name: str, tp: int) -> list[tuple[int, str, int | tuple[int, int]]]:
    out: list[tuple[int, str, int | tuple[int, int]]] = []
    for la in presets.load(name).layers:
        spec = la.spec
        if isinstance(spec, MambaSpec):
            out.append((la.index, "ssm", (spec.conv_bytes(tp), spec.ssm_bytes(tp))))
        elif isinstance(spec, MLASpec):
            out.append((la.index, "mla", spec.token_bytes(tp)))
        else:
            assert isinstance(spec, AttentionSpec)
            out.append((la.index, "attention", spec.token_bytes(tp)))
    return out


def _tps(name: str) -> list[int]:
    f = _fields(name)
    heads = [int(v) for k, v in f.items() if k.endswith("heads") and isinstance(v, int)]
    return [tp for tp in (1, 2, 4) if all(h % tp == 0 for h in heads if h >= tp)]


@pytest.mark.parametrize("name", PRESETS)
def test_preset_layer_bytes_match_an_independent_derivation(name: str) -> None:
    for tp in _tps(name):
        assert _actual(name, tp) == _expected(name, tp), f"{name} TP{tp}"


def test_nemotron_h_8b_by_hand() -> None:
    """Written out: 128 heads x 64, 8 groups x 128 state, conv 4, bf16 conv and (vLLM's NemotronH default)
    float32 temporal state; 8 KV heads x 128, bf16."""
    m = presets.load("nemotron-h-8b")
    ssm = m.ssm_spec
    assert (ssm.conv_bytes(1), ssm.ssm_bytes(1)) == (3 * (128 * 64 + 2 * 8 * 128) * 2, 128 * 64 * 128 * 4)
    assert m.attention_spec.token_bytes(1) == 2 * 8 * 128 * 2
    assert sum(la.kind.is_ssm for la in m.layers) == 24 and sum(not la.kind.is_ssm for la in m.layers) == 4
