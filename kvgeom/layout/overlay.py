"""The allocation families of models with explicit tensor sharing (``Layer.shares``, CSA-linear models):
one region per owning layer viewed by every layer that overlays it (:func:`overlay_geometry`), or vLLM's
packed block-outermost rows (:func:`packed_overlay_geometry`, :mod:`kvgeom.layout.csarows`). Rows of
:data:`kvgeom.layout.allocate.ALLOCATION_FAMILIES`.
"""

from __future__ import annotations

from kvgeom.errors import ConfigError
from kvgeom.layout.csarows import packed_groups, packed_registration
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import (
    Group,
    RankGeometry,
    Region,
    ReplicatedLayout,
    SSMLayout,
    page_bytes_of,
    region_parts,
)
from kvgeom.model.layers import (
    AttentionSpec,
    CircularBufferSpec,
    Layer,
    LayerKind,
    LayerSpec,
    MambaSpec,
    MLASpec,
    ReplicatedStateSpec,
)
from kvgeom.model.spec import ModelSpec

__all__ = ["overlay_geometry", "packed_overlay_geometry"]


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


def packed_overlay_geometry(model: ModelSpec, engine: EngineConfig, held: frozenset[str]) -> RankGeometry:
    """A CSA-linear model in vLLM's block-outermost allocation (``packed_rows``; :mod:`kvgeom.layout.csarows`):
    vLLM's packed groups, one row per block, and one region per distinct page start, ``block_stride`` the
    row; a state or ring page starts at its region's block and may run past its length (not past the row).
    Modelled with SSM state (each token cache its own region); without it vLLM registers whole MLA rows."""
    _check_overlay_engine(engine)
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
    ssm = SSMLayout.of(model.ssm_spec, tp, reg.ssm)
    ple = None
    if reg.ple is not None:
        region, length = reg.ple
        for g, n in regions[region].members:
            page_spec = specs[n]
            if isinstance(page_spec, ReplicatedStateSpec):
                ple = ReplicatedLayout(page_spec, g, region, length)
    return RankGeometry(model, engine, groups, regions, reg.row_bytes, ssm, reg.scratch, ple)


def _check_overlay_engine(engine: EngineConfig) -> None:
    if engine.pp_size > 1 or engine.separate_group or engine.kv_split:
        raise ConfigError(
            "engine",
            "explicit tensor sharing (CSA-linear) is modelled without pipeline stages, separate groups or split "
            "K/V regions",
            value=engine.to_json(),
        )


def _overlay_region(
    index: int,
    owner: Layer,
    names: list[str],
    group_of: dict[str, int],
    engine: EngineConfig,
    specs: dict[str, LayerSpec],
) -> Region:
    """The region of one owning layer and the layers that overlay it (``names``, the owner first)."""
    if not isinstance(owner.spec, (AttentionSpec, MLASpec)):
        raise ConfigError(
            f"{owner.name}.shares",
            "a tensor is owned by a token cache (attention or MLA); states and rings overlay one",
            value=owner.kind.value,
        )
    block_len = region_parts(owner.spec, engine)[0][1]
    page = block_len * engine.ppl
    members = tuple((group_of[n], n) for n in names)
    if len({g for g, _ in members}) != len(members):
        raise ConfigError(
            "layers",
            f"layers {names} of one group overlay the same tensor: their pages of one block would collide",
            value=names,
        )
    for n in names[1:]:
        need = page_bytes_of(specs[n], engine.block_size, engine.tp_size)
        if need > page:
            raise ConfigError(
                "block_size",
                f"{n}'s {need}-byte page does not fit the {page}-byte page of {owner.name} it overlays "
                f"at block size {engine.block_size}",
                value=engine.block_size,
                expected=need,
            )
    is_mla = any(isinstance(specs[n], MLASpec) for n in names)
    return Region(index, owner.name, block_len, block_len, engine.num_blocks * engine.ppl, is_mla, members)


def _replicated_layout(
    regions: tuple[Region, ...], specs: dict[str, LayerSpec], engine: EngineConfig
) -> ReplicatedLayout | None:
    """Where the replicated state page lies (the last such member, as vLLM registers it), checked to divide
    into the kernel blocks; ``None`` without one."""
    tp, ppl = engine.tp_size, engine.ppl
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
    return ple


def overlay_geometry(model: ModelSpec, engine: EngineConfig, held: frozenset[str]) -> RankGeometry:
    """Explicit tensor sharing (``Layer.shares``): one region per owning layer (model order), viewed by its
    owner and every layer that overlays it; a block of a region is one owner page (``block_len`` bytes per
    kernel block), and a state or ring page starts at its slot and must fit the logical page
    (``block_len * ppl``). Two layers of one group never share a tensor (their pages of one pool id would
    collide)."""
    _check_overlay_engine(engine)
    groups = _overlay_groups(model)
    group_of = {name: g.index for g in groups for name in g.layers}
    sharers: dict[str, list[str]] = {}
    for la in model.layers:
        if la.shares is not None:
            sharers.setdefault(la.shares, []).append(la.name)
    specs = {la.name: la.spec for la in model.layers}
    owners = [la for la in model.layers if la.shares is None]
    regions = tuple(
        _overlay_region(i, owner, [owner.name, *sharers.get(owner.name, [])], group_of, engine, specs)
        for i, owner in enumerate(owners)
    )
    page = regions[0].block_len * engine.ppl
    ssm_regions = tuple(
        r.index for r in regions if any(isinstance(specs[n], MambaSpec) for _, n in r.members)
    )
    ssm = SSMLayout.of(model.ssm_spec, engine.tp_size, ssm_regions)
    scratch = tuple(
        r.index for r in regions if any(isinstance(specs[n], CircularBufferSpec) for _, n in r.members)
    )
    ple = _replicated_layout(regions, specs, engine)
    return RankGeometry(model, engine, groups, regions, page, ssm, scratch, ple)
