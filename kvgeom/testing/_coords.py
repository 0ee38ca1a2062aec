"""Byte tags: one ``int64`` per byte naming what the byte holds.

A tag ``>= 0`` is a **logical coordinate** of the model (engine-independent, docs/vllm-behaviour.md Part D):

* attention / sliding window: ``(layer, token, global KV head, K or V, byte within the head)``;
* MLA: ``(layer, token, byte within the latent)``;
* SSM conv piece: ``(layer, piece, global channel, row, byte)``; SSM temporal state:
  ``(layer, global element, byte)``.

Every (layer, part) is one *field*: a mixed-radix box of tags starting at its own base, so a tag is
decoded by finding its field and unravelling the rest. Negative tags are not coordinates:
:data:`POISON` (a destination byte nothing wrote yet), :data:`ZERO` (a byte zeroed by the
post-receive step), and *location* tags (a byte that holds no coordinate of this request, named by
where it lives: a neighbour's block, page padding, or a destination byte outside the request).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from kvgeom.dtypes import dtype_size
from kvgeom.errors import KvgeomError
from kvgeom.model.layers import AttentionSpec, CircularBufferSpec, MambaSpec, MLASpec, ReplicatedStateSpec
from kvgeom.model.spec import ModelSpec


class LayoutError(KvgeomError):
    """The oracle's layout model and the allocated geometry disagree (content past a block or page): a
    :class:`~kvgeom.errors.KvgeomError` whose ``field`` names the region, layer or index at fault and whose
    ``values`` hold the sizes that disagree."""


__all__ = ["POISON", "ZERO", "CoordSpace", "LayoutError", "describe_tag", "location_tags"]

POISON = -1
ZERO = -2
_LOC0 = 3  # location tags are -(_LOC0 + location)
_OFF_BITS, _REGION_BITS, _RANK_BITS = 36, 12, 6
SIDES = ("P", "D")


def location_tags(side: int, rank: int, region: int, offsets: np.ndarray) -> np.ndarray:
    """Tags naming bytes by place: engine ``side`` (0 = P, 1 = D), rank, region, byte offset."""
    if not (0 <= rank < 1 << _RANK_BITS and 0 <= region < 1 << _REGION_BITS):
        raise LayoutError(
            "rank" if not 0 <= rank < 1 << _RANK_BITS else "region",
            f"rank {rank} / region {region} too large for location tags",
            value=(rank, region),
            expected=(1 << _RANK_BITS, 1 << _REGION_BITS),
        )
    head = ((side << _RANK_BITS | rank) << _REGION_BITS | region) << _OFF_BITS
    return -(_LOC0 + head + np.asarray(offsets, dtype=np.int64))


def _describe_location(tag: int) -> str:
    loc = -tag - _LOC0
    offset = loc & ((1 << _OFF_BITS) - 1)
    loc >>= _OFF_BITS
    region = loc & ((1 << _REGION_BITS) - 1)
    loc >>= _REGION_BITS
    rank = loc & ((1 << _RANK_BITS) - 1)
    side = loc >> _RANK_BITS
    return f"no coordinate ({SIDES[side]} rank {rank} region {region} byte {offset})"


@dataclass(frozen=True)
class _Field:
    base: int
    layer: str
    part: str  # "kv", "latent", a conv piece name, or "temporal"
    dims: tuple[tuple[str, int], ...]  # (name, extent), outermost first

    @property
    def size(self) -> int:
        return int(np.prod([n for _, n in self.dims]))


class CoordSpace:
    """Tags of every logical coordinate of ``model`` for tokens ``< max_tokens``."""

    def __init__(self, model: ModelSpec, max_tokens: int) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self._fields: list[_Field] = []
        self._by_key: dict[tuple[str, str], _Field] = {}
        for layer in model.layers:
            spec = layer.spec
            if isinstance(spec, AttentionSpec):
                e = dtype_size(spec.dtype)
                width = max(spec.head_size, spec.v_size) * e
                self._add(
                    layer.name,
                    "kv",
                    (("token", max_tokens), ("head", spec.num_kv_heads), ("kv", 2), ("byte", width)),
                )
            elif isinstance(spec, MLASpec):
                self._add(
                    layer.name,
                    "latent",
                    (("token", max_tokens), ("byte", spec.latent_size * dtype_size(spec.dtype))),
                )
            elif isinstance(spec, CircularBufferSpec):  # a ring entry's bytes, the same on every rank
                self._add(
                    layer.name,
                    "ring",
                    (("entry", spec.capacity), ("byte", spec.entry_size * dtype_size(spec.dtype))),
                )
            elif isinstance(spec, ReplicatedStateSpec):  # the whole state, the same on every rank
                self._add(
                    layer.name,
                    "state",
                    (("channel", spec.channels), ("row", spec.conv_rows), ("byte", dtype_size(spec.dtype))),
                )
            elif isinstance(spec, MambaSpec):
                e = dtype_size(spec.conv_dtype)
                for name, piece in zip(spec.piece_names, spec.conv_pieces):
                    self._add(
                        layer.name,
                        name,
                        (("channel", piece.units * piece.unit_elems), ("row", spec.conv_rows), ("byte", e)),
                    )
                t = spec.temporal
                self._add(
                    layer.name,
                    "temporal",
                    (("element", t.units * t.unit_elems), ("byte", dtype_size(spec.ssm_dtype))),
                )
        self._bases = [f.base for f in self._fields]

    def _add(self, layer: str, part: str, dims: tuple[tuple[str, int], ...]) -> None:
        base = self._fields[-1].base + self._fields[-1].size if self._fields else 0
        f = _Field(base, layer, part, dims)
        self._fields.append(f)
        self._by_key[(layer, part)] = f

    def tag(self, layer: str, part: str, *index: np.ndarray | int) -> np.ndarray:
        """Tags of coordinates ``index`` (one array or int per dimension, broadcast together)."""
        f = self._by_key[(layer, part)]
        flat: np.ndarray | int = 0
        for (name, extent), i in zip(f.dims, index, strict=True):
            i = np.asarray(i, dtype=np.int64)
            if np.any((i < 0) | (i >= extent)):
                raise LayoutError(
                    f"{layer} {part}.{name}",
                    f"index outside [0, {extent})",
                    value=i.tolist(),
                    expected=extent,
                )
            flat = flat * extent + i
        return f.base + np.asarray(flat, dtype=np.int64)

    def describe(self, tag: int) -> str:
        """A person-readable name of ``tag``."""
        return describe_tag(int(tag), self)

    def _decode(self, tag: int) -> str:
        i = bisect.bisect_right(self._bases, tag) - 1
        if i < 0 or tag >= self._fields[i].base + self._fields[i].size:
            return f"unknown tag {tag}"
        f = self._fields[i]
        rest = tag - f.base
        parts = []
        for name, extent in reversed(f.dims):
            parts.append((name, rest % extent))
            rest //= extent
        fields = dict(reversed(parts))
        if f.part == "kv":
            kv = "V" if fields.pop("kv") else "K"
            return f"{f.layer} token {fields['token']} head {fields['head']} {kv} byte {fields['byte']}"
        words = " ".join(f"{k} {v}" for k, v in fields.items())
        return f"{f.layer} {f.part} {words}"


def describe_tag(tag: int, space: CoordSpace | None = None) -> str:
    """Name a tag: a coordinate (decoded with ``space``), ``POISON``, ``ZERO`` or a byte's location."""
    if tag == POISON:
        return "POISON (never written)"
    if tag == ZERO:
        return "ZERO (zeroed)"
    if tag < 0:
        return _describe_location(tag)
    return space._decode(tag) if space is not None else f"coordinate #{tag}"
