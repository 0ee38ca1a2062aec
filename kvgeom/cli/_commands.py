"""The CLI's commands. Each returns a dict: the ``--json`` payload (docs/cli.md) plus ``text`` (what is
printed without ``--json``) and ``exit_status``. Inputs are checked first (:mod:`._inputs`); what kvgeom
refuses about the pair itself is raised as :class:`Refused` (exit status 1)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import io
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvgeom.cli._inputs import (
    DEMO_REQUESTS,
    MOVES,
    SEED,
    WIDTH,
    UsageError,
    check_demo_memory,
    check_int,
    check_size,
    examples,
    load_scenario,
    parse_engine,
)
from kvgeom.errors import KvgeomError
from kvgeom.layout.card import GeometryCard
from kvgeom.model.models import preset_ids, resolve
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.requestplan import MOVE_COLUMNS, RequestPlan, contiguous_runs
from kvgeom.tools.scenario import Scenario

__all__ = ["COMMANDS", "Refused", "demo_hint"]


class Refused(Exception):
    """kvgeom refuses the pair (handshake or planning): the CLI exits with status 1."""

    def __init__(self, error: KvgeomError) -> None:
        super().__init__(str(error))
        self.error = error


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    try:
        yield
    except UsageError:
        raise
    except KvgeomError as exc:
        raise Refused(exc) from None


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.model is not None:
        out["model"] = args.model
    for side in ("prefill", "decode"):
        text = getattr(args, side)
        if text is not None:
            out[side] = parse_engine(text, f"--{side}")
    for key, name in (
        ("mode", "mode"),
        ("compat", "compat"),
        ("kv_cache_dtype", "kv_cache_dtype"),
        ("ssm_cache_dtype", "mamba_ssm_cache_dtype"),
    ):
        if getattr(args, key) is not None:
            out[name] = getattr(args, key)
    return out


def _scenario(args: argparse.Namespace) -> Scenario:
    return load_scenario(args.scenario, _overrides(args))


def _scenario_json(sc: Scenario) -> dict[str, Any]:
    return {
        "model": sc.model.name,
        "model_source": sc.source.origin if sc.source else None,
        "mode": sc.mode,
        "compat": sc.compat,
        "prefill": sc.prefill.to_json(),
        "decode": sc.decode.to_json(),
        "description": sc.describe(),
    }


def _tokens(sc: Scenario, text: str, field: str = "--tokens") -> int:
    return check_int(text, field, 1, max(1, sc.max_tokens()))


# -- models, examples ------------------------------------------------------------------------------------
def cmd_models(args: argparse.Namespace) -> dict[str, Any]:
    rows, lines = [], []
    for name, hf_id in preset_ids().items():
        try:
            ref = resolve(name)
            kinds = sorted({la.kind.value for la in ref.spec.layers})
            tps = ref.accepted_tp(256)
            rows.append(
                {
                    "name": name,
                    "hf_id": hf_id,
                    "supported": True,
                    "cache_layers": len(ref.spec.layers),
                    "kinds": kinds,
                    "tp_sizes": tps,
                    "reason": None,
                }
            )
            lines.append(
                f"{name:32s} {hf_id:44s} {len(ref.spec.layers):4d} cache layers  {', '.join(kinds)}; "
                f"TP {', '.join(map(str, tps))}"
            )
        except KvgeomError as exc:
            rows.append(
                {
                    "name": name,
                    "hf_id": hf_id,
                    "supported": False,
                    "cache_layers": None,
                    "kinds": None,
                    "tp_sizes": None,
                    "reason": str(exc),
                }
            )
            lines.append(f"{name:32s} {hf_id:44s} not supported: {exc}")
    lines.append("--model takes the name or the Hugging Face id, or the path of a config.json.")
    return {"models": rows, "text": "\n".join(lines)}


def cmd_examples(args: argparse.Namespace) -> dict[str, Any]:
    rows, lines = [], []
    for name, path in examples().items():
        try:
            comment = str(json.loads(path.read_text()).get("_comment", ""))
        except (OSError, ValueError):  # pragma: no cover - shipped files are valid JSON
            comment = ""
        rows.append({"name": name, "path": str(path), "description": comment})
        lines.append(f"{name:36s} {comment}\n{'':36s} {path}")
    lines.append("Pass a name or a path as the scenario: kvgeom check NAME")
    return {"examples": rows, "text": "\n".join(lines)}


# -- pair commands ---------------------------------------------------------------------------------------
def _rank_json(card: GeometryCard) -> dict[str, Any]:
    derived: dict[str, Any] = card.to_json()["derived"]
    return {"tp_rank": card.engine.tp_rank, **derived}


def cmd_explain(args: argparse.Namespace) -> dict[str, Any]:
    sc = _scenario(args)
    text = [sc.describe()]
    engines = {}
    for side in ("prefill", "decode"):
        card = sc.cards(side)[0]
        text += [f"\n[{side}]", card.geometry.describe()]
        engines[side] = _rank_json(card)
    return {"scenario": _scenario_json(sc), "rank0": engines, "text": "\n".join(text)}


def cmd_check(args: argparse.Namespace) -> dict[str, Any]:
    sc = _scenario(args)
    check_size(sc)  # the handshake checks build the tables
    with _refusals():
        pairings = sc.pairings
    ranks, text = [], [sc.describe()]
    for rank, pairing in pairings.items():
        first = pairing.describe().splitlines()[0]
        ranks.append(
            {
                "side": sc.local_side,
                "rank": rank,
                "ok": True,
                "summary": first,
                "tp_ratio": pairing.tp_ratio,
                "block_size_ratio": pairing.bsr,
                "targets": list(pairing.targets),
            }
        )
        text.append(f"{sc.local_side} rank {rank}: OK -- {first}")
    return {"scenario": _scenario_json(sc), "ranks": ranks, "text": "\n".join(text)}


def cmd_plan(args: argparse.Namespace) -> dict[str, Any]:
    sc = _scenario(args)
    tokens = _tokens(sc, args.tokens)
    seed = None if args.seed is None else check_int(args.seed, "--seed", *SEED)
    n_moves = check_int(args.moves, "--moves", *MOVES)
    local_tp = sc.engine(sc.local_side).tp_size
    only = None if args.rank is None else check_int(args.rank, "--rank", 0, local_tp - 1)
    check_size(sc)
    req = sc.request(tokens, seed=seed)
    with _refusals():
        pairings = sc.pairings
        if only is not None:
            pairings = {only: pairings[only]}
        plans = {r: p for r, p in sc.plans(req).items() if r in pairings}
        text = [
            sc.describe(),
            f"request: {req.num_tokens} tokens; P ids {list(map(list, req.prefill))}; "
            f"D ids {list(map(list, req.decode))}",
        ]
        ranks = []
        for rank, plan in plans.items():
            lines, row = _plan_rank(sc.local_side, rank, plan, pairings[rank], n_moves)
            text += lines
            ranks.append(row)
    return {
        "scenario": _scenario_json(sc),
        "move_columns": list(MOVE_COLUMNS),
        "request": {
            "num_tokens": req.num_tokens,
            "prefill_ids": [list(g) for g in req.prefill],
            "decode_ids": [list(g) for g in req.decode],
        },
        "ranks": ranks,
        "text": "\n".join(text),
    }


def _plan_rank(
    side: str, rank: int, plan: RequestPlan, pairing: Pairing, n_moves: int
) -> tuple[list[str], dict[str, Any]]:
    """One local rank's plan: its text lines (the first ``n_moves`` byte moves included) and its JSON."""
    moves = plan.moves(pairing)
    runs = contiguous_runs(moves)
    nbytes = int(moves[:, 6].sum())
    text = [
        f"\n{side} rank {rank}:",
        pairing.describe(),
        plan.describe(pairing),
        f"  {len(moves)} byte moves ({nbytes} B), {runs} contiguous runs after coalescing",
    ]
    if n_moves:
        text.append("  " + " ".join(f"{c:>10s}" for c in MOVE_COLUMNS))
        text += ["  " + " ".join(f"{int(x):>10d}" for x in m) for m in moves[:n_moves]]
    zero = np.asarray(plan.zero, dtype=np.int64).reshape(-1, 3)
    row = {
        "side": side,
        "rank": rank,
        "op": plan.op,
        "transfers": [
            {
                "remote_rank": t.remote_rank,
                "descriptors": len(t),
                "notif": t.notif,
                "bytes": int(pairing.local_table(t.local_table).rows[t.local_ids, 2].sum()),
            }
            for t in plan.transfers
        ],
        "notify_only": list(plan.notify_only),
        "expected_notifications": plan.expected_notifications,
        "descriptors": plan.num_descriptors,
        "bytes": nbytes,
        "contiguous_runs": runs,
        "zero": {"consumer_rank": plan.consumer_rank, "ranges": len(zero), "bytes": int(zero[:, 2].sum())},
        "regroups": len(plan.regroup),
        "moves": moves[:n_moves].tolist(),
    }
    return text, row


