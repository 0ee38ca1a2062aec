"""Region discovery: which memory regions a rank registers for transfer, from its cache tensors.

A connector registers each layer's cache tensor as one or more *regions* (a base address, a block length,
a block stride, a block count): the unit its descriptor tables address. vLLM 0.33.0's NIXL worker
(``register_kv_caches``) decides them from facts about each tensor -- where it starts, the storage it
views, its block stride, whether block 0 is one contiguous page -- and from the engine's layout; this
module makes the same decisions on those facts (:class:`CacheTensor`, :class:`RegistrationLayout`) and
returns a :class:`Registration`. The rules, per layer in registration order (names in natural order,
:func:`kvgeom.pair.layerroute.region_sort_key`, except CSA-linear models: the allocation order):

* a recurrent state registers its view: ``(address, page / ppl, stride / ppl)`` with stride the page
  (a CSA-linear state packed with other caches: the tensor's block stride);
* an attention cache with storage laid out block by block (its storage holds ``blocks x stride`` bytes up
  to less than one block of padding) registers one region per block row: for packed (block-outermost)
  MLA rows of a storage shared by every layer, the whole row once -- every layer's page sits in it at an
  offset the handshake advertises -- or, for a PP producer routing layers by name, the layer's page in
  each row; a row whose page is not contiguous registers the whole storage row; otherwise the page;
* an attention view of a larger storage is cut into as many ``blocks x stride`` segments as it holds;
* a region whose base another layer already registered is the same region (the layer joins it; an MLA
  view sets its length, stride and count; two groups make it shared, group ``-1``), except for PP
  producers routing packed layers by name, which keep one region per layer.

Refusals (:class:`~kvgeom.errors.SpecError` naming the layer and the numbers): a view that does not cut
into whole segments, a tensor with fewer blocks than the pool, a packed layer outside its row, a state
page that does not split into kernel blocks; :class:`~kvgeom.errors.UnsupportedError` for packed rows
routed by name in a model that is not MLA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvgeom.errors import SpecError, UnsupportedError
from kvgeom.layout.view import SHARED_GROUP

__all__ = ["CacheTensor", "RegistrationLayout", "Registration", "discover_regions", "KINDS"]

KINDS = ("attention", "mla", "scratch", "state", "replicated_state", "none")
"""Tensor kinds: attention (head-sharded), an MLA latent, a scratch ring (CSA compressor), a recurrent
state, a TP-replicated state page (CSA-linear PLE), or a tensor with no transferable spec (skipped)."""


@dataclass(frozen=True)
class CacheTensor:
    """One layer's cache tensor, as registration sees it. ``address`` / ``nbytes``: the view;
    ``storage_address`` / ``storage_bytes``: the storage it views (what gets registered with the
    transport); ``block_stride``: the stride of its first dimension in bytes (``flat``: a byte view with
    no block dimension, whose blocks abut: their stride is the page); ``first_block_bytes``: the bytes of
    block 0 when they are one contiguous run, else ``None``; ``rows``: the size of the first dimension;
    ``page_bytes``: the spec's page per logical block; ``pool_blocks``: the logical blocks of the
    layer's group pool."""

    name: str
    kind: str
    group: int = 0
    address: int = 0
    nbytes: int = 0
    storage_address: int = 0
    storage_bytes: int = 0
    block_stride: int = 0
    flat: bool = False
    first_block_bytes: int | None = None
    rows: int = 0
    page_bytes: int = 0
    pool_blocks: int = 0
    host_resident: bool = False
    mem_type: str = "VRAM"
    device: int | None = None  # None: host memory

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SpecError(
                "kind",
                f"layer {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}",
                value=self.kind,
            )


@dataclass(frozen=True)
class RegistrationLayout:
    """The engine's facts registration depends on: kernel blocks per logical block (``ppl``), SSM state,
    MLA, CSA-linear, a block-outermost (packed) layout, PP layer-name routing, PP size, whether regions
    advertise their member layers, the engine's kernel block count."""

    ppl: int = 1
    has_ssm: bool = False
    mla: bool = False
    csa_linear: bool = False
    block_outermost: bool = False
    route_by_layer: bool = False
    pp_size: int = 1
    track_members: bool = False
    kernel_blocks: int = 0  # the engine's kernel blocks: with SSM state, every region's count


