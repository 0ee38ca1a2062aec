"""Model presets: real models' cache geometry, from the geometry cards shipped beside this module.

``load("nemotron-h-8b")`` returns a :class:`~kvgeom.model.spec.ModelSpec`; ``names()`` lists the cards.
Cards are data (see ``SOURCE.md``); this module only reads their config fields.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from kvgeom.errors import SpecError
from kvgeom.model.layers import AttentionSpec, Layer, LayerSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec

__all__ = ["names", "load", "from_card"]


def names() -> list[str]:
    """Card names (file stems) of every shipped model."""
    return sorted(p.name[:-5] for p in resources.files(__package__).iterdir() if p.name.endswith(".json"))


@cache
def load(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of a shipped card, by name (see :func:`names`)."""
    path = resources.files(__package__) / f"{name}.json"
    if not path.is_file():
        raise SpecError("model", f"no preset named {name!r}; known: {names()}", value=name)
    return from_card(json.loads(path.read_text()))


def _get(f: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if f.get(k) is not None:
            return f[k]
    return default


def _attention(f: dict[str, Any], card: dict[str, Any], dtype: str) -> AttentionSpec:
    heads = _get(f, "num_attention_heads")
    kv = _get(f, "num_key_value_heads", default=heads)
    head_dim = _get(
        f,
        "head_dim",
        "attention_head_dim",
        "attention_head_size",
        default=(card.get("derived") or {}).get("head_dim") or f["hidden_size"] // heads,
    )
    return AttentionSpec(int(kv), int(head_dim), dtype, sliding_window=_get(f, "sliding_window"))


def _mla(f: dict[str, Any], dtype: str) -> MLASpec:
    return MLASpec(int(f["kv_lora_rank"]) + int(f["qk_rope_head_dim"]), dtype)


def _mamba2(f: dict[str, Any], card: dict[str, Any], conv: str, ssm: str) -> MambaSpec:
    heads = int(_get(f, "mamba_num_heads", "mamba_n_heads", "n_mamba_heads"))
    head_dim = _get(
        f,
        "mamba_head_dim",
        "mamba_d_head",
        "mamba_headdim",
        default=(card.get("derived") or {}).get("mamba_d_head"),
    )
    if head_dim is None:  # granite-4.0-h-small: d_inner = 2 * hidden, split over the heads
        head_dim = 2 * int(f["hidden_size"]) // heads
    return MambaSpec.mamba2(
        heads,
        int(head_dim),
        int(_get(f, "n_groups", "mamba_n_groups", "mamba_ngroups")),
        int(_get(f, "ssm_state_size", "mamba_d_state")),
        int(_get(f, "conv_kernel", "mamba_d_conv", default=4)),
        conv,
        ssm,
    )


def _mamba1(f: dict[str, Any], conv: str, ssm: str) -> MambaSpec:
    inner = int(f["mamba_expand"]) * int(f["hidden_size"])
    return MambaSpec.mamba1(inner, int(f["mamba_d_state"]), int(f["mamba_d_conv"]), conv, ssm)


def _gdn(f: dict[str, Any], conv: str, ssm: str) -> MambaSpec:
    return MambaSpec.gdn(
        int(f["linear_num_key_heads"]),
        int(f["linear_key_head_dim"]),
        int(f["linear_num_value_heads"]),
        int(f["linear_value_head_dim"]),
        int(f["linear_conv_kernel_dim"]),
        conv,
        ssm,
    )


def _kda(f: dict[str, Any], conv: str) -> MambaSpec:
    c = f["linear_attn_config"]
    return MambaSpec.kda(
        int(c["num_heads"]), int(c["head_dim"]), int(c["short_conv_kernel_size"]), conv, "float32"
    )


def from_card(card: dict[str, Any]) -> ModelSpec:
    """Build a :class:`ModelSpec` from a geometry card (format: ``CARDS.md``)."""
    f = card["fields"].get("text_config", card["fields"])
    dtype = str(_get(f, "torch_dtype", "dtype", default="bfloat16"))
    # vLLM's "auto" SSM cache dtype: NemotronH keeps its temporal state in float32 unless the config says
    # otherwise (vLLM 0.33.0 NemotronHForCausalLMConfig; transformers' NemotronHConfig default too); the
    # other families keep the model dtype.
    auto_ssm = "float32" if f.get("model_type") == "nemotron_h" else dtype
    ssm_dtype = str(_get(f, "mamba_ssm_cache_dtype", "mamba_ssm_dtype", default=auto_ssm))
    layers: list[Layer] = []
    for i, kind in enumerate(card["layers"]):
        specs: list[tuple[str, LayerSpec]] = []
        for part in kind.split("+"):
            if part == "attention":
                specs.append(("attn", _attention(f, card, dtype)))
            elif part == "mla":
                specs.append(("attn", _mla(f, dtype)))
            elif part == "mamba2":
                specs.append(("mamba", _mamba2(f, card, dtype, ssm_dtype)))
            elif part == "mamba1":
                specs.append(("mamba", _mamba1(f, dtype, ssm_dtype)))
            elif part == "gdn":
                specs.append(("mamba", _gdn(f, dtype, ssm_dtype)))
            elif part == "kda":
                specs.append(("mamba", _kda(f, dtype)))
            elif part in ("mlp", "moe"):
                continue
            else:
                raise SpecError(
                    f"layers[{i}]",
                    f"layer kind {part!r} of {card['name']} has no kvgeom spec "
                    "(e.g. MiniMax lightning attention keeps no conv state)",
                    value=part,
                )
        layers.extend(Layer(f"layers.{i}.{suffix}", i, spec) for suffix, spec in specs)
    return ModelSpec(card["name"], tuple(layers))