def cmd_draw(args: argparse.Namespace) -> dict[str, Any]:
    from kvgeom.tools import draw

    sc = _scenario(args)
    tokens = _tokens(sc, args.tokens)
    width = check_int(args.width, "--width", *WIDTH)
    fmt = args.format
    if args.output is not None and fmt is None:
        fmt = args.output.rsplit(".", 1)[-1].lower() if "." in os.path.basename(args.output) else None
        if fmt not in draw.FORMATS:
            raise UsageError(
                "--output",
                f"cannot tell the format of {args.output!r}",
                "a .png or .svg file, or --format png|svg",
                value=args.output,
            )
    fmt = fmt or "text"
    if fmt != "text":
        if args.output is None:
            raise UsageError("--output", f"--format {fmt} needs a file to write", "--output FILE", value=None)
        if not _have_matplotlib():
            raise UsageError(
                "--format",
                f"{fmt} pictures need matplotlib: pip install 'kvgeom[plot]'",
                "text (without the plot extra)",
                value=fmt,
            )
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder):
            raise UsageError(
                "--output",
                f"no such directory: {folder}",
                "a path in an existing directory",
                value=args.output,
            )
    check_size(sc)
    req = sc.request(tokens, seed=None)
    with _refusals():
        tmap = draw.transfer_map(sc, req)
    out: dict[str, Any] = {"scenario": _scenario_json(sc), "format": fmt, "output": None, **tmap.to_json()}
    if fmt == "text":
        out["text"] = draw.ascii_art(tmap, width)
    else:
        try:
            path = draw.save(tmap, args.output, fmt)
        except OSError as exc:
            raise UsageError(
                "--output",
                f"cannot write {args.output!r}: {exc.strerror or exc}",
                "a writable path",
                value=args.output,
            ) from None
        out["output"] = str(path)
        out["text"] = f"wrote {path} ({fmt}): {sc.describe()}, request of {tokens} tokens"
    return out


