"""One engine rank's layout computed from a model and an engine config (:func:`rank_geometry`): the KV-cache
groups (by spec equality), then the regions of one of the allocation families: uniform regions (one per
layer, or K and V apart), vLLM's packed hybrid pages (attention and SSM state overlaid in one block), and
the packed block-outermost CSA-linear rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvgeom.errors import ConfigError, SpecError
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import (
    Group,
    RankGeometry,
    Region,
    SSMLayout,
    align_hybrid_block_size,
    page_bytes_of,
    region_parts,
)
from kvgeom.layout.overlay import overlay_geometry, packed_overlay_geometry
from kvgeom.model.layers import (
    AttentionSpec,
    LayerSpec,
    MambaSpec,
    MLASpec,
)
from kvgeom.model.spec import ModelSpec
from kvgeom.model.stages import stage_layers

__all__ = ["ALLOCATION_FAMILIES", "AllocationFamily", "rank_geometry"]


def _spec_key(spec: LayerSpec) -> tuple[object, ...]:
    return (type(spec).__name__, spec)


def _engine_groups(model: ModelSpec, order: tuple[tuple[str, ...], ...]) -> tuple[Group, ...]:
    """The engine's own KV-cache groups (``EngineConfig.kv_cache_groups``), checked: every name a cache
    layer of ``model``, every cache layer in exactly one group, each group's layers of one spec."""
    specs = {la.name: la.spec for la in model.layers}
    seen: dict[str, int] = {}
    for g, names in enumerate(order):
        for name in names:
            if name not in specs:
                raise ConfigError(
                    f"kv_cache_groups[{g}]",
                    f"layer {name!r} is not a cache layer of {model.name!r}",
                    value=name,
                    expected=sorted(specs),
                )
            if name in seen:
                raise ConfigError(
                    f"kv_cache_groups[{g}]",
                    f"layer {name!r} is in groups {seen[name]} and {g}",
                    value=name,
                    expected=seen[name],
                )
            seen[name] = g
            if specs[name] != specs[names[0]]:
                raise SpecError(
                    f"kv_cache_groups[{g}]",
                    f"layers {names[0]!r} and {name!r} of one group have different specs",
                    local=specs[names[0]],
                    remote=specs[name],
                )
    missing = [name for name in specs if name not in seen]
    if missing:
        raise ConfigError(
            "kv_cache_groups",
            f"cache layers {missing} are in no group",
            value=missing,
            expected=sorted(specs),
        )
    return tuple(Group(g, specs[names[0]], tuple(names)) for g, names in enumerate(order))


def _make_groups(model: ModelSpec) -> tuple[Group, ...]:
    """vLLM HMA grouping: one group per spec if the model is uniform, else chunks of the smallest
    per-spec layer count; attention-like groups first, SSM groups after, each in layer order. A model whose
    layers are all full attention (GQA or MLA latents, any sizes: e.g. a GQA draft under an MLA target) is one
    group of per-layer regions, as vLLM merges layers that need the same token slots."""
    full = [
        la
        for la in model.layers
        if isinstance(la.spec, (AttentionSpec, MLASpec)) and not la.spec.sliding_window
    ]
    if len(full) == len(model.layers) and len({la.spec for la in full}) > 1:
        return (Group(0, model.layers[0].spec, tuple(la.name for la in model.layers)),)
    by_spec: dict[tuple[object, ...], list[str]] = {}
    specs: dict[tuple[object, ...], LayerSpec] = {}
    for layer in model.layers:
        key = _spec_key(layer.spec)
        by_spec.setdefault(key, []).append(layer.name)
        specs[key] = layer.spec
    keys = sorted(by_spec, key=lambda k: specs[k].kind.is_ssm)  # stable: keeps first-appearance order
    size = min(len(v) for v in by_spec.values())
    groups: list[Group] = []
    for key in keys:
        names = by_spec[key]
        for start in range(0, len(names), size):
            groups.append(Group(len(groups), specs[key], tuple(names[start : start + size])))
    return tuple(groups)


def _check_tp(model: ModelSpec, tp: int) -> None:
    for layer in model.layers:
        spec = layer.spec
        if isinstance(spec, AttentionSpec):
            spec.heads.check_tp(tp, f"{layer.name}.num_kv_heads")
        elif isinstance(spec, MambaSpec):
            spec.check_tp(tp)