@dataclass(frozen=True)
class Registration:
    """The regions a rank registers (one entry per region in every per-region field), the special
    regions (SSM state, scratch rings, the replicated state page), each region's member layers (when
    tracked), the packed layers' ``(offset in row, page)``, and the memory to register with the transport
    (``(start, length, device, mem_type)``, one per distinct storage)."""

    bases: tuple[int, ...]
    block_lens: tuple[int, ...]
    block_strides: tuple[int, ...]
    num_blocks: tuple[int, ...]
    group_ids: tuple[int, ...]
    names: tuple[str, ...]
    is_mla: tuple[bool, ...]
    mem_types: tuple[str, ...]
    ssm_region_indices: tuple[int, ...] = ()
    scratch_region_indices: tuple[int, ...] = ()
    ple_region_index: int | None = None
    ple_block_len: int | None = None
    members: tuple[tuple[str, ...], ...] = ()
    packed_layouts: dict[str, tuple[int, int]] = field(default_factory=dict)
    ranges: tuple[tuple[int, int, int, str], ...] = ()
    device: int | None = None  # the device of the last accelerator tensor (None: host memory only)

    @property
    def num_regions(self) -> int:
        return len(self.bases)


def _shared_rows(tensors: Sequence[CacheTensor]) -> bool:
    """Every tensor views one storage with one block stride (a block-outermost allocation)."""
    return len({t.block_stride for t in tensors}) == len({t.storage_address for t in tensors}) == 1


