"""VRAM pull on a GPU: scenario (a) of the e2e tests with CUDA tensors, verified, against a device copy.

Scenario (a) (``tests/adapter/test_kv_e2e.py``, ``kvgeom_lab.demo.DEFAULT_SCENARIO``): a Mamba2
hybrid (3 attention + 9 Mamba2 layers), P TP2 with 32-token blocks -> D TP1 with 64-token blocks,
pull. Each P rank and the D rank is a process with its own NIXL agent (UCX), all on GPU 0, every
rank's cache a set of CUDA tensors registered as VRAM (``KVRank(card, device="cuda")``). The script:

1. checks that every rank registered VRAM (device 0), and that D's handshake prepared VRAM tables;
2. pulls the e2e requests (97, 1000, 31, 640 tokens) with ``KVRank.pull`` (plan, NIXL READ, regroup,
   zero ranges) and checks every byte of D's cache against the oracle's layout model
   (``kvgeom.testing.content``: fill and verify go through CPU copies of the CUDA tensors);
3. times one large request (``--bench-tokens``, default 65,536: ~96 MiB, 4 KiB descriptors): NIXL
   post -> done of the plan's transfers, against device-to-device copies of the same bytes in the D
   process (torch ``index_select`` + ``index_copy_`` of the same moves, one ``copy_`` per move, and one
   contiguous ``copy_`` of the same byte count), plus NIXL moving the same bytes in <= 16 MiB pieces;
   the methods are interleaved, ``--reps`` times, median reported; GB/s counts each byte moved once.
   Every method's result is checked against the P content.

Exit status: 0 all checks passed; 1 a check failed; 2 it cannot run here (no CUDA device, or torch /
nixl missing) -- a GPU check that did not run is never reported as passed.

On the lent GPU machine (one H200, Python 3.12, torch with CUDA 13 preinstalled; nothing can be
downloaded there; only the repository travels, and this script needs nothing else):

* nixl is not installed there: carry its wheels. Here, once, in the repo root (~56 MiB, it fits
  the 64 MiB that travels; ``nixl-cu13`` matches a CUDA 13 torch, take ``nixl-cu12`` for CUDA 12)::

      echo /.whl/ >> .git/info/exclude
      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
          --platform manylinux_2_28_x86_64 -d .whl nixl==1.5.1 nixl-cu13==1.5.1

* then one device run (carry ``[".whl"]``, ``timeout_s`` ~300), command::

      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \\
        && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 && python3 bench/gpu_vram_pull.py --json $OUT/gpu.json

  numpy and torch come from the machine's python3; the script prints every version it uses.
* On any other CUDA machine with a package index::

      python3 -m venv .venv && .venv/bin/pip install numpy torch nixl && .venv/bin/python bench/gpu_vram_pull.py

* Dry run without a GPU (the same code path on CPU tensors, DRAM): ``--device cpu``.
* Larger descriptors (32 KiB): ``--scenario examples/nemotron-h-8b_p2_d1_pull.json``. Its pools are
  at least 64 blocks (a 1 GiB D cache), and filling and verifying the oracle's content is host-side
  numpy work: with ``--bench-tokens 4096`` the CPU dry run took 105 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from typing import Any

import numpy as np
from _pullkit import (
    LocalTables,
    blocks_needed,
    gbps,
    move_index,
    run_ranks,
    serve,
    sized,
    timed_pull,
    wait_ranks,
    word_size,
)
from bench_pull import CHUNK, NixlMoves, contiguous_moves

from kvgeom import GeometryCard
from kvgeom.plan.requestplan import check_writes, contiguous_runs
from kvgeom.testing import CoordSpace
from kvgeom.tools.scenario import Scenario

E2E_TOKENS = [97, 1000, 31, 640]  # test_mamba2_hybrid_p_tp2_to_d_tp1_pull_different_block_sizes
NO_CUDA = "no CUDA device: this script needs a GPU machine"


# ----------------------------------------------------------------------------------------- environment
def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("numpy", "torch", "nixl", "nixl-cu12", "nixl-cu13", "kvgeom"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        import torch

        out["torch.version.cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        if out["cuda_available"]:
            out["gpu"] = torch.cuda.get_device_name(0)
            out["gpu_count"] = torch.cuda.device_count()
    except Exception as exc:  # reported, and refused below
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
    return out


def cannot_run(device: str, env: dict[str, Any]) -> str | None:
    """Why this machine cannot run the check, or None."""
    if "torch_error" in env:
        return f"torch is not usable here ({env['torch_error']}): install numpy, torch and nixl"
    if device == "cuda" and not env.get("cuda_available"):
        return NO_CUDA
    try:
        importlib.import_module("nixl._api")
    except Exception as exc:
        return (
            f"nixl is not usable here ({type(exc).__name__}: {exc}): install it (see this script's docstring)"
        )
    return None


# ----------------------------------------------------------------------------------------- ranks
def _sync(device: str) -> Any:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.synchronize


def _open_rank(spec: dict, side: str, rank: int) -> tuple[Scenario, GeometryCard, Any]:
    from kvgeom_nixl.config import TransportConfig
    from kvgeom_nixl.kvrank import KVRank

    sc = Scenario.from_json(spec["scenario"])
    eng = sc.prefill if side == "prefill" else sc.decode
    card = GeometryCard(side, sc.model, eng.with_rank(rank), sc.mode)
    if spec["device"] == "cuda":
        import torch

        torch.cuda.set_device(0)
    kv = KVRank(card, TransportConfig(**spec["config"]), device=spec["device"])
    want = "VRAM" if spec["device"] == "cuda" else "DRAM"
    got = sorted({r.mem_type for r in kv.regions})
    if got != [want]:
        kv.close()
        raise RuntimeError(f"{side} rank {rank}: registered {got}, expected {want}")
    return sc, card, kv


def _space(sc: Scenario, requests: list[dict]) -> CoordSpace:
    return CoordSpace(
        sc.model, max(r["tokens"] for r in requests) + max(sc.prefill.block_size, sc.decode.block_size)
    )


def _fill_producer(tensors: list, card: GeometryCard, space: CoordSpace, requests: list[dict]) -> None:
    from kvgeom.testing.content import BACKGROUND, fill_source

    for t in tensors:
        t.fill_(BACKGROUND)
    for r in requests:
        fill_source(tensors, card, space, r["p_ids"], r["tokens"])


def _regions_info(kv: Any) -> list[tuple[str, int, int]]:
    return [(r.mem_type, r.device_id, r.nbytes) for r in kv.regions]


def _producer(spec: dict, rank: int, events: Any, inbox: Any) -> dict:
    sc, card, kv = _open_rank(spec, "prefill", rank)
    with kv:
        _fill_producer(kv.tensors, card, _space(sc, spec["requests"]), spec["requests"])
        if spec["device"] == "cuda":
            import torch

            torch.cuda.synchronize()
        events.put(("ready", rank, kv.port, os.getpid()))
        seen = serve(kv, inbox, spec["serve_poll_s"], spec["timeout_s"])
        return {"rank": rank, "regions": _regions_info(kv), "notifications": seen}


def _consumer(spec: dict, events: Any, inbox: Any) -> dict:
    import torch

    from kvgeom.testing.content import POISON_BYTE, verify

    sc, card, kv = _open_rank(spec, "decode", 0)
    dev, reps, sync = spec["device"], spec["reps"], _sync(spec["device"])
    requests = spec["requests"]
    e2e, bench = requests[:-1], requests[-1]
    space = _space(sc, requests)
    out: dict[str, Any] = {"regions": _regions_info(kv)}
    with kv:
        for t in kv.tensors:
            t.fill_(POISON_BYTE)
        ranks = wait_ranks(inbox)
        pairing = kv.connect(
            "prefill", {r: port for r, (port, _) in ranks.items()}, mode="pull", compat=sc.compat
        )
        out["remote_tables"] = {r: link.prepped.mem_type for r, link in kv.links["prefill"].items()}

        # -- 1. the e2e requests through the whole adapter path, every byte of D's cache checked
        rows = []
        for r in e2e:
            res = kv.pull(
                "prefill",
                r["d_ids"],
                r["p_ids"],
                r["id"],
                r["id"],
                num_tokens=r["tokens"],
                timeout_s=spec["timeout_s"] / 4,
            )
            rows.append(
                {
                    k: getattr(res, k)
                    for k in (
                        "request_id",
                        "ok",
                        "descriptors",
                        "bytes_moved",
                        "bytes_zeroed",
                        "nixl_desc_count",
                        "runs",
                        "seconds",
                    )
                }
            )
        bad = verify(
            kv.tensors, card, space, [(r["d_ids"], 0, r["tokens"], row["ok"]) for r, row in zip(e2e, rows)]
        )
        out["e2e"] = {
            "requests": rows,
            "mismatches": [str(m) for m in bad],
            "checked_bytes": int(sum(t.numel() for t in kv.tensors)),
        }

        # -- 2. one large request: NIXL against device copies of the same moves
        plan0 = kv.plan("prefill", bench["d_ids"], bench["p_ids"], "bench-0", "bench-0", bench["tokens"])
        check_writes(plan0, pairing, bench["d_ids"])
        moves = plan0.moves(pairing)
        nbytes = int(moves[:, 6].sum())
        per_rank = {r: int(moves[moves[:, 0] == r, 6].sum()) for r in dict.fromkeys(moves[:, 0].tolist())}

        # the P ranks' content, rebuilt here in one flat buffer per side (same fill => same bytes)
        p_cards = {r: GeometryCard("prefill", sc.model, sc.prefill.with_rank(r), sc.mode) for r in ranks}
        p_sizes = {r: [g.nbytes for g in c.geometry.regions] for r, c in p_cards.items()}
        p_base, pos = {}, 0
        for r in sorted(p_sizes):
            p_base[r] = list(pos + np.cumsum([0] + p_sizes[r][:-1]))
            pos += sum(p_sizes[r])
        src_flat = torch.empty(pos, dtype=torch.uint8, device=dev)
        for r, c in p_cards.items():
            views = [src_flat[b : b + n] for b, n in zip(p_base[r], p_sizes[r])]
            _fill_producer(views, c, space, requests)
        d_sizes = [t.numel() for t in kv.tensors]
        d_base = list(np.cumsum([0] + d_sizes[:-1]))
        scratch = torch.zeros(sum(d_sizes), dtype=torch.uint8, device=dev)

        contig = contiguous_moves(per_rank, p_sizes, d_sizes, CHUNK)
        w = word_size(np.vstack([moves, contig]), [*d_sizes, *[n for s in p_sizes.values() for n in s]])
        wtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[w]
        src_w, scratch_w = src_flat.view(wtype), scratch.view(wtype)

        def starts(mv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # byte offsets in the flat buffers
            s = np.array([p_base[r][g] for r, g in mv[:, :2].tolist()], dtype=np.int64).reshape(-1) + mv[:, 2]
            return s, np.asarray(d_base, dtype=np.int64)[mv[:, 4]] + mv[:, 5]

        def index(mv: np.ndarray) -> tuple[Any, Any]:  # word indices of the moves in the flat buffers
            s, d = starts(mv)
            return (
                torch.from_numpy(move_index(s, mv[:, 6], w)).to(dev),
                torch.from_numpy(move_index(d, mv[:, 6], w)).to(dev),
            )

        s_idx, d_idx = index(moves)
        cs_idx, cd_idx = index(contig)

        def d_holds(si: Any, di: Any) -> Any:  # D's cache holds P's bytes at every move
            def check() -> bool:
                d_w = torch.cat([t.view(-1) for t in kv.tensors]).view(wtype)
                return bool(torch.equal(d_w.index_select(0, di), src_w.index_select(0, si)))

            return check

        def scratch_matches() -> bool:
            return bool(torch.equal(scratch_w.index_select(0, d_idx), src_w.index_select(0, s_idx)))

        tables = LocalTables(kv, "prefill")
        serial = iter(range(1, 1 << 30))

        def nixl_plan() -> dict:  # re-plans (untimed), times post -> done
            p = kv.plan(
                "prefill", bench["d_ids"], bench["p_ids"], f"bench-{next(serial)}", "bench", bench["tokens"]
            )
            dt, tel = timed_pull(kv, "prefill", p, tables, spec["timeout_s"] / 4, sync)
            return {"seconds": dt, "desc_count": sum(t.desc_count or 0 for t in tel)}

        src_bases = {r: list(link.bases) for r, link in kv.links["prefill"].items()}
        contig_nixl = NixlMoves(kv, contig, src_bases, [r.addr for r in kv.regions], spec["timeout_s"] / 4)
        mv_rows = [(int(a), int(b), int(n)) for a, b, n in zip(*starts(moves), moves[:, 6])]

        def index_copy() -> None:
            scratch_w.index_copy_(0, d_idx, src_w.index_select(0, s_idx))

        def copy_loop() -> None:
            for s, d, n in mv_rows:
                scratch[d : d + n].copy_(src_flat[s : s + n])

        def copy_contig() -> None:
            scratch[:nbytes].copy_(src_flat[:nbytes])

        methods = {
            "nixl": (nixl_plan, d_holds(s_idx, d_idx)),
            "nixl_contig": (_timed(contig_nixl, sync), d_holds(cs_idx, cd_idx)),
            "index_copy": (_timed(index_copy, sync), scratch_matches),
            "copy_per_move": (_timed(copy_loop, sync), scratch_matches),
            "copy_contig": (_timed(copy_contig, sync), None),
        }
        checks, info = {}, {}
        for name, (fn, check) in methods.items():  # warm-up, checked on zeroed targets
            for t in [*kv.tensors, scratch]:
                t.zero_()
            info[name] = fn()
            if check is not None:
                checks[name] = check()
        samples: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(reps):
            for name, (fn, _) in methods.items():
                info[name] = fn()
                samples[name].append(info[name].pop("seconds"))
        contig_nixl.release()
        out["bench"] = {
            "tokens": bench["tokens"],
            "bytes": nbytes,
            "descriptor_pairs": plan0.num_descriptors,
            "contiguous_runs": contiguous_runs(moves),
            "word_bytes": w,
            "checks": checks,
            "move_lengths": {int(k): int(v) for k, v in zip(*np.unique(moves[:, 6], return_counts=True))},
            "methods": {
                name: {
                    "seconds": statistics.median(ts),
                    "gbps": gbps(nbytes, statistics.median(ts)),
                    "times": ts,
                    **info[name],
                }
                for name, ts in samples.items()
            },
        }
    return out


def _timed(fn: Any, sync: Any) -> Any:
    def run() -> dict:
        if sync:
            sync()
        t0 = time.perf_counter()
        extra = fn()
        if sync:
            sync()
        return {"seconds": time.perf_counter() - t0, **(extra or {})}

    return run


# ----------------------------------------------------------------------------------------- parent
def build_spec(args: argparse.Namespace) -> dict[str, Any]:
    from kvgeom_lab.cluster import assign_blocks
    from kvgeom_lab.demo import DEFAULT_SCENARIO

    base = json.load(open(args.scenario)) if args.scenario else dict(DEFAULT_SCENARIO)
    tokens = [*args.tokens, args.bench_tokens]
    scenario = sized(base, tokens, 1.25)
    sc = Scenario.from_json(scenario)
    if sc.mode != "pull":
        raise SystemExit("the scenario must be a pull")
    reqs = [{"id": f"r{i}", "tokens": n} for i, n in enumerate(args.tokens)] + [
        {"id": "bench", "tokens": args.bench_tokens}
    ]
    return {
        "scenario": scenario,
        "device": args.device,
        "reps": args.reps,
        "timeout_s": args.timeout,
        "serve_poll_s": args.serve_poll_us * 1e-6,
        "requests": assign_blocks(sc, reqs, ["prefill"]),
        "config": {
            "progress_thread": args.progress_thread,
            "poll_interval_s": 0.0,
            "secret": os.urandom(32).hex(),
        },
    }


def report(res: dict, sc: Scenario, env: dict, args: argparse.Namespace, wall: float) -> tuple[str, bool]:
    d = res["decode"]
    e2e, b = d["e2e"], d["bench"]
    mem = {name: sorted({f"{m}:{dev}" for m, dev, _ in v["regions"]}) for name, v in res.items()}
    tables_ok = set(d["remote_tables"].values()) == {"VRAM" if args.device == "cuda" else "DRAM"}
    e2e_ok = not e2e["mismatches"] and all(r["ok"] for r in e2e["requests"])
    bench_ok = all(b["checks"].values())
    ok = e2e_ok and bench_ok and tables_ok
    m = b["methods"]
    lines = [
        f"scenario (a): {sc.describe()}; device {args.device}",
        "registration: "
        + "; ".join(f"{k} {v}" for k, v in sorted(mem.items()))
        + f"; D's prepared remote tables {sorted(set(d['remote_tables'].values()))}",
        f"e2e: {len(e2e['requests'])} requests ({', '.join(str(t) for t in args.tokens)} tokens) pulled with "
        f"KVRank.pull; every byte of {e2e['checked_bytes'] / 2**20:.1f} MiB of D cache checked: "
        + ("PASS" if e2e_ok else f"FAIL, {len(e2e['mismatches'])} mismatching runs"),
        *[f"    {x}" for x in e2e["mismatches"][:10]],
        "",
        f"throughput: one request of {b['tokens']} tokens, {b['bytes'] / 2**20:.1f} MiB in {b['descriptor_pairs']} "
        f"descriptor pairs (lengths {b['move_lengths']}), contiguous runs {b['contiguous_runs']}; median of "
        f"{args.reps}, methods interleaved; GB/s = bytes moved once / time",
        f"{'method':52s} {'seconds':>10s} {'GB/s':>8s}  notes",
    ]

    def line(label: str, key: str, note: str = "") -> None:
        chk = b["checks"].get(key)
        tail = "" if chk is None else ("; bytes ok" if chk else "; BYTES WRONG")
        lines.append(f"{label:52s} {m[key]['seconds']:10.6f} {m[key]['gbps']:8.2f}  {note}{tail}")

    line(
        "NIXL READ, the plan's transfers (post -> done)",
        "nixl",
        f"NIXL posted {m['nixl']['desc_count']} descs",
    )
    line(
        f"NIXL READ, same bytes in <= {CHUNK >> 20} MiB pieces",
        "nixl_contig",
        f"NIXL posted {m['nixl_contig']['desc_count']} descs",
    )
    line("torch index_select + index_copy_, same moves", "index_copy", f"{b['word_bytes']}-byte words")
    line("torch copy_ per move, same moves", "copy_per_move", f"{b['descriptor_pairs']} copies")
    line("torch copy_, same byte count, contiguous", "copy_contig")
    lines += [
        "",
        f"NIXL / index copy: {m['nixl']['gbps'] / m['index_copy']['gbps']:.3f}   NIXL / contiguous copy: "
        f"{m['nixl']['gbps'] / m['copy_contig']['gbps']:.3f}   NIXL per posted descriptor: "
        f"{m['nixl']['seconds'] * 1e6 / max(1, m['nixl']['desc_count']):.2f} us",
        f"verdict: {'PASS' if ok else 'FAIL'} (wall {wall:.1f} s incl. process start)",
    ]
    return "\n".join(lines), ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (the check) or cpu (dry run of the same code path on DRAM)",
    )
    ap.add_argument(
        "--scenario", help="scenario JSON (pull; default: scenario (a), the demo's Mamba2 hybrid)"
    )
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=E2E_TOKENS, help="e2e request lengths (verified)"
    )
    ap.add_argument("--bench-tokens", type=int, default=65536, help="length of the timed request")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--progress-thread", action="store_true", help="enable NIXL's progress thread in every rank"
    )
    ap.add_argument(
        "--serve-poll-us", type=float, default=100.0, help="P ranks' sleep between notification polls"
    )
    ap.add_argument("--timeout", type=float, default=240.0, help="bound of the whole run in seconds")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    env = versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    why = cannot_run(args.device, env)
    if why:
        print(why, file=sys.stderr)
        return 2
    spec = build_spec(args)
    sc = Scenario.from_json(spec["scenario"])
    need = blocks_needed(sc.model, sc.prefill, args.bench_tokens)
    print(
        f"gpu_vram_pull: {sc.describe()}; device {args.device}; starting {sc.prefill.tp_size} P + "
        f"{sc.decode.tp_size} D processes (bench request: {need} P blocks) ...",
        flush=True,
    )
    t0 = time.monotonic()
    try:
        res = run_ranks(_producer, _consumer, spec, sc.prefill.tp_size, args.timeout)
    except Exception as exc:  # a rank failed or timed out: its traceback is in the message
        print(f"verdict: FAIL ({type(exc).__name__}): {exc}")
        return 1
    wall = time.monotonic() - t0
    text, ok = report(res, sc, env, args, wall)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "versions": env,
                    "scenario": spec["scenario"],
                    "ok": ok,
                    "wall_s": wall,
                    "results": res,
                },
                f,
                indent=1,
                default=str,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
