"""Cross-host throughput: NIXL over UCX's TCP transport between P and D on separate hosts (network
namespaces joined by veth pairs and a bridge), against the link's capacity measured in the same run.

    .venv/bin/python bench/bench_hosts.py [--requests 6] [--tokens 4096] [--reps 3] [--no-offload] [--progress-thread] [--json out.json]

Run as root (namespaces), with iperf3 installed. The demo Mamba2 hybrid, P TP2 (32-token blocks) -> D TP1
(64-token blocks), pools sized for the requests; ``prefill`` on host ``p``, D on host ``d``;
``UCX_TLS=tcp``, ``UCX_NET_DEVICES=kvh0``, NIXL's progress thread off unless ``--progress-thread``. For each rep,
interleaved so that load on a shared machine hits all alike:

* link capacity p -> d: ``iperf3`` for 2 s, one TCP stream and two parallel streams (a P TP2 -> D TP1
  request is two READs, one per P rank, each on its own connection);
* NIXL READ of 64 MiB in one transfer between two bare endpoints, in 4 MiB and in 4 KiB descriptors
  (the transport's ceiling, and what small descriptors cost; every byte checked; progress thread off);
* NIXL pull and push: ``--requests`` requests of ``--tokens`` tokens each through ``run_cluster`` (side-channel
  discovery), every byte of D checked at the end; throughput = bytes moved / time from the first post to
  the last completion, per request (``transfer_seconds``), aggregated over the requests.

Reported: medians over the reps, and NIXL's throughput as a fraction of the two-stream capacity. With
``--no-offload`` the hosts' interfaces have TX checksum offload off (as the fault tests' impairable network
has: the kernel checksums and segments every frame), which lowers the capacity of the veth link.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "adapters"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from kvgeom_lab.cluster import run_cluster  # noqa: E402
from kvgeom_lab.demo import DEFAULT_SCENARIO  # noqa: E402
from kvgeom_lab.hostrun import ucx_env  # noqa: E402
from kvgeom_lab.netns import VirtualNet, measure_capacity  # noqa: E402


def _iperf(net: VirtualNet, streams: int, seconds: float) -> float:
    if streams == 1:
        return measure_capacity(net, "d", "p", seconds)
    import subprocess

    srv = net.popen("d", ["iperf3", "-s", "-1", "-B", net["d"].addr, "-p", "5202"])
    try:
        end = time.monotonic() + 10
        while True:
            res = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    net["p"].netns,
                    "iperf3",
                    "-c",
                    net["d"].addr,
                    "-p",
                    "5202",
                    "-t",
                    f"{seconds:g}",
                    "-P",
                    str(streams),
                    "-J",
                ],
                capture_output=True,
                text=True,
                timeout=seconds + 20,
            )
            try:
                return float(json.loads(res.stdout)["end"]["sum_received"]["bits_per_second"]) / 8
            except (ValueError, KeyError):
                if time.monotonic() > end:
                    raise RuntimeError(f"iperf3 failed: {res.stdout[-300:]}") from None
                time.sleep(0.2)
    finally:
        VirtualNet.stop(srv)


def _serve(env: dict, peer_q, done_q, nbytes: int) -> dict:
    """P of the raw READs: a registered region of known content; drives progress until told to stop."""
    import os
    import queue

    os.environ.update(env)
    import torch
    from kvgeom_nixl import Endpoint, TransportConfig

    with Endpoint("raw-p", TransportConfig(insecure=True)) as ep:
        t = torch.arange(nbytes // 4, dtype=torch.int32)
        (r,) = ep.register_tensors([t])
        peer_q.put((ep.metadata(), r.addr))
        end = time.monotonic() + 300
        while time.monotonic() < end:
            ep.notifications()
            try:
                done_q.get_nowait()
                return {}
            except queue.Empty:
                time.sleep(0.0005)
    return {}


def _descs(base: int, n: int, size: int):
    import numpy as np

    offs = np.arange(n, dtype=np.uint64) * np.uint64(size)
    return np.stack([np.uint64(base) + offs, np.full(n, size, np.uint64), np.zeros(n, np.uint64)], axis=1)


def _read(env: dict, peer_q, done_q, nbytes: int, desc_bytes: list[int], reps: int) -> dict:
    """D of the raw READs: ``nbytes`` in descriptors of each size of ``desc_bytes``, ``reps`` times each."""
    import os

    import numpy as np

    os.environ.update(env)
    import torch
    from kvgeom_nixl import Endpoint, TransportConfig

    out: dict[int, list[float]] = {}
    with Endpoint("raw-d", TransportConfig(insecure=True, transfer_timeout_s=120)) as ep:
        t = torch.zeros(nbytes // 4, dtype=torch.int32)
        (r,) = ep.register_tensors([t])
        md, addr = peer_q.get(timeout=60)
        ep.add_peer("raw-p", md)
        for size in desc_bytes:
            n = nbytes // size
            local, remote = (
                ep.prep_local(_descs(r.addr, n, size)),
                ep.prep_remote("raw-p", _descs(addr, n, size)),
            )
            ids = np.arange(n)[::-1].copy()  # reversed on one side: NIXL cannot merge them into one
            for _ in range(reps):
                t.zero_()
                t0 = time.perf_counter()
                ep.post("READ", local, ids, remote, ids[::-1].copy()).wait()
                out.setdefault(size, []).append(nbytes / (time.perf_counter() - t0) / 1e9)
            expect = torch.arange(nbytes // 4, dtype=torch.int32).view(n, -1).flip(0).reshape(-1)
            if not bool((t == expect).all()):
                raise RuntimeError(f"raw READ of {size}-byte descriptors moved wrong bytes")
        done_q.put("done")
    return {k: statistics.median(v) for k, v in out.items()}


def _raw(net: VirtualNet, nbytes: int, desc_bytes: list[int], reps: int) -> dict:
    from kvgeom_lab import ProcGroup

    env = ucx_env()
    with ProcGroup() as g:
        pq, dq = g.queue(), g.queue()
        g.spawn(_serve, (env, pq, dq, nbytes), "p", netns=net["p"].netns)
        g.spawn(_read, (env, pq, dq, nbytes, desc_bytes, reps), "d", netns=net["d"].netns)
        res = g.collect(300)
    return res["d"].unwrap()


def _nixl(net: VirtualNet, mode: str, n: int, tokens: int, progress_thread: bool = False) -> dict:
    blocks_d = max(256, 2 * n * -(-tokens // 64))
    scenario = dict(
        DEFAULT_SCENARIO,
        mode=mode,
        prefill=dict(DEFAULT_SCENARIO["prefill"], num_blocks=2 * blocks_d + 64),
        decode=dict(DEFAULT_SCENARIO["decode"], num_blocks=blocks_d),
    )
    hosts = {
        e: {"netns": net[h].netns, "host": net[h].addr, "env": ucx_env()}
        for e, h in (("prefill", "p"), ("decode", "d"))
    }
    spec = {
        "scenario": scenario,
        "hosts": hosts,
        "check_each": False,
        "requests": [{"id": f"r{i}", "tokens": tokens} for i in range(n)],
        "config": {
            "secret": "bench-hosts-secret-0123456789",
            "transfer_timeout_s": 60,
            "notif_timeout_s": 60,
            "progress_thread": progress_thread,
        },
    }
    out = run_cluster(spec, timeout_s=600)
    d = out["results"]["decode-0"]
    if "traceback" in d or d["mismatches"] or d["bad_bytes"]:
        raise RuntimeError(
            f"the {mode} run failed or moved wrong bytes: {d.get('error') or d['mismatches'][:3]}"
        )
    if mode == "pull":
        rows = d["results"]
        moved = sum(r["bytes_moved"] for r in rows)
        secs = [r["transfer_seconds"] for r in rows]
    else:  # P ranks report their WRITEs; both write at once, a request takes the longer of the two
        ranks = [v["results"] for k, v in out["results"].items() if k.startswith("prefill")]
        moved = sum(r["bytes_moved"] for rows in ranks for r in rows)
        secs = [max(x) for x in zip(*[[r["transfer_seconds"] for r in rows] for rows in ranks])]
    if not all(a["ok"] for a in out["attempts"]):
        raise RuntimeError(f"{mode}: a request failed: {out['attempts']}")
    descs = sum(
        r.get("nixl_desc_count", 0)
        for r in (d["results"] if mode == "pull" else [r for rows in ranks for r in rows])
    )
    return {
        "bytes": moved,
        "seconds": sum(secs),
        "per_request_GBps": [moved / n / s / 1e9 for s in secs],
        "checked_bytes": d["checked_bytes"],
        "nixl_descriptors": descs,
        "bytes_per_descriptor": moved / descs if descs else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0, help="iperf3 duration")
    ap.add_argument("--no-offload", action="store_true")
    ap.add_argument("--progress-thread", action="store_true", help="NIXL's progress thread on in every rank")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows: dict[str, list[float]] = {
        "iperf3 1 stream": [],
        "iperf3 2 streams": [],
        "NIXL READ, one connection, 4 MiB descriptors": [],
        "NIXL READ, one connection, 4 KiB descriptors": [],
        "NIXL pull (KV requests)": [],
        "NIXL push (KV requests)": [],
    }
    detail = []
    with VirtualNet(["p", "d"], impairable=args.no_offload) as net:
        for rep in range(args.reps):
            cap1 = _iperf(net, 1, args.seconds)
            pull = _nixl(net, "pull", args.requests, args.tokens, args.progress_thread)
            cap2 = _iperf(net, 2, args.seconds)
            push = _nixl(net, "push", args.requests, args.tokens, args.progress_thread)
            rows["iperf3 1 stream"].append(cap1 / 1e9)
            rows["iperf3 2 streams"].append(cap2 / 1e9)
            raw = _raw(net, 64 << 20, [4 << 20, 4 << 10], 3)  # progress thread off
            rows["NIXL READ, one connection, 4 MiB descriptors"].append(raw[4 << 20])
            rows["NIXL READ, one connection, 4 KiB descriptors"].append(raw[4 << 10])
            rows["NIXL pull (KV requests)"].append(pull["bytes"] / pull["seconds"] / 1e9)
            rows["NIXL push (KV requests)"].append(push["bytes"] / push["seconds"] / 1e9)
            detail.append({"rep": rep, "pull": pull, "push": push, "cap1": cap1, "cap2": cap2})
            print(
                f"rep {rep}: iperf3 {cap1 / 1e9:.3f} / {cap2 / 1e9:.3f} GB/s (1 / 2 streams); raw READ "
                f"{raw[4 << 20]:.3f} / {raw[4 << 10]:.3f} GB/s (4 MiB / 4 KiB descriptors); NIXL pull "
                f"{rows['NIXL pull (KV requests)'][-1]:.3f} GB/s, push {rows['NIXL push (KV requests)'][-1]:.3f} GB/s "
                f"({pull['bytes'] / 1e6:.1f} MB in {args.requests} requests, {pull['bytes_per_descriptor'] or 0:.0f} B per "
                "posted descriptor; every byte of D checked)",
                flush=True,
            )
    med = {k: statistics.median(v) for k, v in rows.items()}
    link = "veth, TX checksum offload off" if args.no_offload else "veth, offloads on"
    link += ", progress thread on" if args.progress_thread else ", progress thread off"
    print(f"\n| path ({link}) | GB/s (median of {args.reps}) | of the 2-stream capacity |")
    print("| --- | --- | --- |")
    for k, v in med.items():
        print(
            f"| {k} | {v:.3f} (min {min(rows[k]):.3f}, max {max(rows[k]):.3f}) | "
            f"{v / med['iperf3 2 streams']:.0%} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "rows": rows, "median": med, "detail": detail}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
