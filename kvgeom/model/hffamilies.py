"""Each Hugging Face model family kvgeom reads, as data: the config fields of its layers (attention, MLA,
Mamba1/2, GDN, KDA), its layer pattern, and its SSM-state dtype rule (:data:`FAMILIES`, keyed by
``model_type``); :mod:`kvgeom.model.hfconfig` reads a ``config.json`` through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvgeom.errors import SpecError, UnsupportedError
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec

__all__ = [
    "ConfigFields",
    "read_attention",
    "read_mla",
    "read_mamba2",
    "read_mamba1",
    "read_gdn",
    "read_kda",
    "FAMILIES",
]


_MISSING: Any = object()


class ConfigFields:
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


def _num_layers(f: ConfigFields) -> int:
    return f.num("num_hidden_layers")


def _check_length(f: ConfigFields, key: str, pattern: Pattern) -> Pattern:
    n = _num_layers(f)
    if len(pattern) != n:
        raise SpecError(
            f.name(key),
            f"describes {len(pattern)} layers, num_hidden_layers is {n}",
            value=len(pattern),
            expected=n,
        )
    return pattern


def _block_types(f: ConfigFields, key: str, ssm: str) -> Pattern:
    """A ``layer_types`` / ``layers_block_type`` list (either spelling of transformers' names)."""
    out: Pattern = []
    for i, t in enumerate(f.str_list(key)):
        if t not in _BLOCK_TYPES:
            raise SpecError(
                f.name(f"{key}[{i}]"), f"unknown layer type {t!r}; known: {sorted(_BLOCK_TYPES)}", value=t
            )
        out.append(tuple(ssm if p == "ssm" else p for p in _BLOCK_TYPES[t]))
    return _check_length(f, key, out)


def _nemotron_pattern(f: ConfigFields) -> Pattern:
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


def _jamba_pattern(f: ConfigFields) -> Pattern:
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


def _gdn_pattern(f: ConfigFields) -> Pattern:
    if f.has("layer_types"):
        return _block_types(f, "layer_types", "gdn")
    interval = f.num("full_attention_interval")
    return [("gdn",) if (i + 1) % interval else ("attention",) for i in range(_num_layers(f))]


def _kimi_pattern(f: ConfigFields) -> Pattern:
    c = f.get("linear_attn_config")
    if not isinstance(c, Mapping):
        raise SpecError(
            f.name("linear_attn_config"), "missing: Kimi-Linear lists its KDA layers there", value=c
        )
    lc = ConfigFields(c, f.name("linear_attn_config."))
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


def _dense_pattern(f: ConfigFields) -> Pattern:
    if f.has("layer_types"):
        return _block_types(f, "layer_types", "none")
    return [("attention",)] * _num_layers(f)


def _qwen_dense_pattern(f: ConfigFields) -> Pattern:
    """Qwen2/Qwen3: sliding windows only with ``use_sliding_window``, on layers >= ``max_window_layers``."""
    if f.has("layer_types"):
        return _block_types(f, "layer_types", "none")
    n = _num_layers(f)
    if not f.get("use_sliding_window", False):
        return [("attention",)] * n
    first = f.num("max_window_layers", default=n, minimum=0)
    return [("sliding",) if i >= first else ("attention",) for i in range(n)]


def _minimax(f: ConfigFields) -> Pattern:
    raise UnsupportedError(
        f.name("attn_type_list"),
        "MiniMax lightning (linear) attention keeps a per-head "
        "state with no conv state; kvgeom has no state layout for it",
        value=f.get("model_type"),
    )


# -- layer specs -----------------------------------------------------------------------------------------
def read_attention(f: ConfigFields, dtype: str, sliding: bool) -> AttentionSpec:
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


def read_mla(f: ConfigFields, dtype: str) -> MLASpec:
    return MLASpec(f.num("kv_lora_rank") + f.num("qk_rope_head_dim"), dtype)


def read_mamba2(f: ConfigFields, keys: dict[str, tuple[str, ...]], dtype: str, ssm: str) -> MambaSpec:
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


MAMBA2_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
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


def read_mamba1(f: ConfigFields, dtype: str, ssm: str) -> MambaSpec:
    inner = f.num("mamba_expand") * f.num("hidden_size")
    return MambaSpec.mamba1(inner, f.num("mamba_d_state"), f.num("mamba_d_conv", default=4), dtype, ssm)


def read_gdn(f: ConfigFields, dtype: str, ssm: str) -> MambaSpec:
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


def read_kda(f: ConfigFields, dtype: str, ssm: str) -> MambaSpec:
    lc = ConfigFields(f.get("linear_attn_config", {}), f.name("linear_attn_config."))
    return MambaSpec.kda(
        lc.num("num_heads"), lc.num("head_dim"), lc.num("short_conv_kernel_size", default=4), dtype, ssm
    )


# -- families ----------------------------------------------------------------------------------------------
# model_type -> (layer pattern, SSM family, vLLM's "auto" SSM cache dtype rule)
_SsmRule = Callable[[ConfigFields, str], str]


def _ssm_same_as_conv(f: ConfigFields, dtype: str) -> str:
    return dtype


def _ssm_nemotron(f: ConfigFields, dtype: str) -> str:  # vLLM: the config's value, else float32
    return str(f.get("mamba_ssm_cache_dtype", "float32"))


def _ssm_qwen35(f: ConfigFields, dtype: str) -> str:  # vLLM: the text config's mamba_ssm_dtype, else auto
    return str(f.get("mamba_ssm_dtype", dtype))


def _ssm_kda(f: ConfigFields, dtype: str) -> str:  # vLLM: KDA's recurrent state is float32 under auto
    return "float32"


FAMILIES: dict[str, tuple[Callable[[ConfigFields], Pattern], str | None, _SsmRule]] = {
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
