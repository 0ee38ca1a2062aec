"""Ranks of a P/D pair as separate processes, for either transport: each process holds one rank of its
transport (``nixl``: :class:`kvgeom_nixl.kvrank.KVRank`, the rank ``kvgeom_lab.cluster`` runs;
``mooncake``: :class:`kvgeom_mooncake.MooncakeRank`) and obeys commands over multiprocessing queues. P ranks
hold known content (kvgeom.testing.content), D starts as poison and checks every byte of its regions with
verify_report.

A driver per transport (:class:`_NixlDriver`, :class:`_MooncakeDriver`) maps the commands onto its rank's
calls; everything above the drivers (the command loop, :class:`Rank`, :class:`Pair`, :class:`Blocks`) is
the same for both. NIXL ranks run with ``UCX_TLS=tcp``: as Mooncake's TCP transport, no byte moves
without the producer (with UCX's CMA a READ from a stopped process completes), so a stalled producer is a
stalled transfer on both."""

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

from kvgeom import GeometryCard, KvgeomError, ModelSpec, rank_geometry
from kvgeom.testing import CoordSpace
from kvgeom.testing.content import POISON_BYTE, fill_source, verify_report
from kvgeom.tools.scenario import Scenario, example

SECRET = "kvgeom-transport-test-secret-0123456789"
STEP_S = 60.0  # bound of one command's answer (a busy 2-core machine)
TRANSPORTS = ("nixl", "mooncake")

# the demo's 12-layer Mamba2 hybrid (3 attention + 9 Mamba2 layers), the shipped example's model
MODEL = ModelSpec.from_json(example("demo-mamba2-hybrid_p2_d1_pull")["model"])


def scenario(mode: str, p_kernel: int = 8) -> dict:
    """P TP2 (blocks of 32 tokens, kernel blocks of ``p_kernel``) -> D TP1 (64 in 16). Pull uses P kernel
    blocks of 8 (the same kernel blocks per block on both sides: prefix caching allowed); push needs P's
    kernel block to be a multiple of D's (kvgeom refuses 8 into 16), so it uses 16."""
    return {
        "model": MODEL.to_json(),
        "mode": mode,
        "compat": "kvgeom",
        "prefill": {"tp_size": 2, "block_size": 32, "kernel_block_size": p_kernel, "num_blocks": 256},
        "decode": {"tp_size": 1, "block_size": 64, "kernel_block_size": 16, "num_blocks": 128},
    }


def space_of(sc: Scenario, max_tokens: int) -> CoordSpace:
    return CoordSpace(sc.model, max_tokens + max(sc.prefill.block_size, sc.decode.block_size))


def _row(res: Any) -> dict:
    """A served attempt, the same fields for both transports: ``posted`` descriptors (after merging),
    ``transfers`` (one per remote rank it moved bytes with), bytes moved and zeroed."""
    d = asdict(res)
    if "batches" in d:  # MoonResult
        return {
            k: d[k] for k in ("ok", "attempt", "descriptors", "posted", "bytes_moved", "bytes_zeroed")
        } | {"transfers": d["batches"]}
    return {
        "ok": d["ok"],
        "attempt": d["attempt"],
        "descriptors": d["descriptors"],
        "posted": d["runs"],
        "bytes_moved": d["bytes_moved"],
        "bytes_zeroed": d["bytes_zeroed"],
        "transfers": len(res.telemetry),
    }


class _MooncakeDriver:
    def __init__(self, card: GeometryCard, host: str) -> None:
        os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's INFO/WARNING lines: errors only
        from kvgeom_mooncake import MooncakeConfig, MooncakeRank

        self.kv = MooncakeRank(
            card, MooncakeConfig(secret=SECRET, transfer_timeout_s=20.0, notif_timeout_s=20.0), host
        )
        self.arrays = self.kv.arrays

    def poison(self) -> None:
        for a in self.arrays:
            a[:] = POISON_BYTE

    def address(self) -> Any:
        return self.kv.payload()

    def connect(self, engine: str, addrs: dict, mode: str, compat: str) -> None:
        self.kv.connect(engine, addrs, mode=mode, compat=compat)

    def watch(self, engine: str, addrs: dict) -> None:
        self.kv.watch(engine, addrs)

    def pull(self, engine_id: str, local_ids, remote_ids, request_id: str, **kw: Any) -> dict:
        return _row(self.kv.pull(engine_id, local_ids, remote_ids, request_id, **kw))

    def push(self, engine_id: str, local_ids, remote_ids, request_id: str, **kw: Any) -> dict:
        return _row(self.kv.push(engine_id, local_ids, remote_ids, request_id, **kw))

    def wait_received(self, producer: GeometryCard, local_ids, producer_ids, request_id: str, **kw) -> dict:
        res = self.kv.wait_received(producer, local_ids, producer_ids, request_id, **kw)
        return {"ok": res.ok, "attempt": res.attempt, "bytes_zeroed": res.bytes_zeroed}

    def settle(self) -> list:
        return [list(h.token) for h in self.kv.settle()]

    def quarantined(self) -> list:
        return [list(h.token) for h in self.kv.quarantined()]

    def writer_gone(self, request_id: str, attempt: int) -> list:
        """Push, D: the deployment knows the writer is gone (Mooncake's engine tells nothing): release."""
        held = self.kv.release(request_id, attempt)
        return [] if held is None else [list(held.token)]

    def busy(self, seconds: float) -> None:  # not used: a Mooncake producer is stalled by SIGSTOP
        time.sleep(seconds)

    def idle(self) -> None:  # the engine's own threads move the bytes
        pass

    def close(self) -> None:
        self.kv.close()


