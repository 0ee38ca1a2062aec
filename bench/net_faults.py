"""The cross-host fault table (docs/deployment.md), measured: each network fault of
``kvgeom_lab.hostrun.FAULTS`` injected into real P and D processes on separate hosts (network namespaces,
UCX over TCP), every byte of D checked, ``--trials`` times, each trial on a fresh virtual network.

    .venv/bin/python bench/net_faults.py [--trials 3] [--rows link_cut-pull,link_cut-push,...] [--json out.json]
    .venv/bin/python bench/net_faults.py --etcd-bounds 5

Run as root, with iproute2, ethtool, etcd-server and iperf3 installed. The demo Mamba2 hybrid, P TP2 ->
D TP1; 2.5 s transfer / notification timeouts, 3 s handshake timeout, 1 s etcd timeout, 3 s etcd lease.
Per row: trials; the outcome of the faulty attempts (error types); time to fail (from the attempt's start
to its typed error); how long its blocks stayed quarantined (from the failure until they were given back);
the other requests of the trial (served meanwhile or after recovery) that succeeded; and bytes damaged:
bytes of D that differ from what the oracle expects, over the whole cache at the end (after the late
transfers could land) plus in each request's blocks when it completed.

``--etcd-bounds N`` measures etcd's own bounds instead, on a bare member: how long a request to a stopped
member and over a cut link takes to fail, how long a dead rank's record outlives it, how soon a
registration is back after etcd restarts without its data.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "adapters"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from kvgeom_lab.hostrun import FAULTS, Lab, summarize  # noqa: E402

T = 2.5
ROWS = {  # row: (fault, mode, etcd, the faulty attempts, description)
    "link_cut-pull": (
        "link_cut",
        "pull",
        False,
        [("r1", 1)],
        "link cut 0.15 s into a transfer for 4.5 s (pull, side channel)",
    ),
    "link_cut-push": (
        "link_cut",
        "push",
        False,
        [("r1", 1)],
        "link cut 0.15 s into a transfer for 4.5 s (push, side channel)",
    ),
    "link_cut-pull-etcd": (
        "link_cut",
        "pull",
        True,
        [("r1", 1)],
        "link cut 0.15 s into a transfer (pull, etcd)",
    ),
    "impaired": (
        "impaired",
        "pull",
        False,
        [("r2", 1)],
        "netem delay 100 ms, loss 5 %, 16 Mbit/s on P's link (pull): a 6 MiB request; a 150 KB one",
    ),
    "readdress-sidechannel": (
        "readdress",
        "pull",
        False,
        [("r1", 1)],
        "P host's address changed after the handshake (side channel)",
    ),
    "readdress-etcd": (
        "readdress",
        "pull",
        True,
        [("r1", 1)],
        "P host's address changed after the handshake (etcd)",
    ),
    "etcd_restart": (
        "etcd_restart",
        "pull",
        True,
        [("r2", 1)],
        "etcd killed mid-run, back 6 s later without its data: a new handshake; a connected peer",
    ),
}


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} (max {max(xs):.2f})" if xs else "-"


def run_row(name: str, trials: int) -> dict:
    fault, mode, etcd, faulty, desc = ROWS[name]
    outcomes: Counter[str] = Counter()
    fail_s, held_s, damaged, others_ok, others, extra = [], [], 0, 0, 0, []
    for trial in range(trials):
        t0 = time.monotonic()
        with Lab(etcd=etcd) as lab:
            s = summarize(lab.run(FAULTS[fault](lab, mode, T)))
        if s["crashed"]:
            raise RuntimeError(f"{name} trial {trial}: ranks crashed: {s['crashed']}")
        damaged += int(s["bad_bytes"] or 0) + int(s["bad_at_completion"])
        for a in s["attempts"]:
            key = (a["request"], a["attempt"])
            if key in faulty:
                outcomes["ok" if a["ok"] else a["error"]] += 1
                if not a["ok"]:
                    fail_s.append(a["seconds"])
                    if key in s["settled"]:
                        held_s.append(s["settled"][key]["held_s"])
            else:
                others += 1
                others_ok += a["ok"]
                if not a["ok"]:
                    extra.append(f"{a['request']}#{a['attempt']}: {a['error']}")
        if fault == "impaired":  # the small request under the impairment
            small = next(a for a in s["attempts"] if a["request"] == "r1")
            extra.append(
                f"150 KB request under impairment {'ok' if small['ok'] else small['error']} in "
                f"{small['seconds']:.2f} s"
            )
        if fault == "etcd_restart":
            extra.append(
                f"connected peer served while etcd was down (side-channel fallback x{s['stats']['etcd_fallbacks']})"
            )
        print(
            f"  {name} trial {trial}: {dict(outcomes)} damaged {damaged} ({time.monotonic() - t0:.0f} s)",
            flush=True,
        )
    return {
        "row": name,
        "fault": desc,
        "trials": trials,
        "outcome": dict(outcomes),
        "fail_s": fail_s,
        "held_s": held_s,
        "others": f"{others_ok}/{others}",
        "damaged": damaged,
        "notes": sorted(set(extra)),
    }


def etcd_bounds(trials: int, timeout_s: float = 0.5, ttl_s: float = 2.0) -> dict[str, list[float]]:
    """etcd's own bounds, on a bare member (no engines): a request to a stopped member and over a cut link
    (``timeout_s``), a record's life after its rank stops refreshing (``ttl_s``), and how soon a registration
    writes its record again after etcd restarts without its data."""
    out: dict[str, list[float]] = {
        "request to a stopped member": [],
        "request over a cut link": [],
        "record after its rank stopped refreshing": [],
        "record back after a restart without data": [],
    }
    for _ in range(trials):
        _etcd_trial(out, timeout_s, ttl_s)
    return out


def _etcd_trial(out: dict[str, list[float]], timeout_s: float, ttl_s: float) -> None:
    import signal

    from kvgeom_lab.netns import EtcdServer, VirtualNet
    from kvgeom_nixl.discovery import EtcdClient, Registration
    from kvgeom_nixl.errors import DiscoveryError

    key = "/bounds/engines/prefill/0"

    def fail_time() -> float:
        t0 = time.monotonic()
        try:
            c.mod_revision(key)
        except DiscoveryError:
            return time.monotonic() - t0
        raise RuntimeError("etcd answered")

    def until(cond, bound: float = 20.0) -> float:
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > bound:
                raise RuntimeError("condition not reached")
            time.sleep(0.01)
        return time.monotonic() - t0

    with VirtualNet(["e", "c"], impairable=False) as net:
        etcd = EtcdServer(net, "e").start()
        c = EtcdClient([etcd.endpoint], timeout_s=timeout_s)
        reg = net.call(
            "c", lambda: Registration(EtcdClient([etcd.endpoint], timeout_s=timeout_s), key, ttl_s)
        )
        assert net.call("c", lambda: reg.publish(b'{"v": 1}', wait_s=2.0))  # the value is not read here
        etcd.stop(signal.SIGKILL)
        out["request to a stopped member"].append(net.call("c", fail_time))
        etcd.start(wipe=True)
        out["record back after a restart without data"].append(
            net.call("c", until, lambda: c.mod_revision(key) is not None)
        )
        net.link_down("e")
        out["request over a cut link"].append(net.call("c", fail_time))
        net.link_up("e")
        reg._stop = True  # the rank dies: no more refreshes, no revoke
        with reg._cv:
            reg._cv.notify_all()
        reg._thread.join(2)
        out["record after its rank stopped refreshing"].append(
            net.call("c", until, lambda: c.mod_revision(key) is None)
        )
        etcd.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--json")
    ap.add_argument(
        "--etcd-bounds",
        type=int,
        default=0,
        metavar="TRIALS",
        help="only measure etcd's bounds (0.5 s request timeout, 2 s lease), this many trials",
    )
    args = ap.parse_args(argv)
    if args.etcd_bounds:
        b = etcd_bounds(args.etcd_bounds)
        print("| etcd (0.5 s request timeout, 2 s lease TTL) | trials | seconds: median (min, max) |")
        print("| --- | --- | --- |")
        for k, v in b.items():
            print(f"| {k} | {len(v)} | {statistics.median(v):.2f} ({min(v):.2f}, {max(v):.2f}) |")
        if args.json:
            Path(args.json).write_text(json.dumps(b, indent=1))
        return 0
    results = []
    print(
        "| fault | trials | outcome of the faulty attempts | time to fail, s: median (max) | quarantined, s | "
        "other requests ok | bytes damaged |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.rows.split(","):
        r = run_row(name, args.trials)
        results.append(r)
        outcome = ", ".join(f"{k} {v}" for k, v in sorted(r["outcome"].items()))
        print(
            f"| {r['fault']} | {r['trials']} | {outcome} | {_fmt(r['fail_s'])} | {_fmt(r['held_s'])} | "
            f"{r['others']} | {r['damaged']} |",
            flush=True,
        )
        for note in r["notes"]:
            print(f"    note: {note}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
