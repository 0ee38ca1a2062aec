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
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvgeom.dtypes import dtype_size
from kvgeom.errors import SpecError, UnsupportedError
from kvgeom.model.spec import AttentionSpec, Layer, LayerSpec, MambaSpec, MLASpec, ModelSpec

__all__ = [
    "KV_CACHE_DTYPES",
    "SSM_CACHE_DTYPES",
    "load_config",
    "read_config",
    "layer_kinds",
    "model_types",
    "apply_cache_dtypes",
]

#: accepted values of ``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype`` choices whose page is plain bytes)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
#: accepted values of ``mamba_ssm_cache_dtype`` (vLLM's ``--mamba-ssm-cache-dtype``)
SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")

_MISSING: Any = object()


class _Fields:
    """A config dict whose reads name the field at fault (``text_config.linear_num_key_heads``)."""

    def __init__(self, data: Mapping[str, Any], prefix: str = "") -> None:
        self.data = data
        self.prefix = prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def num(self, *keys: str, default: Any = _MISSING, minimum: int = 1) -> int:
        """The first of ``keys`` present, as an integer ``>= minimum``."""
        for key in keys:
            if self.has(key):
                return self._check_int(key, self.data[key], minimum)
        if default is _MISSING:
            alts = f" (or {', '.join(keys[1:])})" if len(keys) > 1 else ""
            raise SpecError(self.name(keys[0]), f"missing from the config{alts}", value=None)
        return int(default)

    def _check_int(self, key: str, value: Any, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise SpecError(self.name(key), f"must be an integer, got {value!r}", value=value)
        number = int(value)
        if number < minimum:
            raise SpecError(
                self.name(key), f"must be >= {minimum}, got {number}", value=number, expected=minimum
            )
        return number

    def int_list(self, key: str, minimum: int = 0) -> list[int]:
        value = self.data.get(key)
        if not isinstance(value, list):
            raise SpecError(self.name(key), f"must be a list of integers, got {value!r}", value=value)
        return [self._check_int(f"{key}[{i}]", v, minimum) for i, v in enumerate(value)]

    def str_list(self, key: str) -> list[str]:
        value = self.data.get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise SpecError(self.name(key), f"must be a list of strings, got {value!r}", value=value)
        return list(value)


# -- layer patterns --------------------------------------------------------------------------------------
# A pattern is one tuple of cache parts per decoder layer, in the card vocabulary: "attention", "mla",
# "mamba1", "mamba2", "gdn", "kda" (empty tuple: an MLP/MoE-only layer without a cache).
Pattern = list[tuple[str, ...]]

_NEMOTRON_CHARS = {"M": ("mamba2",), "*": ("attention",), "-": (), "E": ()}
_BLOCK_TYPES = {
    "mamba": ("ssm",),
    "linear_attention": ("ssm",),
    "attention": ("attention",),
    "full_attention": ("attention",),
    "sliding_attention": ("sliding",),
    "hybrid": ("attention", "ssm"),
    "mlp": (),
    "moe": (),
}


def _num_layers(f: _Fields) -> int:
    return f.num("num_hidden_layers")


def _check_length(f: _Fields, key: str, pattern: Pattern) -> Pattern:
    n = _num_layers(f)
    if len(pattern) != n:
        raise SpecError(
            f.name(key),
            f"describes {len(pattern)} layers, num_hidden_layers is {n}",
            value=len(pattern),
            expected=n,
        )
    return pattern


def _block_types(f: _Fields, key: str, ssm: str) -> Pattern:
    """A ``layer_types`` / ``layers_block_type`` list (either spelling of transformers' names)."""
    out: Pattern = []
    for i, t in enumerate(f.str_list(key)):
        if t not in _BLOCK_TYPES:
            raise SpecError(
                f.name(f"{key}[{i}]"), f"unknown layer type {t!r}; known: {sorted(_BLOCK_TYPES)}", value=t
            )
        out.append(tuple(ssm if p == "ssm" else p for p in _BLOCK_TYPES[t]))
    return _check_length(f, key, out)


def _nemotron_pattern(f: _Fields) -> Pattern:
    if f.has("layers_block_type") or f.has("layer_types"):
        return _block_types(f, "layers_block_type" if f.has("layers_block_type") else "layer_types", "mamba2")
    text = f.get("hybrid_override_pattern")
    if not isinstance(text, str):
        raise SpecError(
            f.name("hybrid_override_pattern"),
            "missing (or not a string): Nemotron-H needs it or layers_block_type",
            value=text,
        )
    bad = sorted(set(text) - set(_NEMOTRON_CHARS))
    if bad:
        raise SpecError(
            f.name("hybrid_override_pattern"),
            f"unknown layer characters {bad}; known: M (Mamba2), * (attention), - (MLP), E (MoE)",
            value=text,
        )
    return _check_length(f, "hybrid_override_pattern", [_NEMOTRON_CHARS[c] for c in text])


def _jamba_pattern(f: _Fields) -> Pattern:
    if f.has("layers_block_type"):
        return _block_types(f, "layers_block_type", "mamba1")
    period = f.num("attn_layer_period")
    offset = f.num("attn_layer_offset", minimum=0)
    if offset >= period:
        raise SpecError(
            f.name("attn_layer_offset"),
            f"{offset} must be below attn_layer_period {period}",
            value=offset,
            expected=period,
        )
    return [("attention",) if i % period == offset else ("mamba1",) for i in range(_num_layers(f))]


def _gdn_pattern(f: _Fields) -> Pattern:
    if f.has("layer_types"):
        return _block_types(f, "layer_types", "gdn")
    interval = f.num("full_attention_interval")
    return [("gdn",) if (i + 1) % interval else ("attention",) for i in range(_num_layers(f))]


def _kimi_pattern(f: _Fields) -> Pattern:
    c = f.get("linear_attn_config")
    if not isinstance(c, Mapping):
        raise SpecError(
            f.name("linear_attn_config"), "missing: Kimi-Linear lists its KDA layers there", value=c
        )
    lc = _Fields(c, f.name("linear_attn_config."))
    n = _num_layers(f)
    kda = set(lc.int_list("kda_layers", minimum=1))  # 1-indexed in the checkpoint config
    if max(kda, default=0) > n:
        raise SpecError(
            lc.name("kda_layers"),
            f"layer {max(kda)} is past num_hidden_layers {n} (1-indexed)",
            value=max(kda),
            expected=n,
        )
    if lc.has("full_attn_layers"):
        full = set(lc.int_list("full_attn_layers", minimum=1))
        if full & kda or full | kda != set(range(1, n + 1)):
            raise SpecError(
                lc.name("full_attn_layers"),
                f"with kda_layers must list every layer 1..{n} exactly once",
                value=sorted(full),
                expected=n,
            )
    return [("kda",) if i + 1 in kda else ("mla",) for i in range(n)]


def _dense_pattern(f: _Fields) -> Pattern:
    if f.has("layer_types"):
        return _block_types(f, "layer_types", "none")
    return [("attention",)] * _num_layers(f)


def _qwen_dense_pattern(f: _Fields) -> Pattern:
    """Qwen2/Qwen3: sliding windows only with ``use_sliding_window``, on layers >= ``max_window_layers``."""
    if f.has("layer_types"):
        return _block_types(f, "layer_types", "none")
    n = _num_layers(f)
    if not f.get("use_sliding_window", False):
        return [("attention",)] * n
    first = f.num("max_window_layers", default=n, minimum=0)
    return [("sliding",) if i >= first else ("attention",) for i in range(n)]


def _minimax(f: _Fields) -> Pattern:
    raise UnsupportedError(
        f.name("attn_type_list"),
        "MiniMax lightning (linear) attention keeps a per-head "
        "state with no conv state; kvgeom has no state layout for it",
        value=f.get("model_type"),
    )


# -- layer specs -----------------------------------------------------------------------------------------
def _attention(f: _Fields, dtype: str, sliding: bool) -> AttentionSpec:
    heads = f.num("num_attention_heads")
    kv = f.num("num_key_value_heads", default=heads)
    if heads % kv:
        raise SpecError(
            f.name("num_key_value_heads"),
            f"{kv} does not divide num_attention_heads {heads}",
            value=kv,
            expected=heads,
        )
    if f.has("head_dim") or f.has("attention_head_dim") or f.has("attention_head_size"):
        head_dim = f.num("head_dim", "attention_head_dim", "attention_head_size")
    else:
        hidden = f.num("attention_hidden_size", "hidden_size")
        if hidden % heads:
            raise SpecError(
                f.name("hidden_size"),
                f"{hidden} is not a multiple of num_attention_heads {heads} (and the config has no head_dim)",
                value=hidden,
                expected=heads,
            )
        head_dim = hidden // heads
    window = f.num("sliding_window") if sliding else None
    return AttentionSpec(kv, head_dim, dtype, sliding_window=window)


def _mla(f: _Fields, dtype: str) -> MLASpec:
    return MLASpec(f.num("kv_lora_rank") + f.num("qk_rope_head_dim"), dtype)


def _mamba2(f: _Fields, keys: dict[str, tuple[str, ...]], dtype: str, ssm: str) -> MambaSpec:
    heads = f.num(*keys["heads"])
    if f.has(keys["head_dim"][0]) and f.get(keys["head_dim"][0]) != "auto":
        head_dim = f.num(*keys["head_dim"])
        inner = heads * head_dim
    else:
        inner = f.num("mamba_expand", "expand", default=2) * f.num("hidden_size")
        if inner % heads:
            raise SpecError(
                f.name(keys["heads"][0]),
                f"{heads} heads do not divide the Mamba inner size {inner} (mamba_expand x hidden_size)",
                value=heads,
                expected=inner,
            )
        head_dim = inner // heads
    if "inner" in keys and f.has(keys["inner"][0]) and f.num(*keys["inner"]) != inner:
        raise SpecError(
            f.name(keys["inner"][0]),
            f"{f.num(*keys['inner'])} != {heads} heads x {head_dim} head dim",
            value=f.num(*keys["inner"]),
            expected=inner,
        )
    groups = f.num(*keys["groups"])
    if heads % groups:
        raise SpecError(
            f.name(keys["groups"][0]),
            f"{groups} groups do not divide {heads} Mamba heads",
            value=groups,
            expected=heads,
        )
    return MambaSpec.mamba2(
        heads, head_dim, groups, f.num(*keys["state"]), f.num(*keys["conv"], default=4), dtype, ssm
    )


_MAMBA2_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "nemotron_h": {
        "heads": ("mamba_num_heads",),
        "head_dim": ("mamba_head_dim",),
        "groups": ("n_groups",),
        "state": ("ssm_state_size",),
        "conv": ("conv_kernel",),
    },
    "falcon_h1": {
        "heads": ("mamba_n_heads",),
        "head_dim": ("mamba_d_head",),
        "groups": ("mamba_n_groups",),
        "state": ("mamba_d_state",),
        "conv": ("mamba_d_conv",),
        "inner": ("mamba_d_ssm",),
    },
    "zamba2": {
        "heads": ("n_mamba_heads",),
        "head_dim": ("mamba_headdim",),
        "groups": ("mamba_ngroups",),
        "state": ("mamba_d_state",),
        "conv": ("mamba_d_conv",),
    },
    "granitemoehybrid": {
        "heads": ("mamba_n_heads",),
        "head_dim": ("mamba_d_head",),
        "groups": ("mamba_n_groups",),
        "state": ("mamba_d_state",),
        "conv": ("mamba_d_conv",),
    },
}


