"""Hugging Face ``config.json`` -> :class:`~kvgeom.model.spec.ModelSpec`.

A checkpoint's ``config.json`` fixes its cache geometry: which decoder layers keep a KV cache (full or
sliding-window attention, or an MLA latent), which keep a recurrent state (Mamba1, Mamba2, GDN, KDA),
and the sizes of each. :func:`read_config` reads them for every family kvgeom ships presets of (dense
and MoE GQA, DeepSeek-style MLA, Jamba, Nemotron-H, Falcon-H1, Zamba2, Granite-4.0-H, Qwen3-Next,
Qwen3.5, Kimi-Linear), the way vLLM 0.33.0 reads them (docs/models.md lists the fields per family).
A config that is incomplete or inconsistent raises :class:`~kvgeom.errors.SpecError` naming the field;
a family kvgeom has no state layout for (MiniMax lightning attention) raises
:class:`~kvgeom.errors.UnsupportedError`.

Cache dtypes follow vLLM's flags: ``kv_cache_dtype`` (``--kv-cache-dtype``: ``auto`` = the model
dtype, or e.g. ``fp8``) sets the attention layers' dtype; ``mamba_ssm_cache_dtype``
(``--mamba-ssm-cache-dtype``: ``auto`` = the model family's rule) sets the SSM temporal state's.
The conv state always keeps the model dtype.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvgeom.dtypes import dtype_size
from kvgeom.errors import SpecError
from kvgeom.model.hffamilies import (
    FAMILIES,
    MAMBA2_KEYS,
    ConfigFields,
    read_attention,
    read_gdn,
    read_kda,
    read_mamba1,
    read_mamba2,
    read_mla,
)
from kvgeom.model.layers import Layer, LayerSpec, MambaSpec
from kvgeom.model.spec import ModelSpec

__all__ = [
    "KV_CACHE_DTYPES",
    "SSM_CACHE_DTYPES",
    "model_types",
    "layer_kinds",
    "read_config",
    "load_config",
    "apply_cache_dtypes",
]


#: accepted values of ``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype`` choices whose page is plain bytes)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")


#: accepted values of ``mamba_ssm_cache_dtype`` (vLLM's ``--mamba-ssm-cache-dtype``)
SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def model_types() -> list[str]:
    """The ``model_type`` values :func:`read_config` knows."""
    return sorted(FAMILIES)


def _text_fields(config: Mapping[str, Any]) -> tuple[ConfigFields, str]:
    """The fields that describe the language model (``text_config`` of a VLM wrapper) and its type."""
    if not isinstance(config, Mapping):
        raise SpecError("config", f"must be a JSON object, got {type(config).__name__}", value=config)
    text = config.get("text_config")
    f = ConfigFields(text, "text_config.") if isinstance(text, Mapping) else ConfigFields(config)
    model_type = f.get("model_type") or config.get("model_type")
    if not isinstance(model_type, str):
        raise SpecError(
            f.name("model_type"), "missing from the config (kvgeom picks the family by it)", value=model_type
        )
    if model_type not in FAMILIES:
        raise SpecError(
            f.name("model_type"),
            f"unknown model type {model_type!r}; kvgeom reads {model_types()}",
            value=model_type,
        )
    return f, model_type


def layer_kinds(config: Mapping[str, Any]) -> list[str]:
    """One entry per decoder layer in the vocabulary of kvgeom's model cards (``"attention"``,
    ``"mamba2"``, ``"attention+mamba2"``, ``"mla"``, ...; ``""`` for a layer without a cache)."""
    f, model_type = _text_fields(config)
    # a pattern already names each family's SSM (the patterns substitute it for "ssm")
    return [
        "+".join("attention" if p == "sliding" else p for p in parts) for parts in FAMILIES[model_type][0](f)
    ]


def _model_dtype(f: ConfigFields, config: Mapping[str, Any]) -> str:
    dtype = (
        f.get("torch_dtype")
        or f.get("dtype")
        or config.get("torch_dtype")
        or config.get("dtype")
        or "bfloat16"
    )
    dtype = str(dtype).removeprefix("torch.")
    if dtype == "float32":  # vLLM serves float32 checkpoints in bfloat16 unless told otherwise
        dtype = "bfloat16"
    dtype_size(dtype, f.name("torch_dtype"))
    return dtype


def _cache_dtype(value: str, model_dtype: str, field: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise SpecError(field, f"unknown cache dtype {value!r}; accepted: {list(allowed)}", value=value)
    return model_dtype if value == "auto" else value


def read_config(
    config: Mapping[str, Any] | str | Path,
    name: str | None = None,
    *,
    kv_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
) -> ModelSpec:
    """The :class:`ModelSpec` of a Hugging Face config (a dict, or the path of a ``config.json`` or of
    the directory holding it). ``name`` defaults to the config's ``_name_or_path`` or the file's
    directory name. Layers are named ``layers.<i>.attn`` / ``layers.<i>.mamba`` as in the presets."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        config = load_config(path)
        if name is None:
            name = str(config.get("_name_or_path") or (path if path.is_dir() else path.parent).resolve().name)
    f, model_type = _text_fields(config)
    pattern_of, ssm_family, ssm_rule = FAMILIES[model_type]
    pattern = pattern_of(f)
    dtype = _model_dtype(f, config)
    attn_dtype = _cache_dtype(kv_cache_dtype, dtype, "kv_cache_dtype", KV_CACHE_DTYPES)
    ssm_dtype = (
        ssm_rule(f, dtype)
        if mamba_ssm_cache_dtype == "auto"
        else _cache_dtype(mamba_ssm_cache_dtype, dtype, "mamba_ssm_cache_dtype", SSM_CACHE_DTYPES)
    )
    dtype_size(ssm_dtype, f.name("mamba_ssm_cache_dtype"))
    specs: dict[str, LayerSpec] = {}

    def spec(part: str) -> LayerSpec:
        if part not in specs:
            if part in ("attention", "sliding"):
                specs[part] = read_attention(f, attn_dtype, part == "sliding")
            elif part == "mla":
                specs[part] = read_mla(f, attn_dtype)
            elif part == "mamba2":
                specs[part] = read_mamba2(f, MAMBA2_KEYS[model_type], dtype, ssm_dtype)
            elif part == "mamba1":
                specs[part] = read_mamba1(f, dtype, ssm_dtype)
            elif part == "gdn":
                specs[part] = read_gdn(f, dtype, ssm_dtype)
            elif part == "kda":
                specs[part] = read_kda(f, dtype, ssm_dtype)
            else:
                raise SpecError(f.name("model_type"), f"{model_type} has no {part!r} layers", value=part)
        return specs[part]

    layers = [
        Layer(f"layers.{i}.{'mamba' if spec(p).kind.is_ssm else 'attn'}", i, spec(p))
        for i, parts in enumerate(pattern)
        for p in parts
    ]
    if not layers:
        raise SpecError(f.name("num_hidden_layers"), "the config describes no cache-holding layer", value=0)
    label = name or str(config.get("_name_or_path") or model_type)
    return ModelSpec(label, tuple(layers))


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a ``config.json`` (or the one in directory ``path``), naming the file at fault."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise SpecError(
            "model",
            f"no such file: {p} (accepted: a preset name or its Hugging Face id, or the path "
            "of a config.json or of its directory)",
            value=str(p),
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(
            "model",
            f"cannot read {p}: {exc.__class__.__name__} (accepted: a readable config.json)",
            value=str(p),
        ) from None
    except json.JSONDecodeError as exc:
        raise SpecError(
            "model", f"{p} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})", value=str(p)
        ) from None
    if not isinstance(data, dict):
        raise SpecError(
            "model",
            f"{p} must hold a JSON object, got {type(data).__name__} (accepted: a JSON object)",
            value=str(p),
        )
    return data


def apply_cache_dtypes(
    model: ModelSpec, kv_cache_dtype: str = "auto", mamba_ssm_cache_dtype: str = "auto"
) -> ModelSpec:
    """``model`` with its attention layers' dtype set to ``kv_cache_dtype`` and its SSM temporal state's
    to ``mamba_ssm_cache_dtype`` (``"auto"`` keeps what the spec has)."""
    _cache_dtype(kv_cache_dtype, "auto", "kv_cache_dtype", KV_CACHE_DTYPES)
    _cache_dtype(mamba_ssm_cache_dtype, "auto", "mamba_ssm_cache_dtype", SSM_CACHE_DTYPES)
    if kv_cache_dtype == "auto" and mamba_ssm_cache_dtype == "auto":
        return model

    def change(spec: LayerSpec) -> LayerSpec:
        if isinstance(spec, MambaSpec):
            return spec if mamba_ssm_cache_dtype == "auto" else replace(spec, ssm_dtype=mamba_ssm_cache_dtype)
        return spec if kv_cache_dtype == "auto" else replace(spec, dtype=kv_cache_dtype)

    return ModelSpec(model.name, tuple(Layer(la.name, la.index, change(la.spec)) for la in model.layers))