class _NixlDriver:
    def __init__(self, card: GeometryCard, host: str) -> None:
        os.environ["UCX_TLS"] = "tcp"  # before NIXL loads (see the module docstring)
        from kvgeom_nixl import TransportConfig
        from kvgeom_nixl.kvrank import KVRank

        cfg = TransportConfig(
            secret=SECRET.encode(), handshake_timeout_s=20.0, transfer_timeout_s=20.0, notif_timeout_s=20.0
        )
        self.kv = KVRank(card, cfg, host=host)
        self.arrays = self.kv.tensors

    def poison(self) -> None:
        for t in self.arrays:
            t.fill_(POISON_BYTE)

    def address(self) -> Any:
        return [self.kv.host, self.kv.port]

    def connect(self, engine: str, addrs: dict, mode: str, compat: str) -> None:
        self.kv.connect(engine, {r: tuple(a) for r, a in addrs.items()}, mode=mode, compat=compat)

    def watch(self, engine: str, addrs: dict) -> None:
        self.kv.watch(engine, {r: tuple(a) for r, a in addrs.items()})

    def pull(self, engine_id: str, local_ids, remote_ids, request_id: str, **kw: Any) -> dict:
        return _row(self.kv.pull(engine_id, local_ids, remote_ids, request_id, request_id, **kw))

    def push(self, engine_id: str, local_ids, remote_ids, request_id: str, **kw: Any) -> dict:
        return _row(self.kv.push(engine_id, local_ids, remote_ids, request_id, request_id, **kw))

    def wait_received(self, producer: GeometryCard, local_ids, producer_ids, request_id: str, **kw) -> dict:
        res = self.kv.wait_received(producer, local_ids, producer_ids, request_id, **kw)
        return {"ok": res.ok, "attempt": res.attempt, "bytes_zeroed": res.bytes_zeroed}

    def settle(self) -> list:
        return [[s.request_id, s.attempt] for s in self.kv.settle()]

    def quarantined(self) -> list:
        return [list(h.token) for h in self.kv.quarantined()]

    def writer_gone(self, request_id: str, attempt: int) -> list:
        """Push, D: the fence finds out itself (the writer's side channel refuses: its process is gone)."""
        return [t for t in self.settle() if t == [request_id, attempt]]

    def busy(self, seconds: float) -> None:
        """Alive (its side channel answers) but not driving NIXL: over UCX's TCP nothing moves."""
        time.sleep(seconds)

    def idle(self) -> None:  # the target of a READ must poll (no progress thread): D notices, progress
        self.kv.drain()

    def close(self) -> None:
        self.kv.close()


DRIVERS = {"nixl": _NixlDriver, "mooncake": _MooncakeDriver}


def _sources(transport: str) -> set[str]:
    """Where this process's kvgeom and transport adapter come from (a rank must run the code under test)."""
    import importlib

    import kvgeom

    return {kvgeom.__file__, importlib.import_module(f"kvgeom_{transport}").__file__ or ""}


