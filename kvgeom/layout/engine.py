"""Engine configuration: how one engine lays a model's cache out on one TP rank."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from kvgeom.errors import ConfigError

__all__ = ["KVLayout", "ConvLayout", "EngineConfig"]


class KVLayout(str, Enum):
    """Order of one attention kernel block's bytes.

    ``HEAD_MAJOR`` is vLLM's ``LBHNC`` (formerly HND): ``[heads, tokens, K|V]``, so a head slice is one
    contiguous run. ``TOKEN_MAJOR`` is ``LBNHC`` (NHD): ``[tokens, heads, K|V]``. ``HEAD_KV_MAJOR`` is the
    page of vLLM's CPU attention backend (``CPU_ATTN``, declared ``LBHNC``; its tensor is ``[blocks, heads,
    tokens, 2 x head_size]``): per head its K half, then its V half. Its kernel
    (``cpu_attn_reshape_and_cache``, ISA ``vec``) stores K **transposed**, ``[head_size, tokens]``, and V as
    ``[tokens, head_size]`` rows (measured: tests/serving/test_cpu_page.py). A head slice is one contiguous
    run, but a token range of a block is not a byte range of the K half: equal kernel blocks move whole
    pages; at a block-size ratio kvgeom mode cuts the page by its token runs (:mod:`kvgeom.layout.tokenruns`)
    and vLLM-compatible mode refuses (vLLM would regroup it as ``[heads, tokens, head_size]``).
    """

    HEAD_MAJOR = "head_major"
    TOKEN_MAJOR = "token_major"
    HEAD_KV_MAJOR = "head_kv_major"

    @property
    def is_head_major(self) -> bool:
        """A head's bytes are contiguous in a kernel block (a head slice is one run)."""
        return self is not KVLayout.TOKEN_MAJOR

    @property
    def runs_per_head(self) -> int:
        """Contiguous runs of one head's token rows in a kernel block of a head-major layout: 1 (``K|V``
        per token), or 2 (the CPU page: its K half, then its V half; the K half is transposed, so a token
        range within it is not contiguous either: its token runs say where each token lies)."""
        return 2 if self is KVLayout.HEAD_KV_MAJOR else 1


class ConvLayout(str, Enum):
    """Order of a conv state: ``DS`` (channel-major, sub-projections contiguous; needed for hetero TP)
    or ``SD`` (row-major)."""

    DS = "DS"
    SD = "SD"


