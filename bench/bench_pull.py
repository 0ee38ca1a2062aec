"""Cross-process pull throughput: NIXL against process_vm_readv and memcpy, on the same byte moves.

Nemotron-H 8B (Mamba2 hybrid), P TP2 (block 1040, kernel 16) -> D TP1 (block 2080, kernel 32), pull:
the shipped example pair, its pools sized for one large request (default 32,768 tokens, ~570 MiB on
D) with shuffled block ids. Each P rank and the D rank is a separate process with its own NIXL agent
(UCX, loopback; progress thread off unless ``--progress-thread``). D plans the request, then, in the
same run and on the same byte ranges (the plan's moves):

* NIXL: posts the plan's transfers (one per P rank) and times first post -> last completion
  (``make_prepped_xfer`` included, planning excluded), re-planning the request before each pull;
* ``process_vm_readv`` from the P ranks' pids into D's registered buffers (what UCX's CMA transport
  does): iovec pairs in plan order, up to 1024 per syscall, one pass per source rank;
* memcpy: numpy slice copies of the same moves from local arrays holding the P ranks' content;

and the same three again moving the same number of bytes as contiguous pieces of up to 16 MiB (the
bandwidth ceilings). Each method runs once into a zeroed D and every moved byte is checked against P's
content; then the six are timed interleaved (so that drift on a shared machine hits all alike), and
the median of ``--reps`` is reported.
Also reported: NIXL's posted descriptor count (telemetry, after its merging) against the plan's
descriptor pairs and against ``contiguous_runs(moves)`` (the fewest possible), and planning time.
Peak memory of the run: P caches + D cache + D's local copy of P's content (~3.7 GiB by default).

Run: ``.venv/bin/python bench/bench_pull.py [--tokens N] [--reps R] [--ids shuffled|sequential]
[--progress-thread] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import sys
import time
from typing import Any

import numpy as np
from _pullkit import LocalTables, gbps, median_time, run_ranks, serve, sized, timed_pull, wait_ranks

from kvgeom import GeometryCard
from kvgeom.plan.requestplan import check_writes, contiguous_runs
from kvgeom.tools.scenario import Scenario

EXAMPLE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "examples", "nemotron-h-8b_p2_d1_pull.json"
)
CHUNK = 16 << 20  # contiguous reference: descriptors / iovecs / copies of at most this many bytes
IOV_MAX = 1024


# ----------------------------------------------------------------------------------------- content
def pattern_fill(buf: np.ndarray, salt: int, chunk: int = 64 << 20) -> None:
    """Fill a uint8 array with a pattern where every 8-byte word differs (word index times an odd
    constant, xor ``salt``): cheap to generate in any process, and misplaced bytes show."""
    k, s = np.uint64(0x9E3779B97F4A7C15), np.uint64(salt)
    for lo in range(0, buf.size, chunk):
        hi = min(buf.size, lo + chunk)
        words = (np.arange(lo // 8, (hi + 7) // 8, dtype=np.uint64) * k) ^ s
        buf[lo:hi] = words.view(np.uint8)[: hi - lo]


def salt_of(rank: int, region: int) -> int:
    return (rank + 1) * 0x1000193 + region * 0x01000001


def mismatches(dst: list[np.ndarray], src: dict[int, list[np.ndarray]], moves: np.ndarray) -> int:
    """Moves whose destination bytes differ from their source bytes."""
    bad = 0
    for s_rank, s_reg, s_off, _, d_reg, d_off, n in moves.tolist():
        bad += not np.array_equal(dst[d_reg][d_off : d_off + n], src[s_rank][s_reg][s_off : s_off + n])
    return bad


def contiguous_moves(
    per_rank: dict[int, int], src_sizes: dict[int, list[int]], dst_sizes: list[int], chunk: int
) -> np.ndarray:
    """Moves of ``per_rank[r]`` bytes from each P rank's regions, front to back, into D's regions,
    front to back, in pieces of at most ``chunk`` bytes that cross no region boundary."""
    rows, d_reg, d_off = [], 0, 0
    for rank, total in per_rank.items():
        s_reg, s_off = 0, 0
        while total > 0:
            if s_off == src_sizes[rank][s_reg]:
                s_reg, s_off = s_reg + 1, 0
            if d_off == dst_sizes[d_reg]:
                d_reg, d_off = d_reg + 1, 0
            n = min(chunk, total, src_sizes[rank][s_reg] - s_off, dst_sizes[d_reg] - d_off)
            rows.append((rank, s_reg, s_off, 0, d_reg, d_off, n))
            s_off, d_off, total = s_off + n, d_off + n, total - n
    return np.array(rows, dtype=np.int64).reshape(-1, 7)


# ----------------------------------------------------------------------------------------- copies
class VmReader:
    """``process_vm_readv`` through ctypes: iovec pairs (numpy ``[addr, len]`` uint64 rows, the C
    ``struct iovec`` layout) read in batches of up to ``IOV_MAX`` per syscall."""

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
        """Read every pair; returns the number of syscalls. Raises OSError on a short read."""
        calls = 0
        lp, rp = local.ctypes.data, remote.ctypes.data
        for lo in range(0, len(local), IOV_MAX):
            k = min(IOV_MAX, len(local) - lo)
            want = int(local[lo : lo + k, 1].sum())
            got = self.fn(pid, lp + 16 * lo, k, rp + 16 * lo, k, 0)
            calls += 1
            if got < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
            if got != want:  # the kernel stops at the first iovec it cannot read
                raise OSError(f"process_vm_readv from pid {pid}: short read, {got} of {want} bytes")
        return calls


def iovecs(moves: np.ndarray, src_bases: dict[int, list[int]], dst_bases: list[int]) -> dict[int, tuple]:
    """Per source rank: (local iovecs into D, remote iovecs in P), rows in ``moves`` order."""
    out = {}
    for rank in dict.fromkeys(moves[:, 0].tolist()):
        m = moves[moves[:, 0] == rank]
        sb = np.asarray(src_bases[rank], dtype=np.uint64)
        db = np.asarray(dst_bases, dtype=np.uint64)
        n = m[:, 6].astype(np.uint64)
        local = np.ascontiguousarray(np.stack([db[m[:, 4]] + m[:, 5].astype(np.uint64), n], axis=1))
        remote = np.ascontiguousarray(np.stack([sb[m[:, 1]] + m[:, 2].astype(np.uint64), n], axis=1))
        out[rank] = (local, remote)
    return out


def memcpy_moves(dst: list[np.ndarray], src: dict[int, list[np.ndarray]], rows: list[list[int]]) -> None:
    for s_rank, s_reg, s_off, _, d_reg, d_off, n in rows:
        dst[d_reg][d_off : d_off + n] = src[s_rank][s_reg][s_off : s_off + n]


# ----------------------------------------------------------------------------------------- ranks
def _config(spec: dict) -> Any:
    from kvgeom_nixl.config import TransportConfig

    return TransportConfig(**spec["config"])


def _card(sc: Scenario, side: str, rank: int) -> GeometryCard:
    eng = sc.prefill if side == "prefill" else sc.decode
    return GeometryCard(side, sc.model, eng.with_rank(rank), sc.mode)


def _producer(spec: dict, rank: int, events: Any, inbox: Any) -> dict:
    from kvgeom_nixl.kvrank import KVRank

    sc = Scenario.from_json(spec["scenario"])
    with KVRank(_card(sc, "prefill", rank), _config(spec)) as kv:
        for i, t in enumerate(kv.tensors):
            pattern_fill(t.numpy(), salt_of(rank, i))
        events.put(("ready", rank, kv.port, os.getpid()))
        seen = serve(kv, inbox, spec["serve_poll_s"], spec["timeout_s"])
        return {"rank": rank, "notifications": seen, "maxrss_mib": _maxrss_mib()}


def _consumer(spec: dict, events: Any, inbox: Any) -> dict:
    from kvgeom_nixl.kvrank import KVRank

    sc = Scenario.from_json(spec["scenario"])
    reps, cfg = spec["reps"], _config(spec)
    req = sc.request(spec["tokens"], seed=spec["seed"])
    out: dict[str, Any] = {}
    with KVRank(_card(sc, "decode", 0), cfg) as kv:
        ranks = wait_ranks(inbox)
        pairing = kv.connect(
            "prefill", {r: port for r, (port, _) in ranks.items()}, mode="pull", compat=sc.compat
        )

        def plan(i: int) -> Any:
            return kv.plan("prefill", req.decode, req.prefill, f"bench-{i}", f"bench-{i}", req.num_tokens)

        plan_s, _ = median_time(lambda: plan(-1), reps)
        p0 = plan(0)
        check_writes(p0, pairing, req.decode)
        moves = p0.moves(pairing)
        moves_s, _ = median_time(lambda: p0.moves(pairing), reps)
        nbytes = int(moves[:, 6].sum())
        per_rank = {r: int(moves[moves[:, 0] == r, 6].sum()) for r in dict.fromkeys(moves[:, 0].tolist())}
        out["request"] = {
            "tokens": spec["tokens"],
            "ids": "sequential" if spec["seed"] is None else "shuffled",
            "bytes": nbytes,
            "bytes_per_rank": per_rank,
            "descriptor_pairs": p0.num_descriptors,
            "transfers": len(p0.transfers),
            "contiguous_runs": contiguous_runs(moves),
            "move_lengths": {int(k): int(v) for k, v in zip(*np.unique(moves[:, 6], return_counts=True))},
        }
        out["plan"] = {
            "seconds": plan_s,
            "us_per_desc": plan_s * 1e6 / p0.num_descriptors,
            "moves_seconds": moves_s,
        }

        dst = [t.numpy() for t in kv.tensors]
        src: dict[int, list[np.ndarray]] = {}
        for r in ranks:
            src[r] = []
            for i, reg in enumerate(_card(sc, "prefill", r).geometry.regions):
                a = np.empty(reg.nbytes, dtype=np.uint8)
                pattern_fill(a, salt_of(r, i))
                src[r].append(a)
        src_bases = {r: list(link.bases) for r, link in kv.links["prefill"].items()}
        dst_bases = [r.addr for r in kv.regions]
        pids = {r: pid for r, (_, pid) in ranks.items()}
        contig = contiguous_moves(
            per_rank, {r: [a.size for a in src[r]] for r in src}, [a.size for a in dst], CHUNK
        )

        # -- NIXL, the plan's own transfers
        tables = LocalTables(kv, "prefill")
        serial = iter(range(1, 1 << 30))

        def nixl_plan() -> dict:  # re-plans the request (untimed), then times post -> done
            dt, tel = timed_pull(kv, "prefill", plan(next(serial)), tables, cfg.transfer_timeout_s)
            return {
                "seconds": dt,
                "desc_count": sum(t.desc_count or 0 for t in tel),
                "nixl_xfer_us": sum(t.xfer_us or 0 for t in tel),
            }

        reader = VmReader()

        def pvr(mv: np.ndarray) -> Any:
            vecs = iovecs(mv, src_bases, dst_bases)
            return _timed(
                lambda: {"syscalls": sum(reader.read(pids[r], loc, rem) for r, (loc, rem) in vecs.items())}
            )

        def memcpy(mv: np.ndarray) -> Any:
            rows = mv.tolist()
            return _timed(lambda: memcpy_moves(dst, src, rows))

        contig_nixl = NixlMoves(kv, contig, src_bases, dst_bases, cfg.transfer_timeout_s)
        methods = {
            "nixl": (moves, nixl_plan),
            "pvr": (moves, pvr(moves)),
            "memcpy": (moves, memcpy(moves)),
            "nixl_contig": (contig, _timed(contig_nixl)),
            "pvr_contig": (contig, pvr(contig)),
            "memcpy_contig": (contig, memcpy(contig)),
        }
        # warm-up: each method once into a zeroed D, then every moved byte checked against P's content
        info, bad = {}, {}
        for name, (mv, fn) in methods.items():
            for t in kv.tensors:
                t.zero_()
            info[name] = fn()
            bad[name] = mismatches(dst, src, mv)
        # timed: the methods interleaved, so that drift on this shared machine hits all of them alike
        samples: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(reps):
            for name, (_, fn) in methods.items():
                info[name] = fn()
                samples[name].append(info[name].pop("seconds"))
        contig_nixl.release()
        for name, (mv, _) in methods.items():
            out[name] = _row(nbytes, samples[name], mv, bad[name], **info[name])
        out["maxrss_mib"] = _maxrss_mib()
    return out


def _timed(fn: Any) -> Any:
    """``fn`` wrapped to return ``{"seconds": wall, **whatever fn returned}``."""

    def run() -> dict:
        t0 = time.perf_counter()
        extra = fn()
        return {"seconds": time.perf_counter() - t0, **(extra or {})}

    return run


class NixlMoves:
    """NIXL READs of arbitrary moves: per source rank one prepared descriptor per move (ids in order),
    one transfer per rank. Calling it pulls once and returns NIXL's posted descriptor count."""

    def __init__(
        self,
        kv: Any,
        moves: np.ndarray,
        src_bases: dict[int, list[int]],
        dst_bases: list[int],
        timeout_s: float,
    ) -> None:
        self.kv, self.timeout_s, self.handles = kv, timeout_s, []
        dev = kv.regions[0].device_id
        for r, (loc, rem) in iovecs(moves, src_bases, dst_bases).items():
            col = np.full((len(loc), 1), dev, dtype=np.uint64)
            lp = kv.ep.prep_local(np.hstack([loc, col]), kv.mem_type)
            rp = kv.ep.prep_remote(kv.links["prefill"][r].agent, np.hstack([rem, col]), kv.mem_type)
            self.handles.append((lp, rp, np.arange(len(loc), dtype=np.int32)))

    def __call__(self) -> dict:
        deadline = time.monotonic() + self.timeout_s
        posted = [self.kv.ep.post("READ", lp, ids, rp, ids, b"contig:1") for lp, rp, ids in self.handles]
        return {"desc_count": sum(x.wait(deadline).desc_count or 0 for x in posted)}

    def release(self) -> None:
        for lp, rp, _ in self.handles:
            lp.release()
            rp.release()


