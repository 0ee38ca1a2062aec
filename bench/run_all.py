"""``make bench``: run every benchmark, then write docs/performance.md (tables, the machine, plots).

Runs, each in a subprocess with a time bound (the whole run stays under 10 minutes on 2 cores):

* ``bench_vs_vllm.py`` in the vLLM venv (``.venv-vllm``, built by ``make test-vllm``; skipped with a note
  when it is missing): kvgeom against vLLM 0.33.0's own per-request functions and handshake;
* ``bench_zero.py``: the adapter's zeroing against a memset;
* ``bench_pull.py``: NIXL pull throughput against ``process_vm_readv`` and memcpy;
* ``bench_plan.py``: planning cost per descriptor against numpy's floor and NIXL's ``make_prepped_xfer``.

Plots (matplotlib, the ``plot`` extra; skipped with a note without it) go to docs/img/perf-*.png.
Run: ``.venv/bin/python bench/run_all.py [--quick] [--out docs/performance.md]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(
            next(
                x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")
            ).split()[1]
        )
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{os.cpu_count()} cores ({model}){mem}, Python {platform.python_version()}, {platform.system()}"


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[str, float, str | None]:
    """stdout, seconds, and an error line (None when it ran)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
    except subprocess.TimeoutExpired:
        return "", time.perf_counter() - t0, f"timed out after {timeout:.0f} s"
    dt = time.perf_counter() - t0
    if p.returncode:
        return (
            p.stdout,
            dt,
            f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}",
        )
    return p.stdout, dt, None