def _split(groups: tuple[Group, ...], separate: tuple[str, ...], model: ModelSpec) -> tuple[Group, ...]:
    """The engine's own grouping: ``separate`` layers in a group of their own (after the others), with their
    own tensors; kvgeom models it for models of one group of attention or MLA layers."""
    if not separate:
        return groups
    names = {la.name for la in model.layers}
    unknown = sorted(set(separate) - names)
    if unknown:
        raise ConfigError(
            "separate_group", f"layers {unknown} are not cache layers of {model.name!r}", value=unknown
        )
    if len(groups) != 1 or model.has_ssm:
        raise ConfigError(
            "separate_group",
            "a separate group is modelled for models of one group of attention or MLA layers",
            value=list(separate),
        )
    (g,) = groups
    rest = tuple(n for n in g.layers if n not in separate)
    if not rest:
        return groups
    return (Group(0, g.spec, rest), Group(1, g.spec, tuple(n for n in g.layers if n in separate)))


def _project(groups: tuple[Group, ...], held: set[str]) -> tuple[Group, ...]:
    """The groups as one pipeline stage holds them: same indices (the scheduler's), the stage's layers only
    (vLLM projects its global groups onto each stage; a group may hold no layer of a stage)."""
    return tuple(Group(g.index, g.spec, tuple(name for name in g.layers if name in held)) for g in groups)


@dataclass(frozen=True)
class AllocationFamily:
    """One way an engine allocates a rank's cache, as data: ``applies`` says whether the model and engine use
    it, ``build`` lays the rank out (``held``: the cache layers of the engine's pipeline stage).
    :func:`rank_geometry` takes the first family of :data:`ALLOCATION_FAMILIES` that applies; a new
    allocation is a new row, not a branch inside another family."""

    name: str
    applies: Callable[[ModelSpec, EngineConfig], bool]
    build: Callable[[ModelSpec, EngineConfig, frozenset[str]], RankGeometry]


def rank_geometry(model: ModelSpec, engine: EngineConfig) -> RankGeometry:
    """Derive the geometry of ``engine``'s rank for ``model``: the checks every family shares (TP divides
    the heads, the stage holds a cache layer), then the first of :data:`ALLOCATION_FAMILIES` that applies."""
    _check_tp(model, engine.tp_size)
    held = frozenset(la.name for la in stage_layers(model, engine.pp_rank, engine.pp_size))
    if not held:
        raise ConfigError(
            "pp_rank",
            f"pipeline stage {engine.pp_rank} of {engine.pp_size} holds no cache layer of {model.name!r}",
            value=engine.pp_rank,
            expected=engine.pp_size,
        )
    family = next(f for f in ALLOCATION_FAMILIES if f.applies(model, engine))
    return family.build(model, engine, held)


def _stage_groups(model: ModelSpec, engine: EngineConfig, held: frozenset[str]) -> tuple[Group, ...]:
    """The groups of a model without tensor sharing, as the stage holds them: the engine's own grouping
    (or vLLM's), the separate group split off, projected onto ``held``."""
    own = _engine_groups(model, engine.kv_cache_groups) if engine.kv_cache_groups else _make_groups(model)
    return _project(_split(own, engine.separate_group, model), set(held))


def _check_packed_rows(model: ModelSpec, engine: EngineConfig) -> None:
    if engine.packed_rows and (
        model.ssm_spec is not None or not all(isinstance(la.spec, MLASpec) for la in model.layers)
    ):
        raise ConfigError(
            "packed_rows",
            "kvgeom models packed (block-outermost) rows for MLA models without SSM "
            "state (vLLM moves only those rows whole: a row of head-sharded pages cannot be cut by "
            "heads)",
            value=True,
        )


def _is_uniform(model: ModelSpec, engine: EngineConfig) -> bool:
    """One group (or a separate group split off it) and no SSM state: a region per layer. The group count
    is the engine's own grouping's, or vLLM's (projection onto a stage keeps every group)."""
    if model.overlays or model.ssm_spec is not None:
        return False
    if engine.separate_group:
        return True
    return (len(engine.kv_cache_groups) if engine.kv_cache_groups else len(_make_groups(model))) == 1


def _uniform_geometry(model: ModelSpec, engine: EngineConfig, held: frozenset[str]) -> RankGeometry:
    """One region per layer in model order (two if K and V are split); the page is one layer's blocks of
    every region of the first layer, the rows packed block-outermost if the engine packs them."""
    groups = _stage_groups(model, engine, held)
    _check_packed_rows(model, engine)
    regions = _uniform_regions(groups, engine, engine.num_blocks * engine.ppl, model)
    first = regions[0].members[0][1]
    page = sum(r.block_stride for r in regions if r.members[0][1] == first) * engine.ppl
    if engine.packed_rows:
        regions = _packed(regions)
    return RankGeometry(model, engine, groups, regions, page, None)


