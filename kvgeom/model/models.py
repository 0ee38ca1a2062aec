"""Model references: the names a person gives a model, and the TP sizes an engine can run it at.

:func:`resolve` turns a reference into a :class:`ModelRef`. A reference is one of

* a preset name, as ``kvgeom models`` lists it (``nemotron-h-8b``);
* the Hugging Face id of a preset (``Qwen/Qwen3-8B``; case-insensitive);
* the path of a Hugging Face ``config.json``, or of a directory holding one (read by
  :mod:`kvgeom.model.hfconfig`);
* a kvgeom model spec as a JSON object (:meth:`ModelSpec.to_json`).

An engine shards a model over TP ranks by whole heads (or channels, or groups); some counts must be
divided by TP exactly (query heads, Mamba heads, GDN/KDA heads, Mamba1 channels), KV heads may also be
replicated (TP a multiple of them), and Mamba2 groups must be divided by TP unless there is only one
(vLLM 0.33.0's rules, see docs/models.md). :meth:`ModelRef.tp_problem` names the count a TP size
breaks; :meth:`ModelRef.accepted_tp` lists the sizes that work.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from kvgeom.errors import KvgeomError, SpecError, UnsupportedError
from kvgeom.model import hfconfig, presets
from kvgeom.model.layers import (
    AttentionSpec,
    CircularBufferSpec,
    LayerKind,
    MambaSpec,
    MLASpec,
    ReplicatedStateSpec,
)
from kvgeom.model.spec import ModelSpec

__all__ = ["TPRule", "Sharding", "ModelRef", "resolve", "preset_ids"]


class Sharding(str, Enum):
    """How TP must relate to a count of units."""

    DIVIDES = "divides"  # TP divides the count
    DIVIDES_OR_REPLICATES = "divides_or_replicates"  # TP divides it, or it divides TP (replicated units)
    DIVIDES_UNLESS_ONE = "divides_unless_one"  # TP divides it, or the count is 1 (replicated)


@dataclass(frozen=True)
class TPRule:
    """One count the TP size must respect."""

    name: str
    units: int
    sharding: Sharding

    def allows(self, tp: int) -> bool:
        if self.units % tp == 0:
            return True
        if self.sharding is Sharding.DIVIDES_OR_REPLICATES:
            return tp % self.units == 0
        return self.sharding is Sharding.DIVIDES_UNLESS_ONE and self.units == 1

    def describe(self) -> str:
        how = {
            Sharding.DIVIDES: "TP must divide it",
            Sharding.DIVIDES_OR_REPLICATES: "TP must divide it or be a multiple of it",
            Sharding.DIVIDES_UNLESS_ONE: "TP must divide it unless it is 1",
        }[self.sharding]
        return f"{self.name} {self.units} ({how})"


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: its spec, where it came from, and its query-head count when known."""

    spec: ModelSpec
    origin: str
    num_attention_heads: int | None = None

    @property
    def tp_rules(self) -> tuple[TPRule, ...]:
        rules: dict[str, TPRule] = {}

        def add(name: str, units: int, sharding: Sharding) -> None:
            rules.setdefault(name, TPRule(name, units, sharding))

        if self.num_attention_heads is not None and any(not la.kind.is_ssm for la in self.spec.layers):
            add("num_attention_heads", self.num_attention_heads, Sharding.DIVIDES)
        for layer in self.spec.layers:
            s = layer.spec
            if isinstance(s, AttentionSpec):
                add("num_key_value_heads", s.num_kv_heads, Sharding.DIVIDES_OR_REPLICATES)
            elif isinstance(s, MambaSpec):
                for rule in _ssm_rules(s):
                    add(rule.name, rule.units, rule.sharding)
            elif not isinstance(s, (MLASpec, CircularBufferSpec, ReplicatedStateSpec)):  # pragma: no cover
                # every spec kind is handled above (MLA latents, rings and replicated pages: no TP rule)
                raise SpecError(layer.name, f"unknown spec {s!r}", value=s)
        return tuple(rules.values())

    def tp_problem(self, tp: int) -> str | None:
        """Why an engine cannot run this model at TP ``tp`` (``None`` when it can)."""
        for rule in self.tp_rules:
            if not rule.allows(tp):
                return f"TP {tp} does not fit {rule.describe()}"
        try:
            for layer in self.spec.layers:  # the spec's own sharding rule (whole units per rank)
                if isinstance(layer.spec, AttentionSpec):
                    layer.spec.heads.check_tp(tp, f"{layer.name}.num_kv_heads")
                elif isinstance(layer.spec, MambaSpec):
                    layer.spec.check_tp(tp)
        except SpecError as exc:
            return str(exc)
        return None

    def accepted_tp(self, limit: int) -> list[int]:
        """Every TP size up to ``limit`` the model can run at."""
        strict = [r.units for r in self.tp_rules if r.sharding is Sharding.DIVIDES]
        top = min(limit, math.gcd(*strict)) if strict else limit
        return [t for t in range(1, top + 1) if self.tp_problem(t) is None]