def _parse_enum(cls: type[Enum], value: Any, name: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        raise ConfigError(
            name, f"unknown value {value!r}; known: {[m.value for m in cls]}", value=value
        ) from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive(name: str, value: object) -> None:
    if not _is_int(value) or value <= 0:  # type: ignore[operator]
        raise ConfigError(name, f"must be a positive integer, got {value!r}", value=value)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(name, f"must be a boolean, got {value!r}", value=value)


@dataclass(frozen=True)
class EngineConfig:
    """One engine rank's cache configuration.

    ``block_size`` is a rank's (logical) block in tokens; ``kernel_block_size`` the page the attention
    kernel uses inside it (default: the logical block). ``num_blocks`` counts logical blocks in the pool.
    ``kv_split`` stores K and V as two regions per layer instead of one packed K|V page. ``dcp_size``
    (decode context parallelism: 1, or the TP size) shards every request's pages over the ranks: the
    scheduler's block is then ``dcp_size`` pages, one per rank (:mod:`kvgeom.pair.dcp`). ``pp_size`` /
    ``pp_rank``: pipeline parallelism; the rank holds only the layers of its stage (:mod:`kvgeom.model.stages`).
    ``packed_rows`` (vLLM's block-outermost ``BLHNC`` layout, MLA models without SSM state): one row per
    kernel block holds every layer's page of that block, so one descriptor moves a block of all layers.
    ``separate_group``: layers this engine keeps in a KV-cache group of their own, with their own tensors
    (e.g. a HiSparse decoder's host-resident layers, vLLM PR 40020): P and D then group the same regions
    differently and pair block lists region by region (:mod:`kvgeom.plan.regionmap`).
    ``permute_local_kv`` (vLLM's ``enable_permute_local_kv`` of a D engine's KV-transfer config): a
    token-major D pulls a head-major P's pages into its own pages as if they were head-major, then permutes
    each received block to token-major (docs/vllm-behaviour.md B.6.15). It belongs to the engine, not to a
    pairing, as in vLLM: one setting of D's cache handling that holds for every peer it pulls from.
    ``kv_cache_groups``: the engine's own KV-cache groups, each a list of layer names, in the engine's order
    (vLLM's ``kv_cache_config.kv_cache_groups``, taken from its registration); empty (the default): kvgeom's
    grouping (:func:`kvgeom.layout.allocate.rank_geometry`: attention-like groups first). A request's block lists
    come one per group in this order, so it must be the engine's: vLLM orders groups by the first layer of
    each spec (a Mamba-first hybrid has its state groups first).
    """

    tp_size: int
    block_size: int
    num_blocks: int
    tp_rank: int = 0
    kernel_block_size: int | None = None
    kv_layout: KVLayout = KVLayout.HEAD_MAJOR
    kv_split: bool = False
    conv_layout: ConvLayout = ConvLayout.DS
    dcp_size: int = 1
    pp_size: int = 1
    pp_rank: int = 0
    packed_rows: bool = False
    separate_group: tuple[str, ...] = ()
    permute_local_kv: bool = False
    kv_cache_groups: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        for name in ("tp_size", "block_size", "num_blocks"):
            _check_positive(name, getattr(self, name))
        if not _is_int(self.tp_rank) or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(
                "tp_rank",
                f"{self.tp_rank} is outside [0, tp_size={self.tp_size})",
                value=self.tp_rank,
                expected=self.tp_size,
            )
        kernel = self.kernel_block_size if self.kernel_block_size is not None else self.block_size
        if not _is_int(kernel) or kernel <= 0 or self.block_size % kernel:
            raise ConfigError(
                "kernel_block_size",
                f"{kernel!r} must be a positive divisor of block_size {self.block_size}",
                value=kernel,
                expected=self.block_size,
            )
        if self.dcp_size not in (1, self.tp_size):
            raise ConfigError(
                "dcp_size",
                f"must be 1 (replicated) or the TP size {self.tp_size} (sharded), got {self.dcp_size!r}",
                value=self.dcp_size,
                expected=self.tp_size,
            )
        _check_positive("pp_size", self.pp_size)
        if not _is_int(self.pp_rank) or not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError(
                "pp_rank",
                f"{self.pp_rank!r} is outside [0, pp_size={self.pp_size})",
                value=self.pp_rank,
                expected=self.pp_size,
            )
        _check_bool("packed_rows", self.packed_rows)
        _check_bool("permute_local_kv", self.permute_local_kv)
        self._normalise_groups()
        object.__setattr__(self, "kernel_block_size", kernel)
        object.__setattr__(self, "kv_layout", _parse_enum(KVLayout, self.kv_layout, "kv_layout"))
        object.__setattr__(self, "conv_layout", _parse_enum(ConvLayout, self.conv_layout, "conv_layout"))

    def _normalise_groups(self) -> None:
        """``separate_group`` and ``kv_cache_groups`` checked as layer names and stored as tuples."""
        if isinstance(self.separate_group, str) or not all(isinstance(x, str) for x in self.separate_group):
            raise ConfigError(
                "separate_group",
                f"must be a list of layer names, got {self.separate_group!r}",
                value=self.separate_group,
            )
        object.__setattr__(self, "separate_group", tuple(self.separate_group))
        groups = self.kv_cache_groups
        if isinstance(groups, str) or not all(
            not isinstance(g, str) and len(g) and all(isinstance(x, str) for x in g) for g in groups
        ):
            raise ConfigError(
                "kv_cache_groups",
                f"must be a list of non-empty lists of layer names, got {groups!r}",
                value=groups,
            )
        object.__setattr__(self, "kv_cache_groups", tuple(tuple(g) for g in groups))

    @property
    def kernel(self) -> int:
        """The kernel block size in tokens."""
        return self.kernel_block_size or self.block_size

    @property
    def ppl(self) -> int:
        """Physical (kernel) blocks per logical block."""
        return self.block_size // self.kernel

    @property
    def scheduler_block(self) -> int:
        """Tokens of one entry of a request's block list: ``block_size`` pages of every DCP rank."""
        return self.block_size * self.dcp_size

    @property
    def dcp_rank(self) -> int:
        return self.tp_rank % self.dcp_size

    @property
    def global_rank(self) -> int:
        """This rank's index among all ranks of the engine: ``pp_rank * tp_size + tp_rank``."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        """Ranks of the whole engine (every TP rank of every pipeline stage)."""
        return self.pp_size * self.tp_size

    def with_rank(self, rank: int, pp_rank: int | None = None) -> EngineConfig:
        """The same engine seen from TP rank ``rank`` (of stage ``pp_rank``, default this one's)."""
        stage = self.pp_rank if pp_rank is None else pp_rank
        return EngineConfig(**{**self._fields(), "tp_rank": rank, "pp_rank": stage})

    def same_but_rank(self, other: EngineConfig) -> bool:
        """Whether ``other`` is this engine seen from another rank: ``other.with_rank(self.tp_rank,
        self.pp_rank) == self``, compared field by field without building that engine."""
        return all(
            getattr(self, k) == getattr(other, k)
            for k in self.__dataclass_fields__
            if k not in ("tp_rank", "pp_rank")
        )

    def _fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["kv_layout"] = self.kv_layout.value
        d["conv_layout"] = self.conv_layout.value
        d["separate_group"] = list(self.separate_group)
        d["kv_cache_groups"] = [list(g) for g in self.kv_cache_groups]
        for name, default in (
            ("dcp_size", 1),
            ("pp_size", 1),
            ("pp_rank", 0),
            ("packed_rows", False),
            ("separate_group", []),
            ("permute_local_kv", False),
            ("kv_cache_groups", []),
        ):
            if d[name] == default:
                del d[name]  # cards of engines without these options stay as they were
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EngineConfig:
        if not isinstance(d, dict):
            raise ConfigError("engine", f"must be an object, got {type(d).__name__}", value=d)
        try:
            return cls(**d)
        except TypeError as exc:
            raise ConfigError("engine", f"malformed engine config: {exc}", value=d) from None
