"""Scenarios: a whole P/D pair (model, both engines, mode) and its requests, as one value.

A scenario is what an operator asks about ("Nemotron-H 8B, P TP2 block 528 -> D TP1 block 1056, pull")
and what the CLI, the benchmarks and the demo run. It builds every rank's card, the pairings of the
local side (D in pull, P in push) and requests with block ids drawn from each engine's pool.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from .card import GeometryCard
from .engine import EngineConfig
from .errors import ConfigError, PlanError
from .geometry import align_hybrid_block_size, rank_geometry
from .pairing import Pairing
from .plan import RequestPlan, plan_request
from .spec import ModelSpec

__all__ = ["Scenario", "RequestIds"]


@dataclass(frozen=True)
class RequestIds:
    """One request's logical block ids per group on each engine (``prefill`` = P, ``decode`` = D)."""

    num_tokens: int
    prefill: tuple[tuple[int, ...], ...]
    decode: tuple[tuple[int, ...], ...]


def _engine(d: dict[str, Any], model: ModelSpec, side: str) -> EngineConfig:
    d = dict(d)
    tp = int(d.get("tp_size", 1))
    if d.get("block_size", "auto") == "auto":
        d["block_size"] = align_hybrid_block_size(model, tp, int(d.pop("min_block_size", 16)))
    if d.get("kernel_block_size") == "auto":
        d["kernel_block_size"] = None
    try:
        return EngineConfig(**d)
    except TypeError as exc:
        raise ConfigError(side, f"malformed engine description: {exc}", value=d) from None


@dataclass(frozen=True, eq=False)
class Scenario:
    """A P/D pair: ``prefill`` and ``decode`` are rank-0 templates of each engine's configuration."""

    model: ModelSpec
    prefill: EngineConfig
    decode: EngineConfig
    mode: str = "pull"
    compat: str = "kvgeom"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Scenario:
        from . import presets

        model_field = data.get("model")
        model = presets.load(model_field) if isinstance(model_field, str) else ModelSpec.from_json(model_field or {})
        return cls(model, _engine(data.get("prefill", {}), model, "prefill"),
                   _engine(data.get("decode", {}), model, "decode"), data.get("mode", "pull"),
                   data.get("compat", "kvgeom"))

    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        return cls.from_json(json.loads(Path(path).read_text()))

    # -- ranks ---------------------------------------------------------------------------------------
    def cards(self, side: str) -> list[GeometryCard]:
        """Every rank's card of ``side`` ("prefill" or "decode")."""
        eng = self.prefill if side == "prefill" else self.decode
        return [GeometryCard(side, self.model, eng.with_rank(r), self.mode) for r in range(eng.tp_size)]

    @property
    def local_side(self) -> str:
        return "decode" if self.mode == "pull" else "prefill"

    @property
    def remote_side(self) -> str:
        return "prefill" if self.mode == "pull" else "decode"

    @cached_property
    def pairings(self) -> dict[int, Pairing]:
        """The pairing of every local rank (D ranks in pull, P ranks in push) with the remote engine."""
        remotes = self.cards(self.remote_side)
        return {c.engine.tp_rank: Pairing.create(c, remotes, self.mode, self.compat) for c in self.cards(self.local_side)}

    # -- requests ------------------------------------------------------------------------------------
    def request(self, num_tokens: int, seed: int | None = 0) -> RequestIds:
        """Block ids for a request of ``num_tokens``: per attention group ``ceil(tokens / block)`` ids,
        per SSM group one state slot; ids are disjoint across groups (one shared pool per engine) and
        shuffled from the whole pool when ``seed`` is given, sequential otherwise."""
        if num_tokens < 1:
            raise PlanError("num_tokens", f"must be >= 1, got {num_tokens}", value=num_tokens)
        return RequestIds(num_tokens, self._ids(self.prefill, num_tokens, seed),
                          self._ids(self.decode, num_tokens, None if seed is None else seed + 1))

    def _ids(self, eng: EngineConfig, num_tokens: int, seed: int | None) -> tuple[tuple[int, ...], ...]:
        geom = rank_geometry(self.model, eng)
        counts = [1 if g.is_ssm else math.ceil(num_tokens / eng.block_size) for g in geom.groups]
        if sum(counts) > eng.num_blocks:
            raise PlanError("num_blocks", f"the request needs {sum(counts)} blocks, the pool has {eng.num_blocks}",
                            value=eng.num_blocks, expected=sum(counts))
        pool = np.arange(eng.num_blocks) if seed is None else np.random.default_rng(seed).permutation(eng.num_blocks)
        out, pos = [], 0
        for n in counts:
            out.append(tuple(int(x) for x in pool[pos:pos + n]))
            pos += n
        return tuple(out)

    def plans(self, req: RequestIds, request_id: str = "req") -> dict[int, RequestPlan]:
        """The plan of every local rank for one request."""
        local, remote = (req.decode, req.prefill) if self.mode == "pull" else (req.prefill, req.decode)
        return {r: plan_request(p, local, remote, request_id) for r, p in self.pairings.items()}

    def describe(self) -> str:
        p, d = self.prefill, self.decode
        return (f"{self.model.name}: P TP{p.tp_size} block {p.block_size} (kernel {p.kernel}) -> "
                f"D TP{d.tp_size} block {d.block_size} (kernel {d.kernel}), {self.mode}, {self.compat} mode")
