"""One engine rank's layout computed from a model and an engine config (:func:`rank_geometry`): the KV-cache
groups (by spec equality), then the regions of one of the allocation families: uniform regions (one per
layer, or K and V apart), vLLM's packed hybrid pages (attention and SSM state overlaid in one block), and
the packed block-outermost CSA-linear rows.
"""

from __future__ import annotations

from kvgeom.dtypes import dtype_size
from kvgeom.errors import ConfigError, SpecError
from kvgeom.layout.csarows import packed_groups, packed_registration
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import (
    Group,
    RankGeometry,
    Region,
    ReplicatedLayout,
    SSMLayout,
    align_hybrid_block_size,
    page_bytes_of,
)
from kvgeom.model.layers import (
    AttentionSpec,
    CircularBufferSpec,
    LayerKind,
    LayerSpec,
    MambaSpec,
    MLASpec,
    ReplicatedStateSpec,
)
from kvgeom.model.spec import ModelSpec
from kvgeom.model.stages import stage_layers

__all__ = ["rank_geometry"]


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


def rank_geometry(model: ModelSpec, engine: EngineConfig) -> RankGeometry:
    """Derive the geometry of ``engine``'s rank for ``model`` (see the module docstring)."""
    tp = engine.tp_size
    _check_tp(model, tp)
    held = {la.name for la in stage_layers(model, engine.pp_rank, engine.pp_size)}
    if not held:
        raise ConfigError(
            "pp_rank",
            f"pipeline stage {engine.pp_rank} of {engine.pp_size} holds no cache layer of {model.name!r}",
            value=engine.pp_rank,
            expected=engine.pp_size,
        )
    if model.overlays:
        return _overlay_geometry(model, engine)
    own = _engine_groups(model, engine.kv_cache_groups) if engine.kv_cache_groups else _make_groups(model)
    groups = _project(_split(own, engine.separate_group, model), held)
    ppl = engine.ppl
    nb_kernel = engine.num_blocks * ppl
    ssm_spec = model.ssm_spec
    if engine.packed_rows and (
        ssm_spec is not None or not all(isinstance(la.spec, MLASpec) for la in model.layers)
    ):
        raise ConfigError(
            "packed_rows",
            "kvgeom models packed (block-outermost) rows for MLA models without SSM "
            "state (vLLM moves only those rows whole: a row of head-sharded pages cannot be cut by "
            "heads)",
            value=True,
        )
    if (len(groups) == 1 or engine.separate_group) and not ssm_spec:
        regions = _uniform_regions(groups, engine, nb_kernel, model)
        first = regions[0].members[0][1]
        page = sum(r.block_stride for r in regions if r.members[0][1] == first) * ppl
        if engine.packed_rows:
            regions = _packed(regions)
        return RankGeometry(model, engine, groups, regions, page, None)

    if engine.kv_split:
        raise ConfigError(
            "kv_split", "split K/V regions are not supported for hybrid (multi-group) models", value=True
        )
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
    count = max(len(g.layers) for g in groups)
    hybrid: list[Region] = []
    for i in range(count):
        members = tuple((g.index, g.layers[i]) for g in groups if i < len(g.layers))
        is_mla = any(groups[gi].is_mla for gi, _ in members)
        part = "state" if all(groups[gi].is_ssm for gi, _ in members) else "kv"
        hybrid.append(Region(i, members[0][1], page // ppl, page // ppl, nb_kernel, is_mla, members, part))
    if engine.packed_rows:
        return RankGeometry(model, engine, groups, _packed(tuple(hybrid)), page, None)
    ssm = None
    if ssm_spec is not None:
        offs, pos = [], 0
        for size in ssm_spec.piece_bytes(tp):
            offs.append((pos, size))
            pos += size
        ssm_regions = tuple(
            r.index for r in hybrid if any(isinstance(groups[g].spec, MambaSpec) for g, _ in r.members)
        )
        ssm = SSMLayout(ssm_spec, tuple(offs), ssm_spec.conv_bytes(tp), ssm_spec.ssm_bytes(tp), ssm_regions)
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


def _parts(spec: LayerSpec, engine: EngineConfig) -> list[tuple[str, int]]:
    """The regions one layer registers: ``(part, kernel block bytes)``."""
    tp, kernel = engine.tp_size, engine.kernel
    if isinstance(spec, MLASpec):
        return [("kv", kernel * spec.token_bytes(tp))]
    if isinstance(spec, AttentionSpec):
        e = dtype_size(spec.dtype)
        h = spec.heads_per_rank(tp)
        if engine.kv_split:
            return [("k", kernel * h * spec.head_size * e), ("v", kernel * h * spec.v_size * e)]
        return [("kv", kernel * spec.token_bytes(tp))]
    # pragma: no cover - SSM-only single groups go through the hybrid path
    raise SpecError("layers", f"unexpected spec {spec!r}", value=spec)


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
        for part, length in _parts(spec, engine):
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


def _overlay_groups(model: ModelSpec) -> tuple[Group, ...]:
    """Groups of a model with explicit tensor sharing: one per distinct spec, in first-appearance order within
    each kind: token caches, then rings, then SSM states, then the replicated state page (the order of the
    descriptor streams: attention, SSM, the replicated page last)."""
    order: dict[LayerSpec, list[str]] = {}
    for la in model.layers:
        order.setdefault(la.spec, []).append(la.name)

    def rank(spec: LayerSpec) -> int:
        kind = spec.kind
        return (
            3
            if kind is LayerKind.REPLICATED_STATE
            else 2
            if kind.is_ssm
            else 1
            if kind is LayerKind.CIRCULAR_BUFFER
            else 0
        )

    specs = sorted(order, key=rank)  # stable
    return tuple(Group(i, spec, tuple(order[spec])) for i, spec in enumerate(specs))


def _packed_overlay_geometry(model: ModelSpec, engine: EngineConfig) -> RankGeometry:
    """A CSA-linear model in vLLM's block-outermost allocation (``packed_rows``; :mod:`kvgeom.layout.csarows`):
    vLLM's packed groups, one row per block, and one region per distinct page start, ``block_stride`` the
    row; a state or ring page starts at its region's block and may run past its length (not past the row).
    Modelled with SSM state (each token cache its own region); without it vLLM registers whole MLA rows."""
    if model.ssm_spec is None:
        raise ConfigError(
            "packed_rows",
            "packed rows of a CSA-linear model are modelled with SSM state (without it vLLM registers whole MLA "
            "rows)",
            value=True,
        )
    for cls in (MLASpec, AttentionSpec):
        token_specs = sorted({repr(la.spec) for la in model.layers if isinstance(la.spec, cls)})
        if len(token_specs) > 1:
            raise ConfigError(
                "layers",
                "packed rows of a CSA-linear model are modelled with one MLA spec and one head-sharded main-KV "
                "spec (vLLM packs all token caches of one slot type into one group; several page sizes of one "
                "kind are not modelled)",
                value=token_specs,
            )
    if engine.ppl != 1:
        raise ConfigError(
            "kernel_block_size",
            "packed rows of a CSA-linear model are modelled with one kernel block per block (a ring or state "
            "page is contiguous in its row, a kernel block view of the row is not)",
            value=engine.kernel,
            expected=engine.block_size,
        )
    tp, ppl = engine.tp_size, engine.ppl
    specs = {la.name: la.spec for la in model.layers}
    names = packed_groups(model, engine.block_size, tp)
    groups = tuple(Group(i, specs[g[0]], g) for i, g in enumerate(names))
    group_of = {name: g.index for g in groups for name in g.layers}
    reg = packed_registration(model, names, block_size=engine.block_size, tp_size=tp)
    regions = tuple(
        Region(
            i,
            r.members[0],
            block_len,
            stride,
            engine.num_blocks * ppl,
            r.is_mla,
            tuple((group_of[n], n) for n in r.members),
            "state" if all(specs[n].kind.is_ssm for n in r.members) else "kv",
            row_offset=r.offset,
        )
        for i, (r, (block_len, stride)) in enumerate(zip(reg.regions, reg.kernel_lens(ppl)))
    )
    ssm_spec = model.ssm_spec
    offs, pos = [], 0
    for size in ssm_spec.piece_bytes(tp):
        offs.append((pos, size))
        pos += size
    ssm = SSMLayout(ssm_spec, tuple(offs), ssm_spec.conv_bytes(tp), ssm_spec.ssm_bytes(tp), reg.ssm)
    ple = None
    if reg.ple is not None:
        region, length = reg.ple
        for g, n in regions[region].members:
            page_spec = specs[n]
            if isinstance(page_spec, ReplicatedStateSpec):
                ple = ReplicatedLayout(page_spec, g, region, length)
    return RankGeometry(model, engine, groups, regions, reg.row_bytes, ssm, reg.scratch, ple)


def _overlay_geometry(model: ModelSpec, engine: EngineConfig) -> RankGeometry:
    """Explicit tensor sharing (``Layer.shares``): one region per owning layer (model order), viewed by its
    owner and every layer that overlays it; a block of a region is one owner page (``block_len`` bytes per
    kernel block), and a state or ring page starts at its slot and must fit the logical page
    (``block_len * ppl``). Two layers of one group never share a tensor (their pages of one pool id would
    collide)."""
    if engine.pp_size > 1 or engine.separate_group or engine.kv_split:
        raise ConfigError(
            "engine",
            "explicit tensor sharing (CSA-linear) is modelled without pipeline stages, separate groups or split "
            "K/V regions",
            value=engine.to_json(),
        )
    if engine.packed_rows:
        return _packed_overlay_geometry(model, engine)
    tp, ppl = engine.tp_size, engine.ppl
    groups = _overlay_groups(model)
    group_of = {name: g.index for g in groups for name in g.layers}
    owners = [la for la in model.layers if la.shares is None]
    sharers: dict[str, list[str]] = {}
    for la in model.layers:
        if la.shares is not None:
            sharers.setdefault(la.shares, []).append(la.name)
    specs = {la.name: la.spec for la in model.layers}
    regions: list[Region] = []
    for owner in owners:
        if not isinstance(owner.spec, (AttentionSpec, MLASpec)):
            raise ConfigError(
                f"{owner.name}.shares",
                "a tensor is owned by a token cache (attention or MLA); states and rings overlay one",
                value=owner.kind.value,
            )
        block_len = _parts(owner.spec, engine)[0][1]
        page = block_len * ppl
        names = [owner.name, *sharers.get(owner.name, [])]
        members = tuple((group_of[n], n) for n in names)
        if len({g for g, _ in members}) != len(members):
            raise ConfigError(
                "layers",
                f"layers {names} of one group overlay the same tensor: their pages of one block would collide",
                value=names,
            )
        for n in names[1:]:
            need = page_bytes_of(specs[n], engine.block_size, tp)
            if need > page:
                raise ConfigError(
                    "block_size",
                    f"{n}'s {need}-byte page does not fit the {page}-byte page of {owner.name} it overlays "
                    f"at block size {engine.block_size}",
                    value=engine.block_size,
                    expected=need,
                )
        is_mla = any(isinstance(specs[n], MLASpec) for n in names)
        regions.append(
            Region(len(regions), owner.name, block_len, block_len, engine.num_blocks * ppl, is_mla, members)
        )
    page = regions[0].block_len * ppl
    ssm_spec = model.ssm_spec
    ssm = None
    if ssm_spec is not None:
        offs, pos = [], 0
        for size in ssm_spec.piece_bytes(tp):
            offs.append((pos, size))
            pos += size
        ssm_regions = tuple(
            r.index for r in regions if any(isinstance(specs[n], MambaSpec) for _, n in r.members)
        )
        ssm = SSMLayout(ssm_spec, tuple(offs), ssm_spec.conv_bytes(tp), ssm_spec.ssm_bytes(tp), ssm_regions)
    scratch = tuple(
        r.index for r in regions if any(isinstance(specs[n], CircularBufferSpec) for _, n in r.members)
    )
    ple = None
    for r in regions:
        for g, n in r.members:
            spec = specs[n]
            if isinstance(spec, ReplicatedStateSpec):
                if spec.state_bytes(tp) % ppl:
                    raise ConfigError(
                        "kernel_block_size",
                        f"the {spec.state_bytes(tp)}-byte replicated state page is not divisible into {ppl} "
                        "kernel blocks",
                        value=engine.kernel,
                        expected=engine.block_size,
                    )
                ple = ReplicatedLayout(spec, g, r.index, spec.state_bytes(tp))
    return RankGeometry(model, engine, groups, tuple(regions), page, ssm, scratch, ple)