def _mamba1(f: _Fields, dtype: str, ssm: str) -> MambaSpec:
    inner = f.num("mamba_expand") * f.num("hidden_size")
    return MambaSpec.mamba1(inner, f.num("mamba_d_state"), f.num("mamba_d_conv", default=4), dtype, ssm)


def _gdn(f: _Fields, dtype: str, ssm: str) -> MambaSpec:
    k_heads, v_heads = f.num("linear_num_key_heads"), f.num("linear_num_value_heads")
    if v_heads % k_heads:
        raise SpecError(
            f.name("linear_num_value_heads"),
            f"{v_heads} is not a multiple of linear_num_key_heads {k_heads}",
            value=v_heads,
            expected=k_heads,
        )
    return MambaSpec.gdn(
        k_heads,
        f.num("linear_key_head_dim"),
        v_heads,
        f.num("linear_value_head_dim"),
        f.num("linear_conv_kernel_dim", default=4),
        dtype,
        ssm,
    )


def _kda(f: _Fields, dtype: str, ssm: str) -> MambaSpec:
    lc = _Fields(f.get("linear_attn_config", {}), f.name("linear_attn_config."))
    return MambaSpec.kda(
        lc.num("num_heads"), lc.num("head_dim"), lc.num("short_conv_kernel_size", default=4), dtype, ssm
    )


