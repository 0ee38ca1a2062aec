"""Every shipped preset's state and cache sizes against vLLM 0.33.0's own shape and dtype calculators
(issue 12: an independent source for what the byte oracle shares with the core).

For each SSM layer family vLLM computes the per-rank conv and temporal state shapes
(``MambaStateShapeCalculator``) and dtypes (``MambaStateDtypeCalculator``, with NemotronH's ``auto`` SSM
dtype resolved by vLLM's own ``NemotronHForCausalLMConfig``); attention and MLA pages come from
``FullAttentionSpec`` / ``MLAAttentionSpec.page_size_bytes``. kvgeom's preset must give the same bytes at
TP 1, 2 and 4.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator as Dt
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Sh
from vllm.model_executor.models.config import NemotronHForCausalLMConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from kvgeom import presets
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec

ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "tests" / "data" / "hf"
CARDS = {
    p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "kvgeom" / "model" / "presets").glob("*.json"))
}
PRESETS = [n for n in CARDS if n != "minimax-text-01"]


def _fields(name: str) -> dict[str, Any]:
    config = json.loads((HF / name / "config.json").read_text())
    return {**config, **config.get("text_config", {})}


def _get(f: dict[str, Any], *keys: str, default: Any = None) -> Any:
    return next((f[k] for k in keys if f.get(k) is not None), default)


def _model_dtype(f: dict[str, Any]) -> str:
    dtype = str(_get(f, "torch_dtype", "dtype", default="bfloat16"))
    return "bfloat16" if dtype == "float32" else dtype


def _ssm_cache_dtype(f: dict[str, Any]) -> str:
    """vLLM's ``--mamba-ssm-cache-dtype auto`` after the model's config hook (NemotronH, Qwen3.5)."""
    if f["model_type"] == "nemotron_h":
        cache = SimpleNamespace(mamba_ssm_cache_dtype="auto")
        NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype(
            cache_config=cache, hf_config=SimpleNamespace(**f)
        )
        return str(cache.mamba_ssm_cache_dtype)
    if f["model_type"].startswith("qwen3_5"):
        return str(f.get("mamba_ssm_dtype", "auto"))
    return "auto"


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def _vllm_state(f: dict[str, Any], kind: str, tp: int) -> tuple[int, int]:
    model_dtype, ssm = getattr(torch, _model_dtype(f)), _ssm_cache_dtype(f)
    if kind == "mamba2":
        heads = int(_get(f, "mamba_num_heads", "mamba_n_heads", "n_mamba_heads"))
        head_dim = _get(f, "mamba_head_dim", "mamba_d_head", "mamba_headdim")
        head_dim = (
            int(head_dim)
            if head_dim
            else int(_get(f, "mamba_expand", default=2)) * int(f["hidden_size"]) // heads
        )
        shapes = Sh.mamba2_state_shape(
            tp,
            heads * head_dim,
            int(_get(f, "n_groups", "mamba_n_groups", "mamba_ngroups")),
            heads,
            head_dim,
            int(_get(f, "ssm_state_size", "mamba_d_state")),
            int(_get(f, "conv_kernel", "mamba_d_conv")),
        )
        dtypes = Dt.mamba2_state_dtype(model_dtype, "auto", ssm)
    elif kind == "mamba1":
        shapes = Sh.mamba1_state_shape(
            tp,
            int(f["mamba_expand"]) * int(f["hidden_size"]),
            int(f["mamba_d_state"]),
            int(f["mamba_d_conv"]),
        )
        dtypes = Dt.mamba1_state_dtype(model_dtype, "auto", ssm)
    elif kind == "gdn":
        shapes = Sh.gated_delta_net_state_shape(
            tp,
            int(f["linear_num_key_heads"]),
            int(f["linear_num_value_heads"]),
            int(f["linear_key_head_dim"]),
            int(f["linear_value_head_dim"]),
            int(f["linear_conv_kernel_dim"]),
        )
        dtypes = Dt.gated_delta_net_state_dtype(model_dtype, "auto", ssm)
    elif kind == "kda":
        c = f["linear_attn_config"]
        shapes = Sh.kda_state_shape(
            tp, int(c["num_heads"]), int(c["head_dim"]), conv_kernel_size=int(c["short_conv_kernel_size"])
        )
        dtypes = Dt.kda_state_dtype(model_dtype, "auto", ssm)
    else:
        raise AssertionError(kind)
    return _nbytes(shapes[0], dtypes[0]), _nbytes(shapes[1], dtypes[1])


def _tps(f: dict[str, Any]) -> list[int]:
    heads = [int(v) for k, v in f.items() if k.endswith("heads") and isinstance(v, int)]
    return [tp for tp in (1, 2, 4) if all(h % tp == 0 for h in heads if h >= tp)]


@pytest.mark.parametrize("name", PRESETS)
def test_preset_states_match_vllms_calculators(name: str) -> None:
    f = _fields(name)
    model = presets.load(name)
    kinds = {part for k in CARDS[name]["layers"] for part in k.split("+")} & {
        "mamba2",
        "mamba1",
        "gdn",
        "kda",
    }
    for tp in _tps(f):
        for la in model.layers:
            spec = la.spec
            if isinstance(spec, MambaSpec):
                (kind,) = kinds
                assert (spec.conv_bytes(tp), spec.ssm_bytes(tp)) == _vllm_state(f, kind, tp), (
                    name,
                    tp,
                    la.name,
                )
            elif isinstance(spec, MLASpec):
                want = MLAAttentionSpec(
                    block_size=16,
                    num_kv_heads=1,
                    head_size=spec.latent_size,
                    dtype=getattr(torch, spec.dtype),
                ).page_size_bytes
                assert spec.token_bytes(tp) * 16 == want, (name, la.name)
            else:
                assert isinstance(spec, AttentionSpec)
                want = FullAttentionSpec(
                    block_size=16,
                    num_kv_heads=spec.heads_per_rank(tp),
                    head_size=spec.head_size,
                    dtype=getattr(torch, spec.dtype),
                ).page_size_bytes
                assert spec.token_bytes(tp) * 16 == want, (name, tp, la.name)
