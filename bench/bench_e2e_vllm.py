"""End to end through real NIXL: one request pulled by kvgeom's NIXL adapter against vLLM 0.33.0's own pull path.

Run in the vLLM venv (``make test-vllm`` builds ``.venv-vllm``):
``.venv-vllm/bin/python bench/bench_e2e_vllm.py [--tokens 1024 16384 131072] [--reps 5] [--ids sequential]``.

One P process and one D process, each holding, side by side on the same geometry (facebook/opt-125m's
attention page, 12 KV heads of 64, float16, head-major, kernel blocks of 32 tokens, ``--layers`` layers,
P TP1 -> D TP1, CPU DRAM, UCX): a registered vLLM ``NixlPullConnectorWorker`` (vLLM's own class, its
real ``NixlWrapper``: a NIXL agent) and a kvgeom ``KVRank`` (its card is the one ``kvgeom_vllm`` derives
for the same vLLM cache). Both P copies hold the same bytes. Per request length, D times:

* vLLM: ``_read_blocks_for_req`` (vLLM's descriptor ids, ``make_prepped_xfer``, ``transfer``), then
  ``get_finished`` polled until the request is reported received (completion, vLLM's receive step);
* kvgeom: ``KVRank.pull`` in kvgeom mode (plan, the peer's freshness check, one descriptor per maximal run
  contiguous on both sides posted as per-request lists, completion, the post-receive step, done notices).

The first request of each length lands in zeroed D caches on both sides and is checked before anything is
timed: D's bytes equal P's on the request's blocks, zero elsewhere, and vLLM's D equals kvgeom's D. Then
both are timed interleaved (median of ``--reps``). Reported per request: vLLM's descriptor pairs posted,
the plan's pairs, the runs kvgeom posted (the fewest: ``contiguous_runs``), NIXL's count after its own
merging, and the ratio kvgeom / vLLM.

Push is not timed here: vLLM 0.33.0's push path (``NixlPushConnectorWorker._xfer_blocks_for_req``, run by
its writer thread after D's registration notification) needs D's scheduler-side registration; see
docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue as queue_mod
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _k, _v in {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_SSM_CONV_STATE_LAYOUT": "DS",
    "HF_HOME": str(ROOT / ".vllm-src" / "hf"),
    "UCX_MODULES": "^ib,rdmacm",
}.items():
    os.environ.setdefault(_k, _v)
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

import numpy as np  # noqa: E402
from _pullkit import STEP_S  # noqa: E402  (sibling module)
from bench_pull import pattern_fill, salt_of  # noqa: E402
from kvgeom_lab.procs import ProcGroup  # noqa: E402

BLOCK = 32  # tokens per block (vLLM's CPU attention takes multiples of 32)


def caches(layers: int, num_blocks: int) -> tuple[Any, dict[str, Any]]:
    """vLLM's KV-cache config and one head-major ``[blocks, heads, tokens, 128]`` float16 cache per layer."""
    import torch
    from _nixl_pairs import HEAD_BYTES, HEADS, LAYERS
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    names = LAYERS[:layers]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=64, dtype=torch.float16)
    kv = {n: torch.zeros((num_blocks, HEADS, BLOCK, 128), dtype=torch.float16) for n in names}
    page = BLOCK * HEADS * HEAD_BYTES
    tensors = [
        KVCacheTensor(size=num_blocks * page, layers=[n], layer_stride=page, block_stride=page) for n in names
    ]
    return KVCacheConfig(num_blocks, tensors, [KVCacheGroupSpec(list(names), spec)]), kv


