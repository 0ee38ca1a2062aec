"""What one cache-holding layer keeps per request, engine-free: its kind (:class:`LayerKind`, whose properties
later stages read as data), its spec (attention, MLA, Mamba/GDN/KDA state, a ring, a replicated state) and
how its heads or channels shard over TP ranks (:class:`Shard`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvgeom.dtypes import dtype_size
from kvgeom.errors import SpecError

__all__ = [
    "LayerKind",
    "Shard",
    "AttentionSpec",
    "MLASpec",
    "MambaSpec",
    "CircularBufferSpec",
    "ReplicatedStateSpec",
    "LayerSpec",
    "Layer",
]


class LayerKind(str, Enum):
    """The kinds of cache-holding layer kvgeom knows."""

    ATTENTION = "attention"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"
    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    GDN = "gdn"
    KDA = "kda"
    CIRCULAR_BUFFER = "circular_buffer"
    REPLICATED_STATE = "replicated_state"

    @property
    def is_ssm(self) -> bool:
        """A state kind (vLLM ``MambaSpec``): one slot per request, SSM descriptor streams."""
        return self in (
            LayerKind.MAMBA1,
            LayerKind.MAMBA2,
            LayerKind.GDN,
            LayerKind.KDA,
            LayerKind.REPLICATED_STATE,
        )

    @property
    def one_block(self) -> bool:
        """The request holds one block of this kind, paired by slot, not by token (states and rings)."""
        return self.is_ssm or self is LayerKind.CIRCULAR_BUFFER

    @classmethod
    def parse(cls, value: str, field_name: str = "kind") -> LayerKind:
        try:
            return cls(value)
        except ValueError:
            raise SpecError(
                field_name, f"unknown layer kind {value!r}; known: {[k.value for k in cls]}", value=value
            ) from None


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SpecError(name, f"must be a positive integer, got {value!r}", value=value)


@dataclass(frozen=True)
class Shard:
    """``units`` indivisible units of ``unit_elems`` elements, sharded over TP ranks by whole units."""

    units: int
    unit_elems: int

    def __post_init__(self) -> None:
        _positive("units", self.units)
        _positive("unit_elems", self.unit_elems)

    def check_tp(self, tp: int, name: str) -> None:
        """Raise unless ``tp`` divides ``units`` or ``units`` divides ``tp`` (whole units per rank)."""
        if self.units % tp and tp % self.units:
            raise SpecError(
                name,
                f"{self.units} units cannot be sharded over TP {tp}: neither divides the other",
                units=self.units,
                tp=tp,
            )

    def units_per_rank(self, tp: int) -> int:
        return max(1, self.units // tp)

    def first_unit(self, rank: int, tp: int) -> int:
        """The first (global) unit rank ``rank`` of a TP-``tp`` engine holds."""
        return rank * self.units // tp

    def elems_per_rank(self, tp: int) -> int:
        return self.units_per_rank(tp) * self.unit_elems

    def replicated(self, tp: int) -> bool:
        return tp > self.units


@dataclass(frozen=True)
class AttentionSpec:
    """Per-token K and V of ``num_kv_heads`` heads (the model total), sharded by heads."""

    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    head_size_v: int | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        _positive("num_kv_heads", self.num_kv_heads)
        _positive("head_size", self.head_size)
        if self.head_size_v is not None:
            _positive("head_size_v", self.head_size_v)
        if self.sliding_window is not None:
            _positive("sliding_window", self.sliding_window)
        dtype_size(self.dtype)

    @property
    def kind(self) -> LayerKind:
        return LayerKind.SLIDING_WINDOW if self.sliding_window else LayerKind.ATTENTION

    @property
    def v_size(self) -> int:
        return self.head_size_v if self.head_size_v is not None else self.head_size

    @property
    def heads(self) -> Shard:
        return Shard(self.num_kv_heads, 1)

    def heads_per_rank(self, tp: int) -> int:
        return self.heads.units_per_rank(tp)

    def token_bytes(self, tp: int) -> int:
        """Bytes of one token of this layer on one rank (all local heads, K and V)."""
        return self.heads_per_rank(tp) * (self.head_size + self.v_size) * dtype_size(self.dtype)


@dataclass(frozen=True)
class MLASpec:
    """A per-token latent (``kv_lora_rank + qk_rope_head_dim`` elements), replicated on every rank."""

    latent_size: int
    dtype: str = "bfloat16"
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        _positive("latent_size", self.latent_size)
        dtype_size(self.dtype)

    @property
    def kind(self) -> LayerKind:
        return LayerKind.MLA

    def token_bytes(self, tp: int) -> int:  # noqa: ARG002 - TP-independent by definition
        return self.latent_size * dtype_size(self.dtype)


@dataclass(frozen=True)
class MambaSpec:
    """A recurrent state: conv sub-projections (DS layout: channel-major, ``conv_kernel - 1`` rows each)
    followed by a temporal state, each a :class:`Shard`.

    Build one with :meth:`mamba1`, :meth:`mamba2`, :meth:`gdn` or :meth:`kda`; the generic
    constructor takes the pieces directly (``conv_pieces`` in page order).
    """

    kind: LayerKind
    conv_pieces: tuple[Shard, ...]
    temporal: Shard
    conv_kernel: int
    conv_dtype: str = "bfloat16"
    ssm_dtype: str = "bfloat16"
    piece_names: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        kind = LayerKind.parse(self.kind) if not isinstance(self.kind, LayerKind) else self.kind
        object.__setattr__(self, "kind", kind)
        if not kind.is_ssm:
            raise SpecError("kind", f"{kind.value!r} is not an SSM layer kind", value=kind.value)
        if not self.conv_pieces:
            raise SpecError("conv_pieces", "an SSM state needs at least one conv piece", value=())
        if self.conv_kernel < 2:
            raise SpecError("conv_kernel", f"must be >= 2, got {self.conv_kernel}", value=self.conv_kernel)
        dtype_size(self.conv_dtype, "conv_dtype")
        dtype_size(self.ssm_dtype, "ssm_dtype")
        if not self.piece_names:
            object.__setattr__(self, "piece_names", tuple(f"conv{i}" for i in range(len(self.conv_pieces))))
        if len(self.piece_names) != len(self.conv_pieces):
            raise SpecError(
                "piece_names",
                f"{len(self.piece_names)} names for {len(self.conv_pieces)} conv pieces",
                value=len(self.piece_names),
                expected=len(self.conv_pieces),
            )

    # -- constructors for the four families --------------------------------------------------------
    @classmethod
    def mamba1(
        cls,
        intermediate_size: int,
        state_size: int,
        conv_kernel: int = 4,
        conv_dtype: str = "bfloat16",
        ssm_dtype: str | None = None,
    ) -> MambaSpec:
        return cls(
            LayerKind.MAMBA1,
            (Shard(intermediate_size, 1),),
            Shard(intermediate_size, state_size),
            conv_kernel,
            conv_dtype,
            ssm_dtype or conv_dtype,
            ("x",),
        )

    @classmethod
    def mamba2(
        cls,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        state_size: int,
        conv_kernel: int = 4,
        conv_dtype: str = "bfloat16",
        ssm_dtype: str | None = None,
    ) -> MambaSpec:
        return cls(
            LayerKind.MAMBA2,
            (Shard(num_heads, head_dim), Shard(n_groups, state_size), Shard(n_groups, state_size)),
            Shard(num_heads, head_dim * state_size),
            conv_kernel,
            conv_dtype,
            ssm_dtype or conv_dtype,
            ("x", "B", "C"),
        )

    @classmethod
    def gdn(
        cls,
        num_k_heads: int,
        k_head_dim: int,
        num_v_heads: int,
        v_head_dim: int,
        conv_kernel: int = 4,
        conv_dtype: str = "bfloat16",
        ssm_dtype: str | None = None,
    ) -> MambaSpec:
        return cls(
            LayerKind.GDN,
            (Shard(num_k_heads, k_head_dim), Shard(num_k_heads, k_head_dim), Shard(num_v_heads, v_head_dim)),
            Shard(num_v_heads, v_head_dim * k_head_dim),
            conv_kernel,
            conv_dtype,
            ssm_dtype or conv_dtype,
            ("Q", "K", "V"),
        )

    @classmethod
    def kda(
        cls,
        num_heads: int,
        head_dim: int,
        conv_kernel: int = 4,
        conv_dtype: str = "bfloat16",
        ssm_dtype: str = "float32",
    ) -> MambaSpec:
        s = Shard(num_heads, head_dim)
        return cls(
            LayerKind.KDA,
            (s, s, s),
            Shard(num_heads, head_dim * head_dim),
            conv_kernel,
            conv_dtype,
            ssm_dtype,
            ("Q", "K", "V"),
        )

    # -- per-rank sizes ----------------------------------------------------------------------------
    @property
    def conv_rows(self) -> int:
        return self.conv_kernel - 1

    def check_tp(self, tp: int) -> None:
        for name, piece in zip(self.piece_names, self.conv_pieces):
            piece.check_tp(tp, f"conv piece {name}")
        self.temporal.check_tp(tp, "temporal state")

    def piece_channels(self, tp: int) -> tuple[int, ...]:
        """Channels of each conv piece held by one rank."""
        return tuple(p.elems_per_rank(tp) for p in self.conv_pieces)

    def conv_shape(self, tp: int) -> tuple[int, int]:
        """Per-rank DS conv state shape ``(conv_dim_local, conv_kernel - 1)``."""
        return (sum(self.piece_channels(tp)), self.conv_rows)

    def piece_bytes(self, tp: int) -> tuple[int, ...]:
        row = self.conv_rows * dtype_size(self.conv_dtype)
        return tuple(c * row for c in self.piece_channels(tp))

    def conv_bytes(self, tp: int) -> int:
        return sum(self.piece_bytes(tp))

    def ssm_bytes(self, tp: int) -> int:
        return self.temporal.elems_per_rank(tp) * dtype_size(self.ssm_dtype)

    def state_bytes(self, tp: int) -> int:
        """Real bytes of one request's state on one rank (conv + temporal), before page padding."""
        return self.conv_bytes(tp) + self.ssm_bytes(tp)

    def replicated_pieces(self, tp: int) -> tuple[bool, ...]:
        """Which conv pieces are replicated at this TP (e.g. Mamba2 B/C when ``n_groups < tp``)."""
        return tuple(p.replicated(tp) for p in self.conv_pieces)