def _row(nbytes: int, times: list[float], moves: np.ndarray, bad: int, **extra: Any) -> dict:
    t = statistics.median(times)
    return {
        "seconds": t,
        "gbps": gbps(nbytes, t),
        "times": times,
        "moves": len(moves),
        "bad_moves": bad,
        **extra,
    }


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------------------- report
def report(res: dict, args: argparse.Namespace, sc: Scenario, wall: float) -> str:
    d = res["decode"]
    q, plan = d["request"], d["plan"]
    n = d["nixl"]
    lines = [
        f"scenario: {sc.describe()}",
        f"request: {q['tokens']} tokens, {q['ids']} block ids; {q['bytes'] / 2**20:.1f} MiB from "
        f"{len(q['bytes_per_rank'])} P rank(s) in {q['descriptor_pairs']} descriptor pairs "
        f"({q['transfers']} transfers); move lengths {q['move_lengths']}",
        f"NIXL: UCX, progress thread {'on' if args.progress_thread else 'off'}; median of {args.reps} "
        f"(methods interleaved) after 1 warm-up that is checked against P's bytes",
        "",
        f"{'method':44s} {'seconds':>9s} {'GB/s':>7s}  {'moves':>7s}  notes",
    ]

    def line(label: str, row: dict, note: str) -> None:
        ok = "ok" if row["bad_moves"] == 0 else f"{row['bad_moves']} MOVES WRONG"
        lines.append(
            f"{label:44s} {row['seconds']:9.4f} {row['gbps']:7.2f}  {row['moves']:7d}  {note}; bytes {ok}"
        )

    line("NIXL READ, the plan's transfers", n, f"NIXL posted {n['desc_count']} descs after merging")
    line("process_vm_readv, same moves", d["pvr"], f"{d['pvr']['syscalls']} syscalls of <= {IOV_MAX} iovecs")
    line("memcpy (numpy slice copies), same moves", d["memcpy"], "one copy per move, one process")
    lines.append(f"-- the same bytes as contiguous pieces of <= {CHUNK >> 20} MiB (bandwidth ceilings):")
    line("NIXL READ", d["nixl_contig"], f"NIXL posted {d['nixl_contig']['desc_count']} descs")
    line("process_vm_readv", d["pvr_contig"], f"{d['pvr_contig']['syscalls']} syscalls")
    line("memcpy (numpy)", d["memcpy_contig"], "")
    r_pvr, r_mem = n["gbps"] / d["pvr"]["gbps"], n["gbps"] / d["memcpy"]["gbps"]
    lines += [
        "",
        f"NIXL / process_vm_readv (same moves): {r_pvr:5.2f}    NIXL / memcpy (same moves): {r_mem:5.2f}",
        f"NIXL / process_vm_readv (contiguous): {d['nixl_contig']['gbps'] / d['pvr_contig']['gbps']:5.2f}    "
        f"NIXL / memcpy (contiguous): {d['nixl_contig']['gbps'] / d['memcpy_contig']['gbps']:5.2f}",
        f"scatter cost vs contiguous: NIXL {_per_desc(n, d['nixl_contig'], n['desc_count']):.2f} us per posted "
        f"desc, process_vm_readv {_per_desc(d['pvr'], d['pvr_contig'], d['pvr']['moves']):.2f} us per iovec, "
        f"memcpy {_per_desc(d['memcpy'], d['memcpy_contig'], d['memcpy']['moves']):.2f} us per move",
        f"descriptors: plan pairs {q['descriptor_pairs']}, NIXL posted {n['desc_count']} "
        f"(telemetry, after merging), contiguous runs {q['contiguous_runs']} (fewest possible) -> "
        + (
            "coalescing could save " + f"{n['desc_count'] - q['contiguous_runs']} descs"
            if n["desc_count"] > q["contiguous_runs"]
            else "nothing left to coalesce"
        ),
        f"plan: {plan['seconds'] * 1e3:.2f} ms per request ({plan['us_per_desc']:.3f} us per descriptor pair); "
        f"moves(): {plan['moves_seconds'] * 1e3:.2f} ms; NIXL median pull {n['seconds'] * 1e3:.1f} ms",
        f"peak RSS MiB: D {d['maxrss_mib']:.0f}, "
        + ", ".join(
            f"P{v['rank']} {v['maxrss_mib']:.0f}" for k, v in sorted(res.items()) if k.startswith("prefill")
        )
        + f"; wall {wall:.1f} s incl. process start",
    ]
    return "\n".join(lines)


