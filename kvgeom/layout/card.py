"""Geometry cards: the versioned, JSON-serialisable description of one rank that a connector sends in
its handshake.

A card carries the model spec and engine configuration (from which everything is re-derived) and the
derived numbers a peer needs (kernel block size, ppl, block counts, region lengths and strides, SSM
sizes and conv offsets). ``GeometryCard.from_json`` re-derives the geometry and rejects a card whose
advertised numbers disagree with its own spec, naming the field and both values. ``digest`` is a
stable hash of the canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
import marshal
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, NamedTuple

from kvgeom.errors import CardError, KvgeomError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import RankGeometry
from kvgeom.model.spec import ModelSpec

__all__ = ["CARD_VERSION", "CardLimits", "DEFAULT_LIMITS", "GeometryCard", "card_of"]

CARD_VERSION = 1


@dataclass(frozen=True)
class CardLimits:
    """Bounds a card received from a peer must respect, checked on the raw JSON before anything is
    derived or allocated (a card is untrusted input: its sizes decide how large the peer's descriptor
    tables are). ``max_table_rows`` bounds kernel blocks x layers, the size of one descriptor table."""

    max_layers: int = 1024
    max_kernel_blocks: int = 1 << 22
    max_table_rows: int = 1 << 25


DEFAULT_LIMITS = CardLimits()


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_limits(data: dict[str, Any], limits: CardLimits) -> None:
    """Refuse a card whose layer, region or block counts exceed ``limits`` (before parsing it)."""
    model, engine, derived = data.get("model"), data.get("engine"), data.get("derived")
    layers = model.get("layers") if isinstance(model, dict) else None
    n_layers = len(layers) if isinstance(layers, list) else 0
    if n_layers > limits.max_layers:
        raise CardError(
            "model.layers",
            f"{n_layers} layers exceed the limit of {limits.max_layers}",
            value=n_layers,
            expected=limits.max_layers,
        )
    regions = derived.get("regions") if isinstance(derived, dict) else None
    if isinstance(regions, list) and len(regions) > max(limits.max_layers, n_layers):
        raise CardError(
            "derived.regions",
            f"{len(regions)} regions exceed the limit of {limits.max_layers}",
            value=len(regions),
            expected=limits.max_layers,
        )
    if not isinstance(engine, dict):
        return
    blocks, size = _int(engine.get("num_blocks")), _int(engine.get("block_size"))
    kernel = _int(engine.get("kernel_block_size")) or size
    if blocks is None or size is None or not kernel or kernel <= 0 or size <= 0:
        return  # malformed: EngineConfig refuses it with its own error
    kernel_blocks = blocks * max(1, size // kernel)
    if kernel_blocks > limits.max_kernel_blocks:
        raise CardError(
            "engine.num_blocks",
            f"{blocks} blocks ({kernel_blocks} kernel blocks) exceed the limit of "
            f"{limits.max_kernel_blocks} kernel blocks",
            value=blocks,
            expected=limits.max_kernel_blocks,
        )
    if kernel_blocks * max(1, n_layers) > limits.max_table_rows:
        raise CardError(
            "engine.num_blocks",
            f"{kernel_blocks} kernel blocks x {n_layers} layers exceed the limit "
            f"of {limits.max_table_rows} table rows",
            value=kernel_blocks * n_layers,
            expected=limits.max_table_rows,
        )


def _derived(geom: RankGeometry) -> dict[str, Any]:
    return {
        "block_size": geom.block_size,
        "logical_block_size": geom.logical_block_size,
        "ppl": geom.ppl,
        "num_blocks": geom.num_blocks,
        "logical_num_blocks": geom.logical_num_blocks,
        "num_kv_heads": geom.num_kv_heads,
        "is_mla": geom.is_mla,
        "group_kinds": [g.kind.value for g in geom.groups],
        "regions": [
            {
                "name": r.name,
                "block_len": r.block_len,
                "block_stride": r.block_stride,
                "num_blocks": r.num_blocks,
                "is_mla": r.is_mla,
                "groups": [g for g, _ in r.members],
            }
            for r in geom.regions
        ],
        "ssm_sizes": list(geom.ssm.sizes) if geom.ssm else None,
        "conv_offsets": [list(o) for o in geom.ssm.conv_offsets] if geom.ssm else None,
        "ssm_region_indices": list(geom.ssm_region_indices),
    }


class _Parsed(NamedTuple):
    """One card parsed by :meth:`GeometryCard.from_json_many`, with what a later rank of the same engine reuses:
    the keys (:func:`_value_key`) of its raw model and of its raw engine without ``tp_rank``, and its derived
    numbers."""

    card: GeometryCard
    model_key: bytes | None
    engine_key: bytes | None
    derived: dict[str, Any]


def _value_key(value: Any) -> bytes | None:
    """A key equal for two JSON values only when they are the same value, types included (``8``, ``8.0``
    and ``True`` differ, as the checks of a spec tell them apart): their ``marshal`` bytes. ``None`` (equal
    to no key) for a value ``marshal`` cannot write. Equal values may still get different keys (``marshal``
    records which objects they share); a miss only costs the work a key saves."""
    try:
        return marshal.dumps(value)
    except ValueError:
        return None


def _engine_key(engine: Any) -> bytes | None:
    """The key of a raw engine object without ``tp_rank``."""
    if not isinstance(engine, dict):
        return None
    return _value_key({k: v for k, v in engine.items() if k != "tp_rank"})


def _decoded(data: Any) -> dict[str, Any]:
    """A card's JSON object (``data`` itself, or its text decoded); a typed error for anything else."""
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise CardError("card", f"not valid JSON: {exc}", value=str(data)[:80]) from None
    if not isinstance(data, dict):
        raise CardError("card", f"must be a JSON object, got {type(data).__name__}", value=data)
    return data