@dataclass(frozen=True)
class CircularBufferSpec:
    """A ring of ``capacity`` entries of ``entry_size`` elements: the keys of the token group a compressor
    is still compressing (vLLM ``CircularBufferSpec``). A request holds one block, whatever its length; the
    ring's content is a state (the latest entries), not tokens at fixed positions, so D needs P's whole ring
    page. Identical on every TP rank (it overlays replicated MLA pages)."""

    capacity: int
    entry_size: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _positive("capacity", self.capacity)
        _positive("entry_size", self.entry_size)
        dtype_size(self.dtype)

    @property
    def kind(self) -> LayerKind:
        return LayerKind.CIRCULAR_BUFFER

    def page_bytes(self, tp: int) -> int:  # noqa: ARG002 - TP-independent by definition
        """Bytes of the ring on one rank: every rank holds all of it."""
        return self.capacity * self.entry_size * dtype_size(self.dtype)


@dataclass(frozen=True)
class ReplicatedStateSpec:
    """A per-request short-conv state of ``channels`` x ``conv_kernel - 1`` elements (DS layout), identical on
    every TP rank (vLLM ``MambaSpec(tp_replicated=True)``, the PLE state): copied whole, never divided by
    TP."""

    channels: int
    conv_kernel: int = 4
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _positive("channels", self.channels)
        if not isinstance(self.conv_kernel, int) or self.conv_kernel < 2:
            raise SpecError("conv_kernel", f"must be >= 2, got {self.conv_kernel!r}", value=self.conv_kernel)
        dtype_size(self.dtype)

    @property
    def kind(self) -> LayerKind:
        return LayerKind.REPLICATED_STATE

    @property
    def conv_rows(self) -> int:
        return self.conv_kernel - 1

    def state_bytes(self, tp: int) -> int:  # noqa: ARG002 - TP-independent by definition
        return self.channels * self.conv_rows * dtype_size(self.dtype)


LayerSpec = AttentionSpec | MLASpec | MambaSpec | CircularBufferSpec | ReplicatedStateSpec


@dataclass(frozen=True)
class Layer:
    """One cache-holding (sub-)layer: its name, its decoder-layer index and its spec. ``shares``: the layer
    whose tensor this layer's pages overlay (``None``: its own, or the hybrid manager's sharing rule)."""

    name: str
    index: int
    spec: LayerSpec
    shares: str | None = None

    @property
    def kind(self) -> LayerKind:
        return self.spec.kind
