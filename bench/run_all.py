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
        kb = int(next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{os.cpu_count()} cores ({model}){mem}, Python {platform.python_version()}, {platform.system()}"


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[str, float, str | None]:
    """stdout, seconds, and an error line (None when it ran)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return "", time.perf_counter() - t0, f"timed out after {timeout:.0f} s"
    dt = time.perf_counter() - t0
    if p.returncode:
        return p.stdout, dt, f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}"
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
        ax.loglog(t, [r["kvgeom_us"] for r in vs["requests"]], "s-", label="kvgeom plan_request")
        ax.loglog(t, [0.5 * r["vllm_us"] for r in vs["requests"]], ":", color="gray", label="target: 0.5 x vLLM")
        ax.set_xlabel("request tokens")
        ax.set_ylabel("microseconds per request")
        ax.set_title("Per-request planning cost")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(img / "perf-request.png", dpi=110)
        made.append("perf-request.png")
        fig, ax = plt.subplots(figsize=(6, 4))
        b = [h["blocks"] for h in vs["handshakes"]]
        ax.loglog(b, [h["vllm_ms"] for h in vs["handshakes"]], "o-", label="vLLM add_remote_agent (2 P ranks)")
        ax.loglog(b, [h["kvgeom_ms"] for h in vs["handshakes"]], "s-", label="kvgeom Pairing.create")
        ax.set_xlabel("kernel blocks per D rank")
        ax.set_ylabel("milliseconds per handshake")
        ax.set_title("Handshake cost")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(img / "perf-handshake.png", dpi=110)
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
        cmd = [str(vpy), "bench/bench_vs_vllm.py", "--json", "--budget", "0.05" if args.quick else "0.6"]
        if args.quick:
            cmd += ["--tokens", "16", "4096", "--blocks", "100", "1000"]
        out, took["bench_vs_vllm"], err = run(cmd, 300, {"PYTHONPATH": f"{ROOT}:{ROOT / 'adapters'}"})
        vs = None if err else last_json(out)
        if err:
            notes.append(f"bench_vs_vllm.py: {err}")
    else:
        notes.append("bench_vs_vllm.py: not run (no .venv-vllm; `make test-vllm` builds it)")
    out, took["bench_zero"], err = run([py, "bench/bench_zero.py", "--json"] +
                                       (["--tokens", "8192"] if args.quick else []), 120)
    zero = None if err else last_json(out)
    if err:
        notes.append(f"bench_zero.py: {err}")
    pull_json = ROOT / "build" / "bench_pull.json"
    pull_json.parent.mkdir(exist_ok=True)
    out, took["bench_pull"], err = run([py, "bench/bench_pull.py", "--json", str(pull_json)] +
                                       (["--tokens", "2048", "--reps", "3"] if args.quick else []), 300)
    pull_text = "\n".join(x for x in out.splitlines() if " NIXL INFO " not in x)
    if err:
        notes.append(f"bench_pull.py: {err}")
    else:
        pull = _pull_summary(json.loads(pull_json.read_text()))
    out, took["bench_plan"], err = run([py, "bench/bench_plan.py"] + (["--tokens", "4096"] if args.quick else []), 120)
    plan_text = out if not err else f"(failed: {err})"
    img = ROOT / "docs" / "img"
    img.mkdir(parents=True, exist_ok=True)
    made = plots(vs, zero, pull, img)
    if not made:
        notes.append("plots: not made (matplotlib missing: install the `plot` extra)")
    Path(args.out).write_text(render(vs, zero, pull, pull_text, plan_text, made, notes, took))
    print(f"wrote {args.out} ({sum(took.values()):.0f} s of benchmarks)")


def _pull_summary(res: dict) -> dict:
    """NIXL / process_vm_readv on the same moves, and the descriptor counts, from bench_pull.py's JSON."""
    d = res["results"]["decode"]
    n, pvr, q = d["nixl"], d["pvr"], d["request"]
    return {"nixl_gbps": n["gbps"], "limit_gbps": pvr["gbps"], "ratio": n["gbps"] / pvr["gbps"],
            "pairs": q["descriptor_pairs"], "posted": n["desc_count"], "runs": q["contiguous_runs"]}


def render(vs: dict | None, zero: dict | None, pull: dict | None, pull_text: str, plan_text: str, made: list[str],
           notes: list[str], took: dict[str, float]) -> str:
    L = ["# Performance", "",
         "Written by `make bench` (`bench/run_all.py`); every number is a ratio against something measured in",
         "the same run, on the machine below. Rerun `make bench` to refresh it.", "",
         f"Machine: {machine()}.", "",
         "Benchmark wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()) + ".", ""]
    if vs:
        L += ["## kvgeom against vLLM 0.33.0 (`bench/bench_vs_vllm.py`)", "", f"Pair: {vs['pair']}.", "",
              "Per request: vLLM's `_logical_to_kernel_block_ids`, `_map_block_ids_for_block_size_ratio`,",
              "`_apply_prefix_caching` and `_compute_desc_ids`, chained per source rank as `_read_blocks` does,",
              "against kvgeom's `plan_request` (which also derives the post-receive zero ranges and checks the",
              "pairing by tokens). Descriptor ids are checked equal to vLLM's before timing.", "",
              "| tokens | descriptor pairs | contiguous runs | vLLM µs | kvgeom µs | kvgeom ÷ vLLM |",
              "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        L += [f"| {r['tokens']:,} | {r['pairs']:,} | {r['runs']:,} | {r['vllm_us']:.0f} | {r['kvgeom_us']:.0f} | "
              f"{r['ratio']:.2f} |" for r in vs["requests"]]
        L += ["", "Handshake: vLLM's `add_remote_agent` for both P ranks (fresh worker each time) against",
              "`Pairing.create` with every table it builds and bounds-checks; tables checked to stand for the",
              "descriptors vLLM prepared.", "",
              "| kernel blocks per D rank | vLLM ms | kvgeom ms | kvgeom ÷ vLLM | kvgeom table runs | descriptors they stand for | table bytes |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        L += [f"| {h['blocks']:,} | {h['vllm_ms']:.2f} | {h['kvgeom_ms']:.2f} | {h['ratio']:.2f} | {h['table_runs']} | "
              f"{h['table_descriptors']:,} | {h['table_bytes']:,} |" for h in vs["handshakes"]]
        L += [""]
        for name in ("perf-request.png", "perf-handshake.png"):
            if name in made:
                L += [f"![{name}](img/{name})", ""]
    if zero:
        L += ["## Zeroing (`bench/bench_zero.py`)", "", f"Pair: {zero['pair']}; {zero['tokens']:,} tokens; CPU tensors.",
              "", "| case | rows | MiB | kvgeom GB/s | memset GB/s | kvgeom ÷ memset speed |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
        L += [f"| {c['case']} | {c['rows']:,} | {c['bytes'] / 2**20:.1f} | {c['kvgeom_gbps']:.1f} | {c['memset_gbps']:.1f} | "
              f"{c['ratio']:.2f} |" for c in zero["cases"]]
        L += [""]
    if pull or pull_text:
        L += ["## NIXL pull throughput (`bench/bench_pull.py`)", ""]
        if pull:
            L += [f"NIXL {pull['nixl_gbps']:.2f} GB/s against `process_vm_readv` {pull['limit_gbps']:.2f} GB/s on the same",
                  f"moves: **{pull['ratio']:.2f}×**. Descriptors: {pull['pairs']:,} plan pairs, {pull['posted']:,} posted",
                  f"by NIXL (after its merging), {pull['runs']:,} contiguous runs (the fewest possible).", ""]
        L += ["```", pull_text.strip(), "```", ""]
    if "perf-throughput.png" in made:
        L += ["![perf-throughput.png](img/perf-throughput.png)", ""]
    L += ["## Planning cost per descriptor (`bench/bench_plan.py`)", "", "```", plan_text.strip(), "```", ""]
    if notes:
        L += ["## Notes", ""] + [f"* {n}" for n in notes] + [""]
    return "\n".join(L)


if __name__ == "__main__":
    main()
