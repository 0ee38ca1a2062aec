"""One request through both transports on the same pair: kvgeom's plan carried by NIXL (kvgeom_nixl) and by
Mooncake's transfer engine (kvgeom_mooncake, TCP), against process_vm_readv and memcpy of the same moves,
in the same run.

The pair: the demo's Mamba2 hybrid, P TP2 (block 32, kernel 16) -> D TP1 (block 64, kernel 16), pull, its
pools sized for the request (default 8,192 tokens) with shuffled ids. Each P rank is one process holding
both a NIXL ``KVRank`` and a ``MooncakeRank`` over the same content (kvgeom.testing.content), the D rank
another process with both. D pulls the request once per transport into poisoned blocks and checks every
byte of it against the layout model (``check_request``); then, interleaved ``--reps`` times:

* NIXL: ``KVRank.pull`` (plan, post, wait, receive step, notices): its ``transfer_seconds`` (first post ->
  last completion) and its whole ``seconds``;
* Mooncake: ``MooncakeRank.pull``: the same two times;
* ``process_vm_readv`` from the P ranks' pids (their Mooncake arrays) into D's arrays, the plan's moves;
* memcpy: one contiguous numpy copy of as many bytes (the machine's bandwidth ceiling here).

Reported: bytes, median seconds and GB/s of each, and the descriptors each transport was handed: the
plan's descriptor pairs, what NIXL posted (its telemetry), what the Mooncake adapter posted after merging
runs contiguous on both sides.

``--pair tp1-tp1`` runs the same model TP1 -> TP1 with equal blocks, ``--ids sequential`` hands out
neighbouring blocks: where runs contiguous on both sides exist, the Mooncake adapter merges them.

Run: ``.venv/bin/python bench/bench_mooncake.py [--tokens N] [--reps R] [--pair tp2-tp1|tp1-tp1]
[--ids shuffled|sequential] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
from _pullkit import gbps, run_ranks, serve, sized

from kvgeom import GeometryCard
from kvgeom.tools.scenario import Scenario, example

SECRET = "kvgeom-bench-mooncake-secret-0123456789"
DEMO = {
    "mode": "pull",
    "compat": "kvgeom",
    "prefill": {"tp_size": 2, "block_size": 32, "kernel_block_size": 16, "num_blocks": 64},
    "decode": {"tp_size": 1, "block_size": 64, "kernel_block_size": 16, "num_blocks": 32},
}
IOV_MAX = 1024


PAIRS = {
    "tp2-tp1": DEMO,
    # the same model, P like D: TP1 -> TP1, equal blocks (where runs contiguous on both sides exist)
    "tp1-tp1": {**DEMO, "prefill": {**DEMO["decode"], "num_blocks": 32}},
}


def demo_scenario(pair: str = "tp2-tp1") -> dict:
    """The demo's Mamba2 hybrid (the shipped example ``demo-mamba2-hybrid_p2_d1_pull``) with ``pair``'s engines."""
    return {"model": example("demo-mamba2-hybrid_p2_d1_pull")["model"], **PAIRS[pair]}


def _ids(sc: Scenario, tokens: int, order: str = "shuffled") -> tuple[list[list[int]], list[list[int]]]:
    from kvgeom.layout.allocate import rank_geometry

    rng = np.random.default_rng(5)
    out = []
    for side in ("decode", "prefill"):
        eng = sc.engine(side)
        pool = (
            [int(b) for b in rng.permutation(eng.num_blocks)]
            if order == "shuffled"
            else list(range(eng.num_blocks))[::-1]
        )
        ids = []
        for g in rank_geometry(sc.model, eng).groups:
            n = 1 if g.one_block else -(-tokens // eng.block_size)
            ids.append([pool.pop() for _ in range(n)])
        out.append(ids)
    return out[0], out[1]


def _space(sc: Scenario, tokens: int) -> Any:
    from kvgeom.testing import CoordSpace

    return CoordSpace(sc.model, tokens + max(sc.prefill.block_size, sc.decode.block_size))


def _configs() -> tuple[Any, Any]:
    from kvgeom_mooncake import MooncakeConfig
    from kvgeom_nixl import TransportConfig

    t = 120.0
    return (
        TransportConfig(secret=SECRET, handshake_timeout_s=30.0, transfer_timeout_s=t, notif_timeout_s=t),
        MooncakeConfig(secret=SECRET, transfer_timeout_s=t, notif_timeout_s=t),
    )


def _producer(spec: dict, rank: int, events: Any, inbox: Any) -> dict:
    os.environ.setdefault("GLOG_minloglevel", "2")
    from kvgeom_mooncake import MooncakeRank
    from kvgeom_nixl.kvrank import KVRank

    from kvgeom.testing.content import fill_source

    sc = Scenario.from_json(spec["scenario"])
    card = sc.cards("prefill")[rank]
    ncfg, mcfg = _configs()
    d_ids, p_ids = _ids(sc, spec["tokens"], spec["ids"])
    space = _space(sc, spec["tokens"])
    kv, mk = KVRank(card, ncfg), MooncakeRank(card, mcfg)
    try:
        fill_source(kv.tensors, card, space, p_ids, spec["tokens"])
        fill_source(mk.arrays, card, space, p_ids, spec["tokens"])
        events.put(("ready", rank, {"nixl": kv.port, "mooncake": mk.payload()}, os.getpid()))
        serve(kv, inbox, 0.0005, spec["limit_s"])
    finally:
        kv.close()
        mk.close()
    return {}


class _Vm:
    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fn = libc.process_vm_readv
        self.fn.restype = ctypes.c_ssize_t
        self.fn.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]

    def read(self, pid: int, local: np.ndarray, remote: np.ndarray) -> int:
        calls = 0
        for lo in range(0, len(local), IOV_MAX):
            k = min(IOV_MAX, len(local) - lo)
            want = int(local[lo : lo + k, 1].sum())
            got = self.fn(pid, local.ctypes.data + 16 * lo, k, remote.ctypes.data + 16 * lo, k, 0)
            calls += 1
            if got != want:
                raise OSError(ctypes.get_errno(), f"process_vm_readv from pid {pid}: {got} of {want} bytes")
        return calls


def _consumer(spec: dict, events: Any, inbox: Any) -> dict:
    os.environ.setdefault("GLOG_minloglevel", "2")
    from kvgeom_mooncake import MooncakeRank
    from kvgeom_nixl.kvrank import KVRank

    from kvgeom.testing.content import POISON_BYTE, check_request

    sc = Scenario.from_json(spec["scenario"])
    card: GeometryCard = sc.cards("decode")[0]
    tokens, reps = spec["tokens"], spec["reps"]
    ncfg, mcfg = _configs()
    d_ids, p_ids = _ids(sc, tokens, spec["ids"])
    space = _space(sc, tokens)
    cmd, ranks = inbox.get(timeout=120)
    kv, mk = KVRank(card, ncfg), MooncakeRank(card, mcfg)
    try:
        kv.connect("prefill", {r: v[0]["nixl"] for r, v in ranks.items()})
        mk.connect("prefill", {r: v[0]["mooncake"] for r, v in ranks.items()})
        pids = {r: int(v[1]) for r, v in ranks.items()}
        attempt = {"nixl": 0, "mooncake": 0}

        def nixl() -> dict:
            attempt["nixl"] += 1
            res = kv.pull("prefill", d_ids, p_ids, "b", "b", num_tokens=tokens, attempt=attempt["nixl"])
            return {
                "t": res.transfer_seconds,
                "all": res.seconds,
                "bytes": res.bytes_moved,
                "posted": res.nixl_desc_count,
                "descriptors": res.descriptors,
            }

        def moon() -> dict:
            attempt["mooncake"] += 1
            res = mk.pull("prefill", d_ids, p_ids, "b", num_tokens=tokens, attempt=attempt["mooncake"])
            return {
                "t": res.transfer_seconds,
                "all": res.seconds,
                "bytes": res.bytes_moved,
                "posted": res.posted,
                "descriptors": res.descriptors,
                "batches": res.batches,
            }

        # the plan's moves, as iovecs from each P rank's Mooncake arrays into D's arrays
        plan, bs = mk.plan("prefill", d_ids, p_ids, "b", tokens)
        moves = plan.moves(mk.pairings["prefill"])
        vm = _Vm()
        iov = {}
        dst_bases = np.asarray([a.ctypes.data for a in mk.arrays], dtype=np.uint64)
        for r, link in mk.links["prefill"].items():
            m = moves[moves[:, 0] == mk.pairings["prefill"].remotes[r].global_rank]
            src = np.asarray(link.bases, dtype=np.uint64)
            loc = np.stack([dst_bases[m[:, 4]] + m[:, 5].astype(np.uint64), m[:, 6].astype(np.uint64)], 1)
            rem = np.stack([src[m[:, 1]] + m[:, 2].astype(np.uint64), m[:, 6].astype(np.uint64)], 1)
            iov[r] = (np.ascontiguousarray(loc), np.ascontiguousarray(rem))
        nbytes = int(moves[:, 6].sum())
        a = np.ones(nbytes, np.uint8)
        b = np.zeros(nbytes, np.uint8)

        def vmread() -> dict:
            t0 = time.perf_counter()
            calls = sum(vm.read(pids[r], *iov[r]) for r in iov)
            return {"t": time.perf_counter() - t0, "bytes": nbytes, "syscalls": calls}

        def memcpy() -> dict:
            t0 = time.perf_counter()
            np.copyto(b, a)
            return {"t": time.perf_counter() - t0, "bytes": nbytes}

        # first run of each transport into poisoned blocks: every byte of the request checked
        bad = {}
        for name, fn, arrays in (("nixl", nixl, kv.tensors), ("mooncake", moon, mk.arrays)):
            for t in arrays:
                t[:] = POISON_BYTE
            fn()
            bad[name] = check_request(arrays, card, space, d_ids, tokens)
        runs: dict[str, list[dict]] = {k: [] for k in ("nixl", "mooncake", "process_vm_readv", "memcpy")}
        for _ in range(reps):  # interleaved: drift on a shared machine hits all alike
            runs["nixl"].append(nixl())
            runs["mooncake"].append(moon())
            runs["process_vm_readv"].append(vmread())
            runs["memcpy"].append(memcpy())
        out: dict[str, Any] = {
            "pair": spec["pair"],
            "ids": spec["ids"],
            "tokens": tokens,
            "reps": reps,
            "bad_bytes": bad,
            "bytes": nbytes,
            "plan_descriptors": plan.num_descriptors,
            "plan_batches": len(bs),
        }
        for k, rs in runs.items():
            med = statistics.median(r["t"] for r in rs)
            row = {"seconds": med, "gbps": gbps(nbytes, med), "bytes": rs[0]["bytes"]}
            if "all" in rs[0]:
                row["pull_seconds"] = statistics.median(r["all"] for r in rs)
            for extra in ("posted", "descriptors", "batches", "syscalls"):
                if extra in rs[0]:
                    row[extra] = rs[0][extra]
            out[k] = row
        return out
    finally:
        kv.close()
        mk.close()


def report(res: dict) -> str:
    lines = [
        f"{res['pair']}, {res['ids']} ids: one request of {res['tokens']} tokens, {res['bytes'] / 2**20:.1f} MiB moved, median of {res['reps']}; "
        f"plan: {res['plan_descriptors']} descriptor pairs; bad bytes after the first pull: {res['bad_bytes']}",
        f"{'method':<18}{'seconds':>10}{'GB/s':>8}{'pull s':>9}{'posted':>9}",
    ]
    for k in ("nixl", "mooncake", "process_vm_readv", "memcpy"):
        r = res[k]
        posted = r.get("posted", r.get("syscalls", ""))
        pull = f"{r['pull_seconds']:.4f}" if "pull_seconds" in r else ""
        lines.append(f"{k:<18}{r['seconds']:>10.4f}{r['gbps']:>8.2f}{pull:>9}{posted!s:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--pair", choices=sorted(PAIRS), default="tp2-tp1")
    ap.add_argument("--ids", choices=["shuffled", "sequential"], default="shuffled")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    from kvgeom_mooncake import available

    why = available()
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    scenario = sized(demo_scenario(args.pair), [args.tokens], 1.5)
    spec = {
        "scenario": scenario,
        "tokens": args.tokens,
        "reps": args.reps,
        "limit_s": args.timeout,
        "pair": args.pair,
        "ids": args.ids,
    }
    t0 = time.monotonic()
    num_p = Scenario.from_json(scenario).prefill.tp_size
    res = run_ranks(_producer, _consumer, spec, num_p, args.timeout)["decode"]
    res["wall_s"] = time.monotonic() - t0
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if all(v == 0 for v in res["bad_bytes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