def _per_desc(scattered: dict, contig: dict, count: int) -> float:
    """Microseconds per descriptor that the scattered run took beyond the contiguous one."""
    return (scattered["seconds"] - contig["seconds"]) * 1e6 / max(1, count)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--scenario", default=EXAMPLE, help="scenario JSON (pull); num_blocks are sized to --tokens"
    )
    ap.add_argument("--tokens", type=int, default=32768, help="length of the request pulled")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per method (median reported)")
    ap.add_argument(
        "--ids",
        choices=("shuffled", "sequential"),
        default="shuffled",
        help="block ids drawn shuffled from the pool (realistic) or in order (best case for merging)",
    )
    ap.add_argument("--slack", type=float, default=1.25, help="pool size / blocks the request needs")
    ap.add_argument(
        "--progress-thread", action="store_true", help="enable NIXL's progress thread in every rank"
    )
    ap.add_argument(
        "--serve-poll-us",
        type=float,
        default=1000.0,
        help="P ranks' sleep between notification polls (the target of a READ must poll)",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="bound of the whole run in seconds")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    scenario = sized(json.load(open(args.scenario)), [args.tokens], args.slack)
    sc = Scenario.from_json(scenario)
    if sc.mode != "pull":
        ap.error("the scenario must be a pull")
    spec = {
        "scenario": scenario,
        "tokens": args.tokens,
        "reps": args.reps,
        "timeout_s": args.timeout,
        "seed": 7 if args.ids == "shuffled" else None,
        "serve_poll_s": args.serve_poll_us * 1e-6,
        "config": {"progress_thread": args.progress_thread, "secret": os.urandom(32).hex()},
    }
    print(
        f"bench_pull: {sc.describe()}; {args.tokens} tokens; starting {sc.prefill.tp_size} P + "
        f"{sc.decode.tp_size} D processes ...",
        flush=True,
    )
    t0 = time.monotonic()
    res = run_ranks(_producer, _consumer, spec, sc.prefill.tp_size, args.timeout)
    wall = time.monotonic() - t0
    print(report(res, args, sc, wall))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "scenario": scenario, "wall_s": wall, "results": res}, f, indent=1)
    bad = sum(v.get("bad_moves", 0) for v in res["decode"].values() if isinstance(v, dict))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