def _child(
    transport: str,
    role: str,
    rank: int,
    scenario: dict,
    max_tokens: int,
    inbox: Any,
    outbox: Any,
    where: tuple | None = None,
) -> None:
    if where is not None:  # first thing, single-threaded: this rank's host is a network namespace
        from kvgeom_lab.netns import enter_netns

        enter_netns(where[0])
    host = where[1] if where is not None else "127.0.0.1"
    sc = Scenario.from_json(scenario)
    card = sc.cards(role)[rank]
    space = space_of(sc, max_tokens)
    drv = DRIVERS[transport](card, host)
    if role == "decode":
        drv.poison()
    outbox.put(("ready", drv.address(), sorted(_sources(transport))))
    last = time.monotonic()
    while True:
        try:
            cmd, kw = inbox.get(timeout=0.002)
        except queue.Empty:
            if time.monotonic() - last > 600:
                raise TimeoutError(f"{role} rank {rank}: no command for 600 s") from None
            drv.idle()
            continue
        last = time.monotonic()
        try:
            if cmd == "busy":  # no answer: the rank's next answer is to the next command
                drv.busy(kw)
                continue
            if cmd == "stop":
                drv.close()
                outbox.put(("ok", None))
                return
            if cmd == "fill":
                n = sum(fill_source(drv.arrays, card, space, r["p_ids"], r["tokens"], r["salt"]) for r in kw)
                out: Any = n
            elif cmd == "connect":
                addrs = {int(k): v for k, v in kw["addrs"].items()}
                drv.connect(kw["engine"], addrs, kw.get("mode", sc.mode), sc.compat)
                out = None
            elif cmd == "watch":
                drv.watch(kw["engine"], {int(k): v for k, v in kw["addrs"].items()})
                out = None
            elif cmd == "pull":
                out = drv.pull(**kw)
            elif cmd == "push":
                out = drv.push(**kw)
            elif cmd == "wait_received":
                kw = dict(kw)
                kw["producer"] = GeometryCard(kw.pop("producer_engine"), sc.model, sc.prefill, sc.mode)
                out = drv.wait_received(**kw)
            elif cmd == "writer_gone":
                out = drv.writer_gone(kw["request_id"], kw["attempt"])
            elif cmd == "settle":
                out = drv.settle()
            elif cmd == "quarantined":
                out = drv.quarantined()
            elif cmd == "stats":  # the rank's counters, for a failing assertion's message
                out = {k: v for k, v in drv.kv.stats.items() if isinstance(v, int)}
            elif cmd == "verify":
                reqs = [
                    (r["d_ids"], r.get("first", 0), r["tokens"], r["ok"], r["salt"]) for r in kw["requests"]
                ]
                rep = verify_report(drv.arrays, card, space, reqs)
                out = {
                    "bad": rep.bad_bytes,
                    "checked": rep.checked_bytes,
                    "total": sum(int(np.asarray(a).nbytes) for a in drv.arrays),
                    "mismatches": [str(m) for m in rep.mismatches[:5]],
                }
            else:
                raise ValueError(f"unknown command {cmd!r}")
            outbox.put(("ok", out))
        except Exception as exc:  # the test asserts on the type and fields
            fields = {k: getattr(exc, k, None) for k in ("field", "stage", "status")}
            outbox.put(("err", type(exc).__name__, fields, str(exc), traceback.format_exc()[-2000:]))


class Rank:
    def __init__(
        self,
        ctx: Any,
        transport: str,
        role: str,
        rank: int,
        scenario: dict,
        max_tokens: int,
        where: tuple | None = None,
    ) -> None:
        self.role, self.rank = role, rank
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=_child, args=(transport, role, rank, scenario, max_tokens, self.inbox, self.outbox, where)
        )
        self.proc.start()
        self.payload: Any = None

    def ready(self, transport: str) -> None:
        got = self.answer()
        assert got[0] == "ready", got
        assert got[2] == sorted(_sources(transport)), (
            f"the rank imports {got[2]}, the test {_sources(transport)}"
        )
        self.payload = got[1]

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


# The heavy third-party modules every rank imports: the fork server imports them once, and each rank forks
# from it (measured on a busy 2-core machine: three NIXL ranks ready in 13 s when each is spawned and imports
# torch itself, 2-3 s forked). The server forks before anything has started a thread; a rank then enters its
# network namespace and creates its agent or engine, itself single-threaded until then. Nothing of this
# repository is preloaded: Python 3.11's fork server imports its preload before it applies the parent's
# sys.path, so an installed kvgeom (another checkout's) would win over the one under test.
PRELOAD = ["numpy", "torch", "nixl._api"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class Pair:
    """P ranks and D ranks of a scenario over ``transport``, started together and ended together.
    ``hosts``: per ``(role, rank)`` the ``(network namespace, address)`` the rank runs in (default:
    loopback here)."""

    def __init__(
        self, scenario: dict, max_tokens: int, hosts: dict | None = None, transport: str = "mooncake"
    ) -> None:
        ctx = _context()
        self.transport = transport
        self.sc = Scenario.from_json(scenario)
        self.scenario = scenario
        self.p: list[Rank] = []
        self.d: list[Rank] = []
        try:
            at = hosts or {}
            self.p = [
                Rank(ctx, transport, "prefill", r, scenario, max_tokens, at.get(("prefill", r)))
                for r in range(self.sc.prefill.tp_size)
            ]
            self.d = [
                Rank(ctx, transport, "decode", r, scenario, max_tokens, at.get(("decode", r)))
                for r in range(self.sc.decode.tp_size)
            ]
            for x in self.p + self.d:
                x.ready(transport)
        except BaseException:
            self.end()
            raise

    def payloads(self, side: str) -> dict[int, Any]:
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