# -- families ----------------------------------------------------------------------------------------------
# model_type -> (layer pattern, SSM family, vLLM's "auto" SSM cache dtype rule)
_SsmRule = Callable[[_Fields, str], str]


def _ssm_same_as_conv(f: _Fields, dtype: str) -> str:
    return dtype


def _ssm_nemotron(f: _Fields, dtype: str) -> str:  # vLLM: the config's value, else float32
    return str(f.get("mamba_ssm_cache_dtype", "float32"))


def _ssm_qwen35(f: _Fields, dtype: str) -> str:  # vLLM: the text config's mamba_ssm_dtype, else auto
    return str(f.get("mamba_ssm_dtype", dtype))


def _ssm_kda(f: _Fields, dtype: str) -> str:  # vLLM: KDA's recurrent state is float32 under auto
    return "float32"


_FAMILIES: dict[str, tuple[Callable[[_Fields], Pattern], str | None, _SsmRule]] = {
    **{
        t: (_dense_pattern, None, _ssm_same_as_conv)
        for t in ("llama", "mistral", "mixtral", "granite", "granitemoe", "phi3", "olmo2")
    },
    **{
        t: (_qwen_dense_pattern, None, _ssm_same_as_conv)
        for t in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
    },
    **{
        t: (lambda f: [("mla",)] * _num_layers(f), None, _ssm_same_as_conv)
        for t in ("deepseek_v2", "deepseek_v3", "kimi_k2")
    },
    "jamba": (_jamba_pattern, "mamba1", _ssm_same_as_conv),
    "nemotron_h": (_nemotron_pattern, "mamba2", _ssm_nemotron),
    "falcon_h1": (lambda f: [("attention", "mamba2")] * _num_layers(f), "mamba2", _ssm_same_as_conv),
    "zamba2": (lambda f: _block_types(f, "layers_block_type", "mamba2"), "mamba2", _ssm_same_as_conv),
    "granitemoehybrid": (lambda f: _block_types(f, "layer_types", "mamba2"), "mamba2", _ssm_same_as_conv),
    "qwen3_next": (_gdn_pattern, "gdn", _ssm_same_as_conv),
    "qwen3_5": (_gdn_pattern, "gdn", _ssm_qwen35),
    "qwen3_5_text": (_gdn_pattern, "gdn", _ssm_qwen35),
    "qwen3_5_moe": (_gdn_pattern, "gdn", _ssm_qwen35),
    "qwen3_5_moe_text": (_gdn_pattern, "gdn", _ssm_qwen35),
    "kimi_linear": (_kimi_pattern, "kda", _ssm_kda),
    "minimax_text_01": (_minimax, None, _ssm_same_as_conv),
    "minimax_m1": (_minimax, None, _ssm_same_as_conv),
}