def _have_matplotlib() -> bool:
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return False
    return True


# -- demo ------------------------------------------------------------------------------------------------
#: the entry-point group where adapters offer what the command line runs (kvgeom_lab: ``demo``)
PLUGIN_GROUP = "kvgeom.plugins"
NIXL_EXTRA = "pip install 'kvgeom[nixl]'"


def demo_plugin() -> tuple[Any, str | None]:
    """The demo (entry point ``demo`` of :data:`PLUGIN_GROUP`, which the nixl extra's adapter declares), or
    ``None`` and why it cannot run here. The plugin's ``missing()`` imports what its processes import, so
    that a broken install is reported here, once, instead of inside a child; the core imports no adapter."""
    found = importlib.metadata.entry_points(group=PLUGIN_GROUP, name="demo")
    if not found:
        return None, f"needs the nixl extra: {NIXL_EXTRA} (no {PLUGIN_GROUP!r} plugin 'demo' is installed)"
    ep = next(iter(found))
    try:
        plugin = ep.load()
    except ImportError as exc:
        return None, f"needs the nixl extra: {NIXL_EXTRA} (cannot load {ep.value}: {_first_line(exc)})"
    missing = list(plugin.missing())
    if missing:
        return None, f"needs the nixl extra: {NIXL_EXTRA} (cannot import {'; '.join(missing)})"
    return plugin, None


