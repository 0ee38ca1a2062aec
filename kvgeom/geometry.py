"""The geometry of one engine rank: KV-cache groups, registered regions and SSM state layout.

``rank_geometry(model, engine)`` derives, as immutable values, what vLLM's hybrid KV-cache manager and
NIXL connector would allocate and register on that rank:

* **groups** -- layers of one spec type, at most ``group_size`` each (vLLM HMA grouping: the smallest
  per-type layer count; every group of a hybrid model views the same tensors);
* **regions** -- one per registered tensor: for a single-group model one per layer (two with split
  K/V), for a hybrid model one per shared tensor, viewed by layer ``i`` of every group;
* the **SSM layout** -- conv sub-projection offsets and (conv, temporal) sizes within a state page;
* with explicit tensor sharing (``Layer.shares``, CSA-linear models) one region per owning layer, viewed
  by the owner and every layer that overlays it: the ring's *scratch* regions and the replicated state
  page (:class:`ReplicatedLayout`) are then data of the geometry.

All sizes are bytes. Regions are kernel-granular: ``block_len`` is one kernel block's transferable
bytes, ``block_stride`` the distance between kernel blocks, ``num_blocks`` the kernel block count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from .csarows import packed_groups, packed_registration
from .dtypes import dtype_size
from .engine import EngineConfig
from .errors import ConfigError, SpecError
from .spec import (
    AttentionSpec,
    CircularBufferSpec,
    LayerKind,
    LayerSpec,
    MambaSpec,
    MLASpec,
    ModelSpec,
    ReplicatedStateSpec,
)
from .stages import stage_layers

__all__ = [
    "Group",
    "Region",
    "SSMLayout",
    "ReplicatedLayout",
    "RankGeometry",
    "rank_geometry",
    "packed_csa_rows",
    "align_hybrid_block_size",
]


@dataclass(frozen=True)
class Group:
    """A KV-cache group: layers of one spec, sharing one block table per request."""

    index: int
    spec: LayerSpec
    layers: tuple[str, ...]

    @property
    def kind(self) -> LayerKind:
        return self.spec.kind

    @cached_property
    def is_ssm(self) -> bool:
        return self.kind.is_ssm

    @property
    def is_mla(self) -> bool:
        return self.kind is LayerKind.MLA

    @property
    def one_block(self) -> bool:
        """A request holds one block of this group, paired by slot (SSM states, rings)."""
        return self.kind.one_block

    @property
    def is_ring(self) -> bool:
        return self.kind is LayerKind.CIRCULAR_BUFFER

    @property
    def is_replicated_state(self) -> bool:
        return self.kind is LayerKind.REPLICATED_STATE


@dataclass(frozen=True)
class Region:
    """One registered memory span with a uniform kernel-block geometry.

    ``members`` are ``(group index, layer name)`` pairs viewing this span; ``part`` is ``"kv"`` for a
    packed K|V page, ``"k"`` / ``"v"`` for split K/V regions, ``"state"`` for an SSM-only region.
    ``slots`` give each member's page as ``(offset, length)`` within a kernel block's row: empty when
    every member views the whole block (``(0, block_len)``); a packed row (block-outermost layout) holds
    every layer's page side by side. ``row_offset`` is where the span starts in a block row of memory it
    shares with other regions (vLLM's packed CSA-linear rows register one region per page start of one
    row, so regions alias: byte ``o`` of region ``r`` is byte ``row_offset + o`` of the rank's rows);
    ``None`` for a span of its own.
    """

    index: int
    name: str
    block_len: int
    block_stride: int
    num_blocks: int
    is_mla: bool
    members: tuple[tuple[int, str], ...]
    part: str = "kv"
    slots: tuple[tuple[int, int], ...] = ()
    row_offset: int | None = None

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_stride

    @property
    def is_packed(self) -> bool:
        """Members hold pages at different offsets of one row (block-outermost layout)."""
        return any(off for off, _ in self.slots)

    def slot(self, layer: str) -> tuple[int, int]:
        """``(offset, length)`` of ``layer``'s page within a kernel block of this region."""
        for k, (_, name) in enumerate(self.members):
            if name == layer:
                return self.slots[k] if self.slots else (0, self.block_len)
        raise SpecError(
            "layer", f"layer {layer!r} does not view region {self.index} ({self.name})", value=layer
        )

    def member_of(self, group: int) -> str | None:
        for g, name in self.members:
            if g == group:
                return name
        return None


@dataclass(frozen=True)
class SSMLayout:
    """Where an SSM state lives in a page: conv pieces then the temporal state, per rank."""

    spec: MambaSpec
    conv_offsets: tuple[tuple[int, int], ...]
    conv_bytes: int
    ssm_bytes: int
    region_indices: tuple[int, ...]

    @property
    def sizes(self) -> tuple[int, int]:
        return (self.conv_bytes, self.ssm_bytes)

    @property
    def num_pieces(self) -> int:
        return len(self.conv_offsets)


@dataclass(frozen=True)
class ReplicatedLayout:
    """The TP-replicated state page (PLE): ``length`` bytes at the start of each state slot of region
    ``region`` (slots ``block_stride * ppl`` apart), held by group ``group``; one descriptor per block,
    copied whole."""

    spec: ReplicatedStateSpec
    group: int
    region: int
    length: int


def _page_bytes(spec: LayerSpec, block_size: int, tp: int) -> int:
    """Real bytes of one logical block of ``spec`` on one rank."""
    if isinstance(spec, (MambaSpec, ReplicatedStateSpec)):
        return spec.state_bytes(tp)
    if isinstance(spec, CircularBufferSpec):
        return spec.page_bytes(tp)
    return block_size * spec.token_bytes(tp)


def align_hybrid_block_size(
    model: ModelSpec,
    tp: int,
    block_size: int,
    kernel_alignment: int = 16,
    *,
    kernel_block_sizes: Sequence[int] = (),
    mla_alignment: int = 1,
) -> int:
    """vLLM's hybrid alignment (docs/vllm-behaviour.md B.2.1, B.6.1 item 10): the smallest multiple of
    ``A = max(kernel_alignment, block_size)`` whose attention page holds the SSM state, using per-rank
    KV heads (hence TP-dependent), then rounded up to a multiple of every attention backend's smallest
    kernel block (``kernel_block_sizes``, their lcm). For MLA hybrids ``A`` is at least
    ``mla_alignment`` (vLLM 0.33.0: 128). ``block_size`` is the size asked for (vLLM's
    ``--block-size``); ``kernel_alignment`` the backend's smallest kernel block. The attention page
    uses the attention specs' dtype: set it to the KV-cache dtype (e.g. fp8,
    :func:`kvgeom.hfconfig.apply_cache_dtypes`); the SSM state keeps its own dtypes."""
    ssm = model.ssm_spec
    attn = [la.spec for la in model.layers if not la.kind.is_ssm]
    if ssm is None or not attn:
        return block_size
    a = max(kernel_alignment, block_size, mla_alignment if model.is_mla else 1)
    per_token = max(s.token_bytes(tp) for s in attn)  # type: ignore[union-attr]
    aligned = a * math.ceil(ssm.state_bytes(tp) / (a * per_token))
    step = math.lcm(*kernel_block_sizes) if kernel_block_sizes else 1
    return step * math.ceil(aligned / step)


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


@dataclass(frozen=True)
class RankGeometry:
    """Everything about one engine rank's cache that a transfer needs, address-free."""

    model: ModelSpec
    engine: EngineConfig
    groups: tuple[Group, ...]
    regions: tuple[Region, ...]
    page_bytes: int
    ssm: SSMLayout | None
    scratch_region_indices: tuple[int, ...] = ()
    ple: ReplicatedLayout | None = None

    # -- engine numbers -----------------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.engine.tp_size

    @property
    def tp_rank(self) -> int:
        return self.engine.tp_rank

    @property
    def block_size(self) -> int:
        """Kernel block size in tokens (what vLLM's connector calls ``block_size``)."""
        return self.engine.kernel

    @property
    def logical_block_size(self) -> int:
        return self.engine.block_size

    @property
    def dcp_size(self) -> int:
        return self.engine.dcp_size

    @property
    def pp_size(self) -> int:
        return self.engine.pp_size

    @property
    def pp_rank(self) -> int:
        return self.engine.pp_rank

    @property
    def global_rank(self) -> int:
        """This rank's index among all ranks of its engine (``pp_rank * tp_size + tp_rank``)."""
        return self.engine.global_rank

    @cached_property
    def layer_specs(self) -> dict[str, LayerSpec]:
        return {la.name: la.spec for la in self.model.layers}

    @property
    def has_draft(self) -> bool:
        """Head-sharded attention layers next to MLA layers (a GQA draft under an MLA target)."""
        return self.is_mla and self.model.attention_spec is not None

    @cached_property
    def layer_names(self) -> tuple[str, ...]:
        """The cache-holding layers this rank holds (its pipeline stage's), in model order."""
        held = {name for r in self.regions for _, name in r.members}
        return tuple(la.name for la in self.model.layers if la.name in held)

    @property
    def dcp_rank(self) -> int:
        return self.engine.dcp_rank

    @property
    def scheduler_block(self) -> int:
        """Tokens per entry of a request's block list (``logical_block_size * dcp_size``)."""
        return self.engine.scheduler_block

    @property
    def ppl(self) -> int:
        return self.engine.ppl

    @property
    def logical_num_blocks(self) -> int:
        return self.engine.num_blocks

    @property
    def num_blocks(self) -> int:
        """Kernel blocks per region."""
        return self.engine.num_blocks * self.engine.ppl

    # -- model numbers ------------------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        """vLLM's ``use_mla`` (an MLA model: KV replicated, one KV head). A CSA-linear model whose main KV is
        head-sharded (vLLM's ``qwen4_exp``) is none, though its compressed keys are MLA pages
        (docs/vllm-behaviour.md B.6.14): TP maps its heads, and MLA regions are still read whole."""
        return self.model.is_mla and not (self.is_csa_linear and self.model.attention_spec is not None)

    @property
    def num_kv_heads(self) -> int:
        return self.model.num_kv_heads

    @cached_property
    def group_is_ssm(self) -> tuple[bool, ...]:
        return tuple(g.is_ssm for g in self.groups)

    @cached_property
    def group_one_block(self) -> tuple[bool, ...]:
        """Per group: a request holds one block of it, paired by slot (states and rings)."""
        return tuple(g.one_block for g in self.groups)

    @property
    def is_csa_linear(self) -> bool:
        return self.model.is_csa_linear

    @cached_property
    def scratch_groups(self) -> tuple[int, ...]:
        """The circular-buffer groups (they live in :attr:`scratch_region_indices` only)."""
        return tuple(g.index for g in self.groups if g.is_ring)

    @property
    def has_ssm(self) -> bool:
        return self.ssm is not None

    @property
    def is_hybrid(self) -> bool:
        """Regions are shared by one layer of every group (vLLM HMA)."""
        return len(self.groups) > 1

    @cached_property
    def region_is_mla(self) -> tuple[bool, ...]:
        return tuple(r.is_mla for r in self.regions)

    def layer_page(self, layer: str) -> int:
        """Bytes of ``layer``'s page in one kernel block on this rank."""
        return _page_bytes(self.layer_specs[layer], self.logical_block_size, self.tp_size) // self.ppl

    @cached_property
    def region_tp_scaling(self) -> tuple[str, ...]:
        """How each region's block length follows TP, by the layers viewing it: ``"heads"`` where a head-sharded
        attention page is among them, ``"state"`` where only SSM state pages are (sharded by
        :class:`~kvgeom.spec.MambaSpec`'s own rule), ``"whole"`` otherwise (MLA latents, rings, the replicated
        page: the same bytes at every TP). In packed CSA-linear rows these differ region by region."""
        specs = self.layer_specs
        out = []
        for region in self.regions:
            kinds = [specs[n] for _, n in region.members]
            if any(isinstance(k, AttentionSpec) for k in kinds):
                out.append("heads")
            elif all(isinstance(k, MambaSpec) for k in kinds):
                out.append("state")
            else:
                out.append("whole")
        return tuple(out)

    @property
    def num_regions(self) -> int:
        return len(self.regions)

    @property
    def ssm_region_indices(self) -> tuple[int, ...]:
        return self.ssm.region_indices if self.ssm else ()

    @property
    def num_fa_descs(self) -> int:
        """Descriptors of the attention part of the whole-region dlist (the FA/SSM boundary)."""
        return self.num_regions * self.num_blocks

    def group_layer_in_region(self, group: int, region: int) -> str | None:
        return self.regions[region].member_of(group)

    def describe(self) -> str:
        lines = [
            f"{self.model.name}: TP{self.tp_size} rank {self.tp_rank}, block {self.logical_block_size} tokens "
            f"(kernel {self.block_size}, ppl {self.ppl}), {self.logical_num_blocks} logical blocks, "
            f"layout {self.engine.kv_layout.value}",
        ]
        if self.pp_size > 1:
            lines[0] += f", pipeline stage {self.pp_rank} of {self.pp_size}"
        for g in self.groups:
            first = f"{g.layers[0]} ..." if g.layers else "none on this stage"
            lines.append(f"  group {g.index}: {g.kind.value} x{len(g.layers)} ({first})")
        for r in self.regions:
            lines.append(
                f"  region {r.index} {r.name}: block_len {r.block_len} B, stride {r.block_stride} B, "
                f"{r.num_blocks} kernel blocks, {'MLA ' if r.is_mla else ''}{len(r.members)} member(s)"
            )
        if self.ssm:
            lines.append(
                f"  ssm: conv {self.ssm.conv_bytes} B in pieces {list(self.ssm.conv_offsets)}, "
                f"temporal {self.ssm.ssm_bytes} B, in regions {list(self.ssm.region_indices)}"
            )
        if self.scratch_region_indices:
            lines.append(f"  ring (scratch) regions: {list(self.scratch_region_indices)}")
        if self.ple:
            lines.append(
                f"  replicated state page: {self.ple.length} B at the start of each slot of region "
                f"{self.ple.region} (group {self.ple.group})"
            )
        return "\n".join(lines)


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
    pages = {g.index: _page_bytes(g.spec, engine.block_size, tp) for g in groups}
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


def packed_csa_rows(geom: RankGeometry) -> bool:
    """A CSA-linear rank in vLLM's block-outermost allocation: its regions alias one row per block
    (:attr:`Region.row_offset`)."""
    return geom.is_csa_linear and geom.engine.packed_rows


def _packed_overlay_geometry(model: ModelSpec, engine: EngineConfig) -> RankGeometry:
    """A CSA-linear model in vLLM's block-outermost allocation (``packed_rows``; :mod:`kvgeom.csarows`):
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
            need = _page_bytes(specs[n], engine.block_size, tp)
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