def model_types() -> list[str]:
    """The ``model_type`` values :func:`read_config` knows."""
    return sorted(_FAMILIES)


def _text_fields(config: Mapping[str, Any]) -> tuple[_Fields, str]:
    """The fields that describe the language model (``text_config`` of a VLM wrapper) and its type."""
    if not isinstance(config, Mapping):
        raise SpecError("config", f"must be a JSON object, got {type(config).__name__}", value=config)
    text = config.get("text_config")
    f = _Fields(text, "text_config.") if isinstance(text, Mapping) else _Fields(config)
    model_type = f.get("model_type") or config.get("model_type")
    if not isinstance(model_type, str):
        raise SpecError(
            f.name("model_type"), "missing from the config (kvgeom picks the family by it)", value=model_type
        )
    if model_type not in _FAMILIES:
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
        "+".join("attention" if p == "sliding" else p for p in parts) for parts in _FAMILIES[model_type][0](f)
    ]


def _model_dtype(f: _Fields, config: Mapping[str, Any]) -> str:
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
    pattern_of, ssm_family, ssm_rule = _FAMILIES[model_type]
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
                specs[part] = _attention(f, attn_dtype, part == "sliding")
            elif part == "mla":
                specs[part] = _mla(f, attn_dtype)
            elif part == "mamba2":
                specs[part] = _mamba2(f, _MAMBA2_KEYS[model_type], dtype, ssm_dtype)
            elif part == "mamba1":
                specs[part] = _mamba1(f, dtype, ssm_dtype)
            elif part == "gdn":
                specs[part] = _gdn(f, dtype, ssm_dtype)
            elif part == "kda":
                specs[part] = _kda(f, dtype, ssm_dtype)
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
