"""P and D engines as separate OS processes on loopback, one NIXL agent per rank, running requests end
to end and checking every received byte.

``run_cluster(spec)`` starts every rank of every prefill engine and of the decode engine (``spawn``
processes), exchanges side-channel ports, lets the local side (D in pull, P in push) run the requests,
and collects each rank's report. A spec is a plain dict (it crosses process boundaries)::

    {"scenario": {...},                      # kvgeom.scenario.Scenario JSON: model, prefill, decode, mode
     "requests": [{"id": "r0", "tokens": 700, "engine": "prefill"}, ...],
     "prefill_engines": ["prefill"],          # several P engines may serve one D engine
     "config": {...},                         # TransportConfig fields
     "faults": {...}}                         # optional, see FAULTS

Every wait is bounded; every process is ended when ``run_cluster`` returns (``ProcGroup``).
"""

from __future__ import annotations

import math
import os
import queue as queue_mod
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvgeom import GeometryCard, KvgeomError
from kvgeom.geometry import rank_geometry
from kvgeom.scenario import Scenario
from kvgeom.testing import CoordSpace

from .config import TransportConfig
from .content import BACKGROUND, POISON_BYTE, fill_source, verify
from .errors import AdapterError, StaleMetadata
from .kvrank import KVRank
from .procs import ProcGroup

__all__ = ["FAULTS", "assign_blocks", "run_cluster"]

FAULTS = {
    "kill": "SIGKILL every rank of engine `engine` once D reports request `after` done",
    "silent": "engine `engine` serves a side channel that never answers (its metadata never arrives)",
    "bad_regions": "engine `engine` advertises region addresses it never registered (prep fails)",
    "reregister": "engine `engine` re-registers its memory once D reports request `after` done",
}
STEP_S = 30.0


def _config(spec: dict) -> TransportConfig:
    return TransportConfig(**spec.get("config", {}))


def assign_blocks(sc: Scenario, requests: list[dict], engines: list[str]) -> list[dict]:
    """Give each request disjoint block ids: P ids from its engine's pool, D ids from D's pool (shuffled,
    seeded), one id list per KV-cache group."""
    rng = np.random.default_rng(1234)
    pools = {name: list(rng.permutation(sc.prefill.num_blocks)) for name in engines}
    pools["decode"] = list(rng.permutation(sc.decode.num_blocks))
    out = []
    for req in requests:
        r = dict(req)
        r.setdefault("engine", engines[0])
        for side, eng, pool in (("p_ids", sc.prefill, pools[r["engine"]]), ("d_ids", sc.decode, pools["decode"])):
            groups = rank_geometry(sc.model, eng).groups
            ids = []
            for g in groups:
                n = 1 if g.is_ssm else math.ceil(r["tokens"] / eng.block_size)
                if n > len(pool):
                    raise KvgeomError("num_blocks", f"the requests need more blocks than the {side[0].upper()} pool "
                                      "holds", value=eng.num_blocks)
                ids.append([int(pool.pop()) for _ in range(n)])
            r[side] = ids
        out.append(r)
    return out


def _space(sc: Scenario, requests: list[dict]) -> CoordSpace:
    return CoordSpace(sc.model, max(r["tokens"] for r in requests) + max(sc.prefill.block_size, sc.decode.block_size))


# ----------------------------------------------------------------------------------------- ranks
def _producer_main(spec: dict, engine: str, rank: int, events: Any, inbox: Any) -> dict:
    sc = Scenario.from_json(spec["scenario"])
    card = GeometryCard(engine, sc.model, sc.prefill.with_rank(rank), sc.mode)
    fault = spec.get("faults", {})
    mine = [r for r in spec["requests"] if r["engine"] == engine]
    with KVRank(card, _config(spec)) as kv:
        for t in kv.tensors:
            t.fill_(BACKGROUND)
        space = _space(sc, spec["requests"])
        for r in mine:
            fill_source(kv.tensors, card, space, r["p_ids"], r["tokens"])
        if fault.get("silent") == engine:
            port = _silent_port()
        else:
            port = kv.port
        if fault.get("bad_regions") == engine:
            payload = kv.payload()
            payload["regions"] = [(a + (1 << 40), n, d) for a, n, d in payload["regions"]]
            kv.server.update(payload)
        events.put(("ready", engine, rank, port))
        if sc.mode == "push":
            return _produce_push(spec, sc, kv, engine, mine, events, inbox)
        return _serve_pull(sc, kv, engine, mine, space, events, inbox)