def _first_line(exc: BaseException) -> str:
    return f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def demo_hint() -> str | None:
    """Why the demo cannot run here (a missing extra), or ``None``."""
    return demo_plugin()[1]


def cmd_demo(args: argparse.Namespace) -> dict[str, Any]:
    overrides = _overrides(args)
    demo, hint = demo_plugin()
    if hint:
        raise UsageError("demo", hint, "an environment with the nixl extra")

    # without a scenario file the built-in pair is the default; a --model replaces it whole
    default = None if args.scenario is not None or "model" in overrides else dict(demo.DEFAULT_SCENARIO)
    sc = load_scenario(args.scenario, overrides, default)
    check_demo_memory(sc)
    tokens = [int(t) for t in demo.DEFAULT_TOKENS] if args.tokens is None else args.tokens
    if len(tokens) > DEMO_REQUESTS:
        raise UsageError("--tokens", f"{len(tokens)} requests", f"1..{DEMO_REQUESTS} requests")
    lengths = [_tokens(sc, str(t)) for t in tokens]
    need = {side: sum(sum(sc._counts(sc.engine(side), n)) for n in lengths) for side in ("prefill", "decode")}
    for side, n in need.items():
        if n > sc.engine(side).num_blocks:
            raise UsageError(
                "--tokens",
                f"the {len(lengths)} requests need {n} {side} blocks, the pool has "
                f"{sc.engine(side).num_blocks}",
                f"fewer or shorter requests, or a larger pool (--{side} blocks=N)",
                value=n,
            )
    timeout = check_int(args.timeout, "--timeout", 1, 3600)
    scenario = {
        "model": sc.model.to_json(),
        "mode": sc.mode,
        "compat": sc.compat,
        "prefill": _engine_json(sc, "prefill"),
        "decode": _engine_json(sc, "decode"),
    }
    with tempfile.TemporaryDirectory(prefix="kvgeom-demo-") as tmp:
        path = os.path.join(tmp, "scenario.json")
        with open(path, "w") as fh:
            json.dump(scenario, fh)
        argv = ["--scenario", path, "--tokens", *map(str, lengths), "--timeout", str(timeout)]
        if args.progress_thread:
            argv.append("--progress-thread")
        run: Callable[[list[str]], int] = demo.main
        if (
            args.json
        ):  # stdout carries only the JSON: the report is captured, the processes' logs go to stderr
            buf = io.StringIO()
            with _stdout_to_stderr(), contextlib.redirect_stdout(buf):
                status = _run_demo(run, argv)
            report = buf.getvalue().splitlines()
        else:
            status, report = _run_demo(run, argv), []
    return {
        "scenario": _scenario_json(sc),
        "requests": lengths,
        "exit_status": status,
        "report": report,
        "text": "",
    }


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr while the demo's processes run (they inherit it)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _run_demo(run: Callable[[list[str]], int], argv: list[str]) -> int:
    try:
        return int(run(argv))
    except KvgeomError as exc:
        raise Refused(exc) from None
    except TimeoutError as exc:
        raise Refused(KvgeomError("demo", f"timed out: {exc}")) from None


def _engine_json(sc: Scenario, side: str) -> dict[str, Any]:
    eng = sc.engine(side)
    return {
        "tp_size": eng.tp_size,
        "block_size": eng.block_size,
        "kernel_block_size": eng.kernel,
        "num_blocks": eng.num_blocks,
        "kv_layout": eng.kv_layout.value,
        "conv_layout": eng.conv_layout.value,
        "kv_split": eng.kv_split,
    } | ({"permute_local_kv": True} if eng.permute_local_kv else {})


COMMANDS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "models": cmd_models,
    "examples": cmd_examples,
    "explain": cmd_explain,
    "check": cmd_check,
    "plan": cmd_plan,
    "draw": cmd_draw,
    "demo": cmd_demo,
}
