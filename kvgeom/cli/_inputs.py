"""The CLI's inputs: engine flags, scenario files and shipped examples, checked before any work.

Every bad input raises :class:`UsageError` naming the field as the user typed it (``--prefill tp``,
``--tokens``) and what is accepted; the CLI prints it as one line and exits with status 2.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvgeom.errors import KvgeomError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.tools.scenario import ENGINE_KEYS, MAX_BLOCK_SIZE, MAX_TP, Scenario, check_ranks, examples

__all__ = [
    "UsageError",
    "ALIASES",
    "TABLE_ROWS",
    "DEMO_BYTES_PER_RANK",
    "DEMO_REQUESTS",
    "WIDTH",
    "MOVES",
    "SEED",
    "check_demo_memory",
    "parse_engine",
    "examples",
    "load_scenario",
    "check_size",
    "check_int",
    "field_for_cli",
]

#: short engine keys accepted by ``--prefill`` / ``--decode`` (the long names work too)
ALIASES = {
    "tp": "tp_size",
    "block": "block_size",
    "min_block": "min_block_size",
    "kernel": "kernel_block_size",
    "align": "kernel_alignment",
    "blocks": "num_blocks",
    "layout": "kv_layout",
    "conv": "conv_layout",
    "split": "kv_split",
    "permute": "permute_local_kv",
}
_SHORT = {v: k for k, v in ALIASES.items()}
_INT_KEYS = {
    "tp_size": MAX_TP,
    "min_block_size": MAX_BLOCK_SIZE,
    "kernel_alignment": MAX_BLOCK_SIZE,
    "num_blocks": 1 << 40,
}
_AUTO_KEYS = {"block_size", "kernel_block_size"}

#: the CLI's bounds (docs/cli.md)
TABLE_ROWS = 4_000_000  # descriptor-table rows of a whole pair (about 250 MB)
DEMO_BYTES_PER_RANK = 2 << 30  # cache bytes one demo process allocates
DEMO_REQUESTS = 64
WIDTH = (8, 512)
MOVES = (0, 1_000_000)
SEED = (0, 2**63 - 1)


class UsageError(KvgeomError):
    """A CLI input that is malformed or out of range (exit status 2)."""

    def __init__(self, field: str, message: str, accepted: str | None = None, **values: Any) -> None:
        self.accepted = accepted
        super().__init__(field, message + (f" (accepted: {accepted})" if accepted else ""), **values)


def check_int(text: str | int, field: str, lo: int, hi: int) -> int:
    """``text`` as an integer in ``lo..hi`` (decimal digits only: no ``1e15``, no ``0x10``)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip()
        if not re.fullmatch(r"[+-]?\d+", s):
            raise UsageError(field, f"{text!r} is not an integer", f"{lo}..{hi}", value=text)
        if len(s.lstrip("+-")) > 30:
            raise UsageError(field, f"{s[:12]}... is out of range", f"{lo}..{hi}", value=s)
        value = int(s)
    if not lo <= value <= hi:
        raise UsageError(field, f"{value} is out of range", f"{lo}..{hi}", value=value)
    return value


def parse_engine(text: str, flag: str) -> dict[str, Any]:
    """``--prefill tp=2,block=auto,...`` as an engine object (docs/cli.md lists the keys)."""
    out: dict[str, Any] = {}
    keys = ", ".join(f"{k} ({v})" for k, v in ALIASES.items())
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise UsageError(flag, f"expected key=value, got {item!r}", keys, value=item)
        k, v = (s.strip() for s in item.split("=", 1))
        key = ALIASES.get(k, k)
        field = f"{flag} {k}"
        if key not in ENGINE_KEYS:
            raise UsageError(field, "unknown key", keys, value=k)
        if key in out:
            raise UsageError(field, "given twice", "each key once", value=k)
        if key in _INT_KEYS:
            out[key] = check_int(v, field, 1, _INT_KEYS[key])
        elif key in _AUTO_KEYS:
            if v != "auto" and not re.fullmatch(r"[+-]?\d+", v):
                raise UsageError(
                    field, f"{v!r} is neither 'auto' nor an integer", f"auto, 1..{MAX_BLOCK_SIZE}", value=v
                )
            out[key] = v if v == "auto" else check_int(v, field, 1, MAX_BLOCK_SIZE)
        elif key in ("kv_split", "permute_local_kv"):
            if v.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise UsageError(field, f"{v!r} is not a boolean", "true, false", value=v)
            out[key] = v.lower() in ("true", "1", "yes")
        else:
            out[key] = v
    return out


