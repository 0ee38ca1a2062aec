"""End to end through real NIXL: one request moved by kvgeom's NIXL adapter against vLLM 0.33.0's own path.

Run in the vLLM venv (``make test-vllm`` builds ``.venv-vllm``):
``.venv-vllm/bin/python bench/bench_e2e_vllm.py [--op pull|push] [--tokens 1024 16384 131072] [--reps 5]
[--ids sequential|shuffled] [--json out.json] [--profile out.pstats]``.

One P process and one D process, each holding, side by side on the same geometry (facebook/opt-125m's
attention page, 12 KV heads of 64, float16, head-major, kernel blocks of 32 tokens, ``--layers`` layers,
P TP1 -> D TP1, CPU DRAM, UCX): a registered vLLM NIXL worker (vLLM's own ``NixlPullConnectorWorker`` or
``NixlPushConnectorWorker``, its real ``NixlWrapper``: a NIXL agent) and a kvgeom ``KVRank`` (its card is
the one ``kvgeom_vllm`` derives for the same vLLM cache). Both P copies hold the same bytes. Per request
length:

* pull, timed on D. vLLM: ``_read_blocks_for_req`` (vLLM's descriptor ids, ``make_prepped_xfer``,
  ``transfer``), then ``get_finished`` polled until the request is reported received (completion and
  vLLM's receive step). kvgeom: ``KVRank.pull`` in kvgeom mode (plan, the peer's freshness check, one
  descriptor per maximal run contiguous on both sides posted as per-request lists, completion, the
  post-receive step, done notices);
* push, timed on P. vLLM: ``_xfer_blocks_for_req`` (what its writer thread runs once D's registration
  arrived; the WRITEs carry the notification), then ``get_finished`` polled until the request is reported
  sent. kvgeom: ``KVRank.push`` (plan, freshness check, merged runs posted as WRITEs carrying the notice,
  completion) while D waits in ``wait_received``.

The first request of each length lands in zeroed D caches on both sides and is checked before anything is
timed: D's bytes equal P's on the request's blocks, zero elsewhere, and vLLM's D equals kvgeom's D. Then
both are timed interleaved (median of ``--reps``). Reported per request: vLLM's descriptor pairs posted,
the plan's pairs, the runs kvgeom posted (the fewest: ``contiguous_runs``), NIXL's count after its own
merging, kvgeom's freshness check and post-to-done time, and the ratio kvgeom / vLLM.
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
    """(vLLM's own pull or push worker (``spec["op"]``) with a real NIXL agent, registered; the kvgeom card of
    the same cache)."""
    from contextlib import ExitStack
    from unittest.mock import patch

    from _nixl_pairs import vllm_config
    from _vllm_workers import RecordingNixl
    from kvgeom_vllm.worker import KvgeomPullConnectorWorker, KvgeomPushConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as bw
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

    config = vllm_config(1, BLOCK, "LBHNC", "vllm")
    push = spec["op"] == "push"
    theirs = NixlPushConnectorWorker if push else NixlPullConnectorWorker
    ours = KvgeomPushConnectorWorker if push else KvgeomPullConnectorWorker
    out = []
    for cls, fake in ((theirs, False), (ours, True)):
        kvc, kv = caches(spec["layers"], spec["num_blocks"])
        with ExitStack() as stack:
            stack.enter_context(patch.object(bw, "get_tensor_model_parallel_rank", return_value=0))
            stack.enter_context(patch.object(bw, "get_tensor_model_parallel_world_size", return_value=1))
            if fake:  # only its card is used: no agent, no push writer thread
                stack.enter_context(patch.object(bw, "NixlWrapper", RecordingNixl))
                stack.enter_context(patch("threading.Thread"))
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
                if spec["op"] == "pull":  # in push, vLLM's writer thread owns the notifications
                    seen += sum(len(v) for v in w.nixl_wrapper.get_new_notifs().values())
                time.sleep(spec["serve_poll_s"])
                continue
            if cmd[0] == "exit":
                break
            try:
                _serve_push(w, kv, cmd, to_d)
            except Exception as exc:
                to_d.put(("error", f"{type(exc).__name__}: {exc}"))
                raise
        if spec["op"] == "push":
            w.shutdown()  # vLLM's writer thread
    return {"vllm_notifs": seen}


def _serve_push(w: Any, kv: Any, cmd: tuple, to_d: Any) -> None:
    """P in push: handshake with D, or push one request one way and report the time."""
    if cmd[0] == "connect":
        import msgspec
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

        _, port, d_meta = cmd
        kv.connect("decode", {0: port}, mode="push", compat="kvgeom")
        meta = msgspec.msgpack.decode(d_meta, type=NixlAgentMetadata)
        w._remote_agents["decode"][(0, 0)] = w.add_remote_agent(meta, remote_tp_rank=0, remote_tp_size=1)
        to_d.put(("connected", kv.card.to_json()))
        return
    _, side, n, ids, rid, count = cmd
    if side == "kvgeom":
        t0 = time.perf_counter()
        r = kv.push("decode", [ids], [ids], rid, rid, num_tokens=n)
        dt = time.perf_counter() - t0
        to_d.put(("pushed", dt, r.descriptors, r.runs, r.nixl_desc_count, r.seconds, r.transfer_seconds))
        return
    from _nixl_pairs import RecordingWrapper
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta

    raw = w.nixl_wrapper
    if count:
        w.nixl_wrapper = RecordingWrapper(raw)
    meta = ReqMeta(
        local_block_ids=[list(ids)],
        local_physical_block_ids=[list(ids)],
        tp_size=1,
        remote=RemoteMeta([list(ids)], "localhost", 0, "decode", rid),
    )
    deadline = time.monotonic() + STEP_S
    t0 = time.perf_counter()
    w._reqs_to_send[rid] = time.perf_counter() + STEP_S  # the lease the scheduler would have given it
    w._xfer_blocks_for_req(rid, meta)
    while rid not in w.get_finished()[0]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM's push of {rid} not done within {STEP_S}s")
    dt = time.perf_counter() - t0
    pairs = sum(int(x[2].size) for x in w.nixl_wrapper.xfers) if count else 0
    w.nixl_wrapper = raw
    to_d.put(("pushed", dt, pairs))


def _consumer(spec: dict, from_p: Any, to_p: Any) -> dict:
    """D: per length, one checked pull each way into zeroed caches, then ``reps`` timed pulls interleaved."""
    import msgspec
    from _nixl_pairs import RecordingWrapper
    from kvgeom_nixl.config import TransportConfig
    from kvgeom_nixl.kvrank import KVRank
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlConnectorMetadata,
    )

    from kvgeom import GeometryCard

    w, card = workers(spec, "decode")
    op = spec["op"]
    out: dict[str, Any] = {op: {}}
    with KVRank(card, TransportConfig(**spec["config"])) as kv:
        _, port, p_meta = _get(from_p, "P's ports")
        if op == "pull":
            kv.connect("prefill", {0: port}, mode="pull", compat="kvgeom")
            meta = msgspec.msgpack.decode(p_meta, type=NixlAgentMetadata)
            w._remote_agents["prefill"][(0, 0)] = w.add_remote_agent(meta, remote_tp_rank=0, remote_tp_size=1)
            w._engine_by_address[("localhost", 0)] = "prefill"  # as vLLM's handshake records it: P is current
        else:
            to_p.put(("connect", kv.port, w.xfer_handshake_metadata.agent_metadata_bytes))
            producer = GeometryCard.from_json(_get(from_p, "P's connection")[1])
        raw = w.nixl_wrapper
        mine = [t.numpy() for t in kv.tensors]
        theirs = region_arrays(w)
        src = [np.empty(a.size, dtype=np.uint8) for a in mine]
        for i, a in enumerate(src):
            pattern_fill(a, salt_of(0, i))
        page = [a.size // spec["num_blocks"] for a in mine]
        rng = np.random.default_rng(spec["seed"])
        serial = iter(range(1 << 30))

        def vllm_pull(ids: list[int], n: int, count: bool) -> tuple[float, int]:
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
            if count:  # the first pull counts vLLM's descriptors
                w.nixl_wrapper = RecordingWrapper(raw)
            deadline = time.monotonic() + STEP_S
            t0 = time.perf_counter()
            w._recving_metadata[rid] = req
            w._read_blocks_for_req(rid, req)
            while rid not in w.get_finished()[1]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM's pull of {rid} not done within {STEP_S}s")
            dt = time.perf_counter() - t0
            pairs = sum(int(x[2].size) for x in w.nixl_wrapper.xfers) if count else 0
            w.nixl_wrapper = raw
            return dt, pairs

        def kvgeom_pull(ids: list[int], n: int) -> tuple:
            rid = f"k-{next(serial)}"
            t0 = time.perf_counter()
            r = kv.pull("prefill", [ids], [ids], rid, rid, num_tokens=n)
            dt = time.perf_counter() - t0
            return dt, r.descriptors, r.runs, r.nixl_desc_count, r.seconds, r.transfer_seconds

        def vllm_push(ids: list[int], n: int, count: bool) -> tuple[float, int]:
            to_p.put(("push", "vllm", n, ids, f"v-{next(serial)}", count))
            return tuple(_get(from_p, "P's push report")[1:])  # type: ignore[return-value]

        def kvgeom_push(ids: list[int], n: int) -> tuple:
            rid = f"k-{next(serial)}"
            to_p.put(("push", "kvgeom", n, ids, rid, False))
            kv.wait_received(producer, [ids], [ids], rid, num_tokens=n, compat="kvgeom")
            return tuple(_get(from_p, "P's push report")[1:])

        vllm_op, kvgeom_op = (vllm_pull, kvgeom_pull) if op == "pull" else (vllm_push, kvgeom_push)

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
            _, vllm_pairs = vllm_op(ids, n, True)
            _, plan_pairs, runs, nixl_count, _, _ = kvgeom_op(ids, n)
            row: dict[str, Any] = {
                "tokens": n,
                "blocks": blocks,
                "bytes": len(ids) * sum(page),
                "vllm_bad_bytes": bad_bytes(theirs, ids),
                "kvgeom_bad_bytes": bad_bytes(mine, ids),
                "same_d": all(np.array_equal(a, b) for a, b in zip(mine, theirs, strict=True)),
                "vllm_pairs": vllm_pairs,
                "plan_pairs": plan_pairs,
                "kvgeom_posted": runs,
                "kvgeom_nixl_count": nixl_count,
                "vllm_s": [],
                "kvgeom_s": [],
                "kvgeom_transfer_s": [],
                "kvgeom_execute_s": [],
            }
            for _ in range(spec["reps"]):
                row["vllm_s"].append(vllm_op(ids, n, False)[0])
                if prof is not None:
                    prof.enable()
                dt, _, _, _, execute_s, transfer_s = kvgeom_op(ids, n)
                if prof is not None:
                    prof.disable()
                row["kvgeom_s"].append(dt)
                row["kvgeom_transfer_s"].append(transfer_s)
                row["kvgeom_execute_s"].append(execute_s)  # freshness check + post + completion
            for k in ("vllm_s", "kvgeom_s", "kvgeom_transfer_s", "kvgeom_execute_s"):
                row[k.replace("_s", "_median_s")] = statistics.median(row[k])
            row["ratio"] = row["kvgeom_median_s"] / row["vllm_median_s"]
            row["ratio_of_fastest"] = min(row["kvgeom_s"]) / min(
                row["vllm_s"]
            )  # the least disturbed run each
            out[op][str(n)] = row
        to_p.put(("exit",))
        if prof is not None:
            prof.dump_stats(spec["profile"])
    if op == "push":
        w.shutdown()
    return out


def report(res: dict, args: argparse.Namespace, wall: float, load: tuple[float, ...]) -> str:
    lines = [
        f"opt-125m page x {args.layers} layers, P TP1 -> D TP1, blocks of {BLOCK}, {args.ids} ids; UCX, DRAM, "
        f"1 P + 1 D process; median of {args.reps} (interleaved) after 1 checked request each; "
        f"load {load[0]:.1f} / {load[1]:.1f} (1 / 5 min)",
        "",
        "| op | tokens | MiB | vLLM pairs | kvgeom plan pairs | kvgeom posted (runs) | NIXL count "
        "| vLLM ms | kvgeom ms | of it: freshness | post to done | kvgeom / vLLM | fastest / fastest | bytes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for n, row in res[args.op].items():
        ok = not row["vllm_bad_bytes"] and not row["kvgeom_bad_bytes"] and row["same_d"]
        lines.append(
            f"| {args.op} | {int(n):,} | {row['bytes'] / 2**20:.1f} | {row['vllm_pairs']:,} | {row['plan_pairs']:,} "
            f"| {row['kvgeom_posted']:,} | {row['kvgeom_nixl_count']:,} | {row['vllm_median_s'] * 1e3:.2f} "
            f"| {row['kvgeom_median_s'] * 1e3:.2f} "
            f"| {(row['kvgeom_execute_median_s'] - row['kvgeom_transfer_median_s']) * 1e3:.2f} "
            f"| {row['kvgeom_transfer_median_s'] * 1e3:.2f} "
            f"| {row['ratio']:.2f} | {row['ratio_of_fastest']:.2f} | {'ok' if ok else 'DIFFER'} |"
        )
    lines += ["", f"wall {wall:.1f} s incl. process start"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 16384, 131072])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--op", choices=("pull", "push"), default="pull")
    ap.add_argument("--layers", type=int, default=2, help="attention layers (of opt-125m's 12)")
    ap.add_argument("--ids", choices=("sequential", "shuffled"), default="sequential")
    ap.add_argument("--slack", type=float, default=1.25)
    ap.add_argument("--serve-poll-us", type=float, default=200.0)
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--profile", metavar="PATH", help="cProfile kvgeom's timed pulls on D into PATH")
    args = ap.parse_args()
    spec = {
        "op": args.op,
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
        n for n, r in res[args.op].items() if r["vllm_bad_bytes"] or r["kvgeom_bad_bytes"] or not r["same_d"]
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
