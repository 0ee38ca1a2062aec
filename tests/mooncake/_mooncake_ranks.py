"""Ranks of a P/D pair as separate processes, each one MooncakeRank with its own transfer engine, driven
by commands over multiprocessing queues; P ranks hold known content (kvgeom.testing.content), D starts
as poison and checks every byte of its regions with verify_report."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from dataclasses import asdict
from typing import Any

import numpy as np

from kvgeom import GeometryCard, KvgeomError, rank_geometry
from kvgeom.testing import CoordSpace
from kvgeom.testing.content import POISON_BYTE, fill_source, verify_report
from kvgeom.tools.scenario import Scenario

SECRET = "kvgeom-mooncake-test-secret-0123456789"
STEP_S = 60.0  # bound of one command's answer (a busy 2-core machine)


def space_of(sc: Scenario, max_tokens: int) -> CoordSpace:
    return CoordSpace(sc.model, max_tokens + max(sc.prefill.block_size, sc.decode.block_size))


def _child(
    role: str, rank: int, scenario: dict, max_tokens: int, inbox: Any, outbox: Any, where: tuple | None = None
) -> None:
    if where is not None:  # first thing, single-threaded: this rank's host is a network namespace
        from kvgeom_lab.netns import enter_netns

        enter_netns(where[0])
    host = where[1] if where is not None else "127.0.0.1"
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's INFO/WARNING lines: errors only
    from kvgeom_mooncake import MooncakeConfig, MooncakeRank

    sc = Scenario.from_json(scenario)
    card = sc.cards(role)[rank]
    space = space_of(sc, max_tokens)
    kv = MooncakeRank(
        card, MooncakeConfig(secret=SECRET, transfer_timeout_s=20.0, notif_timeout_s=20.0), host
    )
    if role == "decode":
        for a in kv.arrays:
            a[:] = POISON_BYTE
    outbox.put(("ready", kv.payload(), os.getpid()))
    while True:
        cmd, kw = inbox.get(timeout=600)
        try:
            if cmd == "stop":
                kv.close()
                outbox.put(("ok", None))
                return
            if cmd == "fill":
                n = sum(fill_source(kv.arrays, card, space, r["p_ids"], r["tokens"], r["salt"]) for r in kw)
                out: Any = n
            elif cmd == "connect":
                kv.connect(kw["engine"], {int(k): v for k, v in kw["payloads"].items()}, **kw.get("opts", {}))
                out = None
            elif cmd == "watch":
                kv.watch(kw["engine"], {int(k): v for k, v in kw["payloads"].items()})
                out = None
            elif cmd == "pull":
                out = asdict(kv.pull(**kw))
            elif cmd == "push":
                out = asdict(kv.push(**kw))
            elif cmd == "wait_received":
                kw = dict(kw)
                kw["producer"] = GeometryCard(kw.pop("producer_engine"), sc.model, sc.prefill, sc.mode)
                out = asdict(kv.wait_received(**kw))
            elif cmd == "batches":
                plan, bs = kv.plan(**kw)
                out = {
                    "moves": plan.moves(kv.pairings[kw["engine_id"]]).tolist(),
                    "batches": [
                        (b.remote_rank, b.local.tolist(), b.remote.tolist(), b.length.tolist()) for b in bs
                    ],
                    "bases": [int(a.ctypes.data) for a in kv.arrays],
                }
            elif cmd == "release":
                held = kv.release(kw["request_id"], kw["attempt"])
                out = None if held is None else list(held.token)
            elif cmd == "settle":
                out = [list(h.token) for h in kv.settle()]
            elif cmd == "quarantined":
                out = [list(h.token) for h in kv.quarantined()]
            elif cmd == "verify":
                reqs = [
                    (r["d_ids"], r.get("first", 0), r["tokens"], r["ok"], r["salt"]) for r in kw["requests"]
                ]
                rep = verify_report(kv.arrays, card, space, reqs)
                out = {
                    "bad": rep.bad_bytes,
                    "checked": rep.checked_bytes,
                    "total": sum(a.size for a in kv.arrays),
                    "mismatches": [str(m) for m in rep.mismatches[:5]],
                }
            else:
                raise ValueError(f"unknown command {cmd!r}")
            outbox.put(("ok", out))
        except Exception as exc:  # the test asserts on the type and fields
            fields = {"field": getattr(exc, "field", None), "stage": getattr(exc, "stage", None)}
            outbox.put(("err", type(exc).__name__, fields, str(exc), traceback.format_exc()[-2000:]))


class Rank:
    def __init__(
        self, ctx: Any, role: str, rank: int, scenario: dict, max_tokens: int, where: tuple | None = None
    ) -> None:
        self.role, self.rank = role, rank
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=_child, args=(role, rank, scenario, max_tokens, self.inbox, self.outbox, where)
        )
        self.proc.start()
        self.payload: dict | None = None

    def ready(self) -> None:
        kind, payload, _ = self.outbox.get(timeout=STEP_S)
        assert kind == "ready"
        self.payload = payload

    def send(self, cmd: str, kw: Any = None) -> None:
        self.inbox.put((cmd, kw))

    def answer(self, timeout: float = STEP_S) -> tuple:
        try:
            return self.outbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.role} rank {self.rank}: no answer in {timeout}s") from None

    def call(self, cmd: str, kw: Any = None, timeout: float = STEP_S) -> Any:
        self.send(cmd, kw)
        got = self.answer(timeout)
        if got[0] != "ok":
            raise AssertionError(f"{self.role} rank {self.rank} {cmd}: {got[1]}: {got[3]}\n{got[4]}")
        return got[1]

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def end(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
        self.proc.join(10)
        for q in (self.inbox, self.outbox):
            q.close()
            q.cancel_join_thread()


class Pair:
    """P ranks and D ranks of a scenario, started together and ended together. ``hosts``: per
    ``(role, rank)`` the ``(network namespace, address)`` the rank runs in (default: loopback here)."""

    def __init__(self, scenario: dict, max_tokens: int, hosts: dict | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.sc = Scenario.from_json(scenario)
        self.scenario = scenario
        self.p: list[Rank] = []
        self.d: list[Rank] = []
        try:
            at = hosts or {}
            self.p = [
                Rank(ctx, "prefill", r, scenario, max_tokens, at.get(("prefill", r)))
                for r in range(self.sc.prefill.tp_size)
            ]
            self.d = [
                Rank(ctx, "decode", r, scenario, max_tokens, at.get(("decode", r)))
                for r in range(self.sc.decode.tp_size)
            ]
            for x in self.p + self.d:
                x.ready()
        except BaseException:
            self.end()
            raise

    def payloads(self, side: str) -> dict[int, dict]:
        return {x.rank: x.payload for x in (self.p if side == "prefill" else self.d)}

    def end(self) -> None:
        for x in self.p + self.d:
            x.end()


class Blocks:
    """Disjoint block ids per engine, one list per KV-cache group (attention: ceil(tokens / block)
    blocks; one-block groups: one slot), from a seeded permutation of each pool."""

    def __init__(self, sc: Scenario, seed: int = 7) -> None:
        rng = np.random.default_rng(seed)
        self.sc = sc
        self.free = {
            side: [int(b) for b in rng.permutation(sc.engine(side).num_blocks)]
            for side in ("prefill", "decode")
        }

    def take(self, side: str, tokens: int, skip: int = 0) -> list[list[int]]:
        eng = self.sc.engine(side)
        groups = rank_geometry(self.sc.model, eng).groups
        out = []
        for g in groups:
            n = 1 if g.one_block else math.ceil(tokens / eng.block_size) - skip
            if n > len(self.free[side]):
                raise KvgeomError("num_blocks", f"{side} pool exhausted", value=eng.num_blocks)
            out.append([self.free[side].pop() for _ in range(n)])
        return out


def wait_dead(proc: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while proc.is_alive() and time.monotonic() < end:
        time.sleep(0.01)
