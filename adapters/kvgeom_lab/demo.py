"""``kvgeom demo``: a real P/D transfer over NIXL between separate processes, verified byte for byte.

Default: a small Mamba2 hybrid (3 attention + 9 Mamba2 layers), P TP2 with 32-token blocks -> D TP1
with 64-token blocks (equal 16-token kernel blocks), pull, a batch of requests of mixed lengths. Every
P byte encodes its logical coordinate; after the transfers each D rank checks every byte of its cache
against kvgeom.testing's independent layout model (received content, zeroed tails, untouched rest).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import secrets
import sys
import time

from kvgeom import ModelSpec
from kvgeom.tools.scenario import example

from .cluster import run_cluster

#: the demo's pair, the shipped example ``demo-mamba2-hybrid_p2_d1_pull`` (kvgeom/examples; the one definition the
#: transport tests and bench_mooncake share)
DEFAULT_SCENARIO = example("demo-mamba2-hybrid_p2_d1_pull")
DEMO_MODEL = ModelSpec.from_json(DEFAULT_SCENARIO["model"])
DEFAULT_TOKENS = [97, 1000, 2500, 31, 4096, 640, 1777, 64]


def missing() -> list[str]:
    """What the demo's processes import and this environment lacks, as ``module (error)``; empty when the
    demo can run. ``kvgeom demo`` (the core's command line, which finds this module as its ``demo``
    plugin) asks before it starts any process."""
    out = []
    for module in ("torch", "nixl"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            out.append(f"{module} ({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault(
        "UCX_MODULES", "^ib,rdmacm"
    )  # CPU DRAM: no IB modules (docs/adapter.md, exit crash)
    ap = argparse.ArgumentParser(prog="kvgeom demo", description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", help="scenario JSON (default: the built-in Mamba2 hybrid, P TP2 -> D TP1)")
    ap.add_argument("--mode", choices=("pull", "push"), help="override the scenario's mode")
    ap.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS, help="request lengths")
    ap.add_argument("--progress-thread", action="store_true", help="enable NIXL's progress thread")
    ap.add_argument("--timeout", type=float, default=300.0, help="bound of the whole run in seconds")
    args = ap.parse_args(argv)
    scenario = json.load(open(args.scenario)) if args.scenario else dict(DEFAULT_SCENARIO)
    if args.mode:
        scenario["mode"] = args.mode
    # a fresh secret per run: every side-channel message, payload and notification is authenticated
    spec = {
        "scenario": scenario,
        "requests": [{"id": f"req-{i}", "tokens": n} for i, n in enumerate(args.tokens)],
        "config": {"progress_thread": args.progress_thread, "secret": secrets.token_hex(32)},
    }
    from kvgeom.tools.scenario import Scenario

    sc = Scenario.from_json(scenario)
    print(f"kvgeom demo: {sc.describe()}")
    print(
        f"  {len(args.tokens)} requests of {', '.join(map(str, args.tokens))} tokens; starting "
        f"{sc.prefill.tp_size} P + {sc.decode.tp_size} D processes (one NIXL agent each) ...",
        flush=True,
    )
    t0 = time.monotonic()

    def progress(row: dict) -> None:
        status = "ok" if row.get("ok") else f"FAILED ({row.get('error')})"
        extra = (
            f"{row.get('descriptors', 0)} descs, {_fmt_bytes(row.get('bytes_moved', 0))}, "
            f"zeroed {_fmt_bytes(row.get('bytes_zeroed', 0))}"
            if row.get("ok")
            else ""
        )
        print(
            f"  [{time.monotonic() - t0:6.2f}s] D rank {row['rank']}: {row['request_id']} {status} {extra}",
            flush=True,
        )

    out = run_cluster(spec, progress=progress, timeout_s=args.timeout)
    return _summary(out, sc, time.monotonic() - t0)


def _summary(out: dict, sc, wall: float) -> int:
    results = out["results"]
    local = "decode" if sc.mode == "pull" else "prefill"
    failed = [k for k, v in results.items() if "error" in v and "results" not in v]
    rows = [row for k, v in results.items() if k.startswith(local) and "results" in v for row in v["results"]]
    ok = [r for r in rows if r.get("ok")]
    moved = sum(r.get("bytes_moved", 0) for r in ok)
    descs = sum(r.get("descriptors", 0) for r in ok)
    posted = sum(r.get("nixl_desc_count", 0) for r in ok)
    runs = sum(r.get("runs", 0) for r in ok)
    xfer_s = sum(r.get("seconds", 0.0) for r in ok)
    nixl_s = sum(r.get("transfer_seconds", 0.0) for r in ok)
    d_reports = [v for k, v in results.items() if k.startswith("decode") and "mismatches" in v]
    bad = sum(v.get("bad_bytes", 0) for v in d_reports)
    zeroed = sum(r.get("bytes_zeroed", 0) for v in d_reports for r in v["results"] if r.get("ok"))
    mismatches = [m for v in d_reports for m in v["mismatches"]]
    checked = sum(v["checked_bytes"] for v in d_reports)
    print("\nsummary")
    ids = sorted({r["request_id"] for r in rows})
    n_ok = sum(all(r.get("ok") for r in rows if r["request_id"] == i) for i in ids)
    print(
        f"  requests           : {n_ok} ok / {len(ids)} ({len(ok)} of {len(rows)} rank-transfers ok; {sc.mode}, "
        f"{sc.compat} mode)"
    )
    print(
        f"  bytes moved        : {_fmt_bytes(moved)} in {descs} descriptor pairs "
        f"({runs} contiguous runs; NIXL posted {posted} after merging)"
    )
    print(
        f"  throughput         : {moved / max(nixl_s, 1e-9) / 1e9:.2f} GB/s in NIXL transfers ({nixl_s:.3f} s); "
        f"{moved / max(xfer_s, 1e-9) / 1e9:.2f} GB/s per request end to end ({xfer_s:.3f} s: planning, checks, "
        f"transfers, post-receive); wall {wall:.1f} s incl. process start"
    )
    print(f"  bytes zeroed       : {_fmt_bytes(zeroed)} (token tails and blocks the producer did not cover)")
    verdict = "PASS" if not mismatches and not bad and not failed and len(ok) == len(rows) else "FAIL"
    print(
        f"  verification       : {verdict}: every byte of {_fmt_bytes(checked)} of D cache checked against the "
        f"oracle's expected content, {len(mismatches)} mismatching run(s), {bad} bad byte(s)"
    )
    print(
        "  authentication     : HMAC-SHA256 with a secret generated for this run (side channel, payloads, "
        "notifications)"
    )
    for m in mismatches[:10]:
        print(f"    {m}")
    for k in failed:
        print(f"  {k} failed: {results[k]['error']}\n{results[k].get('traceback') or ''}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
