"""kvgeom against vLLM 0.33.0's own NIXL geometry code, side by side in one process.

Run in the vLLM venv (``make test-vllm`` builds ``.venv-vllm``): ``.venv-vllm/bin/python bench/bench_vs_vllm.py``.

Pair: Kimi-Linear 48B (MLA + KDA hybrid, 7 regions), P TP2 -> D TP1 pull, kernel blocks 16 (P) vs 32 (D):
block-size ratio 2, two source ranks, split local tables. vLLM's side is a bare pull worker holding the
registration state vLLM's ``register_kv_caches`` would record for the same geometry (the harness of
``tests/vllm/_e2e.py``, with a recording NIXL wrapper); every function timed is vLLM's own.

* per request: vLLM's ``_logical_to_kernel_block_ids`` (D and P ids), then per source rank its
  ``_map_block_ids_for_block_size_ratio``, ``_apply_prefix_caching`` and two ``_compute_desc_ids``,
  chained as ``_read_blocks_for_req`` / ``_read_blocks`` do; against kvgeom's ``plan_request`` (which also
  derives the post-receive zero ranges and refuses count-based pairings that would move wrong tokens),
  twice: for a request shape never seen (the general planner) and for a repeated one (its recipe,
  :mod:`kvgeom.plan.recipe`). Before timing, kvgeom's descriptor ids are checked equal to vLLM's for every
  source rank, and the recipe's plan equal to the general planner's.
* handshake, over a grid of D pools (``--blocks``, kernel blocks per D rank) and P TP sizes (``--remotes``:
  1, 2, 4, 8 P ranks against the one D rank; the pair is otherwise the same): vLLM's ``add_remote_agent``
  for every P rank on a fresh worker (split local handles, remote tables, checks) against kvgeom's
  ``GeometryCard.from_json`` of every P rank's card (the decoded JSON object, as vLLM's metadata arrives
  decoded) and ``Pairing.create`` with every table it builds and bounds-checks. Before timing, the bound
  tables are checked to stand for the same descriptors as vLLM's prepared lists.

Prints one JSON object (``--json``) or a table; ``bench/run_all.py`` writes it into docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

for _k, _v in {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_SSM_CONV_STATE_LAYOUT": "DS",
}.items():
    os.environ.setdefault(_k, _v)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

import _e2e  # noqa: E402  (tests/vllm/_e2e.py: the vLLM worker harness of the differential tests)
import numpy as np  # noqa: E402

from kvgeom.plan.planmemo import memo_of  # noqa: E402
from kvgeom.plan.request import plan_request  # noqa: E402
from kvgeom.plan.splits import expand_strided  # noqa: E402
from kvgeom.tools.scenario import Scenario  # noqa: E402

TOKENS = (16, 449, 4096, 32768, 131072, 1048576)
BLOCKS = (64, 1000, 10000, 100000)
REMOTES = (1, 2, 4, 8)


DECADES = ((16, 100), (100, 1000), (1000, 10000), (10000, 100000), (100000, 1048577))


def scenario(d_blocks: int, compat: str = "vllm", p_tp: int = 2) -> Scenario:
    """The pair, with ``d_blocks`` logical blocks (of 60 kernel blocks) per D rank; P (TP ``p_tp``) holds
    twice as many logical blocks (of 64 kernel blocks)."""
    return Scenario.from_json(
        {
            "model": "kimi-linear-48b-a3b",
            "mode": "pull",
            "compat": compat,
            "prefill": {"tp_size": p_tp, "kernel_block_size": 16, "num_blocks": 2 * d_blocks},
            "decode": {"tp_size": 1, "kernel_block_size": 32, "num_blocks": d_blocks},
        }
    )


def timed(fn: Any, budget_s: float, least: int = 5) -> float:
    """Median seconds of ``fn()`` over repeats filling about ``budget_s``."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    n = max(least, min(2000, int(budget_s / max(first, 1e-6))))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class VllmSide:
    """A vLLM 0.33.0 pull worker for D rank 0 of ``sc``, with every P rank it reads added."""

    def __init__(self, sc: Scenario) -> None:
        self.d = sc.cards("decode")[0].geometry
        self.p = [c.geometry for c in sc.cards("prefill")]
        self.metas = [_e2e.agent_metadata(g) for g in self.p]
        self.w = self.fresh()
        self.handshake(self.w)

    def fresh(self) -> Any:
        return _e2e.consumer_worker(self.d, False)

    def handshake(self, w: Any) -> None:
        for rank in w.transfer_topo.handshake_target_ranks(len(self.p), 1):
            w._remote_agents["P"][(0, rank)] = w.add_remote_agent(
                self.metas[rank], remote_tp_rank=rank, remote_tp_size=len(self.p), remote_dcp_size=1
            )

    def desc_ids(self, local_logical: list[list[int]], remote_logical: list[list[int]]) -> dict[int, tuple]:
        """vLLM's per-request path (``_read_blocks_for_req`` -> ``_read_blocks``), up to the descriptor ids."""
        w = self.w
        plan = w.tp_mappings["P"]
        info = w.transfer_topo.get_engine_info("P")
        local = w._logical_to_kernel_block_ids(local_logical, w._physical_blocks_per_logical_kv_block)
        remote = w._logical_to_kernel_block_ids(remote_logical, info.remote_physical_blocks_per_logical)
        bsr = w.transfer_topo.block_size_ratio(info.remote_block_size)
        out = {}
        for rank in plan.all_source_ranks:
            lids = [
                list(local[g]) if rank in plan.source_ranks_per_group[g] else [] for g in range(len(local))
            ]
            rids = [
                list(remote[g]) if rank in plan.source_ranks_per_group[g] else [] for g in range(len(local))
            ]
            if bsr > 1:
                lids, rids = w._map_block_ids_for_block_size_ratio(lids, rids, bsr)
            if not any(len(g) for g in lids):
                continue
            lids, rids = w._apply_prefix_caching(
                lids, rids, w._physical_blocks_per_logical_kv_block, info.remote_physical_blocks_per_logical
            )
            r = w._compute_desc_ids(
                rids,
                w.dst_num_blocks["P"],
                None,
                info.remote_physical_blocks_per_logical,
                w.dst_region_num_blocks.get("P") or None,
                w.dst_region_group_ids.get("P") or None,
                w.dst_uses_region_group_mapping["P"],
            )
            loc = w._compute_desc_ids(
                lids,
                w.dst_num_blocks[w.engine_id],
                bsr,
                w._physical_blocks_per_logical_kv_block,
                w.dst_region_num_blocks.get(w.engine_id) or None,
                w.region_group_ids or None,
                w._uses_region_group_mapping,
            )
            out[rank] = (np.asarray(loc), np.asarray(r))
        return out

    def prepared(self) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """vLLM's prepared lists, expanded and resolved to (region, offset, length): split local handles
        per source index, remote tables per rank."""
        nixl, w, bs = self.w.nixl_wrapper, self.w, self.metas[0].block_size
        split = w.src_xfer_handles_by_tp_ratio.get((-len(self.p), bs))
        if split is None:  # P TP1: one local handle, at P's block size when it is smaller
            split = [w.src_xfer_handles_by_block_size[bs]]
        local = {i: _resolved(nixl.dlists[h]) for i, h in enumerate(split)}
        remote = {r: _resolved(nixl.dlists[h]) for r, h in self.w.dst_xfer_side_handles["P"].items()}
        return local, remote


