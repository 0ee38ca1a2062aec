"""Fewest descriptors, end to end through real NIXL: kvgeom-mode requests posted three ways, timed in one run.

One P rank and one D rank run as processes (one NIXL agent each, UCX, CPU DRAM): the demo's Mamba2 hybrid,
P TP1 block 32 (kernel 16) -> D TP1 block 64 (kernel 16), kvgeom mode. For each request length (default
1k, 16k, 128k tokens) and each posting path of ``TransportConfig.kvgeom_post``:

* ``initialize``: one descriptor per maximal run contiguous on both sides, as per-request lists given to
  NIXL's ``initialize_xfer``;
* ``prep``: the same runs as per-request prepared lists (``prep_xfer_dlist`` twice, ``make_prepped_xfer``);
* ``ids``: the plan's descriptor ids into the handshake's prepared tables (one per plan pair).

Pull: D times ``KVRank.pull`` (plan, post, completion, post-receive step, done notices). Push: P times
``KVRank.push`` (plan, post, completion; the WRITE carries its notice) while D waits in ``wait_received``.
Every path's first request of each length lands in a zeroed D and every byte of the plan's moves is
checked against P's content before anything is timed; the paths are then timed interleaved (median of
``--reps``). Reported per request: plan descriptor pairs, descriptors posted (NIXL's count after its own
merging, telemetry), and ``contiguous_runs`` of the plan's moves (the fewest possible).

    .venv/bin/python bench/bench_descs.py [--tokens 1024 16384 131072] [--reps 5] [--ids sequential|shuffled]
                                          [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue as queue_mod
import statistics
import sys
import time
from typing import Any

import numpy as np  # noqa: E402
from _pullkit import STEP_S, sized  # sibling modules
from bench_pull import mismatches, pattern_fill, salt_of
from kvgeom_lab.procs import ProcGroup  # noqa: E402

from kvgeom import GeometryCard  # noqa: E402
from kvgeom.plan.requestplan import contiguous_runs  # noqa: E402
from kvgeom.tools.scenario import Scenario  # noqa: E402

PATHS = ("initialize", "prep", "ids")
EXAMPLE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "examples", "demo-mamba2-hybrid_p2_d1_pull.json"
)


def _scenario(tokens: list[int], slack: float) -> dict[str, Any]:
    sc = json.load(open(EXAMPLE))
    sc["prefill"] = dict(sc["prefill"], tp_size=1)
    return sized(sc, [max(tokens)], slack)


def _as_push(scenario: dict[str, Any]) -> Scenario:
    """The same pair planned for push (a card is for one mode)."""
    return Scenario.from_json(dict(scenario, mode="push"))


def _card(sc: Scenario, side: str) -> GeometryCard:
    eng = sc.prefill if side == "prefill" else sc.decode
    return GeometryCard(side, sc.model, eng.with_rank(0), sc.mode)


def _get(q: Any, what: str) -> Any:
    try:
        got = q.get(timeout=STEP_S)
    except queue_mod.Empty:
        raise TimeoutError(f"no {what} within {STEP_S}s") from None
    if got[0] == "error":
        raise RuntimeError(f"P failed: {got[1]}")
    return got


def _producer(spec: dict, p_in: Any, d_in: Any) -> dict:
    """P: fill the cache, serve pulls (poll notifications), push when D asks."""
    from kvgeom_nixl.config import TransportConfig
    from kvgeom_nixl.kvrank import KVRank

    sc = Scenario.from_json(spec["scenario"])
    cfg = TransportConfig(**spec["config"])
    reqs = {n: sc.request(n, seed=spec["seed"]) for n in spec["tokens"]}
    push_sc = _as_push(spec["scenario"])
    with KVRank(_card(sc, "prefill"), cfg) as kv, KVRank(_card(push_sc, "prefill"), cfg) as kvp:
        for rank in (kv, kvp):
            for i, t in enumerate(rank.tensors):
                pattern_fill(t.numpy(), salt_of(0, i))
        d_in.put(("p_ready", kv.port, os.getpid()))
        end = time.monotonic() + spec["timeout_s"]
        while time.monotonic() < end:
            try:
                cmd = p_in.get_nowait()
            except queue_mod.Empty:
                kv.drain()
                kvp.drain()
                time.sleep(spec["serve_poll_s"])
                continue
            if cmd[0] == "exit":
                break
            try:
                _serve(kvp, cmd, cfg, reqs, sc, d_in)
            except Exception as exc:
                d_in.put(("error", f"{type(exc).__name__}: {exc}"))
                raise
    return {}


def _serve(kv: Any, cmd: tuple, cfg: Any, reqs: dict, sc: Scenario, d_in: Any) -> None:
    if True:
        if True:
            if cmd[0] == "connect":
                kv.connect("decode", {0: cmd[1]}, mode="push", compat=sc.compat)
                d_in.put(("connected",))
            elif cmd[0] == "push":
                _, n, path, rid = cmd
                req = reqs[n]
                kv.config = dataclasses.replace(cfg, kvgeom_post=path)
                t0 = time.perf_counter()
                r = kv.push("decode", req.prefill, req.decode, rid, rid, num_tokens=req.num_tokens)
                dt = time.perf_counter() - t0
                d_in.put(("pushed", rid, dt, r.descriptors, r.nixl_desc_count, r.runs))


def _consumer(spec: dict, p_in: Any, d_in: Any) -> dict:
    """D: pull each length by each path (checked, then timed), then ask P to push them the same way."""
    from kvgeom_nixl.config import TransportConfig
    from kvgeom_nixl.kvrank import KVRank

    sc = Scenario.from_json(spec["scenario"])
    cfg = TransportConfig(**spec["config"])
    reqs = {n: sc.request(n, seed=spec["seed"]) for n in spec["tokens"]}
    out: dict[str, Any] = {"pull": {}, "push": {}}
    push_sc = _as_push(spec["scenario"])
    with KVRank(_card(sc, "decode"), cfg) as kv, KVRank(_card(push_sc, "decode"), cfg) as kvd:
        msg = _get(d_in, "P's port")
        pairing = kv.connect("prefill", {0: msg[1]}, mode="pull", compat=sc.compat)
        producer = kv.links["prefill"][0].card
        src = {0: []}
        for i, reg in enumerate(producer.geometry.regions):
            a = np.empty(reg.nbytes, dtype=np.uint8)
            pattern_fill(a, salt_of(0, i))
            src[0].append(a)
        dst = [t.numpy() for t in kv.tensors]
        serial = iter(range(1 << 30))

        def zero() -> None:
            for t in [*kv.tensors, *kvd.tensors]:
                t.zero_()

        def pull(n: int, path: str) -> dict:
            req = reqs[n]
            kv.config = dataclasses.replace(cfg, kvgeom_post=path)
            rid = f"pull-{next(serial)}"
            t0 = time.perf_counter()
            r = kv.pull("prefill", req.decode, req.prefill, rid, rid, num_tokens=req.num_tokens)
            return {"s": time.perf_counter() - t0, "pairs": r.descriptors, "posted": r.nixl_desc_count}

        p_in.put(("connect", kvd.port))
        push_producer = _card(push_sc, "prefill")
        push_dst = [t.numpy() for t in kvd.tensors]
        if _get(d_in, "P's connection")[0] != "connected":
            raise RuntimeError("P did not connect")

        def push(n: int, path: str) -> dict:
            req = reqs[n]
            rid = f"push-{next(serial)}"
            p_in.put(("push", n, path, rid))
            kvd.wait_received(
                push_producer, req.decode, req.prefill, rid, num_tokens=req.num_tokens, compat=sc.compat
            )
            got = _get(d_in, "P's push report")
            if got[0] != "pushed" or got[1] != rid:
                raise RuntimeError(f"unexpected report {got!r}")
            return {"s": got[2], "pairs": got[3], "posted": got[4]}

        for n in spec["tokens"]:
            req = reqs[n]
            plan = kv.plan("prefill", req.decode, req.prefill, "probe", "probe", req.num_tokens)
            moves = plan.moves(pairing)
            runs = contiguous_runs(moves)
            for op, fn in (("pull", pull), ("push", push)):
                row: dict[str, Any] = {"tokens": n, "bytes": int(moves[:, 6].sum()), "runs": runs}
                for path in PATHS:  # each path's first request: into a zeroed D, every byte checked
                    zero()
                    first = fn(n, path)
                    row[path] = {
                        "bad_moves": mismatches(dst if op == "pull" else push_dst, src, moves),
                        "pairs": first["pairs"],
                        "posted": first["posted"],
                        "times": [],
                    }
                for _ in range(spec["reps"]):  # timed, interleaved
                    for path in PATHS:
                        row[path]["times"].append(fn(n, path)["s"])
                for path in PATHS:
                    row[path]["median_s"] = statistics.median(row[path]["times"])
                out[op][str(n)] = row
        p_in.put(("exit",))
    return out


def report(res: dict, sc: Scenario, args: argparse.Namespace, wall: float) -> str:
    lines = [
        f"scenario: {sc.describe()}; ids {args.ids}; UCX, DRAM, 1 P + 1 D process; "
        f"median of {args.reps} (paths interleaved) after 1 checked request per path",
        "",
        "| op | tokens | MiB | plan pairs | contiguous runs | posted: initialize | prep | ids "
        "| initialize ms | prep ms | ids ms | initialize ÷ ids | prep ÷ ids | bytes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for op in ("pull", "push"):
        for n, row in res[op].items():
            t = {p: row[p]["median_s"] for p in PATHS}
            bad = sum(row[p]["bad_moves"] for p in PATHS)
            lines.append(
                f"| {op} | {int(n):,} | {row['bytes'] / 2**20:.1f} | {row['ids']['pairs']:,} | {row['runs']:,} "
                f"| {row['initialize']['posted']:,} | {row['prep']['posted']:,} | {row['ids']['posted']:,} "
                f"| {t['initialize'] * 1e3:.2f} | {t['prep'] * 1e3:.2f} | {t['ids'] * 1e3:.2f} "
                f"| {t['initialize'] / t['ids']:.2f} | {t['prep'] / t['ids']:.2f} "
                f"| {'ok' if not bad else f'{bad} bad moves'} |"
            )
    lines.append("")
    lines.append(f"wall {wall:.1f} s incl. process start")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 16384, 131072])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ids", choices=("sequential", "shuffled"), default="sequential")
    ap.add_argument("--slack", type=float, default=1.25)
    ap.add_argument("--serve-poll-us", type=float, default=200.0)
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    scenario = _scenario(args.tokens, args.slack)
    sc = Scenario.from_json(scenario)
    spec = {
        "scenario": scenario,
        "tokens": args.tokens,
        "reps": args.reps,
        "seed": 7 if args.ids == "shuffled" else None,
        "timeout_s": args.timeout,
        "serve_poll_s": args.serve_poll_us * 1e-6,
        "config": {"secret": os.urandom(32).hex()},
    }
    print(f"bench_descs: {sc.describe()}; tokens {args.tokens}; starting 1 P + 1 D processes ...", flush=True)
    t0 = time.monotonic()
    with ProcGroup() as group:
        p_in, d_in = group.queue(), group.queue()
        group.spawn(_producer, (spec, p_in, d_in), "prefill")
        group.spawn(_consumer, (spec, p_in, d_in), "decode")
        got = group.collect(args.timeout, ["decode", "prefill"])
        res = got["decode"].unwrap()
        got["prefill"].unwrap()
    wall = time.monotonic() - t0
    print(report(res, sc, args, wall))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "wall_s": wall, "results": res}, f, indent=1)
    bad = sum(row[p]["bad_moves"] for op in ("pull", "push") for row in res[op].values() for p in PATHS)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
