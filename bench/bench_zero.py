"""Zeroing speed of the NIXL adapter against a memset of the same number of bytes.

Two cases on the D rank of Kimi-Linear 48B (MLA + KDA), P TP2 -> D TP1 (kernel blocks 16 vs 32), with
CPU tensors (one uint8 tensor per region, as ``kvgeom_nixl.kvrank.allocate`` makes them):

* failure zeroing: ``KVRank.invalidate``'s rows (every block of a request, every region) for one large
  request, zeroed by ``kvgeom_nixl.kvrank._zero_rows``;
* post-receive zeroing: the plan's ``zero`` rows (the tail of partly covered blocks, per head) of the
  same request.

Each is checked first (every listed byte zero, every other byte untouched), then timed against
a memset of one contiguous buffer of the same size (numpy ``fill(0)``). Reports bytes/s and the
ratio kvgeom / memset (>= 0.5 is the target).

Run: ``.venv/bin/python bench/bench_zero.py [--tokens N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adapters"))

import torch  # noqa: E402
from kvgeom_nixl.kvrank import _zero_rows, block_rows  # noqa: E402

from kvgeom.plan import plan_request  # noqa: E402
from kvgeom.scenario import Scenario  # noqa: E402


def median_time(fn, reps: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check(tensors: list[torch.Tensor], rows: np.ndarray) -> None:
    """Fill with 0xA5, zero ``rows``, and compare every byte with a reference zeroed row by row."""
    for t in tensors:
        t.fill_(0xA5)
    _zero_rows(tensors, rows)
    for region, t in enumerate(tensors):
        ref = np.full(t.numel(), 0xA5, dtype=np.uint8)
        for offset, length in rows[rows[:, 0] == region][:, 1:].tolist():  # the reference: one slice per row
            ref[offset : offset + length] = 0
        if not np.array_equal(t.numpy(), ref):
            raise SystemExit(f"region {region}: zeroing wrote other bytes than its rows")


def case(name: str, tensors: list[torch.Tensor], rows: np.ndarray, reps: int) -> dict:
    check(tensors, rows)
    nbytes = int(rows[:, 2].sum())
    buf = np.ones(max(nbytes, 1), dtype=np.uint8)
    t_k = median_time(lambda: _zero_rows(tensors, rows), reps)
    t_m = median_time(lambda: buf.fill(0), reps)  # memset
    return {
        "case": name,
        "rows": int(len(rows)),
        "bytes": nbytes,
        "kvgeom_s": t_k,
        "memset_s": t_m,
        "kvgeom_gbps": nbytes / t_k / 1e9,
        "memset_gbps": nbytes / t_m / 1e9,
        "ratio": t_m / t_k,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    need = -(-args.tokens // 1920) + 4
    sc = Scenario.from_json(
        {
            "model": "kimi-linear-48b-a3b",
            "mode": "pull",
            "compat": "vllm",
            "prefill": {"tp_size": 2, "kernel_block_size": 16, "num_blocks": 2 * need + 8},
            "decode": {"tp_size": 1, "kernel_block_size": 32, "num_blocks": need + 4},
        }
    )
    geom = sc.cards("decode")[0].geometry
    tensors = [torch.zeros(r.nbytes, dtype=torch.uint8) for r in geom.regions]
    req = sc.request(args.tokens, seed=5)
    plan = plan_request(sc.pairings[0], req.decode, req.prefill, num_tokens=req.num_tokens)
    out = {
        "pair": sc.describe(),
        "tokens": args.tokens,
        "cases": [
            case("failure (invalidate)", tensors, block_rows(geom, req.decode), args.reps),
            case("post-receive", tensors, plan.zero, args.reps),
        ],
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['pair']}; {args.tokens} tokens")
    for c in out["cases"]:
        print(
            f"{c['case']:>22}: {c['rows']:7d} rows {c['bytes'] / 2**20:9.1f} MiB  kvgeom {c['kvgeom_gbps']:6.2f} GB/s  "
            f"memset {c['memset_gbps']:6.2f} GB/s  ratio {c['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()