def _silent_port() -> int:
    """A listening socket that accepts and never answers (kept open by this process)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    _silent_port.keep = s  # type: ignore[attr-defined]
    return s.getsockname()[1]


def _serve_pull(sc: Scenario, kv: KVRank, engine: str, mine: list[dict], space: CoordSpace, events: Any,
                inbox: Any) -> dict:
    """P in pull mode: keep NIXL progressing, validate the D cards that arrive, count releases."""
    expected = max(1, sc.decode.tp_size // sc.prefill.tp_size)
    released: dict[str, int] = {}
    deadline = time.monotonic() + 10 * STEP_S
    exiting = False
    while time.monotonic() < deadline:
        released = {}
        for counter in kv.ep.notifications().values():  # drives progress (no progress thread)
            for msg, n in counter.items():
                rid = msg.decode().split(":")[0]
                released[rid] = released.get(rid, 0) + n
        if exiting and all(released.get(r["id"], 0) >= expected for r in mine):
            break  # every request was released (notifications may trail the consumer's completion)
        try:
            cmd, data = inbox.get(timeout=0.002)
        except queue_mod.Empty:
            continue
        if cmd == "exit":
            exiting, deadline = True, min(deadline, time.monotonic() + 5.0)  # bounded wait for stragglers
        if cmd == "reregister":
            kv.reregister()
            for t in kv.tensors:
                t.fill_(BACKGROUND)
            for r in mine:  # fresh memory holds the requests' content again
                fill_source(kv.tensors, kv.card, space, r["p_ids"], r["tokens"])
            events.put(("reregistered", engine, kv.rank, kv.ep.generation))
    kv.check_peers(sc.mode)
    done = sorted(r["id"] for r in mine if released.get(r["id"], 0) >= expected)
    return {"engine": engine, "rank": kv.rank, "released": done, "rejected": kv.rejected,
            "notifications": sum(released.values())}


def _produce_push(spec: dict, sc: Scenario, kv: KVRank, engine: str, mine: list[dict], events: Any,
                  inbox: Any) -> dict:
    ports = _wait_ports(inbox)
    results = []
    try:
        kv.connect("decode", ports["decode"], mode="push", compat=sc.compat)
    except (AdapterError, KvgeomError) as exc:
        return {"engine": engine, "rank": kv.rank, "error": f"{type(exc).__name__}: {exc}", "results": []}
    for r in mine:
        res = kv.push("decode", r["p_ids"], r["d_ids"], r["id"], r["id"], num_tokens=r["tokens"])
        results.append(res.__dict__ | {"telemetry": None})
    _wait_cmd(inbox, "exit")
    return {"engine": engine, "rank": kv.rank, "results": results}


def _wait_ports(inbox: Any) -> dict:
    cmd, data = inbox.get(timeout=STEP_S)
    if cmd != "ports":
        raise RuntimeError(f"expected the port map, got {cmd!r}")
    return {e: {int(r): p for r, p in ranks.items()} for e, ranks in data.items()}


def _wait_cmd(inbox: Any, want: str) -> Any:
    deadline = time.monotonic() + 10 * STEP_S
    while time.monotonic() < deadline:
        try:
            cmd, data = inbox.get(timeout=0.05)
        except queue_mod.Empty:
            continue
        if cmd == want:
            return data
    raise TimeoutError(f"no {want!r} command within {10 * STEP_S}s")


def _consumer_main(spec: dict, rank: int, events: Any, inbox: Any) -> dict:
    sc = Scenario.from_json(spec["scenario"])
    card = GeometryCard("decode", sc.model, sc.decode.with_rank(rank), sc.mode)
    space = _space(sc, spec["requests"])
    with KVRank(card, _config(spec)) as kv:
        for t in kv.tensors:
            t.fill_(POISON_BYTE)
        events.put(("ready", "decode", rank, kv.port))
        ports = _wait_ports(inbox)
        results = []
        for r in spec["requests"]:
            t0 = time.monotonic()
            try:
                if sc.mode == "pull":
                    if r["engine"] not in kv.pairings:
                        kv.connect(r["engine"], ports[r["engine"]], mode="pull", compat=sc.compat)
                    res = kv.pull(r["engine"], r["d_ids"], r["p_ids"], r["id"], r["id"], num_tokens=r["tokens"])
                else:
                    producer = GeometryCard(r["engine"], sc.model, sc.prefill, "push")
                    expected = max(1, sc.prefill.tp_size // sc.decode.tp_size)
                    res = kv.wait_received(producer, r["d_ids"], r["p_ids"], r["id"], expected,
                                           num_tokens=r["tokens"])
                row = res.__dict__ | {"telemetry": None}
            except (AdapterError, KvgeomError) as exc:
                kv.invalidate(r["d_ids"])
                if isinstance(exc, StaleMetadata):  # handshake again before the next request
                    kv.pairings.pop(r["engine"], None)
                row = {"request_id": r["id"], "ok": False, "error": f"{type(exc).__name__}: {exc}",
                       "seconds": time.monotonic() - t0}
            results.append(row)
            events.put(("done", "decode", rank, row))
            _maybe_pause(inbox)
        first = {r["id"]: 0 for r in spec["requests"]}
        report = verify(kv.tensors, card, space,
                        [(r["d_ids"], first[r["id"]], r["tokens"], row["ok"]) for r, row in zip(spec["requests"],
                                                                                             results)])
        return {"rank": rank, "results": results, "mismatches": [str(m) for m in report],
                "checked_bytes": int(sum(t.numel() for t in kv.tensors))}


def _maybe_pause(inbox: Any) -> None:
    """Let the parent inject a fault between two requests (it answers every 'done' with 'go')."""
    _wait_cmd(inbox, "go")


# ----------------------------------------------------------------------------------------- parent
def run_cluster(spec: dict, progress: Callable[[dict], None] | None = None, timeout_s: float = 300.0) -> dict:
    """Run a whole P/D cluster (see the module docstring); returns every rank's report."""
    sc = Scenario.from_json(spec["scenario"])
    engines = list(spec.get("prefill_engines", ["prefill"]))
    spec = dict(spec, requests=assign_blocks(sc, spec["requests"], engines))
    faults = spec.get("faults", {})
    names = [(e, r) for e in engines for r in range(sc.prefill.tp_size)] + \
            [("decode", r) for r in range(sc.decode.tp_size)]
    deadline = time.monotonic() + timeout_s
    with ProcGroup() as group:
        events = group.queue()
        inboxes = {n: group.queue() for n in names}
        for e, r in names:
            if e == "decode":
                group.spawn(_consumer_main, (spec, r, events, inboxes[(e, r)]), f"decode-{r}")
            else:
                group.spawn(_producer_main, (spec, e, r, events, inboxes[(e, r)]), f"{e}-{r}")
        ports: dict[str, dict[int, int]] = {}
        while sum(len(v) for v in ports.values()) < len(names):
            kind, engine, rank, port = _next_event(events, deadline, group)
            if kind == "ready":
                ports.setdefault(engine, {})[rank] = port
        for n in names:
            inboxes[n].put(("ports", ports))
        done: dict[str, int] = {}
        killed: set[str] = set()
        n_req = len(spec["requests"]) * sc.decode.tp_size
        while sum(done.values()) < n_req:
            kind, engine, rank, row = _next_event(events, deadline, group)
            if kind != "done":
                continue
            done[row["request_id"]] = done.get(row["request_id"], 0) + 1
            if progress:
                progress(dict(row, rank=rank))
            if done[row["request_id"]] == sc.decode.tp_size:
                _inject(faults, row["request_id"], group, inboxes, killed, events)
                for r in range(sc.decode.tp_size):
                    inboxes[("decode", r)].put(("go", None))
        for n in names:
            if n[0] != "decode" and n[0] not in killed:
                inboxes[n].put(("exit", None))
        results = group.collect(max(1.0, deadline - time.monotonic()))
    return {"spec": spec, "results": {k: (v.value if v.ok else {"error": v.error, "traceback": v.traceback})
                                      for k, v in results.items()}}