def _hybrid_page(model: ModelSpec, engine: EngineConfig, groups: tuple[Group, ...]) -> int:
    """vLLM's unified page of a hybrid model: the largest group's page, which every attention page must
    equal (an SSM state fits one) and which divides into the kernel blocks."""
    if engine.kv_split:
        raise ConfigError(
            "kv_split", "split K/V regions are not supported for hybrid (multi-group) models", value=True
        )
    tp, ppl = engine.tp_size, engine.ppl
    pages = {g.index: page_bytes_of(g.spec, engine.block_size, tp) for g in groups}
    page = max(pages.values())
    attn_pages = {pages[g.index] for g in groups if not g.is_ssm}
    if attn_pages and attn_pages != {page}:
        suggestion = align_hybrid_block_size(model, tp, engine.block_size)
        raise ConfigError(
            "block_size",
            f"attention pages {sorted(attn_pages)} B do not all equal the unified page {page} B at block "
            f"size {engine.block_size} (TP{tp}); an SSM state must fit one attention page: use block size "
            f"{suggestion} (align_hybrid_block_size)",
            value=engine.block_size,
            expected=suggestion,
        )
    if page % ppl:
        raise ConfigError(
            "kernel_block_size",
            f"page {page} B is not divisible into {ppl} kernel blocks",
            value=engine.kernel,
            expected=engine.block_size,
        )
    return page


def _hybrid_geometry(model: ModelSpec, engine: EngineConfig, held: frozenset[str]) -> RankGeometry:
    """vLLM's hybrid allocation: region ``i`` is the ``i``-th layer of every group, overlaid in one page per
    block (attention KV or SSM state), the SSM state's pieces from the page's start."""
    groups = _stage_groups(model, engine, held)
    _check_packed_rows(model, engine)
    page = _hybrid_page(model, engine, groups)
    ppl, nb_kernel = engine.ppl, engine.num_blocks * engine.ppl
    count = max(len(g.layers) for g in groups)
    hybrid: list[Region] = []
    for i in range(count):
        members = tuple((g.index, g.layers[i]) for g in groups if i < len(g.layers))
        is_mla = any(groups[gi].is_mla for gi, _ in members)
        part = "state" if all(groups[gi].is_ssm for gi, _ in members) else "kv"
        hybrid.append(Region(i, members[0][1], page // ppl, page // ppl, nb_kernel, is_mla, members, part))
    if engine.packed_rows:
        return RankGeometry(model, engine, groups, _packed(tuple(hybrid)), page, None)
    ssm_regions = tuple(
        r.index for r in hybrid if any(isinstance(groups[g].spec, MambaSpec) for g, _ in r.members)
    )
    ssm = SSMLayout.of(model.ssm_spec, engine.tp_size, ssm_regions)
    return RankGeometry(model, engine, groups, tuple(hybrid), page, ssm)


def _packed(regions: tuple[Region, ...]) -> tuple[Region, ...]:
    """The block-outermost layout of ``regions``: one row per kernel block holding each region's block
    side by side, in region order (vLLM ``BLHNC``: every layer's page of a block in one row)."""
    offsets, pos = [], 0
    for r in regions:
        offsets.append(pos)
        pos += r.block_len
    members = tuple(m for r in regions for m in r.members)
    slots = tuple((off, r.block_len) for r, off in zip(regions, offsets) for _ in r.members)
    first = regions[0]
    return (
        Region(
            0, first.name, pos, pos, first.num_blocks, all(r.is_mla for r in regions), members, "kv", slots
        ),
    )


def _uniform_regions(
    groups: tuple[Group, ...], engine: EngineConfig, nb_kernel: int, model: ModelSpec
) -> tuple[Region, ...]:
    """Regions of an attention model without shared tensors: one per layer in model order (two if K and V are
    split), each viewed by its layer's group."""
    specs = {la.name: la.spec for la in model.layers}
    group_of = {name: g for g in groups for name in g.layers}
    regions: list[Region] = []
    for name in (la.name for la in model.layers if la.name in group_of):
        spec, group = specs[name], group_of[name]
        for part, length in region_parts(spec, engine):
            idx = len(regions)
            regions.append(
                Region(
                    idx,
                    name if part == "kv" else f"{name}.{part}",
                    length,
                    length,
                    nb_kernel,
                    isinstance(spec, MLASpec),
                    ((group.index, name),),
                    part,
                )
            )
    return tuple(regions)


ALLOCATION_FAMILIES: tuple[AllocationFamily, ...] = (
    AllocationFamily(
        "packed CSA-linear rows",
        lambda model, engine: bool(model.overlays) and engine.packed_rows,
        packed_overlay_geometry,
    ),
    AllocationFamily("explicit tensor sharing", lambda model, engine: bool(model.overlays), overlay_geometry),
    AllocationFamily("a region per layer", _is_uniform, _uniform_geometry),
    AllocationFamily("hybrid pages", lambda model, engine: True, _hybrid_geometry),
)
"""The allocation families :func:`rank_geometry` chooses from, in order (the first that applies)."""
