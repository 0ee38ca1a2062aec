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

from kvgeom.dtypes import dtype_size
from kvgeom.errors import SpecError
from kvgeom.layout.engine import EngineConfig
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

__all__ = [
    "Group",
    "Region",
    "SSMLayout",
    "ReplicatedLayout",
    "align_hybrid_block_size",
    "RankGeometry",
    "packed_csa_rows",
    "page_bytes_of",
    "region_parts",
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

    @cached_property
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

    @classmethod
    def of(cls, spec: MambaSpec | None, tp: int, regions: tuple[int, ...]) -> SSMLayout | None:
        """The layout of ``spec``'s state on a rank of TP ``tp``: its pieces (conv parts, then the temporal
        state) back to back from the page's start, held by ``regions``; ``None`` without SSM state."""
        if spec is None:
            return None
        offs, pos = [], 0
        for size in spec.piece_bytes(tp):
            offs.append((pos, size))
            pos += size
        return cls(spec, tuple(offs), spec.conv_bytes(tp), spec.ssm_bytes(tp), regions)

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


def page_bytes_of(spec: LayerSpec, block_size: int, tp: int) -> int:
    """Real bytes of one logical block of ``spec`` on one rank."""
    if isinstance(spec, (MambaSpec, ReplicatedStateSpec)):
        return spec.state_bytes(tp)
    if isinstance(spec, CircularBufferSpec):
        return spec.page_bytes(tp)
    return block_size * spec.token_bytes(tp)


def region_parts(spec: LayerSpec, engine: EngineConfig) -> list[tuple[str, int]]:
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
    :func:`kvgeom.model.hfconfig.apply_cache_dtypes`); the SSM state keeps its own dtypes."""
    ssm = model.ssm_spec
    attn = [la.spec for la in model.layers if not la.kind.is_ssm]
    if ssm is None or not attn:
        return block_size
    a = max(kernel_alignment, block_size, mla_alignment if model.is_mla else 1)
    per_token = max(s.token_bytes(tp) for s in attn)  # type: ignore[union-attr]
    aligned = a * math.ceil(ssm.state_bytes(tp) / (a * per_token))
    step = math.lcm(*kernel_block_sizes) if kernel_block_sizes else 1
    return step * math.ceil(aligned / step)


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

    def __hash__(self) -> int:
        """The hash of the engine and the regions (equal geometries have equal ones): hashing the model,
        every layer's spec, costs several times more and tells apart no geometries these do not (a
        geometry is looked up by value: ``streams.registration``)."""
        return hash((self.engine, self.regions, self.page_bytes))

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
        return page_bytes_of(self.layer_specs[layer], self.logical_block_size, self.tp_size) // self.ppl

    @cached_property
    def region_tp_scaling(self) -> tuple[str, ...]:
        """How each region's block length follows TP, by the layers viewing it: ``"heads"`` where a head-sharded
        attention page is among them, ``"state"`` where only SSM state pages are (sharded by
        :class:`~kvgeom.model.layers.MambaSpec`'s own rule), ``"whole"`` otherwise (MLA latents, rings, the replicated
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


def packed_csa_rows(geom: RankGeometry) -> bool:
    """A CSA-linear rank in vLLM's block-outermost allocation: its regions alias one row per block
    (:attr:`Region.row_offset`)."""
    return geom.is_csa_linear and geom.engine.packed_rows