def _ssm_rules(s: MambaSpec) -> list[TPRule]:
    units = [p.units for p in s.conv_pieces]
    if s.kind is LayerKind.MAMBA2:
        return [
            TPRule("Mamba2 heads", s.temporal.units, Sharding.DIVIDES),
            TPRule("Mamba2 groups (n_groups)", units[1], Sharding.DIVIDES_UNLESS_ONE),
        ]
    if s.kind is LayerKind.GDN:
        return [
            TPRule("GDN key heads", units[0], Sharding.DIVIDES),
            TPRule("GDN value heads", units[2], Sharding.DIVIDES),
        ]
    if s.kind is LayerKind.KDA:
        return [TPRule("KDA heads", s.temporal.units, Sharding.DIVIDES)]
    return [TPRule("Mamba1 channels", units[0], Sharding.DIVIDES)]


@cache
def _cards() -> dict[str, dict[str, Any]]:
    root = resources.files(presets)
    return {p.name[:-5]: json.loads(p.read_text()) for p in root.iterdir() if p.name.endswith(".json")}


def preset_ids() -> dict[str, str]:
    """Preset name -> the Hugging Face id its card describes."""
    return {name: str(card["name"]) for name, card in sorted(_cards().items())}


def _heads(fields: Mapping[str, Any]) -> int | None:
    text = fields.get("text_config")
    f = text if isinstance(text, Mapping) else fields
    value = f.get("num_attention_heads")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _preset(name: str) -> ModelRef:
    try:
        spec = presets.load(name)
    except KvgeomError as exc:
        supported = [n for n in _cards() if n != name]
        raise UnsupportedError(
            "model", f"preset {name} is not supported: {exc} (accepted: {', '.join(supported)})", value=name
        ) from None
    return ModelRef(spec, f"preset {name}", _heads(_cards()[name]["fields"]))


def resolve(ref: str | Mapping[str, Any], *, base: Path | None = None) -> ModelRef:
    """The model ``ref`` names (see the module docstring). A relative path is taken from ``base``
    (default: the working directory). Unknown names raise :class:`SpecError` on field ``model``
    listing the close matches."""
    if isinstance(ref, Mapping):
        if "layers" in ref:
            return ModelRef(ModelSpec.from_json(dict(ref)), "inline model spec")
        if "model_type" in ref or "text_config" in ref:
            return ModelRef(hfconfig.read_config(ref), "inline config", _heads(ref))
        raise SpecError(
            "model",
            "an object must be a kvgeom model spec ('layers') or a Hugging Face config ('model_type')",
            value=sorted(ref)[:8],
        )
    if not isinstance(ref, str) or not ref.strip():
        raise SpecError("model", f"must be a name, a path or an object, got {ref!r}", value=ref)
    cards = _cards()
    if ref in cards:
        return _preset(ref)
    by_id = {card["name"].lower(): name for name, card in cards.items()}
    if ref.lower() in by_id:
        return _preset(by_id[ref.lower()])
    path = Path(ref).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    if path.is_dir() or path.suffix == ".json" or path.exists():
        config = hfconfig.load_config(path)
        return ModelRef(hfconfig.read_config(path), f"config {path}", _heads(config))
    close = difflib.get_close_matches(ref.lower(), [*cards, *by_id], n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(by_id.get(c, c)) for c in close)}?" if close else ""
    raise SpecError(
        "model",
        f"{ref!r} is not a preset, the Hugging Face id of a preset, or a config.json path "
        f"(accepted: the names `kvgeom models` lists, or a path to a config.json){hint}",
        value=ref,
    )