def workers(spec: dict, engine_id: str) -> tuple[Any, Any]:
    """(vLLM's own pull worker with a real NIXL agent, registered; the kvgeom card of the same cache)."""
    from contextlib import ExitStack
    from unittest.mock import patch

    from _nixl_pairs import vllm_config
    from _vllm_workers import RecordingNixl
    from kvgeom_vllm.worker import KvgeomPullConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

    config = vllm_config(1, BLOCK, "LBHNC", "vllm")
    out = []
    for cls, fake in ((NixlPullConnectorWorker, False), (KvgeomPullConnectorWorker, True)):
        kvc, kv = caches(spec["layers"], spec["num_blocks"])
        with ExitStack() as stack:
            stack.enter_context(patch.object(bw, "get_tensor_model_parallel_rank", return_value=0))
            stack.enter_context(patch.object(bw, "get_tensor_model_parallel_world_size", return_value=1))
            if fake:  # only its card is used: no agent
                stack.enter_context(patch.object(bw, "NixlWrapper", RecordingNixl))
            w = cls(config, engine_id, kvc)
            w.register_kv_caches(kv)
        out.append(w)
    return out[0], out[1].kvgeom_card


def region_arrays(w: Any) -> list[np.ndarray]:
    from _nixl_pairs import region_views

    return [v.numpy() for v in region_views(w)]


def _get(q: Any, what: str) -> Any:
    try:
        got = q.get(timeout=STEP_S * 3)
    except queue_mod.Empty:
        raise TimeoutError(f"no {what} within {STEP_S * 3}s") from None
    if got[0] == "error":
        raise RuntimeError(f"P failed: {got[1]}")
    return got


def _producer(spec: dict, to_d: Any, inbox: Any) -> dict:
    """P: a vLLM worker and a KVRank over the same bytes; serve (drain notifications) until told to exit."""
    from kvgeom_nixl.config import TransportConfig
    from kvgeom_nixl.kvrank import KVRank

    w, card = workers(spec, "prefill")
    with KVRank(card, TransportConfig(**spec["config"])) as kv:
        mine = [t.numpy() for t in kv.tensors]
        theirs = region_arrays(w)
        if [a.size for a in mine] != [a.size for a in theirs]:
            raise RuntimeError(
                f"kvgeom's regions {[a.size for a in mine]} != vLLM's {[a.size for a in theirs]}"
            )
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            pattern_fill(a, salt_of(0, i))
            b[:] = a
        to_d.put(("p_ready", kv.port, w.xfer_handshake_metadata.agent_metadata_bytes))
        end = time.monotonic() + spec["timeout_s"]
        seen = 0
        while time.monotonic() < end:
            try:
                cmd = inbox.get_nowait()
            except queue_mod.Empty:
                kv.drain()
                seen += sum(len(v) for v in w.nixl_wrapper.get_new_notifs().values())
                time.sleep(spec["serve_poll_s"])
                continue
            if cmd[0] == "exit":
                break
    return {"vllm_notifs": seen}