def _next_event(events: Any, deadline: float, group: ProcGroup) -> tuple:
    while time.monotonic() < deadline:
        try:
            return events.get(timeout=0.1)
        except queue_mod.Empty:
            dead = [n for n, p in group.procs.items() if not p.is_alive() and p.exitcode not in (0, None, -9)]
            if dead:
                res = group.collect(1.0, dead)
                raise RuntimeError(f"rank(s) {dead} died: {[res[d].error for d in dead]}") from None
    raise TimeoutError("the cluster did not finish in time")


def _inject(faults: dict, request_id: str, group: ProcGroup, inboxes: dict, killed: set, events: Any) -> None:
    kill = faults.get("kill")
    if kill and kill["after"] == request_id:
        for name, proc in group.procs.items():
            if name.startswith(kill["engine"] + "-"):
                os.kill(proc.pid, 9)
                proc.join(5.0)
        killed.add(kill["engine"])
    rereg = faults.get("reregister")
    if rereg and rereg["after"] == request_id:
        ranks = [n for n in inboxes if n[0] == rereg["engine"]]
        for n in ranks:
            inboxes[n].put(("reregister", None))
        acks = 0
        while acks < len(ranks):  # the consumers are paused: only the acknowledgements arrive now
            kind, *_ = _next_event(events, time.monotonic() + STEP_S, group)
            acks += kind == "reregistered"
