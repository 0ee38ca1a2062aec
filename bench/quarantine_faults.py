"""Issue 22's rows of the fault matrix (docs/reliability.md), measured with real P and D processes:

    .venv/bin/python bench/quarantine_faults.py [--trials 3] [--rows flood,legit-pull,legit-push,stop-bound,exhaust]

* ``flood``: :func:`kvgeom_lab.floods.live_producer_flood` (push; ``prefill`` busy past the 2.5 s timeout,
  alive, while a process without the secret holds 40 connections to each of its side channels). r2
  (``backup``) is served meanwhile.
* ``legit-pull``, ``legit-push``: :func:`kvgeom_lab.floods.legit_requests_under_flood`, 20 requests with a
  1 s transfer timeout while 3 flood processes hold 700 connections each per flooded side channel
  (more than the server's ``max_pending``) plus 100 slow drips each; counts served and failed.
* ``stop-bound``: push; ``prefill`` SIGSTOPped with r1 not yet written, for 8 s, with
  ``quarantine_bound_s=1.5``; r2 is served after the retirement, r3 after SIGCONT.
* ``exhaust``: push; ``prefill`` stopped for 60 s; attempts of one 2,700-token request (44 of D's 256
  blocks each; each new attempt takes new blocks, the failed ones stay held) go to it until D's pool is
  short, then a 300-token request goes to ``backup``; with the default bound (60 s) and with 1.5 s.

Every byte of D is checked against the oracle at the end (successful requests keep their blocks).
Prints one JSON line per trial, then a summary per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "adapters"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from kvgeom_lab.cluster import run_cluster  # noqa: E402
from kvgeom_lab.floods import T, legit_requests_under_flood, live_producer_flood, result, spec  # noqa: E402


def flood() -> dict:
    return live_producer_flood().row()


def legit(mode: str) -> dict:
    return legit_requests_under_flood(mode, n=20, processes=3, config={"transfer_timeout_s": 1.0}).row()


def stop_bound() -> dict:
    reqs = [
        {"id": "r0", "tokens": 300, "engine": "prefill"},
        {"id": "r1", "tokens": 900, "engine": "prefill"},
        {"id": "r2", "tokens": 900, "engine": "backup", "delay_s": 2.5},
        {"id": "r3", "tokens": 900, "engine": "backup", "delay_s": 6.0},
    ]
    faults = {"stop": {"engine": "prefill", "at": "r1", "seconds": T + 5.5}}
    out = run_cluster(
        spec("push", reqs, faults, config={"quarantine_bound_s": 1.5}, linger_s=2.0), timeout_s=150
    )
    return result(out, {("r1", 1)}, {("r2", 1)}).row()


def exhaust(bound: float) -> dict:
    reqs = [{"id": "f", "tokens": 2700, "engine": "prefill"}] * 7  # attempts 1..7 of one request
    reqs.append({"id": "b1", "tokens": 300, "engine": "backup"})
    faults = {"stop": {"engine": "prefill", "at": "f", "seconds": 60.0}}
    out = run_cluster(
        spec("push", reqs, faults, config={"quarantine_bound_s": bound}, drain_s=1.0), timeout_s=240
    )
    att = out["attempts"]
    failed = [x for x in att if not x["ok"] and x.get("error") != "no free blocks"]
    short = [x["request_id"] for x in att if x.get("error") == "no free blocks"]
    return {
        "bound_s": bound,
        "failed_before_exhaustion": len(failed),
        "refused_no_free_blocks": short,
        "backup_ok": any(x["ok"] and x["request_id"] == "b1" for x in att),
        "retired": len(out["retired"]),
        "bytes_damaged": out["results"]["decode-0"]["bad_bytes"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--rows", default="flood,legit-pull,legit-push,stop-bound,exhaust")
    args = ap.parse_args()
    rows = args.rows.split(",")
    for row in rows:
        runs = []
        for trial in range(1 if row == "exhaust" else args.trials):
            if row == "exhaust":
                res = [exhaust(60.0), exhaust(1.5)]
            elif row.startswith("legit-"):
                res = legit(row.split("-", 1)[1])
            else:
                res = flood() if row == "flood" else stop_bound()
            print(json.dumps({"row": row, "trial": trial, "result": res}, default=str), flush=True)
            runs.append(res)
        if row.startswith("legit-"):
            print(
                json.dumps(
                    {
                        "row": row,
                        "trials": len(runs),
                        "served": sum(r["served"] for r in runs),
                        "failed": sum(r["failed"] for r in runs),
                        "worst_served_s": max(r["worst_served_s"] for r in runs),
                        "bytes_damaged": sum(r["bytes_damaged"] for r in runs),
                        "connects": sum(r["flood"].get("connects", 0) for r in runs),
                    }
                ),
                flush=True,
            )
        elif row != "exhaust":
            held = [h for r in runs for h in r["held_s"] if h is not None]
            ttf = [t for r in runs for t in r["time_to_fail"]]
            print(
                json.dumps(
                    {
                        "row": row,
                        "trials": len(runs),
                        "time_to_fail_median": statistics.median(ttf),
                        "time_to_fail_max": max(ttf),
                        "held_median": statistics.median(held) if held else None,
                        "held_max": max(held) if held else None,
                        "bytes_damaged": sum(r["bytes_damaged"] for r in runs),
                        "reused_while_held": sum(r["reused_while_held"] for r in runs),
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