def _resolved(descs: np.ndarray) -> np.ndarray:
    rows = expand_strided(np.asarray(descs, dtype=np.int64)) if np.asarray(descs).shape[1] == 5 else descs
    where = _e2e.resolve(np.asarray(rows[:, 0], dtype=np.int64))
    return np.column_stack([where[:, 2], where[:, 3], np.asarray(rows[:, 1], dtype=np.int64)])


def check_tables(sc: Scenario, side: VllmSide, pairing: Any = None) -> None:
    """kvgeom's tables (``pairing``'s, by default the scenario's) stand for exactly the descriptors vLLM
    prepared."""
    pairing = sc.pairings[0] if pairing is None else pairing
    local, remote = side.prepared()
    for i, rank in enumerate(pairing.transfer_ranks):
        mine_l = pairing.local_table(pairing.local_key(rank)).rows
        mine_r = pairing.remote_table(rank).rows
        if not (np.array_equal(mine_l, local[i]) and np.array_equal(mine_r, remote[rank])):
            raise SystemExit(f"tables differ from vLLM's for source rank {rank}")


def request_row(sc: Scenario, side: VllmSide, tokens: int, budget: float) -> dict[str, Any]:
    pairing = sc.pairings[0]
    req = sc.request(tokens, seed=tokens)
    local, remote = [list(x) for x in req.decode], [list(x) for x in req.prefill]
    plan = plan_request(pairing, req.decode, req.prefill, "req", num_tokens=req.num_tokens)
    theirs = side.desc_ids(local, remote)
    mine = {t.remote_rank: (t.local_ids, t.remote_ids) for t in plan.transfers}
    if sorted(mine) != sorted(theirs) or any(
        not (np.array_equal(mine[r][0], theirs[r][0]) and np.array_equal(mine[r][1], theirs[r][1]))
        for r in mine
    ):
        raise SystemExit(f"{tokens} tokens: kvgeom's descriptor ids differ from vLLM's")
    larr, rarr = (
        [np.asarray(x, dtype=np.int64) for x in local],
        [np.asarray(x, dtype=np.int64) for x in remote],
    )
    t_v = timed(lambda: side.desc_ids(local, remote), budget)

    def cold() -> None:  # a shape never seen: the general planner (no recipe yet)
        memo_of(pairing).shapes.clear()
        plan_request(pairing, larr, rarr, "req", num_tokens=req.num_tokens)

    t_new = timed(cold, budget)
    for _ in range(2):  # the second sighting traces the shape's recipe
        plan_request(pairing, larr, rarr, "req", num_tokens=req.num_tokens)
    warm = plan_request(pairing, larr, rarr, "req", num_tokens=req.num_tokens)
    if any(
        not (
            np.array_equal(t.local_ids, mine[t.remote_rank][0])
            and np.array_equal(t.remote_ids, mine[t.remote_rank][1])
        )
        for t in warm.transfers
    ) or not np.array_equal(warm.zero, plan.zero):
        raise SystemExit(f"{tokens} tokens: the recipe's plan differs from the general planner's")
    t_k = timed(lambda: plan_request(pairing, larr, rarr, "req", num_tokens=req.num_tokens), budget)
    return {
        "tokens": tokens,
        "pairs": plan.num_descriptors,
        "runs": _runs(plan, pairing),
        "vllm_us": t_v * 1e6,
        "kvgeom_new_us": t_new * 1e6,
        "kvgeom_us": t_k * 1e6,
        "ratio_new": t_new / t_v,
        "ratio": t_k / t_v,
    }


