"""Per-request planning cost: descriptor ids and whole plans for a 52-layer Mamba2 hybrid at 128k tokens.

Nemotron-H 8B (52 layers: 4 attention, 24 Mamba2), P TP2 -> D TP1 pull with kernel blocks 16 vs 32
(block-size ratio 2, split local tables), one request of 131,072 tokens with shuffled block ids.
Reports microseconds per descriptor for (a) descriptor ids alone, (b) the whole per-request plan,
(c) resolving the plan into byte moves, and compares them in the same run with two limits:
numpy's own cost of writing the same number of int64 ids (a memory-bound floor), and -- when the
``nixl`` extra is installed -- NIXL's own per-descriptor cost of ``make_prepped_xfer`` on those ids.

Run: ``.venv/bin/python bench/bench_plan.py [--tokens N] [--repeat R]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvgeom.blocks import logical_to_kernel
from kvgeom.plan.descids import compute_desc_ids
from kvgeom.tools.scenario import Scenario


def timed(fn, repeat: int) -> float:
    """Median wall time of ``fn()`` in seconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def nixl_make_cost(
    local: np.ndarray, remote: np.ndarray, lids: np.ndarray, rids: np.ndarray, repeat: int
) -> float | None:
    """Seconds per ``make_prepped_xfer`` call on these ids between two in-process agents, or None."""
    try:
        import torch
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception:  # the nixl extra is optional for this benchmark
        return None
    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_agent("bench-a", cfg), nixl_agent("bench-b", cfg)
    span_l = int((local[:, 0] + local[:, 1]).max())
    span_r = int((remote[:, 0] + remote[:, 1]).max())
    buf_a = torch.empty(span_l, dtype=torch.uint8)
    buf_b = torch.empty(span_r, dtype=torch.uint8)
    a.register_memory(buf_a)
    b.register_memory(buf_b)
    a.add_remote_agent(b.get_agent_metadata())
    loc = local.copy()
    loc[:, 0] += np.uint64(buf_a.data_ptr())
    rem = remote.copy()
    rem[:, 0] += np.uint64(buf_b.data_ptr())
    lh = a.prep_xfer_dlist("", loc, "DRAM")
    rh = a.prep_xfer_dlist("bench-b", rem, "DRAM")
    li, ri = lids.astype(np.int32), rids.astype(np.int32)

    def make() -> None:
        h = a.make_prepped_xfer("READ", lh, li, rh, ri, b"")
        a.release_xfer_handle(h)

    return timed(make, repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    sc = Scenario.from_json(
        {
            "model": "nemotron-h-8b",
            "mode": "pull",
            "prefill": {"tp_size": 2, "block_size": 1040, "kernel_block_size": 16, "num_blocks": 1024},
            "decode": {"tp_size": 1, "block_size": 2080, "kernel_block_size": 32, "num_blocks": 512},
        }
    )
    req = sc.request(args.tokens, seed=7)
    t0 = time.perf_counter()
    pairing = sc.pairings[0]
    plan = sc.plans(req)[0]  # builds and caches the tables: handshake-time work
    setup = time.perf_counter() - t0
    n = plan.num_descriptors
    local = pairing.local

    t = plan.transfers[0]
    lk = logical_to_kernel(req.decode, local.ppl, local.group_is_ssm)

    def ids_only() -> np.ndarray:
        return compute_desc_ids(
            lk,
            local.num_blocks,
            local.num_regions,
            None,
            local.ppl,
            local.group_is_ssm,
            local.ssm_region_indices,
            local.ssm.num_pieces,
        )

    ids_n = sum(len(x) for x in req.decode)  # logical ids in -> descriptors out
    ids_out = ids_only().size
    t_ids = timed(ids_only, args.repeat)
    t_plan = timed(lambda: sc.plans(req), args.repeat)
    t_moves = timed(lambda: plan.moves(pairing), args.repeat)
    floor = timed(
        lambda: np.concatenate([np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)]), args.repeat
    )
    print(f"scenario: {sc.describe()}")
    print(
        f"request: {args.tokens} tokens; {n} descriptor pairs in {len(plan.transfers)} transfers "
        f"(local table {len(pairing.local_table(t.local_table))} rows); handshake-time tables {setup * 1e3:.1f} ms"
    )
    print(f"descriptor ids : {t_ids * 1e6 / ids_out:8.4f} us/desc ({ids_out} ids from {ids_n} logical ids)")
    print(f"whole plan     : {t_plan * 1e6 / n:8.4f} us/desc ({t_plan * 1e3:.2f} ms per request)")
    print(f"byte moves     : {t_moves * 1e6 / n:8.4f} us/desc")
    print(
        f"numpy floor    : {floor * 1e6 / n:8.4f} us/desc (writing 2 x {n} int64)  -> plan/floor "
        f"{t_plan / floor:6.1f}x"
    )
    make = nixl_make_cost(
        pairing.local_table(t.local_table).bind([0] * local.num_regions),
        pairing.remote_table(t.remote_rank).bind(_remote_bases(pairing, t.remote_rank)),
        t.local_ids,
        t.remote_ids,
        args.repeat,
    )
    if make is not None:
        per = make * 1e6 / len(t)
        print(
            f"NIXL make_prepped_xfer: {per:8.4f} us/desc -> plan / NIXL make {t_plan / n * 1e6 / per:6.2f}x"
        )
    else:
        print("NIXL make_prepped_xfer: not measured (install the nixl extra)")


def _remote_bases(pairing, rank: int) -> list[int]:
    return [0] * pairing.remotes[rank].num_regions


if __name__ == "__main__":
    main()