def field_for_cli(field: str, flags: Mapping[str, bool]) -> str:
    """``prefill.tp_size`` as ``--prefill tp`` when that engine came from a flag."""
    side, _, key = field.partition(".")
    if side in ("prefill", "decode") and flags.get(side) and key:
        return f"--{side} {_SHORT.get(key, key)}"
    return field


def load_scenario(
    arg: str | None, overrides: dict[str, Any], default: dict[str, Any] | None = None
) -> Scenario:
    """The scenario of a command: ``arg`` (a file, or a shipped example's name), else ``default``, with
    ``overrides`` (model, engines, mode, ...) applied; or the overrides alone."""
    data: dict[str, Any] = dict(default or {})
    base: Path | None = None
    if arg is not None:
        path = Path(arg).expanduser()
        shipped = examples()
        if not path.exists() and arg.removesuffix(".json") in shipped:
            path = shipped[arg.removesuffix(".json")]
        if not path.exists():
            raise UsageError(
                "scenario",
                f"no such file or example: {arg!r}",
                "a scenario JSON file or one of " + ", ".join(shipped),
                value=arg,
            )
        if path.is_dir():
            raise UsageError("scenario", f"{arg!r} is a directory", "a scenario JSON file", value=arg)
        try:
            loaded = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(
                "scenario", f"cannot read {arg!r}: {exc.__class__.__name__}", "a readable file", value=arg
            ) from None
        except json.JSONDecodeError as exc:
            raise UsageError(
                "scenario",
                f"{arg!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
                "a JSON object",
                value=arg,
            ) from None
        if not isinstance(loaded, dict):
            raise UsageError(
                "scenario",
                f"{arg!r} holds a JSON {type(loaded).__name__}, not an object",
                "a JSON object with model, prefill, decode, ...",
                value=arg,
            )
        data, base = loaded, path.parent
    elif "model" not in overrides and not data:
        raise UsageError(
            "model", "no scenario file and no --model", "a scenario file, or --model with --prefill/--decode"
        )
    for side in ("prefill", "decode"):
        if side in overrides:
            engine = data.get(side, {})
            overrides[side] = {**(engine if isinstance(engine, dict) else {}), **overrides[side]}
    data = {**data, **overrides}
    if "model" in overrides:
        base = None  # a --model path is relative to the working directory
    sc = Scenario.from_json(data, base=base)
    check_ranks(sc)
    return sc


def _rows(sc: Scenario, side: str) -> int:
    """Descriptor-table rows one rank of ``side`` holds (regions x kernel blocks, one per token for
    token-major pages, plus SSM pieces)."""
    eng = sc.engine(side)
    geom = rank_geometry(sc.model, eng)
    per_block = eng.kernel if eng.kv_layout.value == "token_major" else 1
    ssm = len(geom.ssm_region_indices) * (geom.ssm.num_pieces + 1) * eng.num_blocks if geom.ssm else 0
    return geom.num_regions * geom.num_blocks * per_block + ssm


def check_size(sc: Scenario) -> None:
    """Refuse a pair whose descriptor tables would exceed the CLI's bound, before building any. Each
    local rank holds its own table and one per remote rank it reads from or writes to."""
    tp = {side: sc.engine(side).tp_size for side in ("prefill", "decode")}
    local, remote = sc.local_side, sc.remote_side
    parts = {local: tp[local] * _rows(sc, local), remote: max(tp[local], tp[remote]) * _rows(sc, remote)}
    total, limit = sum(parts.values()), TABLE_ROWS
    if total <= limit:
        return
    side = max(parts, key=lambda k: parts[k])
    other = total - parts[side]
    per_block = parts[side] / sc.engine(side).num_blocks
    most = max(1, math.floor((limit - other) / per_block)) if other < limit else 1
    raise UsageError(
        f"{side}.num_blocks",
        f"{sc.engine(side).num_blocks:,} blocks make the pair's descriptor "
        f"tables {total:,} rows, past the CLI's bound of {limit:,}",
        f"1..{most:,} blocks",
        value=total,
    )


def check_demo_memory(sc: Scenario) -> None:
    """Refuse a demo whose ranks would each allocate more than the CLI's bound."""
    limit = DEMO_BYTES_PER_RANK
    for side in ("prefill", "decode"):
        geom = rank_geometry(sc.model, sc.engine(side))
        need = sum(r.block_stride * r.num_blocks for r in geom.regions)
        if need > limit:
            raise UsageError(
                f"{side}.num_blocks",
                f"each {side} rank would allocate {need:,} bytes, past the demo's bound of {limit:,}",
                f"at most {max(1, sc.engine(side).num_blocks * limit // need):,} blocks",
                value=need,
            )