def stream_lengths(count: int, lo: int, hi: int, seed: int, realistic: bool) -> list[int]:
    """``count`` distinct request lengths in ``[lo, hi)``: log-normal around 2k tokens (``realistic``: most
    prompts short, a long tail to 1M) or log-uniform (one decade alone)."""
    rng = np.random.default_rng(seed)
    out: dict[int, None] = {}
    while len(out) < count:
        x = rng.normal(np.log(2048), 1.9) if realistic else rng.uniform(np.log(lo), np.log(hi))
        t = int(round(float(np.exp(x))))
        if lo <= t < hi and t not in out:
            out[t] = None
    return list(out)


def _sorted_moves(m: np.ndarray) -> np.ndarray:
    return m[np.lexsort(m.T[::-1])]


class Floor:
    """The numpy calls a plan of this pair cannot avoid, in straight-line code written for this one pair
    (MLA group 0 of kernel blocks 60 (D) / 64 (P) per logical block, block-size ratio 2, SSM groups 1-3, every
    group read from P rank 0, the SSM groups from rank 1 too, D's list from token 0): both sides' ids checked
    (one sort each: distinct, inside the pool), the attention ids expanded to kernel and fine blocks, per
    transfer and side one broadcast per run of a group's segments, and the zero rows of
    the partly and wholly unwritten blocks. Every lookup that depends only on the pairing is done in
    ``__init__``; :meth:`check` asserts the floor builds the plan's own arrays."""

    def __init__(self, sc: Scenario) -> None:
        from kvgeom.plan.align import PageSet
        from kvgeom.plan.bind import rank_tables

        p = sc.pairings[0]
        assert p.local.ppl == 60 and p.remote_view(0).ppl == 64 and p.bsr == 2 and p.transfer_ranks == (0, 1)
        self.lnb, self.rnb = p.local.logical_num_blocks, p.remotes[0].logical_num_blocks
        self.cols = [  # per transfer, per side: (group, offsets column) of the groups it sends
            tuple(
                tuple((g, c) for g, c in seg.columns if rank_tables(p, r).keep[g])
                for seg in (rank_tables(p, r).local, rank_tables(p, r).remote)
            )
            for r in p.transfer_ranks
        ]
        ps = PageSet.of(p.tables.group_pages[0], p.local.block_size)
        self.pages, self.run_page, self.run_off, self.run_tok = (
            ps.cols,
            ps.run_page,
            ps.run_offset,
            ps.run_token_bytes,
        )
        self.s60, self.s64, self.s2 = (np.arange(k, dtype=np.int64) for k in (60, 64, 2))
        self.tokens = p.local.block_size

    def __call__(self, lids: list[np.ndarray], rids: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
        for ids, nb in ((lids, self.lnb), (rids, self.rnb)):
            s = np.sort(np.concatenate(ids))
            if not (s[0] >= 0 and s[-1] < nb) or (s[1:] == s[:-1]).any():
                raise ValueError("bad ids")
        lk = np.add.outer(lids[0] * 60, self.s60).reshape(-1)
        rk = np.add.outer(rids[0] * 64, self.s64).reshape(-1)
        lf = np.add.outer(lk * 2, self.s2).reshape(-1)
        n = min(lf.size, rk.size)
        lg = [lf[:n], lids[1], lids[2], lids[3]]
        rg = [rk[:n], rids[1], rids[2], rids[3]]
        out = []
        for lcols, rcols in self.cols:
            for cols, ids in ((lcols, lg), (rcols, rg)):
                out.append(np.concatenate([(c + ids[g]).reshape(-1) for g, c in cols]))
        a, b = n // 2, -(-n // 2)  # blocks [b, end) unwritten; block a partly when n is odd
        whole = lk[b:]
        pages = self.pages
        full = np.empty((pages.shape[0], whole.size, 3), dtype=np.int64)
        full[..., 0] = pages[:, 0, None]
        full[..., 1] = whole[None, :] * pages[:, 3, None] + pages[:, 1, None]
        full[..., 2] = pages[:, 2, None]
        zero = full.reshape(-1, 3)
        if a < b:
            first = self.tokens // 2
            page = self.run_page
            gap = np.empty((page.size, 3), dtype=np.int64)
            gap[:, 0] = pages[page, 0]
            gap[:, 1] = lk[a] * pages[page, 3] + pages[page, 1] + first * self.run_tok + self.run_off
            gap[:, 2] = (self.tokens - first) * self.run_tok
            zero = np.concatenate([gap, zero])
        return out, zero

    def check(self, plan: Any, lids: list[np.ndarray], rids: list[np.ndarray], tokens: int) -> None:
        out, zero = self(lids, rids)
        mine = [x for t in plan.transfers for x in (t.local_ids, t.remote_ids)]
        if plan.regroup:
            raise SystemExit(f"{tokens} tokens: a regroup the floor does not build")
        if len(mine) != len(out) or not all(np.array_equal(a, b) for a, b in zip(mine, out)):
            raise SystemExit(f"{tokens} tokens: the floor's descriptor ids differ from the plan's")
        if not np.array_equal(zero, plan.zero):
            raise SystemExit(f"{tokens} tokens: the floor's zero rows differ from the plan's")


def stream_rows(
    sides: dict[str, tuple[Scenario, VllmSide]],
    count: int,
    per_decade: int,
    reps: int,
    decades: tuple[tuple[int, int], ...] = DECADES,
) -> list[dict[str, Any]]:
    """Per mode and per stream (a realistic mix of ``count`` lengths, then each decade alone with
    ``per_decade``): every length new, so kvgeom's general planner is timed (its per-shape memo is cleared
    before every timed call, so no recipe can help) against vLLM's chain on the same request. Checked
    first, per request: vllm mode's descriptor ids equal vLLM's; kvgeom mode moves the same bytes
    (``RequestPlan.moves``, sorted) as vLLM's ids resolved in the vllm-mode pairing, with the same zero rows."""
    top = decades[-1][1]
    streams = [(f"16 to {top - 1:,}, realistic", stream_lengths(count, 16, top, 19, True))] + [
        (f"{lo:,} to {hi - 1:,}", stream_lengths(per_decade, lo, hi, 19 + i, False))
        for i, (lo, hi) in enumerate(decades)
    ]
    vsc, vside = sides["vllm"]
    floor = Floor(vsc)
    rows = []
    for name, lengths in streams:
        for compat, (sc, side) in sides.items():
            pairing = sc.pairings[0]
            memo = memo_of(pairing)
            t_v = t_k = t_f = 0.0
            descs = 0
            for tokens in lengths:
                req = vsc.request(tokens, seed=tokens)
                local, remote = [list(x) for x in req.decode], [list(x) for x in req.prefill]
                larr = [np.asarray(x, dtype=np.int64) for x in local]
                rarr = [np.asarray(x, dtype=np.int64) for x in remote]
                memo.shapes.clear()
                plan = plan_request(pairing, larr, rarr, "req", num_tokens=tokens)
                theirs = vside.desc_ids(local, remote)
                if compat == "vllm":
                    mine = {t.remote_rank: (t.local_ids, t.remote_ids) for t in plan.transfers}
                    if sorted(mine) != sorted(theirs) or any(
                        not (
                            np.array_equal(mine[r][0], theirs[r][0])
                            and np.array_equal(mine[r][1], theirs[r][1])
                        )
                        for r in mine
                    ):
                        raise SystemExit(f"stream {name}, {tokens} tokens: descriptor ids differ from vLLM's")
                else:
                    vplan = plan_request(vsc.pairings[0], larr, rarr, "req", num_tokens=tokens)
                    vmine = {t.remote_rank: (t.local_ids, t.remote_ids) for t in vplan.transfers}
                    if any(
                        not (
                            np.array_equal(vmine[r][0], theirs[r][0])
                            and np.array_equal(vmine[r][1], theirs[r][1])
                        )
                        for r in theirs
                    ) or not (
                        np.array_equal(
                            _sorted_moves(plan.moves(pairing)), _sorted_moves(vplan.moves(vsc.pairings[0]))
                        )
                        and np.array_equal(_sorted_moves(plan.zero), _sorted_moves(vplan.zero))
                    ):
                        raise SystemExit(
                            f"stream {name}, {tokens} tokens: kvgeom mode moves other bytes than vLLM"
                        )
                floor.check(plan, larr, rarr, tokens)
                descs += plan.num_descriptors
                vs, ks, fs = [], [], []
                for _ in range(reps):  # interleaved; every kvgeom call sees the shape for the first time
                    t0 = time.perf_counter()
                    side.desc_ids(local, remote)
                    vs.append(time.perf_counter() - t0)
                    memo.shapes.clear()
                    t0 = time.perf_counter()
                    plan_request(pairing, larr, rarr, "req", num_tokens=tokens)
                    ks.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    floor(larr, rarr)
                    fs.append(time.perf_counter() - t0)
                t_v += statistics.median(vs)
                t_k += statistics.median(ks)
                t_f += statistics.median(fs)
            rows.append(
                {
                    "stream": name,
                    "compat": compat,
                    "requests": len(lengths),
                    "median_tokens": int(statistics.median(lengths)),
                    "descriptor_pairs": descs,
                    "vllm_us": t_v / len(lengths) * 1e6,
                    "kvgeom_us": t_k / len(lengths) * 1e6,
                    "floor_us": t_f / len(lengths) * 1e6,
                    "ratio": t_k / t_v,
                    "floor_ratio": t_f / t_v,
                    "vs_floor": t_k / t_f,
                }
            )
    return rows


def _runs(plan: Any, pairing: Any) -> int:
    from kvgeom.plan.requestplan import contiguous_runs

    return contiguous_runs(plan.moves(pairing))


def _least(fn: Any, budget: float, most: int) -> float:
    """Least seconds of ``fn()`` (which returns its own timed seconds) over at least 3 and at most ``most``
    calls, stopping once they sum past ``budget``."""
    samples: list[float] = []
    while len(samples) < 3 or (len(samples) < most and sum(samples) < budget):
        samples.append(fn())
    return min(samples)


def handshake_row(blocks: int, budget: float, remotes: int = 2) -> dict[str, Any]:
    """Handshake of a D rank of about ``blocks`` kernel blocks (rounded to whole logical blocks of 60) with
    ``remotes`` P ranks (P TP ``remotes``). Least of repeated handshakes, each side on its own fresh state."""
    from kvgeom.layout.card import GeometryCard
    from kvgeom.plan.pairing import Pairing

    sc = scenario(max(1, round(blocks / 60)), p_tp=remotes)
    side = VllmSide(sc)
    check_tables(sc, side)
    d, p = sc.cards("decode")[0], sc.cards("prefill")
    d.geometry  # noqa: B018 - the local card as a connector keeps it (its geometry built once)

    def vllm() -> float:
        w = side.fresh()  # not timed: a fresh worker per handshake (registration is in `fresh`)
        t0 = time.perf_counter()
        side.handshake(w)
        return time.perf_counter() - t0

    # kvgeom: every P card arrives as its decoded JSON object (vLLM's metadata arrives decoded too), fresh for
    # every handshake, so nothing derived from it is reused between handshakes
    texts = [c.dumps() for c in p]
    parse_s: list[float] = []

    def kvgeom() -> float:
        objs = [json.loads(t) for t in texts]
        t0 = time.perf_counter()
        cards = GeometryCard.from_json_many(objs)
        t1 = time.perf_counter()
        pairing = Pairing.create(d, cards, "pull", "vllm")
        t2 = time.perf_counter()
        parse_s.append(t1 - t0)
        kvgeom.last = pairing  # type: ignore[attr-defined]
        return t2 - t0

    most = max(5, int(budget / 0.0005))
    t_v = _least(vllm, budget, most)
    t_k = _least(kvgeom, budget, most)
    pairing = kvgeom.last  # type: ignore[attr-defined]
    check_tables(sc, side, pairing)  # the timed pairing, from the parsed cards, too
    tables = [pairing.local_table(pairing.local_key(r)) for r in pairing.transfer_ranks] + [
        pairing.remote_table(r) for r in pairing.transfer_ranks
    ]
    runs = sum(len(t.runs) for t in tables)
    descs = sum(len(t) for t in tables)
    return {
        "blocks": d.geometry.num_blocks,
        "logical_blocks": d.geometry.logical_num_blocks,
        "remotes": remotes,
        "vllm_ms": t_v * 1e3,
        "kvgeom_ms": t_k * 1e3,
        "parse_ms": min(parse_s) * 1e3,
        "ratio": t_k / t_v,
        "table_runs": runs,
        "table_descriptors": descs,
        "table_bytes": runs * 5 * 8,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    ap.add_argument("--blocks", type=int, nargs="*", default=list(BLOCKS), help="kernel blocks per D rank")
    ap.add_argument("--remotes", type=int, nargs="*", default=list(REMOTES), help="P ranks (P TP sizes)")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of repeats per measurement and side")
    ap.add_argument(
        "--stream", type=int, default=200, help="requests in the realistic new-length stream (0: none)"
    )
    ap.add_argument("--per-decade", type=int, default=40, help="requests in each decade's stream")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per request and side (median)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    most = max([*args.tokens, DECADES[-1][1] if args.stream else 16])
    d_blocks = max(64, -(-most * 5 // 1920 // 2) + 8)  # room for the request's probes (2.5x) on both sides
    sc = scenario(d_blocks)
    side = VllmSide(sc)
    check_tables(sc, side)
    stream = []
    if args.stream:
        ksc = scenario(d_blocks, "kvgeom")
        stream = stream_rows(
            {"vllm": (sc, side), "kvgeom": (ksc, side)}, args.stream, args.per_decade, args.reps
        )
    requests = [request_row(sc, side, t, args.budget) for t in args.tokens]
    handshakes = [handshake_row(b, args.budget, n) for n in args.remotes for b in args.blocks]
    out = {"pair": sc.describe(), "stream": stream, "requests": requests, "handshakes": handshakes}
    if args.json:
        print(json.dumps(out))
        return
    print(out["pair"])
    if stream:
        print(
            f"{'new lengths':>22} {'mode':>7} {'reqs':>5} {'median tok':>10} {'vLLM us':>9} {'kvgeom us':>9} {'ratio':>6}"
        )
    for r in stream:
        print(
            f"{r['stream']:>22} {r['compat']:>7} {r['requests']:5d} {r['median_tokens']:10d} {r['vllm_us']:9.1f} "
            f"{r['kvgeom_us']:9.1f} {r['ratio']:6.2f} {r['floor_us']:9.1f} {r['floor_ratio']:10.2f} {r['vs_floor']:12.2f}"
        )
    print(
        f"{'tokens':>9} {'pairs':>8} {'runs':>8} {'vLLM us':>10} {'new shape':>10} {'ratio':>6} {'repeated':>10} "
        f"{'ratio':>6}"
    )
    for r in requests:
        print(
            f"{r['tokens']:9d} {r['pairs']:8d} {r['runs']:8d} {r['vllm_us']:10.1f} {r['kvgeom_new_us']:10.1f} "
            f"{r['ratio_new']:6.2f} {r['kvgeom_us']:10.1f} {r['ratio']:6.2f}"
        )
    print(
        f"{'P ranks':>7} {'blocks':>9} {'vLLM ms':>10} {'kvgeom ms':>10} {'parse ms':>9} {'ratio':>6} {'runs':>6} "
        f"{'descs':>10}"
    )
    for h in handshakes:
        print(
            f"{h['remotes']:7d} {h['blocks']:9d} {h['vllm_ms']:10.2f} {h['kvgeom_ms']:10.2f} {h['parse_ms']:9.2f} "
            f"{h['ratio']:6.2f} {h['table_runs']:6d} {h['table_descriptors']:10d}"
        )


if __name__ == "__main__":
    main()
