"""``kvgeom`` command line: explain, check, plan and draw a P/D pair; list models; run the demo.

A pair is given as a scenario file (JSON: ``model``, ``prefill``, ``decode``, ``mode``, ``compat``) or
with flags: ``--model nemotron-h-8b --prefill tp=2,block=auto --decode tp=1,block=1056``.
Exit status: 0 when the pair works, 1 when kvgeom refuses it (the reason is printed), 2 on usage errors.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import presets
from .errors import KvgeomError
from .plan import contiguous_runs
from .scenario import Scenario

_ALIASES = {"tp": "tp_size", "rank": "tp_rank", "block": "block_size", "kernel": "kernel_block_size",
            "blocks": "num_blocks", "layout": "kv_layout", "conv": "conv_layout", "split": "kv_split"}


def _engine_arg(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {"num_blocks": 64}
    for item in filter(None, text.split(",")):
        if "=" not in item:
            raise argparse.ArgumentTypeError(f"expected key=value, got {item!r}")
        k, v = item.split("=", 1)
        key = _ALIASES.get(k.strip(), k.strip())
        v = v.strip()
        out[key] = v if key in ("kv_layout", "conv_layout") or v == "auto" else (v.lower() in ("1", "true")
                                                                                if key == "kv_split" else int(v))
    return out


def _scenario(args: argparse.Namespace) -> Scenario:
    if args.scenario:
        sc = Scenario.load(args.scenario)
        if args.mode or args.compat:
            return Scenario(sc.model, sc.prefill, sc.decode, args.mode or sc.mode, args.compat or sc.compat)
        return sc
    if not args.model:
        raise SystemExit("kvgeom: give a scenario file or --model with --prefill/--decode")
    return Scenario.from_json({"model": args.model, "prefill": args.prefill or {}, "decode": args.decode or {},
                               "mode": args.mode or "pull", "compat": args.compat or "kvgeom"})


def cmd_models(args: argparse.Namespace) -> int:
    for name in presets.names():
        try:
            m = presets.load(name)
            kinds = sorted({la.kind.value for la in m.layers})
            print(f"{name:34s} {len(m.layers):4d} cache layers  {', '.join(kinds)}")
        except KvgeomError as exc:
            print(f"{name:34s} (not supported: {exc})")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    sc = _scenario(args)
    print(sc.describe())
    for side in ("prefill", "decode"):
        print(f"\n[{side}]")
        print(sc.cards(side)[0].geometry.describe())
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    sc = _scenario(args)
    print(sc.describe())
    for rank, pairing in sc.pairings.items():
        print(f"{sc.local_side} rank {rank}: OK -- {pairing.describe().splitlines()[0]}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    sc = _scenario(args)
    req = sc.request(args.tokens, seed=args.seed)
    print(sc.describe())
    print(f"request: {req.num_tokens} tokens; P ids {list(map(list, req.prefill))}; D ids {list(map(list, req.decode))}")
    for rank, plan in sc.plans(req).items():
        pairing = sc.pairings[rank]
        print(f"\n{sc.local_side} rank {rank}:\n{pairing.describe()}\n{plan.describe(pairing)}")
        moves = plan.moves(pairing)
        runs = contiguous_runs(moves)
        print(f"  {len(moves)} byte moves ({int(moves[:, 6].sum())} B), {runs} contiguous runs after coalescing")
        if args.moves:
            print("  src_rank src_region src_offset -> dst_rank dst_region dst_offset length")
            for m in moves[: args.moves]:
                print("  " + " ".join(f"{int(x):>10d}" for x in m))
    return 0


def cmd_draw(args: argparse.Namespace) -> int:
    """Draw which source rank fills each byte of D rank 0's request blocks ('.' = zeroed)."""
    sc = _scenario(args)
    req = sc.request(args.tokens, seed=None)
    plans = sc.plans(req)
    d0 = sc.cards("decode")[0].geometry
    moves = np.concatenate([p.moves(sc.pairings[r]) for r, p in plans.items()])
    moves = moves[moves[:, 3] == 0]
    src_col = 0
    zero = plans[0].zero if sc.mode == "pull" else np.zeros((0, 3), dtype=np.int64)
    width = args.width
    print(sc.describe())
    print(f"D rank 0, request of {args.tokens} tokens: digit = P rank that wrote the bytes, '.' = zeroed, "
          f"' ' = not written")
    for group, ids in zip(d0.groups, req.decode):
        region = next(r for r in d0.regions if r.member_of(group.index))
        unit = region.block_len if not group.is_ssm else region.block_stride * d0.ppl
        blocks = [b * d0.ppl + j for b in ids for j in range(d0.ppl)] if not group.is_ssm else list(ids)
        print(f"group {group.index} ({group.kind.value}), region {region.index}:")
        for b in blocks:
            start = b * unit
            line = [" "] * width
            for m in moves[moves[:, 4] == region.index]:
                _paint(line, start, unit, int(m[5]), int(m[6]), str(int(m[src_col]) % 10))
            for z in zero[zero[:, 0] == region.index]:
                _paint(line, start, unit, int(z[1]), int(z[2]), ".")
            print(f"  block {b:5d} |{''.join(line)}|")
    return 0


def _paint(line: list[str], start: int, unit: int, off: int, length: int, ch: str) -> None:
    lo, hi = max(off, start), min(off + length, start + unit)
    if lo >= hi:
        return
    w = len(line)
    for i in range((lo - start) * w // unit, max((hi - start) * w // unit, (lo - start) * w // unit + 1)):
        line[min(i, w - 1)] = ch


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["demo"]:  # the demo parses its own options (--mode, --tokens, ...)
        from kvgeom_nixl.demo import main as demo_main  # lazy: only the demo needs torch and nixl

        return demo_main(args_list[1:])
    parser = argparse.ArgumentParser(prog="kvgeom", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    def pair_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("scenario", nargs="?", help="scenario JSON file (see examples/)")
        p.add_argument("--model", help="preset name (kvgeom models) when no scenario file is given")
        p.add_argument("--prefill", type=_engine_arg, help="P engine, e.g. tp=2,block=auto,kernel=16,blocks=64")
        p.add_argument("--decode", type=_engine_arg, help="D engine, same keys")
        p.add_argument("--mode", choices=("pull", "push"))
        p.add_argument("--compat", choices=("kvgeom", "vllm"))

    sub.add_parser("models", help="list the shipped model presets").set_defaults(fn=cmd_models)
    for name, fn, text in (("explain", cmd_explain, "print both engines' rank geometry"),
                           ("check", cmd_check, "check the pair at handshake, rank by rank"),
                           ("plan", cmd_plan, "plan one request and print it"),
                           ("draw", cmd_draw, "draw what lands in D rank 0's blocks")):
        p = sub.add_parser(name, help=text)
        pair_args(p)
        p.set_defaults(fn=fn)
        if name in ("plan", "draw"):
            p.add_argument("--tokens", type=int, default=100, help="request length in tokens")
        if name == "plan":
            p.add_argument("--seed", type=int, default=None, help="shuffle block ids from the pool")
            p.add_argument("--moves", type=int, default=0, help="print the first N byte moves")
        if name == "draw":
            p.add_argument("--width", type=int, default=64)
    sub.add_parser("demo", help="run a real NIXL transfer between P and D processes (kvgeom demo --help)")
    args = parser.parse_args(args_list)
    try:
        return int(args.fn(args))
    except KvgeomError as exc:
        print(f"kvgeom: refused: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
