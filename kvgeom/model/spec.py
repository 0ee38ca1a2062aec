"""Model specs: what each decoder layer keeps per request, independent of any engine.

A model is a sequence of cache-holding layers. Each layer holds one of:

* :class:`AttentionSpec` -- per-token K and V for ``num_kv_heads`` heads (full or sliding-window);
* :class:`MLASpec` -- a per-token latent, identical on every TP rank;
* :class:`MambaSpec` -- one recurrent state per request: a conv state made of sub-projections
  (``x | B | C`` for Mamba2, ``Q | K | V`` for GDN/KDA, ``x`` for Mamba1) and a temporal state;
* :class:`CircularBufferSpec` -- a ring ("scratch") of a compressor's latest entries, one block per
  request, identical on every TP rank (CSA-linear models);
* :class:`ReplicatedStateSpec` -- a per-request state page identical on every TP rank, never divided by TP
  (the PLE short-conv state of CSA-linear models).

A layer may *share* another layer's tensor (``Layer.shares``): its pages overlay that layer's allocation,
block for block (a CSA-linear model puts its ring on the pages of its compressed MLA layers, the PLE state
and the SSM state on the first main-KV page). Pages of one pool id belong to one group at a time, so the
overlaid caches never hold the same block at once.

Everything that TP shards is a :class:`Shard`: ``units`` indivisible units (heads, groups, channels)
of ``unit_elems`` elements each. A rank of a TP-``t`` engine holds ``max(1, units // t)`` units,
starting at unit ``rank * units // t``; when ``t > units`` the units are replicated (GQA KV
replication, Mamba2 ``n_groups < TP``). This one rule covers KV heads, SSM heads and conv groups.
"""

from __future__ import annotations

import json
import marshal
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

from kvgeom.errors import SpecError
from kvgeom.model.layers import (
    AttentionSpec,
    CircularBufferSpec,
    Layer,
    LayerKind,
    LayerSpec,
    MambaSpec,
    MLASpec,
    ReplicatedStateSpec,
    Shard,
)

__all__ = ["ModelSpec"]


def _spec_to_json(spec: LayerSpec) -> dict[str, Any]:
    if isinstance(spec, MambaSpec):
        d = asdict(spec)
        d["kind"] = spec.kind.value
        d["conv_pieces"] = [[p.units, p.unit_elems] for p in spec.conv_pieces]
        d["temporal"] = [spec.temporal.units, spec.temporal.unit_elems]
        d["piece_names"] = list(spec.piece_names)
        return d
    d = asdict(spec)
    d["kind"] = spec.kind.value
    return d


def _spec_from_json(d: dict[str, Any], where: str) -> LayerSpec:
    if not isinstance(d, dict) or "kind" not in d:
        raise SpecError(where, f"a layer spec must be an object with a 'kind', got {d!r}", value=d)
    kind = LayerKind.parse(d["kind"], f"{where}.kind")
    rest = {k: v for k, v in d.items() if k != "kind"}
    try:
        if kind in (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW):
            return AttentionSpec(**rest)
        if kind is LayerKind.MLA:
            return MLASpec(**rest)
        if kind is LayerKind.CIRCULAR_BUFFER:
            return CircularBufferSpec(**rest)
        if kind is LayerKind.REPLICATED_STATE:
            return ReplicatedStateSpec(**rest)
        rest["conv_pieces"] = tuple(Shard(*p) for p in rest["conv_pieces"])
        rest["temporal"] = Shard(*rest["temporal"])
        rest["piece_names"] = tuple(rest.get("piece_names", ()))
        return MambaSpec(kind=kind, **rest)
    except TypeError as exc:
        raise SpecError(where, f"malformed {kind.value} spec: {exc}", value=d) from None


def _spec_once(d: Any, where: str, parsed: dict[bytes, LayerSpec]) -> LayerSpec:
    """:func:`_spec_from_json` of ``d``, or the spec already parsed (in this one model) from a value of the
    same ``marshal`` bytes: the same JSON value, types included (``8`` and ``8.0`` differ), so the same
    spec."""
    try:
        key = marshal.dumps(d)
    except ValueError:  # not a JSON value: parsed (and refused) alone
        return _spec_from_json(d, where)
    spec = parsed.get(key)
    if spec is None:
        spec = parsed[key] = _spec_from_json(d, where)
    return spec