def _consumer(spec: dict, from_p: Any, to_p: Any) -> dict:
    """D: per length, one checked pull each way into zeroed caches, then ``reps`` timed pulls interleaved."""
    import msgspec
    from kvgeom_nixl.config import TransportConfig
    from kvgeom_nixl.kvrank import KVRank
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlConnectorMetadata,
    )

    w, card = workers(spec, "decode")
    out: dict[str, Any] = {"pull": {}}
    with KVRank(card, TransportConfig(**spec["config"])) as kv:
        _, port, p_meta = _get(from_p, "P's ports")
        kv.connect("prefill", {0: port}, mode="pull", compat="kvgeom")
        meta = msgspec.msgpack.decode(p_meta, type=NixlAgentMetadata)
        w._remote_agents["prefill"][(0, 0)] = w.add_remote_agent(meta, remote_tp_rank=0, remote_tp_size=1)
        w._engine_by_address[("localhost", 0)] = "prefill"  # as vLLM's handshake records it: P stays current
        raw = w.nixl_wrapper
        mine = [t.numpy() for t in kv.tensors]
        theirs = region_arrays(w)
        src = [np.empty(a.size, dtype=np.uint8) for a in mine]
        for i, a in enumerate(src):
            pattern_fill(a, salt_of(0, i))
        page = [a.size // spec["num_blocks"] for a in mine]
        rng = np.random.default_rng(spec["seed"])
        serial = iter(range(1 << 30))

        def vllm_pull(ids: list[int], n: int) -> float:
            rid = f"v-{next(serial)}"
            md = NixlConnectorMetadata()
            md.add_new_req_to_recv(
                rid,
                [ids],
                {
                    "remote_block_ids": [ids],
                    "remote_engine_id": "prefill",
                    "remote_request_id": rid,
                    "remote_host": "localhost",
                    "remote_port": 0,
                    "tp_size": 1,
                    "remote_num_tokens": n,
                },
                local_num_computed_blocks=(0,),
                awaiting_kvs=True,
            )
            req = md.reqs_to_recv[rid]
            deadline = time.monotonic() + STEP_S
            t0 = time.perf_counter()
            w._recving_metadata[rid] = req
            w._read_blocks_for_req(rid, req)
            while rid not in w.get_finished()[1]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM's pull of {rid} not done within {STEP_S}s")
            return time.perf_counter() - t0

        def kvgeom_pull(ids: list[int], n: int) -> tuple[float, Any]:
            rid = f"k-{next(serial)}"
            t0 = time.perf_counter()
            r = kv.pull("prefill", [ids], [ids], rid, rid, num_tokens=n)
            return time.perf_counter() - t0, r

        def bad_bytes(dst: list[np.ndarray], ids: list[int]) -> int:
            bad = 0
            for a, s, pg in zip(dst, src, page, strict=True):
                want = np.zeros_like(s)
                for b in ids:
                    want[b * pg : (b + 1) * pg] = s[b * pg : (b + 1) * pg]
                bad += int(np.count_nonzero(a != want))
            return bad

        prof = None
        if spec.get("profile"):  # cProfile of kvgeom's timed pulls (--profile PATH: pstats file)
            import cProfile

            prof = cProfile.Profile()
        for n in spec["tokens"]:
            blocks = math.ceil(n / BLOCK)
            pool = np.arange(spec["num_blocks"])
            ids = (rng.permutation(pool)[:blocks] if spec["shuffled"] else pool[:blocks]).tolist()
            for a in [*mine, *theirs]:
                a[:] = 0
            from _nixl_pairs import RecordingWrapper

            w.nixl_wrapper = RecordingWrapper(raw)  # the first pull counts vLLM's descriptors
            vllm_pull(ids, n)
            vllm_pairs = sum(int(x[2].size) for x in w.nixl_wrapper.xfers)
            w.nixl_wrapper = raw
            _, first = kvgeom_pull(ids, n)
            row: dict[str, Any] = {
                "tokens": n,
                "blocks": blocks,
                "bytes": first.bytes_moved,
                "vllm_bad_bytes": bad_bytes(theirs, ids),
                "kvgeom_bad_bytes": bad_bytes(mine, ids),
                "same_d": all(np.array_equal(a, b) for a, b in zip(mine, theirs, strict=True)),
                "vllm_pairs": vllm_pairs,
                "plan_pairs": first.descriptors,
                "kvgeom_posted": first.runs,
                "kvgeom_nixl_count": first.nixl_desc_count,
                "vllm_s": [],
                "kvgeom_s": [],
                "kvgeom_transfer_s": [],
                "kvgeom_execute_s": [],
            }
            for _ in range(spec["reps"]):
                row["vllm_s"].append(vllm_pull(ids, n))
                if prof is not None:
                    prof.enable()
                dt, r = kvgeom_pull(ids, n)
                if prof is not None:
                    prof.disable()
                row["kvgeom_s"].append(dt)
                row["kvgeom_transfer_s"].append(r.transfer_seconds)
                row["kvgeom_execute_s"].append(r.seconds)  # freshness check + post + completion
            for k in ("vllm_s", "kvgeom_s", "kvgeom_transfer_s", "kvgeom_execute_s"):
                row[k.replace("_s", "_median_s")] = statistics.median(row[k])
            row["ratio"] = row["kvgeom_median_s"] / row["vllm_median_s"]
            out["pull"][str(n)] = row
        to_p.put(("exit",))
        if prof is not None:
            prof.dump_stats(spec["profile"])
    return out


def report(res: dict, args: argparse.Namespace, wall: float, load: tuple[float, ...]) -> str:
    lines = [
        f"opt-125m page x {args.layers} layers, P TP1 -> D TP1, blocks of {BLOCK}, {args.ids} ids; UCX, DRAM, "
        f"1 P + 1 D process; median of {args.reps} (interleaved) after 1 checked pull each; "
        f"load {load[0]:.1f} / {load[1]:.1f} (1 / 5 min)",
        "",
        "| op | tokens | MiB | vLLM pairs | kvgeom plan pairs | kvgeom posted (runs) | NIXL count "
        "| vLLM ms | kvgeom ms | of it: freshness | post to done | kvgeom / vLLM | bytes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for n, row in res["pull"].items():
        ok = not row["vllm_bad_bytes"] and not row["kvgeom_bad_bytes"] and row["same_d"]
        lines.append(
            f"| pull | {int(n):,} | {row['bytes'] / 2**20:.1f} | {row['vllm_pairs']:,} | {row['plan_pairs']:,} "
            f"| {row['kvgeom_posted']:,} | {row['kvgeom_nixl_count']:,} | {row['vllm_median_s'] * 1e3:.2f} "
            f"| {row['kvgeom_median_s'] * 1e3:.2f} "
            f"| {(row['kvgeom_execute_median_s'] - row['kvgeom_transfer_median_s']) * 1e3:.2f} "
            f"| {row['kvgeom_transfer_median_s'] * 1e3:.2f} "
            f"| {row['ratio']:.2f} | {'ok' if ok else 'DIFFER'} |"
        )
    lines += ["", f"wall {wall:.1f} s incl. process start"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 16384, 131072])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=2, help="attention layers (of opt-125m's 12)")
    ap.add_argument("--ids", choices=("sequential", "shuffled"), default="sequential")
    ap.add_argument("--slack", type=float, default=1.25)
    ap.add_argument("--serve-poll-us", type=float, default=200.0)
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--profile", metavar="PATH", help="cProfile kvgeom's timed pulls on D into PATH")
    args = ap.parse_args()
    spec = {
        "profile": args.profile,
        "tokens": args.tokens,
        "reps": args.reps,
        "layers": args.layers,
        "num_blocks": math.ceil(math.ceil(max(args.tokens) / BLOCK) * args.slack) + 1,
        "shuffled": args.ids == "shuffled",
        "seed": 7,
        "timeout_s": args.timeout,
        "serve_poll_s": args.serve_poll_us * 1e-6,
        "config": {"secret": os.urandom(32).hex()},
    }
    print(f"bench_e2e_vllm: tokens {args.tokens}; starting 1 P + 1 D processes ...", flush=True)
    t0 = time.monotonic()
    with ProcGroup() as group:
        to_d, to_p = group.queue(), group.queue()
        group.spawn(_producer, (spec, to_d, to_p), "prefill")
        group.spawn(_consumer, (spec, to_d, to_p), "decode")
        got = group.collect(args.timeout, ["decode", "prefill"])
        res = got["decode"].unwrap()
        got["prefill"].unwrap()
    wall = time.monotonic() - t0
    load = os.getloadavg()
    print(report(res, args, wall, load))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "wall_s": wall, "load": load, "results": res}, f, indent=1)
    bad = [
        n for n, r in res["pull"].items() if r["vllm_bad_bytes"] or r["kvgeom_bad_bytes"] or not r["same_d"]
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