def last_json(out: str) -> Any:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def plots(vs: dict | None, zero: dict | None, pull: dict | None, img: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    if vs:
        fig, ax = plt.subplots(figsize=(6, 4))
        t = [r["tokens"] for r in vs["requests"]]
        ax.loglog(t, [r["vllm_us"] for r in vs["requests"]], "o-", label="vLLM 0.33.0 per-request path")
        ax.loglog(
            t, [r["kvgeom_new_us"] for r in vs["requests"]], "s-", label="kvgeom plan_request, new shape"
        )
        ax.loglog(
            t, [r["kvgeom_us"] for r in vs["requests"]], "^-", label="kvgeom plan_request, repeated shape"
        )
        ax.loglog(
            t, [0.5 * r["vllm_us"] for r in vs["requests"]], ":", color="gray", label="target: 0.5 x vLLM"
        )
        ax.set_xlabel("request tokens")
        ax.set_ylabel("microseconds per request")
        ax.set_title("Per-request planning cost")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(img / "perf-request.png", dpi=110)
        made.append("perf-request.png")
        handshake_plot(vs["handshakes"], img)
        made.append("perf-handshake.png")
    bars = []
    if zero:
        bars += [(c["case"], c["kvgeom_gbps"], c["memset_gbps"]) for c in zero["cases"]]
    if pull:
        bars.append(("NIXL pull", pull["nixl_gbps"], pull["limit_gbps"]))
    if bars:
        fig, ax = plt.subplots(figsize=(6, 4))
        x = range(len(bars))
        ax.bar([i - 0.2 for i in x], [b[1] for b in bars], 0.4, label="kvgeom / NIXL")
        ax.bar([i + 0.2 for i in x], [b[2] for b in bars], 0.4, label="limit (memset / process_vm_readv)")
        ax.set_xticks(list(x), [b[0] for b in bars], fontsize=8)
        ax.set_ylabel("GB/s")
        ax.set_title("Throughput against its limit")
        ax.legend()
        fig.tight_layout()
        fig.savefig(img / "perf-throughput.png", dpi=110)
        made.append("perf-throughput.png")
    return made


def handshake_plot(hs: list[dict[str, Any]], img: Path) -> None:
    """``img/perf-handshake.png``: the handshake grid, one vLLM and one kvgeom line per P rank count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for n in sorted({h["remotes"] for h in hs}):
        cells = [h for h in hs if h["remotes"] == n]
        b = [h["blocks"] for h in cells]
        (line,) = ax.loglog(b, [h["vllm_ms"] for h in cells], "o-", label=f"vLLM add_remote_agent, {n} P")
        ax.loglog(
            b,
            [h["kvgeom_ms"] for h in cells],
            "s--",
            color=line.get_color(),
            label=f"kvgeom parse + pair, {n} P",
        )
    ax.set_xlabel("kernel blocks per D rank")
    ax.set_ylabel("milliseconds per handshake")
    ax.set_title("Handshake cost")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(img / "perf-handshake.png", dpi=110)
    plt.close(fig)


def stream_section(vs: dict) -> list[str]:
    """The new-length streams of ``bench_vs_vllm.py`` (empty when it ran without them)."""
    rows = vs.get("stream") or []
    if not rows:
        return []
    L = [
        "New lengths (issue 19, target 1): streams of requests whose lengths never repeat, a realistic mix",
        "(log-normal around 2k tokens, 16 to 1M) and each decade alone (log-uniform), in both compat modes.",
        "Every kvgeom call plans a shape it has never seen: its per-shape memo is cleared before each timed",
        "call, so no recipe helps. Checked first, per request: vllm mode's descriptor ids equal vLLM's;",
        "kvgeom mode moves the same bytes (`RequestPlan.moves`, sorted) and zero rows as vLLM's ids. Per",
        "request the median of interleaved calls; the table gives the mean over the stream. *floor*: the",
        "numpy calls this pair's plan cannot avoid (`Floor` in the script: both sides' ids checked by one",
        "sort each, the expansions, one broadcast per run of a group's segments, the zero rows), written",
        "straight for this one pair with every pairing lookup done ahead, checked to build the plan's arrays.",
        "",
        "| stream | mode | requests | median tokens | vLLM µs | kvgeom µs | kvgeom ÷ vLLM | floor µs | floor ÷ vLLM | kvgeom ÷ floor |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    L += [
        f"| {r['stream']} | {r['compat']} | {r['requests']} | {r['median_tokens']:,} | {r['vllm_us']:.0f} | "
        f"{r['kvgeom_us']:.0f} | {r['ratio']:.2f} | {r['floor_us']:.0f} | {r['floor_ratio']:.2f} | {r['vs_floor']:.2f} |"
        for r in rows
    ]
    return L + [""]


def handshake_section(hs: list[dict[str, Any]]) -> list[str]:
    """The handshake grid of ``bench_vs_vllm.py`` (pool sizes x P ranks) as a table."""
    L = [
        "Handshake: vLLM's `add_remote_agent` for every P rank the D rank reads (a fresh worker each time)",
        "against kvgeom's `GeometryCard.from_json_many` of those ranks' cards (decoded JSON objects, as vLLM's",
        "metadata arrives decoded) and `Pairing.create` with every table it builds and bounds-checks; the",
        "timed pairing's tables checked to stand for the descriptors vLLM prepared. Least of repeated",
        "handshakes per side; *parse*: kvgeom's card parse alone (included in kvgeom ms).",
        "",
        "| P ranks | kernel blocks per D rank | vLLM ms | kvgeom ms | of which parse | kvgeom ÷ vLLM | | kvgeom table runs | descriptors they stand for | table bytes |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    L += [
        f"| {h['remotes']} | {h['blocks']:,} | {h['vllm_ms']:.2f} | {h['kvgeom_ms']:.2f} | {h['parse_ms']:.2f} | "
        f"{h['ratio']:.2f} | {'met' if h['ratio'] <= 1 else 'missed'} | {h['table_runs']} | "
        f"{h['table_descriptors']:,} | {h['table_bytes']:,} |"
        for h in hs
    ]
    return L


def handshake_target(hs: list[dict[str, Any]]) -> tuple[str, str, str]:
    """The targets row of the handshake grid: met in every cell or not, and where."""
    missed = [h for h in hs if h["ratio"] > 1]
    worst = max(hs, key=lambda h: h["ratio"])
    best = min(hs, key=lambda h: h["ratio"])
    blocks = sorted({h["blocks"] for h in hs})
    ranks = sorted({h["remotes"] for h in hs})
    where = ", ".join(f"{h['remotes']} P / {h['blocks']:,} blocks {h['ratio']:.2f}x" for h in missed)
    return (
        f"handshake (card parse + pairing) <= 1x vLLM's `add_remote_agent`, {blocks[0]:,}-{blocks[-1]:,} "
        f"kernel blocks per D rank, {ranks[0]}-{ranks[-1]} P ranks",
        f"{len(hs) - len(missed)} of {len(hs)} cells met; {best['ratio']:.3f}x at best ({best['remotes']} P, "
        f"{best['blocks']:,} blocks), {worst['ratio']:.2f}x at worst ({worst['remotes']} P, {worst['blocks']:,})"
        + (f"; missed: {where}" if missed else ""),
        "met" if not missed else "missed",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "performance.md"))
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    args = ap.parse_args()
    py = sys.executable
    vpy = ROOT / ".venv-vllm" / "bin" / "python"
    notes, took = [], {}
    vs = zero = pull = None
    if vpy.exists():
        cmd = [str(vpy), "bench/bench_vs_vllm.py", "--json", "--budget", "0.05" if args.quick else "1.0"]
        if args.quick:
            cmd += [
                "--tokens",
                "16",
                "4096",
                "--blocks",
                "64",
                "1000",
                "--remotes",
                "1",
                "8",
                "--stream",
                "20",
                "--per-decade",
                "4",
            ]
        out, took["bench_vs_vllm"], err = run(cmd, 480, {"PYTHONPATH": f"{ROOT}:{ROOT / 'adapters'}"})
        vs = None if err else last_json(out)
        if err:
            notes.append(f"bench_vs_vllm.py: {err}")
    else:
        notes.append("bench_vs_vllm.py: not run (no .venv-vllm; `make test-vllm` builds it)")
    out, took["bench_zero"], err = run(
        [py, "bench/bench_zero.py", "--json"] + (["--quick"] if args.quick else []), 300
    )
    zero = None if err else last_json(out)
    if err:
        notes.append(f"bench_zero.py: {err}")
    pull_json = ROOT / "build" / "bench_pull.json"
    pull_json.parent.mkdir(exist_ok=True)
    out, took["bench_pull"], err = run(
        [py, "bench/bench_pull.py", "--json", str(pull_json)]
        + (["--tokens", "2048", "--reps", "3"] if args.quick else []),
        300,
    )
    pull_text = "\n".join(x for x in out.splitlines() if " NIXL INFO " not in x)
    if err:
        notes.append(f"bench_pull.py: {err}")
    else:
        pull = _pull_summary(json.loads(pull_json.read_text()))
    descs_json = ROOT / "build" / "bench_descs.json"
    out, took["bench_descs"], err = run(
        [py, "bench/bench_descs.py", "--ids", "shuffled", "--json", str(descs_json)]
        + (["--tokens", "1024", "16384", "--reps", "2"] if args.quick else ["--reps", "3"]),
        300,
    )
    descs_text = "\n".join(x for x in out.splitlines() if " NIXL INFO " not in x)
    descs = None
    if err:
        notes.append(f"bench_descs.py: {err}")
    else:
        descs = json.loads(descs_json.read_text())["results"]
    e2e = run_e2e_vllm(vpy, args.quick, notes, took)
    out, took["bench_plan"], err = run(
        [py, "bench/bench_plan.py"] + (["--tokens", "4096"] if args.quick else []), 120
    )
    plan_text = out if not err else f"(failed: {err})"
    img = ROOT / "docs" / "img"
    img.mkdir(parents=True, exist_ok=True)
    made = plots(vs, zero, pull, img)
    if not made:
        notes.append("plots: not made (matplotlib missing: install the `plot` extra)")
    Path(args.out).write_text(
        render(
            vs,
            zero,
            pull,
            pull_text,
            plan_text,
            made,
            notes,
            took,
            descs=descs,
            descs_text=descs_text,
            e2e=e2e,
        )
    )
    print(f"wrote {args.out} ({sum(took.values()):.0f} s of benchmarks)")


def _pull_summary(res: dict) -> dict:
    """NIXL / process_vm_readv on the same moves, and the descriptor counts, from bench_pull.py's JSON."""
    d = res["results"]["decode"]
    n, pvr, q = d["nixl"], d["pvr"], d["request"]
    return {
        "nixl_gbps": n["gbps"],
        "limit_gbps": pvr["gbps"],
        "ratio": n["gbps"] / pvr["gbps"],
        "pairs": q["descriptor_pairs"],
        "posted": n["desc_count"],
        "runs": q["contiguous_runs"],
    }


def render(
    vs: dict | None,
    zero: dict | None,
    pull: dict | None,
    pull_text: str,
    plan_text: str,
    made: list[str],
    notes: list[str],
    took: dict[str, float],
    descs: dict | None = None,
    descs_text: str = "",
    e2e: list[str] | None = None,
) -> str:
    L = [
        "# Performance",
        "",
        "Written by `make bench` (`bench/run_all.py`); every number is a ratio against something measured in",
        "the same run, on the machine below. Rerun `make bench` to refresh it.",
        "",
        f"Machine: {machine()}.",
        "",
        "Benchmark wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()) + ".",
        "",
    ]
    if vs:
        L += [
            "## kvgeom against vLLM 0.33.0 (`bench/bench_vs_vllm.py`)",
            "",
            f"Pair: {vs['pair']}.",
            "",
            "Per request: vLLM's `_logical_to_kernel_block_ids`, `_map_block_ids_for_block_size_ratio`,",
            "`_apply_prefix_caching` and `_compute_desc_ids`, chained per source rank as `_read_blocks` does,",
            "against kvgeom's `plan_request` (which also derives the post-receive zero ranges and checks the",
            "pairing by tokens). Descriptor ids are checked equal to vLLM's before timing.",
            "",
        ]
        L += stream_section(vs)
        L += [
            "kvgeom is timed twice: on a request shape it has never seen (the general planner) and on a",
            "repeated shape (its recipe, `kvgeom.plan.recipe`); the recipe's plan is checked equal to the general",
            "planner's first.",
            "",
            "| tokens | descriptor pairs | contiguous runs | vLLM µs | kvgeom µs, new shape | ÷ vLLM | kvgeom µs, repeated shape | ÷ vLLM |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        L += [
            f"| {r['tokens']:,} | {r['pairs']:,} | {r['runs']:,} | {r['vllm_us']:.0f} | {r['kvgeom_new_us']:.0f} | "
            f"{r['ratio_new']:.2f} | {r['kvgeom_us']:.0f} | {r['ratio']:.2f} |"
            for r in vs["requests"]
        ]
        L += [""] + handshake_section(vs["handshakes"])
        L += [""]
        for name in ("perf-request.png", "perf-handshake.png"):
            if name in made:
                L += [f"![{name}](img/{name})", ""]
    if zero:
        L += zero_section(zero)
    if pull or pull_text:
        L += ["## NIXL pull throughput (`bench/bench_pull.py`)", ""]
        if pull:
            L += [
                f"NIXL {pull['nixl_gbps']:.2f} GB/s against `process_vm_readv` {pull['limit_gbps']:.2f} GB/s on the same",
                f"moves: **{pull['ratio']:.2f}×**. Descriptors: {pull['pairs']:,} plan pairs, {pull['posted']:,} posted",
                f"by NIXL (after its merging), {pull['runs']:,} contiguous runs (the fewest possible).",
                "",
            ]
        L += ["```", pull_text.strip(), "```", ""]
    if "perf-throughput.png" in made:
        L += ["![perf-throughput.png](img/perf-throughput.png)", ""]
    if descs:
        L += [
            "## Descriptors posted per request, kvgeom mode (`bench/bench_descs.py`)",
            "",
            "Each request is posted three ways (`TransportConfig.kvgeom_post`), the paths interleaved in one run:",
            "`initialize` (the default: one descriptor per maximal run contiguous on both sides, per-request",
            "lists through NIXL's `initialize_xfer`), `prep` (the same runs as per-request prepared lists) and",
            "`ids` (the plan's ids into the handshake's prepared tables). *posted*: NIXL's count after its own",
            "merging (telemetry); *contiguous runs*: `contiguous_runs` of the plan's moves, the fewest possible.",
            "Pull: D's `KVRank.pull`; push: P's `KVRank.push`; every byte checked first.",
            "",
        ]
        L += [x for x in descs_text.splitlines() if x.startswith(("|", "scenario", "wall"))] + [""]
    L += e2e or []
    L += ["## Planning cost per descriptor (`bench/bench_plan.py`)", "", "```", plan_text.strip(), "```", ""]
    L += targets(vs, zero, pull, descs)
    L += FINDINGS.splitlines() + [""]
    if notes:
        L += ["## Notes", ""] + [f"* {n}" for n in notes] + [""]
    return "\n".join(L)


def run_e2e_vllm(vpy: Path, quick: bool, notes: list[str], took: dict[str, float]) -> list[str]:
    """``bench_e2e_vllm.py`` in the vLLM venv, pull then push (kvgeom's KVRank against vLLM's own workers, each
    with a real NIXL agent): docs/performance.md's end-to-end section (empty, with a note, when it did not run)."""
    if not vpy.exists():
        notes.append("bench_e2e_vllm.py: not run (no .venv-vllm; `make test-vllm` builds it)")
        return []
    rows: list[str] = []
    for op in ("pull", "push"):
        path = ROOT / "build" / f"bench_e2e_vllm_{op}.json"
        path.parent.mkdir(exist_ok=True)
        out, took[f"bench_e2e_vllm {op}"], err = run(
            [str(vpy), "bench/bench_e2e_vllm.py", "--op", op, "--json", str(path)]
            + (["--tokens", "1024", "16384", "--reps", "2"] if quick else ["--reps", "5"]),
            480,
            {"PYTHONPATH": f"{ROOT}:{ROOT / 'adapters'}"},
        )
        if err:
            notes.append(f"bench_e2e_vllm.py --op {op}: {err}")
            continue
        table = [x for x in out.splitlines() if x.startswith("|")]
        if not rows:  # the conditions line and the table head once
            rows += [x for x in out.splitlines() if x.startswith("opt-125m")] + [""] + table[:2]
        rows += table[2:]
    if not rows:
        return []
    return [
        "## End to end through real NIXL against vLLM 0.33.0 (`bench/bench_e2e_vllm.py`)",
        "",
        "One request per length. Pull, timed on D: vLLM's own `NixlPullConnectorWorker`",
        "(`_read_blocks_for_req`, then `get_finished` polled until the request is received) against kvgeom's",
        "`KVRank.pull` in kvgeom mode (plan, the peer's freshness check, merged runs posted, completion, the",
        "post-receive step, done notices). Push, timed on P: vLLM's `NixlPushConnectorWorker._xfer_blocks_for_req`",
        "(what its writer thread runs once D registered the request), then `get_finished` until the request is",
        "sent, against `KVRank.push`. Each side has its own NIXL agent on the same geometry and the same P bytes;",
        "every byte of both D caches is checked (equal to P's on the request's blocks, and to each other) before",
        "timing. *vLLM pairs*: the descriptor pairs vLLM posted; *kvgeom posted*: the runs kvgeom posted (the",
        "fewest, `contiguous_runs`); *freshness*: kvgeom's generation check; *post to done*: kvgeom's post and",
        "completion.",
        "",
        *rows,
        "",
    ]


def zero_section(zero: dict) -> list[str]:
    """docs/performance.md's zeroing section from ``bench_zero.py --json``."""
    L = ["## Zeroing (`bench/bench_zero.py`)", "", "Pairs (D rank 0, CPU tensors, shuffled block ids):", ""]
    L += [f"* {p}" for p in zero["pairs"]]
    L += [
        "",
        "Ratios are speeds against libc `memset` of one contiguous buffer of the same bytes, timed in the same",
        "run, interleaved (least of the reps). *floor*: the faster of one `memset` per row and one per maximal",
        "contiguous byte range found ahead of time; *vs floor* = floor time / kvgeom time. A case meets the",
        f"target at ratio >= {zero['target']}, or, where the floor itself is below it, within 1.2x of the floor.",
        "",
        "| case | rows | runs | MiB | kvgeom GB/s | memset GB/s | kvgeom ÷ memset | floor ÷ memset | vs floor | |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    L += [
        f"| {c['case']} | {c['rows']:,} | {c['runs']:,} | {c['bytes'] / 2**20:.2f} | {c['kvgeom_gbps']:.1f} | "
        f"{c['memset_gbps']:.1f} | {c['ratio']:.2f} | {c['floor_ratio']:.2f} | {c['vs_floor']:.2f} | "
        f"{'met' if c['meets'] else 'missed'} |"
        for c in zero["cases"]
    ]
    return L + [""]


def targets(vs: dict | None, zero: dict | None, pull: dict | None, descs: dict | None = None) -> list[str]:
    """The issue's targets against this run's numbers."""
    rows = []
    if vs:
        req = vs["requests"]
        worst_new = max(req, key=lambda r: r["ratio_new"])
        worst_rep = max(req, key=lambda r: r["ratio"])
        span = f"{req[0]['tokens']:,}-{req[-1]['tokens']:,} tokens"
        rows.append(
            (
                "`plan_request` <= 0.5x vLLM's per-request path, " + span + ", repeated request shape",
                f"at most {worst_rep['ratio']:.2f}x ({worst_rep['tokens']:,} tokens)",
                "met" if worst_rep["ratio"] <= 0.5 else "missed",
            )
        )
        met_from = next(
            (
                r["tokens"]
                for r in req
                if all(x["ratio_new"] <= 0.5 for x in req if x["tokens"] >= r["tokens"])
            ),
            None,
        )
        rows.append(
            (
                "the same, a request shape never seen before (the general planner)",
                f"at most {worst_new['ratio_new']:.2f}x ({worst_new['tokens']:,} tokens); "
                + (f"<= 0.5x from {met_from:,} tokens" if met_from else "above 0.5x at every size"),
                "met"
                if worst_new["ratio_new"] <= 0.5
                else "missed below " + (f"{met_from:,} tokens" if met_from else "every size"),
            )
        )
        rows.append(handshake_target(vs["handshakes"]))
        hs = vs["handshakes"]
        per_n = {
            n: {h["table_runs"] for h in hs if h["remotes"] == n} for n in sorted({h["remotes"] for h in hs})
        }
        rows.append(
            (
                "table memory linear in regions, not blocks",
                "; ".join(f"{n} P: {sorted(r)} runs" for n, r in per_n.items())
                + f" ({max(h['table_bytes'] for h in hs):,} B at most) for "
                f"{min(h['table_descriptors'] for h in hs):,}-{max(h['table_descriptors'] for h in hs):,} descriptors",
                "met" if all(len(r) == 1 for r in per_n.values()) else "missed",
            )
        )
        rows.append(
            ("descriptors per request <= vLLM's", "equal to vLLM's (ids checked equal) in vLLM mode", "met")
        )

    if zero:
        for kind in ("failure", "post-receive"):
            cases = [c for c in zero["cases"] if c["kind"] == kind]
            met = [c for c in cases if c["ratio"] >= zero["target"]]
            near = [c for c in cases if c["meets"] and c not in met]
            missed = [c for c in cases if not c["meets"]]
            rows.append(
                (
                    f"{kind} zeroing >= 0.5x memset speed (else within 1.2x of the floor)",
                    f"{len(met)} of {len(cases)} at >= 0.5x; {len(near)} within 1.2x of a floor below 0.5x"
                    + (
                        "; missed: "
                        + ", ".join(
                            f"{c['case']} {c['ratio']:.2f}x, {c['vs_floor']:.2f} of floor" for c in missed
                        )
                        if missed
                        else ""
                    ),
                    "met" if not missed else "missed",
                )
            )
    if pull:
        rows.append(
            (
                "NIXL pull >= 0.69x `process_vm_readv` (bench_pull default)",
                f"{pull['ratio']:.2f}x",
                "met" if pull["ratio"] >= 0.69 else "missed",
            )
        )
    if descs:
        cells = [(op, n, r) for op in ("pull", "push") for n, r in descs[op].items()]
        exact = all(r["initialize"]["posted"] == r["runs"] for _, _, r in cells)
        worst = max(r["initialize"]["median_s"] / r["ids"]["median_s"] for _, _, r in cells)
        rows.append(
            (
                "descriptors per request = the minimal contiguous runs (kvgeom mode)",
                "posted / runs / plan pairs: "
                + ", ".join(
                    f"{op} {int(n):,} tok {r['initialize']['posted']:,}/{r['runs']:,}/{r['ids']['pairs']:,}"
                    for op, n, r in cells
                )
                + f"; end to end at most {worst:.2f}x the prepared tables' ids",
                "met" if exact else "missed",
            )
        )
    if not rows:
        return []
    return (
        ["## Targets", "", "| target | measured (this run) | |", "| --- | --- | --- |"]
        + [f"| {a} | {b} | {c} |" for a, b, c in rows]
        + [""]
    )


FINDINGS = """## What the profiles showed, and the gaps

Profiled with pyinstrument and cProfile (the numbers below are from the Kimi-Linear pair of
`bench_vs_vllm.py`).

* **Handshake.** `Pairing.create` expanded every table to one row per descriptor and checked every row:
  1.0 s for 2,000 logical blocks per rank (1.7 million rows), 49 s at 35,000. Tables are now kept as
  strided runs (`Dlist.runs`, NIXL's N x 5 form), split per source rank and bounds-checked per run, and
  bound to NIXL as N x 5 lists (`Dlist.bind_strided`, checked against real NIXL 1.5.1 by the adapter's
  byte-verified transfer tests and `bench_pull.py`); the expanded rows exist only where a caller asks
  (`Dlist.rows`, the oracle). Cost and memory no longer depend on blocks: 140 runs here, whatever the
  pool. The model-equality check converted both models to JSON on every handshake (7 ms); equal values
  now skip it, and vLLM's registration order is kept on the geometry value. What remains (~0.6 ms) is
  Python-level work per region and per remote rank (stream pairing, TP mapping, route checks): it is why
  small pools (a few hundred blocks) are still ~1.5-2x vLLM's `add_remote_agent`, whose cost grows with
  the pool instead (vLLM expands its split tables per block: 0.3 ms at 120 blocks, ~430 ms at 100k).
* **Per request.** The general planner spent its time in per-call overhead, not per descriptor: the same
  ids validated four times (`as_group_ids` in every helper), group pages rebuilt per request, a Python
  loop over pages and heads for zero rows, per-group capacity checks (26 numpy reductions per request),
  uncached pairing properties. Ids are now checked once (one sort per side: distinct, in the pool, not
  negative), helpers take checked ids, pages and segment limits are cached on the pairing, zero rows
  are broadcast over pages and heads: ~500 µs -> ~150 µs for a 449-token request. Its fixed cost is
  still ~1.3x vLLM's chain below ~10k tokens: it runs ~60 numpy calls (each 1-3 µs) where vLLM's chain
  runs a handful of list operations, and it does more (zero ranges, the token check that refuses
  count-based pairings vLLM would get wrong). Above ~30k tokens the per-descriptor cost dominates and
  kvgeom is 0.1-0.7x vLLM.
* **Repeated shapes.** Everything the planner computes outside DCP and region-mapped pairs depends on
  the request's shape only, up to one gather of its ids (`kvgeom.plan.recipe`): the second time a shape is
  seen it is traced on probe ids, checked against the general planner, and later requests of that shape
  cost one gather (~30 µs at small sizes, about 0.15-0.3x vLLM at every size). A workload whose request
  shapes never repeat gains nothing from it: closing the gap there needs the general planner itself
  written as per-segment gathers (fewer numpy calls per group), which is the next step.
* **Zeroing.** Failure zeroing built one int64 index per byte (two orders of magnitude slower than a
  memset); then rows of a `[-1, g]` view (8-byte words), with a dozen numpy calls per (region, length)
  bucket; then the rows were merged into the fewest disjoint runs (`zero_runs`), each one libc `memset`.
  Now (issue 19) a failed request's rows are its runs already: adjacent kernel blocks are found once on
  the ids and are one row in every region (`kvgeom.block_runs`: 60 rows are 15 for the 97-token hybrid
  request, 30,240 are 42 for the long Kimi-Linear one). Up to 64 rows are checked and merged in one pass
  of plain Python and zeroed by one `memset` each, with no numpy call. More are merged by `zero_runs` (a
  dozen numpy calls) and the runs of one length under 1 MiB, in every region at once, are one numpy
  indexed write of a view of host memory (`__array_interface__` windows of that length one byte apart,
  indexed by the runs' addresses; numpy runs the memsets in C): the 100-token Llama receive's 256 tails
  of 8 KiB in 32 regions are one write, not 256 `memset` calls from Python. Before -> after, across 8
  runs of the code before and 5 of this code alternated with them on 2026-12-08 01:46-02:05 UTC (load
  average 3-10 on 2 cores shared with a CI run and stress-ng; ratio to memset, then to the floor): the
  97-token hybrid failure 0.11-0.14x / 0.59-0.62 -> 0.15-0.17x / 0.89-0.91, the 100-token Llama receive
  0.04-0.17x / 0.08-0.55 -> 0.28-0.42x / 0.99-1.43, the 100-token Llama failure 0.75-0.88 -> 0.94-1.01 of
  its floor, the 8,192-token one 0.90-1.03 -> 0.94-1.05, the 12,000-token hybrid receive 0.34-0.67x ->
  0.48-0.55x. Where the runs are long, kvgeom is within 0.9-1.0x of memsetting the same ranges found
  ahead of time, and that floor is itself 0.2-0.5x of one contiguous buffer: glibc's `memset` zeroes
  ranges up to ~16 MiB at ~10 GB/s here and one of 1 GiB at ~30 GB/s, on numpy and torch buffers alike
  (so not huge pages; likely streaming stores only above a size threshold). Where the rows are few and
  small, the floor has no checks and its ranges found ahead of time, and memset speed is out of reach:
  the 97-token hybrid failure is 0.9x its floor, most of its time being `block_runs` itself (the ids'
  checks, ~50 µs here, which the floor pays too). What is left is the 12,000-token hybrid receive, 3
  runs of 16 KiB in 3 regions (48 KiB, a 3 µs `memset`): ~7 µs, of which the three `memset` calls are
  ~3.3 µs and reading each tensor's size, device, contiguity and address (four torch calls per region)
  ~1.5 µs, so it reads 0.48-0.55x, borderline. Zeroing by dropping pages (`madvise(MADV_DONTNEED)`) would
  be faster for whole pages but is unsafe on memory NIXL has registered (pinned pages), so it is not used.
  With the caches evicted before every timed call (`bench_zero.py --cold`, one run of this code at
  02:06 UTC, load ~5: a failed request's blocks are rarely hot), 8 of the 10 cases meet the target (the
  12,000-token hybrid receive 0.62x); the misses are the 100-token Llama receive (0.38x, 0.77 of the
  floor) and the 8,192-token Llama failure (0.31x, 0.76 of the floor, 1 GiB, where eviction changes
  nothing: bandwidth noise).
* **Descriptors posted.** In vLLM mode the plan posts exactly vLLM's descriptors (checked equal), one
  per kernel block and region, so "no more than vLLM" holds, and more than the minimal runs by design
  (616 pairs for 175 runs at 16 tokens, in the table above). In kvgeom mode each transfer's pairs are
  merged into the maximal runs contiguous on both sides, within one region on each side
  (`kvgeom.layout.runs.merge_runs`, also what `kvgeom_vllm`'s kvgeom mode posts), and posted as per-request lists through NIXL's `initialize_xfer`:
  NIXL's posted count (telemetry) equals `contiguous_runs` in every request of `bench_descs.py`. Of the
  three ways measured (`TransportConfig.kvgeom_post`), none is clearly faster end to end: per request,
  NIXL's per-descriptor cost is small beside the freshness check, the completion polling and the
  receive step, and NIXL's own merging already joins neighbours in an id list (39 posted for 9 runs with
  sequential ids, 12,324 for 12,294 shuffled at 128k tokens). `initialize` is within 0.80-1.33x of the ids
  (median 0.98x, 12 rows), `prep` costs two extra prepares per request and is slower than `initialize`
  in 7 of the 12 rows, so `initialize` is the default and the other two stay selectable.
"""


if __name__ == "__main__":
    main()
