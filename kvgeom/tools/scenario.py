"""Scenarios: a whole P/D pair (model, both engines, mode) and its requests, as one value.

A scenario is what an operator asks about ("Nemotron-H 8B, P TP2 block 1040 -> D TP1 block 2080, pull")
and what the CLI, the benchmarks and the demo run. It builds every rank's card, the pairings of the
local side (D in pull, P in push) and requests with block ids drawn from each engine's pool.

The JSON form (docs/cli.md) is validated key by key: an unknown key, a value of the wrong type or out
of range raises :class:`~kvgeom.errors.ConfigError` naming the field (``prefill.tp_size``) and what
is accepted. ``block_size: "auto"`` derives the block size the way vLLM 0.33.0 does for hybrid models
(from ``min_block_size``, the size asked for, and ``kernel_alignment``, the attention backend's
smallest kernel block).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from kvgeom.errors import ConfigError, KvgeomError, PlanError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.card import GeometryCard
from kvgeom.layout.engine import ConvLayout, EngineConfig, KVLayout
from kvgeom.layout.geometry import align_hybrid_block_size
from kvgeom.model.hfconfig import KV_CACHE_DTYPES, SSM_CACHE_DTYPES, apply_cache_dtypes
from kvgeom.model.layers import AttentionSpec, MLASpec
from kvgeom.model.models import ModelRef, resolve
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.request import plan_request
from kvgeom.plan.requestplan import RequestPlan

__all__ = [
    "Scenario",
    "RequestIds",
    "examples",
    "example",
    "SCENARIO_KEYS",
    "ENGINE_KEYS",
    "MAX_TP",
    "MAX_BLOCK_SIZE",
]

#: keys of a scenario object (keys starting with ``_`` are comments)
SCENARIO_KEYS = ("model", "prefill", "decode", "mode", "compat", "kv_cache_dtype", "mamba_ssm_cache_dtype")
#: keys of an engine object, with their defaults
ENGINE_KEYS: dict[str, Any] = {
    "tp_size": 1,
    "block_size": "auto",
    "min_block_size": 16,
    "kernel_block_size": "auto",
    "kernel_alignment": 16,
    "num_blocks": 64,
    "kv_layout": KVLayout.HEAD_MAJOR.value,
    "conv_layout": ConvLayout.DS.value,
    "kv_split": False,
    "permute_local_kv": False,
}
MAX_TP = 1024
MAX_BLOCK_SIZE = 1 << 20
_MAX_NUM_BLOCKS = 1 << 40


def examples() -> dict[str, Path]:
    """The shipped example scenarios by name (``kvgeom/examples/*.json``, installed with the package)."""
    d = Path(str(resources.files("kvgeom") / "examples"))
    return {p.stem: p for p in sorted(d.glob("*.json"))} if d.is_dir() else {}


def example(name: str) -> dict[str, Any]:
    """A shipped example scenario's JSON object, its comment keys (``_...``) left out: the one definition of
    a pair that the demo, the transport tests and the benchmarks share. An unknown name is a
    :class:`~kvgeom.errors.ConfigError` (field ``example``) naming the shipped ones."""
    shipped = examples()
    if name not in shipped:
        raise ConfigError(
            "example", f"no shipped example {name!r} (shipped: {', '.join(shipped)})", value=name,
            expected=tuple(shipped),
        )  # fmt: skip
    data = json.loads(shipped[name].read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


@dataclass(frozen=True)
class RequestIds:
    """One request's logical block ids per group on each engine (``prefill`` = P, ``decode`` = D)."""

    num_tokens: int
    prefill: tuple[tuple[int, ...], ...]
    decode: tuple[tuple[int, ...], ...]


def _int(d: Mapping[str, Any], key: str, where: str, lo: int, hi: int) -> int:
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{where}.{key}", f"must be an integer, got {value!r} (accepted: {lo}..{hi})", value=value
        )
    if not lo <= value <= hi:
        raise ConfigError(
            f"{where}.{key}",
            f"{value} is out of range (accepted: {lo}..{hi})",
            value=value,
            expected=(lo, hi),
        )
    return value


def _choice(value: Any, field: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(field, f"unknown value {value!r} (accepted: {', '.join(choices)})", value=value)
    return str(value)


def _object(value: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        keys = ", ".join(ENGINE_KEYS if field in ("prefill", "decode") else SCENARIO_KEYS)
        raise ConfigError(
            field,
            f"must be a JSON object, got {type(value).__name__} (accepted: an object of {keys})",
            value=value,
        )
    unknown = sorted(
        k
        for k in value
        if not str(k).startswith("_")
        and k not in (ENGINE_KEYS if field in ("prefill", "decode") else SCENARIO_KEYS)
    )
    if unknown:
        accepted = ", ".join(ENGINE_KEYS if field in ("prefill", "decode") else SCENARIO_KEYS)
        where = f"{field}." if field in ("prefill", "decode") else ""
        raise ConfigError(f"{where}{unknown[0]}", f"unknown key (accepted: {accepted})", value=unknown[0])
    return value


def _engine(data: Any, ref: ModelRef, side: str) -> EngineConfig:
    d = {**ENGINE_KEYS, **{k: v for k, v in _object(data, side).items() if not str(k).startswith("_")}}
    tp = _engine_tp(d, ref, side)
    block = _engine_block(d, ref.spec, tp, side)
    kernel = _engine_kernel(d, block, side)
    for flag in ("kv_split", "permute_local_kv"):
        if not isinstance(d[flag], bool):
            raise ConfigError(
                f"{side}.{flag}",
                f"must be true or false, got {d[flag]!r} (accepted: true, false)",
                value=d[flag],
            )
    return EngineConfig(
        tp_size=tp,
        block_size=block,
        num_blocks=_int(d, "num_blocks", side, 1, _MAX_NUM_BLOCKS),
        kernel_block_size=kernel,
        kv_layout=KVLayout(_choice(d["kv_layout"], f"{side}.kv_layout", tuple(k.value for k in KVLayout))),
        kv_split=d["kv_split"],
        conv_layout=ConvLayout(
            _choice(d["conv_layout"], f"{side}.conv_layout", tuple(c.value for c in ConvLayout))
        ),
        permute_local_kv=d["permute_local_kv"],
    )


def _engine_tp(d: Mapping[str, Any], ref: ModelRef, side: str) -> int:
    """``tp_size``: an integer the model's heads split by."""
    tp = _int(d, "tp_size", side, 1, MAX_TP)
    problem = ref.tp_problem(tp)
    if problem:
        accepted = ", ".join(map(str, ref.accepted_tp(min(MAX_TP, 256)))) or "none"
        raise ConfigError(f"{side}.tp_size", f"{problem} (accepted: {accepted})", value=tp)
    return tp


def _engine_block(d: Mapping[str, Any], model: ModelSpec, tp: int, side: str) -> int:
    """``block_size``: given, or ``"auto"`` (vLLM's hybrid alignment from ``min_block_size`` and
    ``kernel_alignment``, which is checked either way)."""
    align = _int(d, "kernel_alignment", side, 1, MAX_BLOCK_SIZE)
    if d["block_size"] == "auto":
        return align_hybrid_block_size(
            model,
            tp,
            _int(d, "min_block_size", side, 1, MAX_BLOCK_SIZE),
            align,
            kernel_block_sizes=(align,),
            mla_alignment=128,
        )
    if isinstance(d["block_size"], str):
        raise ConfigError(
            f"{side}.block_size",
            f"unknown value {d['block_size']!r} (accepted: 'auto' or 1..{MAX_BLOCK_SIZE})",
            value=d["block_size"],
        )
    return _int(d, "block_size", side, 1, MAX_BLOCK_SIZE)


def _engine_kernel(d: Mapping[str, Any], block: int, side: str) -> int | None:
    """``kernel_block_size``: ``None`` for ``"auto"``, else a divisor of ``block``."""
    kernel = d["kernel_block_size"]
    if kernel in ("auto", None):
        return None
    if isinstance(kernel, str):
        raise ConfigError(
            f"{side}.kernel_block_size",
            f"unknown value {kernel!r} (accepted: 'auto' or a divisor of block_size {block})",
            value=kernel,
        )
    size = _int(d, "kernel_block_size", side, 1, block)
    if block % size:
        divisors = [k for k in range(1, min(block, 4096) + 1) if block % k == 0]
        raise ConfigError(
            f"{side}.kernel_block_size",
            f"{size} does not divide block_size {block} (accepted: 'auto' or one of {divisors[-12:]})",
            value=size,
            expected=block,
        )
    return size


@dataclass(frozen=True, eq=False)
class Scenario:
    """A P/D pair: ``prefill`` and ``decode`` are rank-0 templates of each engine's configuration."""

    model: ModelSpec
    prefill: EngineConfig
    decode: EngineConfig
    mode: str = "pull"
    compat: str = "kvgeom"
    source: ModelRef | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any], base: Path | None = None) -> Scenario:
        """Build from the JSON form (docs/cli.md). ``base`` resolves a relative ``model`` path."""
        data = _object(data, "scenario")
        if "model" not in data:
            raise ConfigError(
                "model",
                "missing (accepted: a preset name, a Hugging Face id of a preset, a "
                "config.json path, or a model spec object)",
                value=None,
            )
        ref = resolve(data["model"], base=base)
        kv = _choice(data.get("kv_cache_dtype", "auto"), "kv_cache_dtype", KV_CACHE_DTYPES)
        ssm = _choice(data.get("mamba_ssm_cache_dtype", "auto"), "mamba_ssm_cache_dtype", SSM_CACHE_DTYPES)
        if kv != "auto" or ssm != "auto":
            ref = ModelRef(apply_cache_dtypes(ref.spec, kv, ssm), ref.origin, ref.num_attention_heads)
        mode = _choice(data.get("mode", "pull"), "mode", ("pull", "push"))
        compat = _choice(data.get("compat", "kvgeom"), "compat", ("kvgeom", "vllm"))
        prefill = _engine(data.get("prefill", {}), ref, "prefill")
        decode = _engine(data.get("decode", {}), ref, "decode")
        return cls(ref.spec, prefill, decode, mode, compat, ref)

    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        """Read a scenario file; a missing, unreadable or malformed file raises :class:`ConfigError`
        on field ``scenario``."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError("scenario", f"no such file: {p}", value=str(p)) from None
        except IsADirectoryError:
            raise ConfigError(
                "scenario", f"{p} is a directory (accepted: a scenario JSON file)", value=str(p)
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                "scenario", f"cannot read {p}: {exc.__class__.__name__}", value=str(p)
            ) from None
        except json.JSONDecodeError as exc:
            raise ConfigError(
                "scenario",
                f"{p} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
                value=str(p),
            ) from None
        return cls.from_json(data, base=p.parent)

    # -- ranks ---------------------------------------------------------------------------------------
    def engine(self, side: str) -> EngineConfig:
        return self.prefill if side == "prefill" else self.decode

    def cards(self, side: str) -> list[GeometryCard]:
        """Every rank's card of ``side`` ("prefill" or "decode")."""
        eng = self.engine(side)
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
        return {
            c.engine.tp_rank: Pairing.create(c, remotes, self.mode, self.compat)
            for c in self.cards(self.local_side)
        }

    # -- requests ------------------------------------------------------------------------------------
    def _counts(self, eng: EngineConfig, num_tokens: int) -> list[int]:
        geom = rank_geometry(self.model, eng)
        return [1 if g.one_block else math.ceil(num_tokens / eng.block_size) for g in geom.groups]

    def max_tokens(self) -> int:
        """The longest request both engines' pools hold (attention groups take one block per
        ``block_size`` tokens, SSM and ring groups one block; groups share each engine's pool)."""
        out = []
        for eng in (self.prefill, self.decode):
            geom = rank_geometry(self.model, eng)
            ssm = sum(g.one_block for g in geom.groups)
            attn = len(geom.groups) - ssm
            out.append(
                (eng.num_blocks - ssm) // attn * eng.block_size if attn else MAX_BLOCK_SIZE * eng.num_blocks
            )
        return max(0, min(out))

    def request(self, num_tokens: int, seed: int | None = 0) -> RequestIds:
        """Block ids for a request of ``num_tokens``: per attention group ``ceil(tokens / block)`` ids,
        per SSM group one state slot; ids are disjoint across groups (one shared pool per engine) and
        shuffled from the whole pool when ``seed`` is given, sequential otherwise."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 1:
            raise PlanError(
                "num_tokens",
                f"must be an integer >= 1, got {num_tokens!r} (accepted: 1..{self.max_tokens()})",
                value=num_tokens,
            )
        most = self.max_tokens()
        if num_tokens > most:
            raise PlanError(
                "num_tokens",
                f"{num_tokens} tokens do not fit the pools ({self.prefill.num_blocks} P, "
                f"{self.decode.num_blocks} D blocks) (accepted: 1..{most})",
                value=num_tokens,
                expected=most,
            )
        return RequestIds(
            int(num_tokens),
            self._ids(self.prefill, int(num_tokens), seed),
            self._ids(self.decode, int(num_tokens), None if seed is None else seed + 1),
        )

    def _ids(self, eng: EngineConfig, num_tokens: int, seed: int | None) -> tuple[tuple[int, ...], ...]:
        counts = self._counts(eng, num_tokens)
        need = sum(counts)  # <= eng.num_blocks: request() checked max_tokens first
        if seed is None:
            pool = np.arange(need)
        else:  # a sample of `need` distinct ids, without materialising the whole pool
            pool = np.random.default_rng(seed).choice(eng.num_blocks, size=need, replace=False)
        out, pos = [], 0
        for n in counts:
            out.append(tuple(int(x) for x in pool[pos : pos + n]))
            pos += n
        return tuple(out)

    def plans(self, req: RequestIds, request_id: str = "req") -> dict[int, RequestPlan]:
        """The plan of every local rank for one request."""
        local, remote = (req.decode, req.prefill) if self.mode == "pull" else (req.prefill, req.decode)
        return {
            r: plan_request(p, local, remote, request_id, num_tokens=req.num_tokens)
            for r, p in self.pairings.items()
        }

    def describe(self) -> str:
        p, d = self.prefill, self.decode
        return (
            f"{self.model.name}: P TP{p.tp_size} block {p.block_size} (kernel {p.kernel}) -> "
            f"D TP{d.tp_size} block {d.block_size} (kernel {d.kernel}), {self.mode}, {self.compat} mode"
        )


def check_ranks(sc: Scenario) -> None:
    """Derive every rank's geometry of both engines (cheap: no tables); a geometry an engine cannot
    have raises its :class:`KvgeomError` with the side prefixed to the field and what is accepted."""
    for side in ("prefill", "decode"):
        eng = sc.engine(side)
        try:
            rank_geometry(sc.model, eng)
        except KvgeomError as exc:
            message = str(exc).split(": ", 1)[-1]
            ssm = sc.model.ssm_spec
            attn = [la.spec for la in sc.model.layers if isinstance(la.spec, (AttentionSpec, MLASpec))]
            if exc.field == "block_size" and ssm is not None and attn:
                per_token = max(s.token_bytes(eng.tp_size) for s in attn)
                least = math.ceil(ssm.state_bytes(eng.tp_size) / per_token)
                message += (
                    f" (accepted: auto, or a block of at least {least} tokens that the kernel block divides)"
                )
            elif "(accepted:" not in message:
                message += " (accepted: see docs/cli.md)"
            raise type(exc)(f"{side}.{exc.field}", message, **exc.values) from None
