"""Hypothesis strategies for one engine's side of a pair: layer specs, models (every family kvgeom models,
CSA-linear rows included), the TP sizes a model allows, and engine configurations (:mod:`kvgeom.testing.strategies`
builds P/D pairs, requests and cases from them)."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from kvgeom.layout.engine import ConvLayout, EngineConfig, KVLayout
from kvgeom.layout.geometry import align_hybrid_block_size
from kvgeom.model.csa import csa_linear_model
from kvgeom.model.layers import (
    AttentionSpec,
    CircularBufferSpec,
    LayerSpec,
    MambaSpec,
    MLASpec,
    ReplicatedStateSpec,
    Shard,
)
from kvgeom.model.spec import ModelSpec

__all__ = [
    "TP_SIZES",
    "attention_specs",
    "csa_linear_models",
    "engine_configs",
    "mla_specs",
    "model_specs",
    "ssm_specs",
    "valid_tp_sizes",
]

TP_SIZES = (1, 2, 4, 8)
_DTYPES = ("float16", "float32", "fp8")
_SSM_DTYPES = ("float16", "float32")


# -- layer specs ------------------------------------------------------------------------------------
@st.composite
def attention_specs(draw: st.DrawFn) -> AttentionSpec:
    """Small attention specs; 1-8 KV heads (fewer than ranks at high TP), optional distinct V size."""
    heads = draw(st.sampled_from((2, 1, 4, 8)))
    head_size = draw(st.sampled_from((2, 4, 8)))
    v = draw(st.sampled_from((None, 2, 4)))
    return AttentionSpec(heads, head_size, draw(st.sampled_from(_DTYPES)), v)


@st.composite
def mla_specs(draw: st.DrawFn) -> MLASpec:
    return MLASpec(draw(st.sampled_from((4, 6, 8, 12))), draw(st.sampled_from(_DTYPES)))


@st.composite
def ssm_specs(draw: st.DrawFn) -> MambaSpec:
    """Small Mamba1 / Mamba2 / GDN / KDA states (Mamba2 ``n_groups`` may be below TP: replicated B/C)."""
    family = draw(st.sampled_from(("mamba2", "mamba1", "gdn", "kda")))
    kernel = draw(st.sampled_from((2, 3, 4)))
    conv, ssm = draw(st.sampled_from(_SSM_DTYPES)), draw(st.sampled_from(_SSM_DTYPES))
    small = st.sampled_from((1, 2))
    heads = st.sampled_from((2, 4, 8, 1))
    if family == "mamba1":
        return MambaSpec.mamba1(draw(st.sampled_from((2, 4, 8))), draw(small), kernel, conv, ssm)
    if family == "mamba2":
        return MambaSpec.mamba2(
            draw(heads), draw(small), draw(st.sampled_from((2, 1, 4))), draw(small), kernel, conv, ssm
        )
    if family == "gdn":
        return MambaSpec.gdn(draw(heads), draw(small), draw(heads), draw(small), kernel, conv, ssm)
    return MambaSpec.kda(draw(heads), draw(small), kernel, conv, ssm)


def _windowed(spec: AttentionSpec | MLASpec, window: int) -> AttentionSpec | MLASpec:
    if isinstance(spec, MLASpec):
        return MLASpec(spec.latent_size, spec.dtype, window)
    return AttentionSpec(spec.num_kv_heads, spec.head_size, spec.dtype, spec.head_size_v, window)


@st.composite
def csa_linear_models(draw: st.DrawFn) -> ModelSpec:
    """Small CSA-linear models (:func:`kvgeom.model.csa.csa_linear_model`): 1-2 MLA layers of 4-16 elements per
    token, each with a ring (compression ratio 2 or 4, 0-2 speculative tokens) and an SSM layer of any
    family overlaid, and a replicated short-conv page of 2-8 channels on the first tensor; half of them with a
    head-sharded main KV of 1, 2 or 4 KV heads per CSA decoder layer (vLLM's ``Qwen4ExpQSAAttention``)."""
    return csa_linear_model(
        "csa-linear",
        num_csa_layers=draw(st.integers(1, 2)),
        head_size=draw(st.sampled_from((8, 4, 16))),
        compress_ratio=draw(st.sampled_from((4, 2))),
        speculative_tokens=draw(st.integers(0, 2)),
        gdn=draw(ssm_specs()),
        ple_channels=draw(st.sampled_from((8, 2, 4))),
        ple_conv_kernel=draw(st.sampled_from((4, 2, 3))),
        main_kv_heads=draw(st.sampled_from((0, 2, 0, 1, 0, 4))),
        dtype=draw(st.sampled_from(_SSM_DTYPES)),
    )


@st.composite
def model_specs(draw: st.DrawFn, families: tuple[str, ...] | None = None) -> ModelSpec:
    """Small models of one family: ``dense`` (attention, maybe with sliding-window layers), ``mla``,
    ``attn+ssm``, ``mla+ssm``, ``ssm`` or ``mla+draft`` (MLA layers, then the head-sharded attention layers of
    a GQA draft) (restrict with ``families``); ``csa-linear`` (:func:`csa_linear_models`) only when named."""
    family = draw(st.sampled_from(families or ("dense", "mla", "attn+ssm", "mla+ssm", "ssm", "mla+draft")))
    if family == "csa-linear":
        return draw(csa_linear_models())
    layers: list[LayerSpec] = []
    if family == "mla+draft":
        target = [draw(mla_specs())] * draw(st.integers(1, 2))
        return ModelSpec.from_layers(family, target + [draw(attention_specs())] * draw(st.integers(1, 2)))
    if family != "ssm":
        base: AttentionSpec | MLASpec
        if family in ("dense", "attn+ssm"):
            base = draw(attention_specs())
        else:
            base = draw(mla_specs())
        n = draw(st.integers(1, 3))
        plain = [False] * n
        windowed = (
            draw(st.lists(st.booleans(), min_size=n, max_size=n)) if family in ("dense", "mla") else plain
        )
        layers += [_windowed(base, 8) if w else base for w in windowed]
    if family in ("attn+ssm", "mla+ssm", "ssm"):
        ssm = draw(ssm_specs())
        layers += [ssm] * draw(st.integers(1, 3))
        layers = draw(st.permutations(layers)) if family != "ssm" else layers
    return ModelSpec.from_layers(family, layers)


# -- engines ----------------------------------------------------------------------------------------
def _shards(model: ModelSpec) -> list[Shard]:
    out: list[Shard] = []
    for layer in model.layers:
        spec = layer.spec
        if isinstance(spec, AttentionSpec):
            out.append(spec.heads)
        elif isinstance(spec, MambaSpec):
            out += [*spec.conv_pieces, spec.temporal]
    return out


def valid_tp_sizes(model: ModelSpec) -> tuple[int, ...]:
    """TP sizes of :data:`TP_SIZES` at which every sharded unit splits into whole units per rank."""
    return tuple(tp for tp in TP_SIZES if all(s.units % tp == 0 or tp % s.units == 0 for s in _shards(model)))


def _is_hybrid(model: ModelSpec) -> bool:
    return model.has_ssm and any(not la.kind.is_ssm for la in model.layers)


def _divisors(n: int, most: int = 8) -> list[int]:
    """Divisors ``d`` of ``n`` with ``n // d <= most`` (kernel blocks), largest first (ppl 1 first)."""
    return [n // p for p in range(1, most + 1) if n % p == 0]


def _overlay_need(model: ModelSpec, tp: int) -> tuple[int, int]:
    """Bytes per token of the owners' pages and the largest page overlaid on them (a model with explicit
    sharing: every state and ring must fit one owner page)."""
    per_token = max(la.spec.token_bytes(tp) for la in model.layers if isinstance(la.spec, MLASpec))
    need = 1
    for la in model.layers:
        spec = la.spec
        if isinstance(spec, CircularBufferSpec):
            need = max(need, spec.page_bytes(tp))
        elif isinstance(spec, (MambaSpec, ReplicatedStateSpec)):
            need = max(need, spec.state_bytes(tp))
    return per_token, need


@st.composite
def _block_size(draw: st.DrawFn, model: ModelSpec, tp: int) -> int:
    if model.overlays:  # the smallest multiple of 4 tokens whose owner page holds every overlaid page
        per_token, need = _overlay_need(model, tp)
        return 4 * math.ceil(need / (4 * per_token)) * draw(st.sampled_from((1, 2)))
    if _is_hybrid(model):
        return align_hybrid_block_size(
            model, tp, draw(st.sampled_from((4, 1, 2, 8))), draw(st.sampled_from((4, 1, 2, 8, 16)))
        )
    return draw(st.sampled_from((4, 2, 1, 8, 16)))


def _engine(
    model: ModelSpec,
    tp: int,
    block: int,
    kernel: int,
    num_blocks: int,
    layout: KVLayout,
    kv_split: bool,
    conv: ConvLayout,
    dcp: int = 1,
    pp: int = 1,
    packed: bool = False,
) -> EngineConfig:
    return EngineConfig(
        tp_size=tp,
        block_size=block,
        num_blocks=num_blocks,
        kernel_block_size=kernel,
        kv_layout=layout,
        kv_split=kv_split,
        conv_layout=conv,
        dcp_size=dcp,
        pp_size=pp,
        packed_rows=packed,
    )


def _group_count(model: ModelSpec) -> int:
    counts: dict[object, int] = {}
    for la in model.layers:
        counts[la.spec] = counts.get(la.spec, 0) + 1
    size = min(counts.values())
    return sum(math.ceil(c / size) for c in counts.values())


@st.composite
def _layouts(draw: st.DrawFn, model: ModelSpec) -> tuple[KVLayout, bool, ConvLayout]:
    single_attention = not model.has_ssm and not model.is_mla and _group_count(model) == 1
    layout = draw(st.sampled_from((KVLayout.HEAD_MAJOR, KVLayout.TOKEN_MAJOR)))
    kv_split = draw(st.booleans()) if single_attention else False
    conv = draw(st.sampled_from((ConvLayout.DS, ConvLayout.SD))) if model.has_ssm else ConvLayout.DS
    return layout, kv_split, conv


@st.composite
def engine_configs(draw: st.DrawFn, model: ModelSpec, tp: int | None = None) -> EngineConfig:
    """One engine for ``model``: TP size, logical block (hybrid: aligned), kernel block, pool, layouts."""
    tp = tp or draw(st.sampled_from(valid_tp_sizes(model)))
    block = draw(_block_size(model, tp))
    kernel = draw(st.sampled_from(_divisors(block)))
    groups = _group_count(model)
    layout, kv_split, conv = draw(_layouts(model))
    return _engine(
        model, tp, block, kernel, draw(st.integers(groups + 1, 3 * groups + 6)), layout, kv_split, conv
    )


# -- P/D pairs --------------------------------------------------------------------------------------