def _specs(
    t: CacheTensor, layout: RegistrationLayout, packed_storage: bool, packed: dict[str, tuple[int, int]]
) -> tuple[list[tuple[int, int, int]], int]:
    """``[(base, block_len, block_stride)]`` of one tensor, and its block count."""
    ppl = layout.ppl
    base, length = (t.address, t.nbytes) if t.host_resident else (t.storage_address, t.storage_bytes)
    if t.kind in ("state", "replicated_state"):
        page = t.page_bytes
        stride = t.block_stride if layout.csa_linear and not t.flat else page
        if stride % ppl or page % ppl:
            raise SpecError(
                "block_stride",
                f"layer {t.name!r}: a state page of {page} B (stride {stride} B) does not "
                f"split into {ppl} kernel blocks",
                value=stride,
                expected=ppl,
            )
        return [(t.address, page // ppl, stride // ppl)], t.pool_blocks
    page = t.page_bytes // ppl
    blocks = t.pool_blocks * ppl
    stride = page if t.flat else t.block_stride
    block_major = 0 <= length - blocks * stride < stride
    contiguous = not t.flat and t.first_block_bytes == page
    is_mla = t.kind == "mla"
    packed_row = layout.block_outermost and not layout.has_ssm and packed_storage and block_major and is_mla
    if packed_row and layout.route_by_layer:
        return [(t.address, page, stride)], blocks
    if packed_row and (layout.pp_size == 1 or not contiguous):
        offset = t.address - t.storage_address
        if offset < 0 or offset + page > stride:
            raise SpecError(
                "address",
                f"layer {t.name!r}: its {page}-byte page at offset {offset} escapes the {stride}-byte row",
                value=offset,
                expected=stride,
            )
        packed[t.name] = (offset, page)
        return [(base, stride, stride)], blocks
    if block_major and not contiguous and ((packed_storage and is_mla) or not layout.csa_linear):
        return [(base, stride, stride)], blocks
    if block_major:
        return [(t.address, page, stride)], blocks
    segment = blocks * stride
    if segment <= 0 or t.nbytes % segment:
        raise SpecError(
            "nbytes",
            f"layer {t.name!r}: a {t.nbytes}-byte view does not cut into segments of {blocks} "
            f"blocks x {stride} B (page {page} B)",
            value=t.nbytes,
            expected=segment,
        )
    count = t.nbytes // segment
    return [(t.address + i * segment, stride if count > 1 else page, stride) for i in range(count)], blocks


@dataclass
class _Regions:
    """The regions found so far, one entry per region in every list (a builder local to
    :func:`discover_regions`)."""

    bases: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    strides: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    mla: list[bool] = field(default_factory=list)
    mems: list[str] = field(default_factory=list)
    members: list[list[str]] = field(default_factory=list)
    ssm: list[int] = field(default_factory=list)
    scratch: list[int] = field(default_factory=list)
    ple: int | None = None
    ple_len: int | None = None

    def add(
        self, t: CacheTensor, base: int, block_len: int, block_stride: int, blocks: int, merge: bool
    ) -> int:
        """Region ``base`` of tensor ``t``: a new region, or (``merge``) the one already at ``base``, which
        the tensor then also views; its index."""
        is_mla = t.kind == "mla"
        if merge and base in self.bases:
            r = self.bases.index(base)
            if self.mems[r] != t.mem_type:
                raise SpecError(
                    "mem_type",
                    f"layer {t.name!r}: region at {base:#x} is {self.mems[r]} and {t.mem_type}",
                    local=self.mems[r],
                    remote=t.mem_type,
                )
            self.mla[r] |= is_mla
            if is_mla:
                self.lens[r], self.strides[r], self.counts[r] = block_len, block_stride, blocks
            if self.groups[r] != t.group:
                self.groups[r] = SHARED_GROUP
            return r
        self.bases.append(base)
        self.lens.append(block_len)
        self.strides.append(block_stride)
        self.counts.append(blocks)
        self.groups.append(t.group)
        self.names.append(t.name)
        self.mla.append(is_mla)
        self.mems.append(t.mem_type)
        return len(self.bases) - 1

    def view(self, t: CacheTensor, r: int, block_len: int, layout: RegistrationLayout) -> None:
        """Tensor ``t`` views region ``r``: a member of it, and its state, ring or replicated page."""
        if layout.track_members:
            if r == len(self.members):
                self.members.append([t.name])
            else:
                self.members[r].append(t.name)
        if t.kind == "replicated_state":
            if not layout.csa_linear or self.ple not in (None, r):
                raise SpecError(
                    "kind",
                    f"layer {t.name!r}: one TP-replicated state page, of a CSA-linear model",
                    value=r,
                    expected=self.ple,
                )
            self.ple, self.ple_len = r, block_len
        elif t.kind == "state" and r not in self.ssm:
            self.ssm.append(r)
        elif t.kind == "scratch" and r not in self.scratch:
            self.scratch.append(r)


def discover_regions(tensors: Sequence[CacheTensor], layout: RegistrationLayout) -> Registration:
    """The regions a rank registers for ``tensors`` (in registration order), see the module doc."""
    route_packed = layout.block_outermost and layout.route_by_layer
    packed_storage = _shared_rows(tensors) and layout.mla and not layout.has_ssm
    live = [t for t in tensors if t.kind != "none"]
    if route_packed and any(t.kind != "mla" for t in live):
        raise UnsupportedError(
            "kind", "PP push with packed KV caches requires MLA", value=sorted({t.kind for t in live})
        )
    found = _Regions()
    packed: dict[str, tuple[int, int]] = {}
    ranges: dict[tuple[int, str], tuple[int, int, int, str]] = {}
    device: int | None = None
    for t in live:
        start, length = (t.address, t.nbytes) if t.host_resident else (t.storage_address, t.storage_bytes)
        ranges.setdefault((start, t.mem_type), (start, length, t.device or 0, t.mem_type))
        if t.device is not None:
            device = t.device
        specs, blocks = _specs(t, layout, packed_storage, packed)
        for base, block_len, block_stride in specs:
            r = found.add(t, base, block_len, block_stride, blocks, merge=not route_packed)
            found.view(t, r, block_len, layout)
        if layout.ppl == 1 and t.rows < blocks:
            raise SpecError(
                "rows",
                f"layer {t.name!r}: the cache tensor has {t.rows} blocks, the pool {blocks}",
                value=t.rows,
                expected=blocks,
            )
    counts = found.counts
    if layout.has_ssm:  # state and attention views of one page: every region counts kernel blocks
        counts = [layout.kernel_blocks] * len(counts)
    return Registration(
        tuple(found.bases),
        tuple(found.lens),
        tuple(found.strides),
        tuple(counts),
        tuple(found.groups),
        tuple(found.names),
        tuple(found.mla),
        tuple(found.mems),
        tuple(found.ssm),
        tuple(sorted(found.scratch)),
        found.ple,
        found.ple_len,
        tuple(tuple(m) for m in found.members),
        packed,
        tuple(ranges.values()),
        device,
    )
