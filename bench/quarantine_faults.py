"""Issue 22's rows of the fault matrix (docs/reliability.md), measured with real P and D processes:

    .venv/bin/python bench/quarantine_faults.py [--trials 3] [--rows flood,stop-bound,exhaust]

* ``flood``: push; ``prefill`` busy past the 2.5 s timeout (alive, its side channel answering) while a
  process without the secret holds 40 connections to each of its side channels (the server closes the
  surplus at accept: D's probes read a reset or an EOF). r2 (``backup``) is served meanwhile.
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
from kvgeom_lab.demo import DEFAULT_SCENARIO  # noqa: E402

T = 2.5
CONFIG = {
    "handshake_timeout_s": 3.0,
    "transfer_timeout_s": T,
    "notif_timeout_s": T,
    "secret": "quarantine-bench-secret-0123456789",
}


def _spec(requests: list[dict], faults: dict, **extra) -> dict:
    return {
        "scenario": dict(DEFAULT_SCENARIO, mode="push"),
        "requests": requests,
        "prefill_engines": ["prefill", "backup"],
        "config": dict(CONFIG, **extra.pop("config", {})),
        "drain_s": extra.pop("drain_s", 10.0),
        "push_deadline": False,
        "faults": faults,
        **extra,
    }


def _rows(out: dict, faulty: set[tuple[str, int]], during: set[tuple[str, int]]) -> dict:
    """The row's numbers; ``during``: the attempts handed blocks while the faulty ones were held."""
    d = out["results"]["decode-0"]
    a = {(x["request_id"], x["attempt"]): x for x in out["attempts"]}
    settled = {(r, n): (held, cleared) for _, r, n, held, cleared in out["settled"]}
    ids = {k: {b for g in v.get("ids", []) for b in g} for k, v in a.items()}
    ok = [k for k, v in a.items() if v["ok"]]
    return {
        "outcome": [a[k]["errors"][0].split(":")[0] if not a[k]["ok"] else "ok" for k in sorted(faulty)],
        "time_to_fail": [a[k]["seconds"] for k in sorted(faulty)],
        "held_s": [settled.get(k, (None,))[0] for k in sorted(faulty)],
        "cleared_by": [settled.get(k, (None, None))[1] for k in sorted(faulty)],
        "blocks_held": [len(ids[k]) for k in sorted(faulty)],
        "reused_while_held": sum(len(ids[k] & ids[o]) for k in faulty for o in during),
        "bytes_damaged": d["bad_bytes"],
        "mismatches": len(d["mismatches"]),
        "others_ok": f"{sum(1 for k in ok if k not in faulty)}/{sum(1 for k in a if k not in faulty)}",
        "retired": [(x[1], x[2], round(x[3], 2)) for x in out["retired"]],
        "stats": {k: d["stats"][k] for k in ("probes_unknown", "retired", "retired_blocks")},
    }


def flood() -> dict:
    reqs = [
        {"id": "r0", "tokens": 300, "engine": "prefill"},
        {"id": "r1", "tokens": 900, "engine": "prefill"},
        {"id": "r2", "tokens": 900, "engine": "backup"},
        {"id": "r3", "tokens": 300, "engine": "backup", "delay_s": 5.0},
    ]
    faults = {
        "busy": {"engine": "prefill", "at": "r1", "seconds": T + 3.0},
        "flood": {
            "engine": "prefill",
            "at": "r1",
            "seconds": T + 6.0,
            "connections": 40,
            "max_connects": 60000,
        },
    }
    out = run_cluster(_spec(reqs, faults, linger_s=2.0), timeout_s=150)
    return _rows(out, {("r1", 1)}, {("r2", 1)}) | {"flood": out["results"]["flood"]}


def stop_bound() -> dict:
    reqs = [
        {"id": "r0", "tokens": 300, "engine": "prefill"},
        {"id": "r1", "tokens": 900, "engine": "prefill"},
        {"id": "r2", "tokens": 900, "engine": "backup", "delay_s": 2.5},
        {"id": "r3", "tokens": 900, "engine": "backup", "delay_s": 6.0},
    ]
    faults = {"stop": {"engine": "prefill", "at": "r1", "seconds": T + 5.5}}
    out = run_cluster(_spec(reqs, faults, config={"quarantine_bound_s": 1.5}, linger_s=2.0), timeout_s=150)
    return _rows(out, {("r1", 1)}, {("r2", 1)})


def exhaust(bound: float) -> dict:
    reqs = [{"id": "f", "tokens": 2700, "engine": "prefill"}] * 7  # attempts 1..7 of one request
    reqs.append({"id": "b1", "tokens": 300, "engine": "backup"})
    faults = {"stop": {"engine": "prefill", "at": "f", "seconds": 60.0}}
    spec = _spec(reqs, faults, config={"quarantine_bound_s": bound}, drain_s=1.0)
    out = run_cluster(spec, timeout_s=240)
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
    ap.add_argument("--rows", default="flood,stop-bound,exhaust")
    args = ap.parse_args()
    rows = args.rows.split(",")
    for row in rows:
        runs = []
        for trial in range(1 if row == "exhaust" else args.trials):
            if row == "exhaust":
                res = [exhaust(60.0), exhaust(1.5)]
            else:
                res = flood() if row == "flood" else stop_bound()
            print(json.dumps({"row": row, "trial": trial, "result": res}, default=str), flush=True)
            runs.append(res)
        if row != "exhaust":
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