def _diff(path: str, card: Any, derived: Any) -> None:
    if isinstance(derived, dict):
        if not isinstance(card, dict):
            raise CardError(path, f"card has {card!r}, expected an object", card=card, derived=derived)
        for key, value in derived.items():
            if key not in card:
                raise CardError(f"{path}.{key}", "missing from the card", card=None, derived=value)
            _diff(f"{path}.{key}", card[key], value)
    elif isinstance(derived, list):
        if not isinstance(card, list) or len(card) != len(derived):
            raise CardError(
                path, f"card says {card!r}, its own spec derives {derived!r}", card=card, derived=derived
            )
        for i, (a, b) in enumerate(zip(card, derived)):
            _diff(f"{path}[{i}]", a, b)
    elif card != derived:
        raise CardError(
            path, f"card says {card!r}, its own spec derives {derived!r}", card=card, derived=derived
        )


@dataclass(frozen=True)
class GeometryCard:
    """One rank's handshake card. ``engine_id`` names the engine (all its ranks share it)."""

    engine_id: str
    model: ModelSpec
    engine: EngineConfig
    mode: str = "pull"

    def __post_init__(self) -> None:
        if self.mode not in ("pull", "push"):
            raise CardError("mode", f"must be 'pull' or 'push', got {self.mode!r}", value=self.mode)

    @cached_property
    def geometry(self) -> RankGeometry:
        return rank_geometry(self.model, self.engine)

    def to_json(self) -> dict[str, Any]:
        return {
            "kvgeom_card": CARD_VERSION,
            "engine_id": self.engine_id,
            "mode": self.mode,
            "model": self.model.to_json(),
            "engine": self.engine.to_json(),
            "derived": _derived(self.geometry),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> str:
        """Stable hash of the canonical card (sha256 of the sorted-key compact JSON, 16 hex digits)."""
        return hashlib.sha256(self.dumps().encode()).hexdigest()[:16]

    @property
    def model_digest(self) -> str:
        """Hash of the model spec alone: both sides of a pair must agree on it."""
        return hashlib.sha256(self.model.dumps().encode()).hexdigest()[:16]

    @classmethod
    def from_json(cls, data: dict[str, Any] | str, limits: CardLimits = DEFAULT_LIMITS) -> GeometryCard:
        """Parse and check a card: ``limits`` first (on the raw JSON), then the spec, then its derived
        numbers against the spec's own."""
        return cls._parse(_decoded(data), limits, None, False)[0]

    @classmethod
    def from_json_many(
        cls, items: Sequence[dict[str, Any] | str], limits: CardLimits = DEFAULT_LIMITS
    ) -> list[GeometryCard]:
        """Parse and check several cards (the ranks of an engine, as a handshake receives them): the cards
        and the errors :meth:`from_json` gives for each in turn, with the work ranks share done once. A
        card whose raw model has the key (:func:`_value_key`) of an earlier card's (the same JSON value,
        types included)
        takes that card's parsed model; one whose raw engine also differs from that card's only in
        ``tp_rank`` takes its geometry with its own engine (a geometry's numbers do not depend on the TP
        rank) and is checked against the same derived numbers."""
        done: list[_Parsed] = []
        for item in items:
            data = _decoded(item)
            model_key = _value_key(data.get("model"))
            engine_key = _engine_key(data.get("engine"))
            same = next((p for p in done if model_key is not None and p.model_key == model_key), None)
            card, derived = cls._parse(
                data,
                limits,
                same,
                same is not None and engine_key is not None and same.engine_key == engine_key,
            )
            done.append(_Parsed(card, model_key, engine_key, derived))
        return [p.card for p in done]

    @classmethod
    def _parse(
        cls, data: dict[str, Any], limits: CardLimits, same: _Parsed | None, same_engine: bool
    ) -> tuple[GeometryCard, dict[str, Any]]:
        """The checked card of ``data`` and its derived numbers; ``same``: an earlier card of the same raw
        model (its engine the same but for ``tp_rank`` where ``same_engine``)."""
        version = data.get("kvgeom_card")
        if version != CARD_VERSION:
            raise CardError(
                "kvgeom_card",
                f"unsupported card version {version!r}; this kvgeom reads {CARD_VERSION}",
                card=version,
                expected=CARD_VERSION,
            )
        for key in ("engine_id", "model", "engine", "derived"):
            if key not in data:
                raise CardError(key, "missing from the card", value=None)
        _check_limits(data, limits)
        try:
            card = cls(
                str(data["engine_id"]),
                same.card.model if same is not None else ModelSpec.from_json(data["model"]),
                EngineConfig.from_json(data["engine"]),
                str(data.get("mode", "pull")),
            )
            if same is not None and same_engine:
                # what `geometry` would compute: the earlier rank's geometry, this rank's engine
                card.__dict__["geometry"] = replace(same.card.geometry, engine=card.engine)
                derived = same.derived
            else:
                derived = _derived(card.geometry)
        except CardError:
            raise
        except KvgeomError as exc:
            raise CardError(f"card.{exc.field}", str(exc), **exc.values) from None
        if data["derived"] != derived:  # equal values pass _diff; otherwise it names the first difference
            _diff("derived", data["derived"], derived)
        return card, derived

    @classmethod
    def loads(cls, text: str) -> GeometryCard:
        return cls.from_json(text)


def card_of(engine_id: str, model: ModelSpec, engine: EngineConfig, mode: str = "pull") -> GeometryCard:
    """The card of one rank (a shorthand for ``GeometryCard(...)``)."""
    return GeometryCard(engine_id, model, engine, mode)
