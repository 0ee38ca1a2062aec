"""The NIXL adapter's fault matrix (docs/reliability.md), measured: each fault injected into real P and D
processes (or, for the side channel, against real servers in this process), every byte of D checked.

    .venv/bin/python bench/fault_matrix.py [--model demo|nemotron] [--trials 5] [--rows kill,stop-push,...]

Two P engines (``prefill`` takes the faults, ``backup`` serves meanwhile) and one D rank; P TP2 -> D TP1;
5 s timeouts. ``--model demo`` (default): the demo Mamba2 hybrid (P block 32 -> D block 64, kernel 16),
requests of 1,000 / 2,500 / 4,000 tokens. ``--model nemotron``: Nemotron-H 8B (P block 1040 kernel 16 ->
D block 2080, kernel 32 in pull and 16 in push), requests of 2,080 / 4,160 tokens. Every
byte is checked against kvgeom.testing's layout model, which costs about 9 bytes of memory per byte of
cache checked: that, not the adapter, bounds the request sizes here.

For each row: trials, outcome of the faulty attempts, time to fail (from the attempt's start to its typed
error), how long blocks stayed quarantined, and bytes damaged: bytes of D that differ from what the
oracle expects over the whole cache at the end (successful requests keep their blocks to the end, so a
late byte that landed in one is seen), plus, with ``--check-each``, in each request's blocks when it
completes.

Side-channel rows (byte drip, hostile payloads) use the attack payloads of
``tests/adapter/test_hostile.py`` (run from a checkout with the dev venv).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "adapters", ROOT / "tests" / "adapter"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from kvgeom_lab.cluster import run_cluster  # noqa: E402

from kvgeom.tools.scenario import Scenario  # noqa: E402

MODELS = {
    "nemotron": (
        {
            "model": "nemotron-h-8b",
            "mode": "pull",
            "compat": "kvgeom",
            "prefill": {"tp_size": 2, "block_size": 1040, "kernel_block_size": 16, "num_blocks": 64},
            "decode": {"tp_size": 1, "block_size": 2080, "kernel_block_size": 32, "num_blocks": 64},
        },
        {"kernel_block_size": 16},
        [2080, 4160],
    ),  # push needs P kernel blocks multiple of D's
    "demo": (None, {}, [1000, 2500, 4000]),
}
TOKENS: list[int] = []


def _scenario(args: argparse.Namespace, mode: str, reqs: list[dict]) -> dict:
    """The scenario with pools sized for every entry (successful requests keep their blocks to the end)."""
    base, push_decode, _ = MODELS[args.model]
    if base is None:
        from kvgeom_lab.demo import DEFAULT_SCENARIO

        base = DEFAULT_SCENARIO
    sc = dict(base, mode=mode)
    if mode == "push":
        sc["decode"] = dict(sc["decode"], **push_decode)
    s = Scenario.from_json(sc)
    from kvgeom_lab.cluster import _need

    d = sum(sum(_need(s, s.decode, r["tokens"])) for r in reqs)
    per = Counter()
    for r in reqs:
        per[r["engine"]] += sum(_need(s, s.prefill, r["tokens"]))
    sc["decode"] = dict(sc["decode"], num_blocks=int(d * 1.2) + 4)
    sc["prefill"] = dict(sc["prefill"], num_blocks=int(max(per.values()) * 1.2) + 4)
    from kvgeom import GeometryCard

    s = Scenario.from_json(sc)
    cache = sum(r.nbytes for r in GeometryCard("d", s.model, s.decode, mode).geometry.regions)
    if 10 * cache > args.max_oracle_gib * 2**30:  # the oracle holds ~9 bytes per byte of cache checked
        raise SystemExit(
            f"D's cache for this row is {cache / 2**20:.0f} MiB: checking it needs ~{10 * cache / 2**30:.1f} "
            f"GiB (--max-oracle-gib {args.max_oracle_gib}); use fewer --trials or smaller requests"
        )
    return sc


def _config(args: argparse.Namespace) -> dict:
    return {
        "handshake_timeout_s": args.timeout,
        "transfer_timeout_s": args.timeout,
        "notif_timeout_s": args.timeout,
        "secret": os.urandom(32).hex(),
    }


def _cluster(args: argparse.Namespace, mode: str, reqs: list[dict], faults: dict, **extra: Any) -> dict:
    spec = {
        "scenario": _scenario(args, mode, reqs),
        "requests": reqs,
        "prefill_engines": ["prefill", "backup"],
        "config": _config(args),
        "faults": faults,
        "push_deadline": False,
        "drain_s": 4 * args.timeout,
        "check_each": args.check_each,
        **extra,
    }
    t0 = time.monotonic()
    out = run_cluster(spec, timeout_s=60 + 12 * args.timeout * len(reqs))
    out["wall"] = time.monotonic() - t0
    for name, v in out["results"].items():
        if v.get("traceback"):  # a rank that raised (a killed one has no traceback)
            raise RuntimeError(f"{name}: {v['error']}\n{v['traceback']}")
    return out


def _victims(args: argparse.Namespace, gap_s: float, retries: list[str] | None = None) -> list[dict]:
    """Per trial: a victim request to ``prefill`` (the faulty engine), then a filler to ``backup`` that
    would get the victim's blocks if they were not quarantined, then the victim's retries."""
    reqs = []
    for i in range(args.trials):
        n = TOKENS[i % len(TOKENS)]
        reqs.append({"id": f"v{i}", "tokens": n, "engine": "prefill", "delay_s": gap_s if i else 0.0})
        reqs.append({"id": f"f{i}", "tokens": TOKENS[(i + 1) % len(TOKENS)], "engine": "backup"})
        for e in retries or []:
            reqs.append({"id": f"v{i}", "tokens": n, "engine": e})
    return reqs


def _summary(out: dict, faulty: set[tuple[str, int]], exclude: set[tuple[str, int]] = frozenset()) -> dict:
    """Outcome, time to fail and quarantine time of the faulty attempts; bytes damaged over the run
    (``exclude``: attempts that fail by design and are neither the row's subject nor 'others')."""
    att = {
        (a["request_id"], a["attempt"]): a
        for a in out["attempts"]
        if (a["request_id"], a["attempt"]) not in exclude
    }
    rows = [att[k] for k in sorted(faulty) if k in att]
    outcome = Counter(("ok" if a["ok"] else next(iter(a["errors"].values())).split(":")[0]) for a in rows)
    fail_s = [a["seconds"] for a in rows if not a["ok"]]
    held = [h for _, rid, at, h, _ in out["settled"] if (rid, at) in faulty]
    d = out["results"]["decode-0"]
    ok_elsewhere = sum(a["ok"] for k, a in att.items() if k not in faulty)
    return {
        "trials": len(rows),
        "outcome": dict(outcome),
        "fail_s": fail_s,
        "held_s": held,
        "damaged": d["bad_bytes"] + sum(a.get("bad_at_completion", 0) for a in att.values()),
        "damaged_outside": d["bad_outside"],
        "rejected_notices": d["stats"]["rejected_notices"],
        "bad_at_completion": sum(a.get("bad_at_completion", 0) for a in att.values()),
        "checked_bytes": d["checked_bytes"],
        "still_held": len(d["held"]),
        "others_ok": ok_elsewhere,
        "others": len(att) - len(rows),
        "stats": d["stats"],
        "wall": out["wall"],
    }


# ----------------------------------------------------------------------------------------- rows
def row_kill(args: argparse.Namespace) -> dict:
    """SIGKILL of every P rank of ``prefill`` right after a request; the next request to it fails typed."""
    runs = []
    for _ in range(args.trials):
        reqs = [
            {"id": "r0", "tokens": TOKENS[0], "engine": "prefill"},
            {"id": "v0", "tokens": TOKENS[1], "engine": "prefill"},
            {"id": "f0", "tokens": TOKENS[-1], "engine": "backup"},
        ]
        runs.append(
            _summary(
                _cluster(args, "pull", reqs, {"kill": {"engine": "prefill", "after": "r0"}}), {("v0", 1)}
            )
        )
    return _merge(runs)


def _merge(runs: list[dict]) -> dict:
    out = {
        "trials": 0,
        "outcome": Counter(),
        "fail_s": [],
        "held_s": [],
        "damaged": 0,
        "bad_at_completion": 0,
        "checked_bytes": 0,
        "still_held": 0,
        "others_ok": 0,
        "others": 0,
        "wall": 0.0,
        "damaged_outside": 0,
        "rejected_notices": 0,
    }
    for r in runs:
        for k in (
            "trials",
            "damaged",
            "bad_at_completion",
            "checked_bytes",
            "still_held",
            "others_ok",
            "others",
            "damaged_outside",
            "rejected_notices",
        ):
            out[k] += r[k]
        out["outcome"].update(r["outcome"])
        out["fail_s"] += r["fail_s"]
        out["held_s"] += r["held_s"]
        out["wall"] += r["wall"]
    out["outcome"] = dict(out["outcome"])
    return out


def row_stop_push(args: argparse.Namespace) -> dict:
    """``prefill`` SIGSTOPped before the victim's WRITE, continued past the timeout: the WRITE lands late."""
    s = args.timeout + 2.0
    reqs = _victims(args, gap_s=s - args.timeout + 1.0)
    out = _cluster(
        args,
        "push",
        reqs,
        {"stop": {"engine": "prefill", "at": [f"v{i}" for i in range(args.trials)], "seconds": s}},
    )
    return _summary(out, {(f"v{i}", 1) for i in range(args.trials)})


def row_stop_pull_tcp(args: argparse.Namespace) -> dict:
    """UCX over TCP; ``prefill`` SIGSTOPped while D's READ is in flight: it is kept from serving the READ
    for 0.5 s (alive, answering D's generation check), and stopped 0.2 s after D started the attempt."""
    s = args.timeout + 2.0
    reqs = _victims(args, gap_s=s - args.timeout + 1.0)
    victims = [f"v{i}" for i in range(args.trials)]
    faults = {
        "busy": {"engine": "prefill", "at": victims, "seconds": 0.5},
        "stop": {"engine": "prefill", "at": victims, "seconds": s, "when": "after_post", "delay_s": 0.2},
    }
    out = _cluster(args, "pull", reqs, faults, env={"UCX_TLS": "tcp"}, linger_s=s)
    return _summary(out, {(v, 1) for v in victims})


def row_busy_pull_tcp(args: argparse.Namespace) -> dict:
    """UCX over TCP; ``prefill`` rank 1 alive but not driving NIXL past the timeout: partial failure."""
    s = args.timeout + 2.0
    reqs = _victims(args, gap_s=s - args.timeout + 1.0)
    faults = {
        "busy": {"engine": "prefill", "rank": 1, "at": [f"v{i}" for i in range(args.trials)], "seconds": s}
    }
    out = _cluster(args, "pull", reqs, faults, env={"UCX_TLS": "tcp"}, linger_s=s)
    return _summary(out, {(f"v{i}", 1) for i in range(args.trials)})


def row_busy_push(args: argparse.Namespace) -> dict:
    """``prefill`` alive but not driving NIXL (its WRITE is posted late)."""
    s = args.timeout + 2.0
    reqs = _victims(args, gap_s=s - args.timeout + 1.0)
    out = _cluster(
        args,
        "push",
        reqs,
        {"busy": {"engine": "prefill", "at": [f"v{i}" for i in range(args.trials)], "seconds": s}},
    )
    return _summary(out, {(f"v{i}", 1) for i in range(args.trials)})


def row_tcp(args: argparse.Namespace) -> dict:
    """UCX over TCP, no fault: pull and push of every size (the transport itself)."""
    runs = []
    for mode in ("pull", "push"):
        reqs = [
            {"id": f"r{i}", "tokens": TOKENS[i % len(TOKENS)], "engine": ("prefill", "backup")[i % 2]}
            for i in range(args.trials)
        ]
        out = _cluster(args, mode, reqs, {}, env={"UCX_TLS": "tcp"})
        runs.append(_summary(out, {(r["id"], 1) for r in reqs}))
    return _merge(runs)


def row_retry_forged(args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """Push. Attempt 1 to a stopped ``prefill``, attempt 2 to a busy ``backup`` (the late notice of 1 and
    the rogue's forged notices arrive while 2 waits), attempt 3 to ``backup``."""
    t = args.timeout
    reqs = _victims(args, gap_s=3.0, retries=["backup", "backup"])
    victims = [f"v{i}" for i in range(args.trials)]
    faults = {
        "stop": {"engine": "prefill", "at": victims, "seconds": t + 1.5},
        "busy": {"engine": "backup", "at": victims, "attempt": 2, "seconds": t + 1.0},
        "rogue": {"at": victims, "attempt": 2},
    }
    out = _cluster(args, "push", reqs, faults)
    retry = _summary(out, {(v, 2) for v in victims}, exclude={(v, 1) for v in victims})
    forged = dict(retry, forged=out["results"]["rogue"]["forged"])
    rogue = out["results"]["rogue"]["sidechannel"]
    side = {
        "trials": len(rogue),
        "outcome": dict(Counter(x[4] for x in rogue)),
        "fail_s": [x[5] for x in rogue],
        "held_s": [],
        "damaged": 0,
        "damaged_outside": 0,
        "wall": 0.0,
    }
    return retry, forged, side


def row_lying_card(args: argparse.Namespace) -> tuple[dict, dict]:
    """``prefill`` serves a lying (sealed) payload; D must refuse it and ``backup`` serve the retry."""
    refused = []
    for what in ("num_blocks", "sizes", "unregistered", "overlap", "impersonate"):
        reqs = [
            {"id": "v0", "tokens": TOKENS[1], "engine": "prefill"},
            {"id": "v0", "tokens": TOKENS[1], "engine": "backup"},
        ]
        refused.append(
            _summary(_cluster(args, "pull", reqs, {"lie": {"engine": "prefill", "what": what}}), {("v0", 1)})
        )
    reqs = [
        {"id": f"v{i}", "tokens": TOKENS[i % len(TOKENS)], "engine": "prefill"} for i in range(args.trials)
    ]
    swap = _summary(
        _cluster(args, "pull", reqs, {"lie": {"engine": "prefill", "what": "swap"}}),
        {(r["id"], 1) for r in reqs},
    )
    return _merge(refused), swap


def row_byte_drip(args: argparse.Namespace) -> dict:
    """A peer answering one byte every 50 ms: a 1 s generation check and a 2 s fetch, ``--trials`` each."""
    from _inproc import AUTH
    from kvgeom_nixl import AdapterError, fetch, query_generation
    from kvgeom_nixl.sidechannel import _dumps
    from test_hostile import _Drip

    drip = _Drip(lambda req: _dumps({"nonce": req["nonce"], "ok": True, "generation": 1, "pad": "x" * 400}))
    times, outcome = [], Counter()
    try:
        for _ in range(args.trials):
            for fn in (
                lambda: query_generation("127.0.0.1", drip.port, timeout_s=1.0, auth=AUTH),
                lambda: fetch("127.0.0.1", drip.port, timeout_s=2.0, auth=AUTH),
            ):
                t0 = time.monotonic()
                try:
                    fn()
                    outcome["answered"] += 1
                except AdapterError as exc:
                    outcome[type(exc).__name__] += 1
                times.append(time.monotonic() - t0)
    finally:
        drip.close()
    return {
        "trials": 2 * args.trials,
        "outcome": dict(outcome),
        "fail_s": times,
        "held_s": [],
        "damaged": 0,
        "damaged_outside": 0,
        "wall": sum(times),
    }


def row_hostile(args: argparse.Namespace) -> dict:
    """Every hostile payload of the regression test against a D rank in this process."""
    from _inproc import CONFIG, Pump, ReplyServer, card, payload_reply
    from kvgeom_nixl import AdapterError
    from kvgeom_nixl.kvrank import KVRank
    from test_hostile import RAW_REPLIES, _hostile_payloads

    from kvgeom import KvgeomError

    p, d = KVRank(card("prefill"), CONFIG), KVRank(card("decode"), CONFIG)
    outcome, times = Counter(), []
    try:
        cases = {n: payload_reply(pl) for n, pl in _hostile_payloads(p.payload()).items()}
        cases.update(RAW_REPLIES)
        for reply in cases.values():
            with ReplyServer(reply) as srv:
                t0 = time.monotonic()
                try:
                    d.connect("prefill", {0: srv.port}, timeout_s=2.0)
                    outcome["accepted"] += 1
                except (AdapterError, KvgeomError) as exc:
                    outcome[type(exc).__name__] += 1
                except Exception as exc:  # noqa: BLE001 - counted, not hidden
                    outcome[f"UNTYPED {type(exc).__name__}"] += 1
                times.append(time.monotonic() - t0)
        with Pump(p):
            d.connect("prefill", {0: p.port})
            survived = d.pull("prefill", [[1]], [[2]], "after", "after", num_tokens=10).ok
    finally:
        d.close()
        p.close()
    return {
        "trials": len(times),
        "outcome": dict(outcome),
        "fail_s": times,
        "held_s": [],
        "damaged": 0,
        "damaged_outside": 0,
        "wall": sum(times),
        "survived": survived,
    }


ROWS = [
    "kill",
    "stop-push",
    "stop-pull-tcp",
    "busy-pull-tcp",
    "busy-push",
    "tcp",
    "retry",
    "byte-drip",
    "hostile",
    "lying-card",
]


def run(args: argparse.Namespace) -> dict:
    want = args.rows.split(",") if args.rows else ROWS
    res: dict[str, dict] = {}
    for name in want:
        t0 = time.monotonic()
        print(f"-- {name} ...", file=sys.stderr, flush=True)
        if name == "kill":
            res["kill (SIGKILL of P after a request)"] = row_kill(args)
        elif name == "stop-push":
            res["stop past the timeout, then continue (push, CMA)"] = row_stop_push(args)
        elif name == "stop-pull-tcp":
            res["stop past the timeout, then continue (pull, UCX over TCP)"] = row_stop_pull_tcp(args)
        elif name == "busy-pull-tcp":
            res["busy peer, one of two READs late (pull, TCP)"] = row_busy_pull_tcp(args)
        elif name == "busy-push":
            res["busy peer (push, CMA)"] = row_busy_push(args)
        elif name == "tcp":
            res["TCP transport, no fault (pull and push)"] = row_tcp(args)
        elif name == "retry":
            retry, forged, side = row_retry_forged(args)
            res["retry: attempt 2 waits while attempt 1's notice arrives late"] = retry
            res["forged notifications (rogue with leaked metadata, no secret)"] = forged
            res["rogue process on the side channel (no or wrong secret)"] = side
        elif name == "byte-drip":
            res["byte drip (1 byte / 50 ms) against a 1 s / 2 s deadline"] = row_byte_drip(args)
        elif name == "hostile":
            res["hostile handshake payloads"] = row_hostile(args)
        elif name == "lying-card":
            refused, swap = row_lying_card(args)
            res["lying card: num_blocks 2**26, sizes, unregistered, overlapping, impersonation"] = refused
            res["lying card: two equal-size regions swapped (insider)"] = swap
        else:
            raise SystemExit(f"unknown row {name!r}; rows: {', '.join(ROWS)}")
        print(f"   {time.monotonic() - t0:.0f} s\n{table(res)}", file=sys.stderr, flush=True)  # so far
    return res


def _fmt_s(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} (max {max(xs):.2f})"


def table(res: dict) -> str:
    lines = [
        "| fault | trials | outcome of the faulty attempts | time to fail, s: median (max) | quarantined, s | "
        "other requests ok | bytes damaged |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in res.items():
        outcome = ", ".join(f"{k} {v}" for k, v in sorted(r["outcome"].items()))
        others = f"{r['others_ok']}/{r['others']}" if r.get("others") else "-"
        damaged = f"{r['damaged']}" + (
            f" ({r['damaged_outside']} outside the requests)" if r["damaged"] else ""
        )
        lines.append(
            f"| {name} | {r['trials']} | {outcome} | {_fmt_s(r['fail_s'])} | {_fmt_s(r['held_s'])} | "
            f"{others} | {damaged} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=5.0, help="handshake / transfer / notification timeout")
    ap.add_argument("--rows", help=f"comma-separated subset of {','.join(ROWS)}")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument(
        "--max-oracle-gib", type=float, default=6.0, help="refuse rows whose byte check needs more"
    )
    ap.add_argument(
        "--check-each",
        action="store_true",
        help="also check each request's bytes when it completes "
        "(a full-cache oracle image per request: slow on Nemotron-H)",
    )
    args = ap.parse_args(argv)
    TOKENS[:] = MODELS[args.model][2]
    res = run(args)
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