@dataclass(frozen=True)
class ModelSpec:
    """A model's cache-holding layers, in decoder order (a layer index may hold two sub-layers,
    e.g. Falcon-H1's parallel attention + Mamba2 block)."""

    name: str
    layers: tuple[Layer, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise SpecError("layers", "a model needs at least one cache-holding layer", value=0)
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise SpecError("layers", "layer names must be unique", value=names)
        ssm = {layer.spec for layer in self.layers if isinstance(layer.spec, MambaSpec)}
        if len(ssm) > 1:
            raise SpecError("layers", "all SSM layers of a model must share one state spec", value=len(ssm))
        _check_overlays(self.layers)

    @classmethod
    def from_layers(cls, name: str, specs: Sequence[LayerSpec | None]) -> ModelSpec:
        """Build from one spec per decoder layer (``None`` for layers without a cache)."""
        layers = []
        for i, spec in enumerate(specs):
            if spec is None:
                continue
            suffix = "mamba" if isinstance(spec, MambaSpec) else "attn"
            layers.append(Layer(f"layers.{i}.{suffix}", i, spec))
        return cls(name, tuple(layers))

    @property
    def num_hidden_layers(self) -> int:
        """Decoder layers of the model (the highest cache-holding index + 1): what pipeline stages split."""
        return max(layer.index for layer in self.layers) + 1

    @property
    def kinds(self) -> set[LayerKind]:
        return {layer.kind for layer in self.layers}

    @cached_property
    def has_ssm(self) -> bool:
        return any(k.is_ssm for k in self.kinds)

    @cached_property
    def is_mla(self) -> bool:
        return LayerKind.MLA in self.kinds

    @cached_property
    def is_csa_linear(self) -> bool:
        """Holds a circular-buffer cache (vLLM's CSA-linear models): layers overlay each other's tensors."""
        return LayerKind.CIRCULAR_BUFFER in self.kinds

    @property
    def overlays(self) -> bool:
        """Some layer shares another layer's tensor explicitly (``Layer.shares``)."""
        return any(la.shares is not None for la in self.layers)

    @cached_property
    def ssm_spec(self) -> MambaSpec | None:
        for layer in self.layers:
            if isinstance(layer.spec, MambaSpec):
                return layer.spec
        return None

    @cached_property
    def attention_spec(self) -> AttentionSpec | None:
        for layer in self.layers:
            if isinstance(layer.spec, AttentionSpec):
                return layer.spec
        return None

    @property
    def num_kv_heads(self) -> int:
        """Total KV heads of the attention layers (1 for MLA-only or SSM-only models)."""
        spec = self.attention_spec
        return spec.num_kv_heads if spec is not None else 1

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layers": [
                {"name": la.name, "index": la.index, "spec": _spec_to_json(la.spec)}
                | ({"shares": la.shares} if la.shares is not None else {})
                for la in self.layers
            ],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelSpec:
        if not isinstance(d, dict) or "layers" not in d:
            raise SpecError("model", "a model spec must be an object with 'layers'", value=type(d).__name__)
        layers = []
        parsed: dict[bytes, LayerSpec] = {}  # a model's layers mostly repeat a few specs: each parsed once
        for i, la in enumerate(d["layers"]):
            try:
                shares = la.get("shares")
                layers.append(
                    Layer(
                        str(la["name"]),
                        int(la["index"]),
                        _spec_once(la["spec"], f"layers[{i}]", parsed),
                        None if shares is None else str(shares),
                    )
                )
            except (KeyError, TypeError, AttributeError):
                raise SpecError(f"layers[{i}]", "needs 'name', 'index' and 'spec'", value=la) from None
        return cls(str(d.get("name", "")), tuple(layers))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))


def _check_overlays(layers: tuple[Layer, ...]) -> None:
    """Explicit tensor sharing (``Layer.shares``) and the CSA-linear caches: a sharing layer names a layer
    that owns its tensor (shares none); a ring overlays an MLA layer (its pages are read whole, as the
    latent's); a replicated state page needs a ring and a sharded SSM state next to it (vLLM: at most one
    such page, in CSA-linear models only); every ring and state of a model with rings shares a tensor."""
    by_name = {la.name: la for la in layers}
    for la in layers:
        if la.shares is None:
            continue
        owner = by_name.get(la.shares)
        if owner is None or owner.shares is not None or owner.name == la.name:
            raise SpecError(
                f"{la.name}.shares",
                f"must name a layer that owns its tensor, got {la.shares!r}",
                value=la.shares,
                expected=sorted(n for n, x in by_name.items() if x.shares is None and n != la.name)[:8],
            )
    kinds = [la.kind for la in layers]
    ple = [la for la in layers if la.kind is LayerKind.REPLICATED_STATE]
    has_ring = LayerKind.CIRCULAR_BUFFER in kinds
    if ple and (len(ple) > 1 or not has_ring or not any(isinstance(la.spec, MambaSpec) for la in layers)):
        raise SpecError(
            "layers",
            "a replicated state (PLE) page is modelled as in vLLM 0.33.0: at most one, in a CSA-linear model "
            "(with a circular buffer) holding a sharded SSM state",
            value=len(ple),
            expected=1,
        )
    for la in layers:
        if la.kind is LayerKind.CIRCULAR_BUFFER and (
            la.shares is None or by_name[la.shares].kind is not LayerKind.MLA
        ):
            raise SpecError(
                f"{la.name}.shares",
                "a circular buffer overlays the pages of an MLA layer (its scratch region)",
                value=la.shares,
            )
    for la in layers:
        if has_ring and la.kind.is_ssm and la.shares is None:
            raise SpecError(
                f"{la.name}.shares",
                "in a CSA-linear model every state overlays a main-KV page",
                value=None,
            )
        if has_ring and la.shares is None and la.kind not in (LayerKind.MLA, LayerKind.ATTENTION):
            raise SpecError(
                f"{la.name}.kind",
                "a CSA-linear model's own tensors are its token caches': MLA pages (the compressed keys) or "
                "full attention (head-sharded main KV); sliding-window caches are not modelled",
                value=la.kind.value,
                expected=[LayerKind.ATTENTION.value, LayerKind.MLA.value],
            )
