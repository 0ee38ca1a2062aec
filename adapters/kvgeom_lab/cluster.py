"""P and D engines as separate OS processes on loopback, one NIXL agent per rank, running requests end
to end, with a scheduler that reuses blocks, retries failed requests and injects faults, and every byte
of D checked at the end.

``run_cluster(spec)`` starts every rank of every prefill engine and of the decode engine (``spawn``
processes) and plays the scheduler in the parent: it hands each request D block ids from a pool (LIFO:
a block given back is the next one handed out, so a fencing bug shows at once), sends the request to
the D ranks (pull: they read; push: they wait while the P ranks write), retries a failed request with a
new attempt, and gives a failed attempt's blocks back only once every D rank reports them *settled*
(:meth:`KVRank.settle`: nothing can write them any more). A spec is a plain dict::

    {"scenario": {...},                      # kvgeom.tools.scenario.Scenario JSON: model, prefill, decode, mode
     "requests": [{"id": "r0", "tokens": 700, "engine": "prefill"}, ...],  # an id listed again: a later retry;
                                              # "delay_s": pause before sending this entry
     "prefill_engines": ["prefill"],          # several P engines may serve one D engine
     "config": {...},                         # TransportConfig fields (``secret`` or ``insecure``)
     "retries": 0,                            # extra attempts of a failed request
     "env": {"UCX_TLS": "tcp"},               # environment of every rank (before NIXL loads)
     "push_deadline": True,                   # P refuses to post an attempt past its deadline
     "drain_s": 5.0,                          # how long D ranks settle quarantined blocks at the end
     "linger_s": 0.0,                         # how long D ranks keep driving NIXL at the end in any case
     "check_each": True,                      # check each request's bytes when it completes (costly)
     "hosts": {"prefill": {"netns": "...", "host": "10.77.0.1", "env": {...}}, ...},  # optional: an engine's
                                              # ranks run in that network namespace, serve on that address
                                              # and get that environment (a VirtualNet host)
     "faults": {...}}                         # optional, see FAULTS (``at``: a request id or a list)

With ``config["discovery"] == "etcd"`` ranks find each other through etcd (``KVRank.connect(engine)``)
instead of the side-channel addresses the scheduler hands out. ``run_cluster(..., actions={name: fn})``
gives the scheduler callables (a link taken down, etcd stopped, an address changed) that the ``net`` and
``readdress`` faults run at the right moment.

Every wait is bounded; every process is ended when ``run_cluster`` returns (``ProcGroup``).
"""

from __future__ import annotations

import errno
import math
import os
import queue as queue_mod
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from kvgeom_nixl.config import TransportConfig
from kvgeom_nixl.errors import AdapterError, StaleMetadata
from kvgeom_nixl.kvrank import KVRank

from kvgeom import GeometryCard, KvgeomError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.testing import CoordSpace
from kvgeom.testing.content import BACKGROUND, POISON_BYTE, check_request, fill_source, verify_report
from kvgeom.tools.scenario import Scenario

from .procs import ProcGroup

__all__ = ["FAULTS", "BlockPool", "assign_blocks", "run_cluster"]

FAULTS = {
    "kill": "SIGKILL every rank of engine `engine` once request `after` is done",
    "silent": "engine `engine` serves a side channel that never answers (its metadata never arrives)",
    "bad_regions": "engine `engine` advertises region addresses it never registered",
    "reregister": "engine `engine` re-registers its memory once request `after` is done",
    "stop": "SIGSTOP engine `engine` (every rank, or rank `rank`) just before attempt `attempt` (default 1) of "
    "request `at` is sent (`when`: before), or `delay_s` after D starts it (`when`: after_post); SIGCONT "
    "`seconds` later",
    "busy": "engine `engine` (every rank, or rank `rank`) stops driving NIXL (alive, its side channel answers) "
    "for `seconds` before attempt `attempt` (default 1) of request `at`; with `refuse`, its side channels' ports "
    "also refuse every fresh connect from then on (the listening socket is shut down; the process, its accept "
    "thread and its open sessions live on: what a flooded, live server was measured to do to some connects)",
    "lie": "engine `engine` serves a lying handshake payload: `what` is num_blocks | sizes | unregistered | "
    "overlap | impersonate | swap",
    "rogue": "a process with no role tries every side channel without the secret; given the ranks' leaked NIXL "
    "metadata it forges W notices to D and D notices to P for attempt `attempt` of request `at`",
    "net": "a list of {at, attempt, when: before | after_post, delay_s, do, undo, seconds}: the scheduler runs "
    "actions[do]() `delay_s` after attempt `attempt` of request `at` is sent (after_post: after D starts "
    "it) and actions[undo]() `seconds` later",
    "flood": "a process without the secret holds `connections` (default 40) TCP connections to every side channel "
    "of engine `engine` (a name or a list; loopback only), and `drips` (default 0) more that send one byte every "
    "0.1 s, from attempt `attempt` (default 1) of request `at` on, for `seconds` or until the run ends, reopening "
    "each one the server closes (at most `max_connects` connects in all); `processes` (default 1) such processes "
    "(reports ``flood``, ``flood-1``, ...)",
    "readdress": "{engine, after, action}: once request `after` is done, actions[action]() gives engine's host a "
    "new address (returned) and the engine's ranks rebind to it; with side-channel discovery D "
    "learns the new addresses only after the next attempt (as from an orchestrator)",
}
STEP_S = 30.0


def _config(spec: dict) -> TransportConfig:
    return TransportConfig(**spec.get("config", {}))


def _groups(sc: Scenario, engine: Any) -> list[bool]:
    return [g.is_ssm for g in rank_geometry(sc.model, engine).groups]


def _need(sc: Scenario, engine: Any, tokens: int) -> list[int]:
    """Blocks per group a request of ``tokens`` needs on ``engine``."""
    return [1 if ssm else math.ceil(tokens / engine.block_size) for ssm in _groups(sc, engine)]


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
        for side, eng, pool in (
            ("p_ids", sc.prefill, pools[r["engine"]]),
            ("d_ids", sc.decode, pools["decode"]),
        ):
            ids = []
            for n in _need(sc, eng, r["tokens"]):
                if n > len(pool):
                    raise KvgeomError(
                        "num_blocks",
                        f"the requests need more blocks than the {side[0].upper()} pool holds",
                        value=eng.num_blocks,
                    )
                ids.append([int(pool.pop()) for _ in range(n)])
            r[side] = ids
        out.append(r)
    return out


class BlockPool:
    """The logical block ids of one engine, as a scheduler hands them out: a LIFO free list (the block
    given back last is the next one handed out), so that a block given back too early is reused at once."""

    def __init__(self, num_blocks: int, seed: int = 1234) -> None:
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)]
        self.out: set[int] = set()

    def take(self, counts: list[int]) -> list[list[int]] | None:
        """One id list per group (``counts[g]`` ids each), or ``None`` if the pool is short."""
        if sum(counts) > len(self.free):
            return None
        ids = [[self.free.pop() for _ in range(n)] for n in counts]
        self.out.update(b for g in ids for b in g)
        return ids

    def give(self, ids: list[list[int]]) -> None:
        for b in (b for g in ids for b in g):
            if b not in self.out:
                raise ValueError(f"block {b} given back but not handed out")
            self.out.discard(b)
            self.free.append(b)


def _sources(spec: dict) -> list[dict]:
    """One entry per distinct (request id, engine): the P blocks holding that request on that engine."""
    seen: dict[tuple[str, str], dict] = {}
    for r in spec["requests"]:
        seen.setdefault((r["id"], r["engine"]), r)
    return list(seen.values())


def _prepare(sc: Scenario, requests: list[dict], engines: list[str]) -> list[dict]:
    """Each entry gets its engine, its request's salt (one per request id) and P ids per (id, engine)."""
    salts: dict[str, int] = {}
    entries = []
    for r in requests:
        r = dict(r)
        r.setdefault("engine", engines[0])
        r["salt"] = salts.setdefault(r["id"], len(salts))
        entries.append(r)
    blocks = {(r["id"], r["engine"]): r for r in assign_blocks(sc, _sources({"requests": entries}), engines)}
    return [dict(r, p_ids=blocks[(r["id"], r["engine"])]["p_ids"]) for r in entries]


def _space(sc: Scenario, requests: list[dict]) -> CoordSpace:
    return CoordSpace(
        sc.model, max(r["tokens"] for r in requests) + max(sc.prefill.block_size, sc.decode.block_size)
    )


def _env(spec: dict, engine: str | None = None) -> None:
    os.environ.update({str(k): str(v) for k, v in spec.get("env", {}).items()})
    host = spec.get("hosts", {}).get(engine, {})
    os.environ.update({str(k): str(v) for k, v in host.get("env", {}).items()})


def _host(spec: dict, engine: str) -> str:
    """The address an engine's ranks serve on (its VirtualNet host's, or loopback)."""
    return spec.get("hosts", {}).get(engine, {}).get("host", "127.0.0.1")


def _etcd(spec: dict) -> bool:
    return spec.get("config", {}).get("discovery") == "etcd"


def _after_post(spec: dict) -> bool:
    """Whether a fault waits for D to start an attempt (D then says when it does)."""
    faults = spec.get("faults", {})
    entries = [faults.get("stop", {})] + list(faults.get("net", []))
    return any(isinstance(f, dict) and f.get("when") == "after_post" for f in entries)


def _poll_inbox(inbox: Any, timeout: float) -> tuple[str, Any] | None:
    try:
        return inbox.get(timeout=timeout)
    except queue_mod.Empty:
        return None


# ----------------------------------------------------------------------------------------- producer
def _producer_main(spec: dict, engine: str, rank: int, events: Any, inbox: Any) -> dict:
    _env(spec, engine)
    sc = Scenario.from_json(spec["scenario"])
    card = GeometryCard(engine, sc.model, sc.prefill.with_rank(rank), sc.mode)
    fault = spec.get("faults", {})
    mine = [(r["salt"], r) for r in _sources(spec) if r["engine"] == engine]
    space = _space(sc, spec["requests"])
    with KVRank(card, _config(spec), host=_host(spec, engine)) as kv:
        _fill(kv, card, space, mine)
        port = _silent_port() if fault.get("silent") == engine else kv.port
        if fault.get("bad_regions") == engine:
            payload = kv.payload()
            payload["regions"] = [(a + (1 << 40), n, d) for a, n, d in payload["regions"]]
            kv.server.update(payload)
        lie = fault.get("lie", {})
        if lie.get("engine") == engine:
            kv.server.update(_lie(kv, lie["what"]))
        events.put(("ready", engine, rank, [kv.host, port]))
        if "rogue" in fault:
            events.put(("leak", engine, rank, {"agent": kv.ep.name, "metadata": kv.ep.metadata()}))
        ports = _wait_ports(inbox)
        out = {"engine": engine, "rank": rank, "results": [], "released": [], "watch_error": None}
        if (
            _etcd(spec) and sc.mode == "pull"
        ):  # the consumers read us: know their agents and cards (check_peers)
            try:
                kv.watch("decode")
            except (AdapterError, KvgeomError) as exc:
                out["watch_error"] = f"{type(exc).__name__}: {exc}"
        released: set[str] = set()
        expected = max(1, sc.decode.tp_size // sc.prefill.tp_size)
        deadline = time.monotonic() + 20 * STEP_S
        exiting = None
        connected = False
        while time.monotonic() < deadline:
            for rid, n in kv.released().items():  # consumes the D notices (authenticated, one per D rank)
                if n >= expected:
                    released.add(rid)
                    kv.forget_released(rid)
            kv.settle()  # our fenced WRITEs: their W (or A) notices go out when they end
            if exiting is not None and (
                time.monotonic() > exiting
                or (not kv.quarantined() if sc.mode == "push" else all(r["id"] in released for _, r in mine))
            ):
                break
            msg = _poll_inbox(inbox, 0.002)
            if msg is None:
                continue
            cmd, data = msg
            if cmd == "exit":
                exiting = time.monotonic() + 3.0  # bounded wait for stragglers' notices
            elif cmd == "busy":
                if isinstance(data, dict):
                    if data.get("refuse"):
                        _refuse_fresh_connects(kv)
                    data = data["seconds"]
                time.sleep(float(data))  # alive, answering its side channel, but not driving NIXL
            elif cmd == "reregister":
                kv.reregister()
                _fill(kv, card, space, mine)
                events.put(("reregistered", engine, rank, kv.ep.generation))
            elif cmd == "rebind":  # our host's address changed
                kv.rebind(str(data))
                connected = False
                events.put(("rebound", engine, rank, [kv.host, kv.port]))
            elif cmd == "push":
                row = _push(kv, spec, sc, data, ports, connected)
                connected = row.pop("connected")
                out["results"].append(row)
                events.put(("pushed", engine, rank, row))
        kv.check_peers(sc.mode)
        out.update(
            released=sorted(released),
            rejected=kv.rejected,
            stats=dict(kv.stats),
            handles=kv.ep.handle_counts(),
            held=len(kv.quarantined()),
            sidechannel=dict(kv.server.stats),
        )
        return out


def _refuse_fresh_connects(kv: KVRank) -> None:
    """The ``busy`` fault's ``refuse``: the rank's side-channel port refuses every fresh connect while the
    process, its side channel's threads and its open sessions live (``shutdown`` of the listening socket
    unhashes it). A live producer that a probe on a new connection would take for dead."""
    import socket

    if kv.server is not None:
        kv.server._sock.shutdown(socket.SHUT_RD)


def _fill(kv: KVRank, card: GeometryCard, space: CoordSpace, mine: list[tuple[int, dict]]) -> None:
    for t in kv.tensors:
        t.fill_(BACKGROUND)
    for salt, r in mine:
        fill_source(kv.tensors, card, space, r["p_ids"], r["tokens"], salt)


def _push(kv: KVRank, spec: dict, sc: Scenario, req: dict, ports: dict, connected: bool) -> dict:
    t0 = time.monotonic()
    try:
        if not connected:
            kv.connect("decode", None if _etcd(spec) else ports["decode"], mode="push", compat=sc.compat)
            connected = True
        not_after = req["not_after"] if spec.get("push_deadline", True) else None
        res = kv.push(
            "decode",
            req["p_ids"],
            req["d_ids"],
            req["id"],
            req["id"],
            num_tokens=req["tokens"],
            attempt=req["attempt"],
            not_after=not_after,
        )
        row = res.__dict__ | {"telemetry": None}
    except (AdapterError, KvgeomError) as exc:
        if isinstance(exc, StaleMetadata):
            connected = False
        row = {
            "request_id": req["id"],
            "attempt": req["attempt"],
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "seconds": time.monotonic() - t0,
        }
    return row | {"connected": connected}


def _lie(kv: KVRank, what: str) -> dict:
    """A payload that lies about the rank's geometry or identity (sealed: the liar holds the secret)."""
    p = kv.payload()
    card = p["card"]
    if what == "num_blocks":
        card["engine"]["num_blocks"] = 1 << 26
    elif what == "sizes":
        p["regions"] = [(a, n // 2, d) for a, n, d in p["regions"]]
    elif what == "unregistered":
        p["regions"] = [(a + (1 << 40), n, d) for a, n, d in p["regions"]]
    elif what == "overlap":
        p["regions"] = [(p["regions"][0][0], n, d) for _, n, d in p["regions"]]
    elif what == "impersonate":
        p["engine_id"] = card["engine_id"] = "someone-else"
    elif what == "swap":  # two regions of equal size trade places: only the liar knows
        regions = [list(r) for r in p["regions"]]
        pair = next(
            (
                (i, j)
                for i in range(len(regions))
                for j in range(i + 1, len(regions))
                if regions[i][1] == regions[j][1]
            ),
            None,
        )
        if pair:
            i, j = pair
            regions[i][0], regions[j][0] = regions[j][0], regions[i][0]
        p["regions"] = regions
    else:
        raise ValueError(f"lie: unknown what={what!r}")
    return p


def _silent_port() -> int:
    """A listening socket that accepts and never answers (kept open by this process)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    _silent_port.keep = s  # type: ignore[attr-defined]
    return s.getsockname()[1]


def _wait_ports(inbox: Any) -> dict:
    """The side channels of every rank: ``{engine: {rank: (host, port)}}``."""
    cmd, data = inbox.get(timeout=10 * STEP_S)  # every rank must be ready first (filling can be slow)
    if cmd != "ports":
        raise RuntimeError(f"expected the port map, got {cmd!r}")
    return {e: {int(r): (str(p[0]), int(p[1])) for r, p in ranks.items()} for e, ranks in data.items()}


# ----------------------------------------------------------------------------------------- consumer
def _consumer_main(spec: dict, rank: int, events: Any, inbox: Any) -> dict:
    _env(spec, "decode")
    sc = Scenario.from_json(spec["scenario"])
    card = GeometryCard("decode", sc.model, sc.decode.with_rank(rank), sc.mode)
    space = _space(sc, spec["requests"])
    with KVRank(card, _config(spec), host=_host(spec, "decode")) as kv:
        for t in kv.tensors:
            t.fill_(POISON_BYTE)
        events.put(("ready", "decode", rank, [kv.host, kv.port]))
        if "rogue" in spec.get("faults", {}):
            events.put(("leak", "decode", rank, {"agent": kv.ep.name, "metadata": kv.ep.metadata()}))
        ports = _wait_ports(inbox)
        if sc.mode == "push":
            for e in spec.get("prefill_engines", ["prefill"]):
                kv.watch(e, None if _etcd(spec) else ports[e])
        rows: list[dict] = []
        retired: set[tuple[str, int]] = set()
        last_settle = 0.0
        deadline = time.monotonic() + 20 * STEP_S
        while time.monotonic() < deadline:
            now = time.monotonic()
            if now - last_settle > 0.02:
                last_settle = now
                _settle(kv, events, rank, retired)
            msg = _poll_inbox(inbox, 0.005)
            if msg is None:
                continue
            cmd, data = msg
            if cmd == "req":
                if _after_post(spec):
                    events.put(("posting", "decode", rank, (data["id"], data["attempt"])))
                row = _consume(kv, sc, data, None if _etcd(spec) else ports)
                if row["ok"] and spec.get(
                    "check_each", True
                ):  # what a consumer reads now: every byte checked
                    row["bad_at_completion"] = check_request(
                        kv.tensors, card, space, data["d_ids"], data["tokens"], data["salt"]
                    )
                rows.append(row)
                _settle(kv, events, rank, retired)  # before "done": the scheduler reuses it at once
                events.put(("done", "decode", rank, row))
            elif cmd == "drop":  # a request failed on another rank: its blocks are invalid here too
                kv.invalidate(data)
            elif (
                cmd == "moved"
            ):  # an engine's side channels moved (side-channel discovery: the orchestrator says)
                for e, ranks in data.items():
                    ports[e] = {int(r): (str(p[0]), int(p[1])) for r, p in ranks.items()}
                    kv.pairings.pop(e, None)
            elif cmd == "finish":
                drain_s, linger_s = data
                t_fin = time.monotonic()
                while time.monotonic() < t_fin + drain_s and (
                    kv.quarantined() or time.monotonic() < t_fin + linger_s
                ):
                    _settle(kv, events, rank, retired)
                    time.sleep(0.01)
                events.put(("finished", "decode", rank, [h.token for h in kv.quarantined()]))
            elif cmd == "verify":
                rep = verify_report(kv.tensors, card, space, data["requests"], data["free"], data["skip"])
                return {
                    "rank": rank,
                    "results": rows,
                    "mismatches": [str(m) for m in rep.mismatches],
                    "bad_bytes": rep.bad_bytes,
                    "bad_outside": rep.bad_outside,
                    "checked_bytes": rep.checked_bytes,
                    "skipped_bytes": rep.skipped_bytes,
                    "stats": dict(kv.stats),
                    "handles": kv.ep.handle_counts(),
                    "held": [h.token for h in kv.quarantined()],
                    "via": {
                        e: sorted({link.via for link in links.values()}) for e, links in kv.links.items()
                    },
                    "peer_hosts": {
                        e: sorted({link.host for link in links.values()}) for e, links in kv.links.items()
                    },
                    "sidechannel": dict(kv.server.stats),
                }
        raise TimeoutError("consumer: no verify command in time")


def _settle(kv: KVRank, events: Any, rank: int, retired: set[tuple[str, int]]) -> None:
    """``kv.settle()``; each settled attempt and each newly retired one (past the quarantine bound) is
    reported to the scheduler."""
    for s in kv.settle():
        events.put(("settled", "decode", rank, (s.request_id, s.attempt, s.held_s, s.cleared_by)))
    for h in kv.retired():
        if h.token not in retired:
            retired.add(h.token)
            data = (h.token[0], h.token[1], h.retired_at - h.since, h.ids, time.time())
            events.put(("retired", "decode", rank, data))


def _consume(kv: KVRank, sc: Scenario, req: dict, ports: dict | None) -> dict:
    t0 = time.monotonic()
    try:
        if sc.mode == "pull":
            if req["engine"] not in kv.pairings:
                try:
                    kv.connect(
                        req["engine"],
                        None if ports is None else ports[req["engine"]],
                        mode="pull",
                        compat=sc.compat,
                    )
                except (AdapterError, KvgeomError):
                    kv.invalidate(req["d_ids"])  # nothing was posted: invalid now, free at once
                    kv.fence.hold((req["id"], req["attempt"]), req["d_ids"], reason="handshake failed")
                    raise
            res = kv.pull(
                req["engine"],
                req["d_ids"],
                req["p_ids"],
                req["id"],
                req["id"],
                num_tokens=req["tokens"],
                attempt=req["attempt"],
            )
        else:
            producer = GeometryCard(req["engine"], sc.model, sc.prefill, "push")
            res = kv.wait_received(
                producer,
                req["d_ids"],
                req["p_ids"],
                req["id"],
                num_tokens=req["tokens"],
                attempt=req["attempt"],
                compat=sc.compat,
            )
        return res.__dict__ | {"telemetry": None}
    except (AdapterError, KvgeomError) as exc:
        if isinstance(exc, StaleMetadata):  # handshake again before the next request
            kv.pairings.pop(req["engine"], None)
        return {
            "request_id": req["id"],
            "attempt": req["attempt"],
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "seconds": time.monotonic() - t0,
        }


# ----------------------------------------------------------------------------------------- rogue
def _rogue_main(spec: dict, events: Any, inbox: Any) -> dict:
    """A process with no role: no secret (or a wrong one), NIXL metadata only if it leaked."""
    _env(spec, "rogue")
    from kvgeom_nixl.auth import Auth, Notice, encode_notice
    from kvgeom_nixl.sidechannel import fetch, query_generation

    ports = _wait_ports(inbox)
    out: dict[str, Any] = {"sidechannel": [], "forged": 0}
    for engine, ranks in ports.items():
        for r, (host, port) in ranks.items():
            for label, auth in (("none", Auth.none()), ("wrong", Auth(os.urandom(32)))):
                for op in ("get", "generation"):
                    t0 = time.monotonic()
                    try:
                        if op == "get":
                            fetch(host, port, {"agent_name": "rogue"}, timeout_s=2.0, auth=auth)
                        else:
                            query_generation(host, port, timeout_s=2.0, auth=auth)
                        result = "served"
                    except AdapterError as exc:
                        result = type(exc).__name__
                    out["sidechannel"].append((engine, r, label, op, result, time.monotonic() - t0))
    cmd, leaked = inbox.get(timeout=10 * STEP_S)
    from kvgeom_nixl.agent import Endpoint

    with Endpoint(f"rogue-{os.getpid()}", _config(spec)) as ep:
        import torch

        ep.register_tensors(torch.zeros(4096, dtype=torch.uint8))
        for who in leaked.values():
            ep.add_peer(who["agent"], who["metadata"])
        events.put(("rogue-ready", "rogue", 0, None))
        while True:
            msg = _poll_inbox(inbox, 0.01)
            ep.notifications()
            if msg is None:
                continue
            cmd, data = msg
            if cmd == "exit":
                break
            rid, attempt = data["id"], data["attempt"]
            wrong = Auth(os.urandom(32))
            sc = Scenario.from_json(spec["scenario"])
            for (engine, _r), who in leaked.items():
                kind = "W" if engine == "decode" else "D"
                claims = (
                    [(data["engine"], r) for r in range(sc.prefill.tp_size)]
                    if engine == "decode"
                    else [("decode", r) for r in range(sc.decode.tp_size)]
                )
                for auth in (Auth.none(), wrong):
                    for claim in claims:  # claims to be every rank that would send it
                        msg = encode_notice(
                            auth, Notice(kind, claim[0], claim[1], rid, attempt), ep.name, who["agent"]
                        )
                        ep.send_notif(who["agent"], msg)
                        out["forged"] += 1
                ep.send_notif(who["agent"], f"{rid}:1".encode())  # the old, prefix-matched format
                out["forged"] += 1
            events.put(("forged", "rogue", 0, out["forged"]))
    return out


# ----------------------------------------------------------------------------------------- flood
def _flood_main(spec: dict, events: Any, inbox: Any) -> dict:
    """A process without the secret that only opens and holds TCP connections to one engine's side
    channels (the ``flood`` fault), and, with ``drips``, keeps that many more connections per side channel
    sending one byte every 0.1 s (a slow drip). Connections are opened without blocking (as fast as one
    process can, up to ``connections`` held per side channel, so a count over the server's ``max_pending``
    keeps it evicting), each one the server closes is reopened; bounded in connects (``max_connects``) and
    time (``seconds``, or the scheduler's ``exit``); loopback only."""
    import select

    ports = _wait_ports(inbox)
    out = {"connects": 0, "closed_by_server": 0, "connect_errors": 0, "drip_bytes": 0, "seconds": 0.0}
    cmd, f = inbox.get(timeout=10 * STEP_S)
    if cmd != "flood":
        return out
    engines = f["engine"] if isinstance(f["engine"], list) else [f["engine"]]
    addrs = [(str(a[0]), int(a[1])) for e in engines for a in ports[e].values()]
    if any(not h.startswith("127.") for h, _ in addrs):
        raise ValueError(f"flood: loopback side channels only, got {addrs}")
    per, drips = int(f.get("connections", 40)), int(f.get("drips", 0))
    cap = int(f.get("max_connects", 20000))
    poller = select.epoll()
    socks: dict[int, tuple[Any, tuple[str, int], bool]] = {}  # fd -> (socket, address, drips)
    t0 = time.monotonic()
    end = t0 + float(f["seconds"])
    try:
        _flood_fill(poller, socks, addrs, per, drips, cap, out)
        events.put(("flooding", "flood", 0, len(socks)))
        next_drip = time.monotonic()
        while time.monotonic() < end:
            for fd, _ in poller.poll(0.005):
                _flood_closed(poller, socks, fd, out)
            if time.monotonic() >= next_drip:
                next_drip = time.monotonic() + 0.1
                for fd in [fd for fd, (_, _, d) in socks.items() if d]:
                    try:
                        out["drip_bytes"] += socks[fd][0].send(b"\x00")
                    except BlockingIOError:
                        pass  # not connected yet
                    except OSError:
                        _flood_closed(poller, socks, fd, out, read=False)
                msg = _poll_inbox(inbox, 0.0)
                if msg is not None and msg[0] == "exit":
                    break
            _flood_fill(poller, socks, addrs, per, drips, cap, out)
    finally:
        for sock, _, _ in socks.values():
            sock.close()
        poller.close()
    out["seconds"] = time.monotonic() - t0
    if time.monotonic() >= end:
        _poll_inbox(inbox, 10 * STEP_S)  # the scheduler says when to go (a rank ending early is a failure)
    return out


def _flood_fill(
    poller: Any, socks: dict, addrs: list[tuple[str, int]], per: int, drips: int, cap: int, out: dict
) -> None:
    import select
    import socket

    for addr in addrs:
        for want, drip in ((per, False), (drips, True)):
            have = sum(1 for _, a, d in socks.values() if a == addr and d == drip)
            for _ in range(want - have):
                if out["connects"] >= cap:
                    return
                out["connects"] += 1
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                if sock.connect_ex(addr) not in (0, errno.EINPROGRESS):
                    out["connect_errors"] += 1
                    sock.close()
                    continue
                socks[sock.fileno()] = (sock, addr, drip)
                poller.register(sock.fileno(), select.EPOLLIN | select.EPOLLRDHUP)


def _flood_closed(poller: Any, socks: dict, fd: int, out: dict, read: bool = True) -> None:
    """Forget (and close) a held connection if the server has closed it (the greeting is read and
    dropped)."""
    entry = socks.get(fd)
    if entry is None:
        return
    data = b""
    if read:
        try:
            data = entry[0].recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
    if data:
        return
    out["closed_by_server"] += 1
    poller.unregister(fd)
    del socks[fd]
    entry[0].close()


# ----------------------------------------------------------------------------------------- parent
class _Scheduler:
    def __init__(
        self,
        spec: dict,
        group: ProcGroup,
        events: Any,
        inboxes: dict,
        progress: Callable | None,
        deadline: float,
        actions: dict[str, Callable[[], Any]] | None = None,
    ) -> None:
        self.spec, self.group, self.events, self.inboxes = spec, group, events, inboxes
        self.sc = Scenario.from_json(spec["scenario"])
        self.progress, self.deadline = progress, deadline
        self.d_ranks = [n for n in inboxes if n[0] == "decode"]
        self.timers: list[tuple[float, Callable[[], None]]] = []
        self.settled: dict[tuple[str, int], set[int]] = {}
        self.settle_log: list[tuple] = []
        self.retire_log: list[tuple] = []  # (rank, request id, attempt, held s, ids, wall time)
        #: (request id, attempt, wall time) each failed attempt's blocks went back to the pool (all D ranks settled)
        self.reclaim_log: list[tuple[str, int, float]] = []
        self.signal_log: list[tuple[float, str, int]] = []  # (wall time, engine, signal)
        self.pushed: list[dict] = []
        self.killed: set[str] = set()
        self.leaks: dict[tuple[str, int], dict] = {}
        self.actions = dict(actions or {})
        self.action_log: list[tuple[float, str, Any]] = []  # (monotonic time, action, what it returned)
        self.tell_after: dict | None = None  # side-channel addresses D learns after the next attempt

    def fire_timers(self, all_now: bool = False) -> None:
        now = time.monotonic()
        for t, action in [x for x in self.timers if all_now or x[0] <= now]:
            self.timers.remove((t, action))
            action()

    def next_event(self, timeout_s: float | None = None) -> tuple | None:
        """The next event that is not bookkeeping (settled, pushed, leak); ``None`` after ``timeout_s``."""
        end = self.deadline if timeout_s is None else min(self.deadline, time.monotonic() + timeout_s)
        while time.monotonic() < end:
            self.fire_timers()
            try:
                ev = self.events.get(timeout=0.05)
            except queue_mod.Empty:
                # nothing ends before the scheduler says so: an early exit is a failure (a rank that raised
                # exits with code 0 after reporting), except the engines we killed
                dead = [n for n, p in self.group.procs.items() if not p.is_alive() and p.exitcode != -9]
                if dead:
                    res = self.group.collect(1.0, dead)
                    raise RuntimeError(
                        f"rank(s) {dead} ended early: {[res[d].error for d in dead]}\n"
                        + "\n".join(res[d].traceback or "" for d in dead)
                    ) from None
                continue
            kind, engine, rank, data = ev
            if kind == "settled":
                self.settled.setdefault((data[0], data[1]), set()).add(rank)
                self.settle_log.append((rank, *data))
            elif kind == "retired":
                self.retire_log.append((rank, *data))
            elif kind == "pushed":
                self.pushed.append(dict(data, engine=engine, rank=rank))
            elif kind == "leak":
                self.leaks[(engine, rank)] = data
            elif kind == "posting":
                stop = self.spec.get("faults", {}).get("stop", {})
                if stop and _hits(stop, *data) and stop.get("when") == "after_post":
                    self.stop_later(stop, float(stop.get("delay_s", 0.0)))
                for net in self.spec.get("faults", {}).get("net", []):
                    if _hits(net, *data) and net.get("when") == "after_post":
                        self.act_later(net)
            else:
                return ev
        if timeout_s is not None and time.monotonic() < self.deadline:
            return None
        raise TimeoutError("the cluster did not finish in time")

    def expect(self, kind: str, n: int) -> list[tuple]:
        got = []
        while len(got) < n:
            ev = self.next_event()
            if ev[0] == kind:
                got.append(ev)
        return got

    def stop_later(self, stop: dict, delay_s: float) -> None:
        """SIGSTOP ``stop['engine']`` in ``delay_s``, SIGCONT ``stop['seconds']`` after that."""
        t = time.monotonic() + delay_s
        engine, rank = stop["engine"], stop.get("rank")
        self.timers.append((t, lambda: self.signal_engine(engine, signal.SIGSTOP, rank)))
        self.timers.append(
            (t + float(stop["seconds"]), lambda: self.signal_engine(engine, signal.SIGCONT, rank))
        )

    def act(self, name: str) -> Any:
        """Run ``actions[name]()`` now and log it."""
        out = self.actions[name]()
        self.action_log.append((time.monotonic(), name, out))
        return out

    def act_later(self, net: dict) -> None:
        """A ``net`` fault: ``do`` after ``delay_s``, ``undo`` ``seconds`` after that."""
        t = time.monotonic() + float(net.get("delay_s", 0.0))
        self.timers.append((t, lambda: self.act(net["do"])))
        if net.get("undo"):
            self.timers.append((t + float(net["seconds"]), lambda: self.act(net["undo"])))

    def signal_engine(self, engine: str, sig: int, rank: int | None = None) -> None:
        for name, proc in self.group.procs.items():
            if (
                name.startswith(engine + "-")
                and (rank is None or name == f"{engine}-{rank}")
                and proc.is_alive()
            ):
                os.kill(proc.pid, sig)
                self.signal_log.append((time.time(), engine, int(sig)))


def run_cluster(
    spec: dict,
    progress: Callable[[dict], None] | None = None,
    timeout_s: float = 300.0,
    actions: dict[str, Callable[[], Any]] | None = None,
) -> dict:
    """Run a whole P/D cluster (see the module docstring); returns every rank's report and the
    scheduler's record (``attempts``, ``settled``, ``pushed``, ``actions``: the fault actions run, with
    their times relative to each attempt's ``t_sent``)."""
    sc = Scenario.from_json(spec["scenario"])
    engines = list(spec.get("prefill_engines", ["prefill"]))
    spec = dict(spec, requests=_prepare(sc, spec["requests"], engines))
    faults = spec.get("faults", {})
    names = [(e, r) for e in engines for r in range(sc.prefill.tp_size)] + [
        ("decode", r) for r in range(sc.decode.tp_size)
    ]
    with ProcGroup() as group:
        events = group.queue()
        inboxes = {n: group.queue() for n in names}
        for e, r in names:
            if e == "decode":
                group.spawn(
                    _consumer_main, (spec, r, events, inboxes[(e, r)]), f"decode-{r}", netns=_netns(spec, e)
                )
            else:
                group.spawn(
                    _producer_main, (spec, e, r, events, inboxes[(e, r)]), f"{e}-{r}", netns=_netns(spec, e)
                )
        if "rogue" in faults:
            inboxes[("rogue", 0)] = group.queue()
            group.spawn(
                _rogue_main, (spec, events, inboxes[("rogue", 0)]), "rogue", netns=_netns(spec, "rogue")
            )
        for i in range(_flooders(faults)):  # "flood", then "flood-1", ...: each its own process
            inboxes[("flood", i)] = group.queue()
            group.spawn(_flood_main, (spec, events, inboxes[("flood", i)]), "flood" + (f"-{i}" if i else ""))
        s = _Scheduler(spec, group, events, inboxes, progress, time.monotonic() + timeout_s, actions)
        ports: dict[str, dict[int, int]] = {}
        while sum(len(v) for v in ports.values()) < len(names):
            kind, engine, rank, port = s.next_event()
            if kind == "ready":
                ports.setdefault(engine, {})[rank] = port
        for n in inboxes:
            inboxes[n].put(("ports", ports))
        if "rogue" in faults:
            while len(s.leaks) < len(names):
                ev = s.next_event(0.1)
                if ev is not None:
                    raise RuntimeError(f"unexpected event while collecting leaks: {ev[:3]}")
            inboxes[("rogue", 0)].put(("leaks", dict(s.leaks)))
            s.expect("rogue-ready", 1)
        attempts = _schedule(s, spec, faults)
        for n in names:
            if n[0] != "decode" and n[0] not in s.killed:
                inboxes[n].put(("exit", None))
        if "rogue" in faults:
            inboxes[("rogue", 0)].put(("exit", None))
        for i in range(_flooders(faults)):
            inboxes[("flood", i)].put(("exit", None))
        results = group.collect(max(1.0, s.deadline - time.monotonic()))
    return {
        "spec": spec,
        "attempts": attempts,
        "settled": s.settle_log,
        "retired": s.retire_log,
        "reclaimed": s.reclaim_log,
        "signals": s.signal_log,
        "pushed": s.pushed,
        "actions": [(t, name, out) for t, name, out in s.action_log],
        "results": {
            k: (v.value if v.ok else {"error": v.error, "traceback": v.traceback}) for k, v in results.items()
        },
    }


def _schedule(s: _Scheduler, spec: dict, faults: dict) -> list[dict]:
    """Hand out blocks, send requests (with retries), free failed attempts' blocks once settled."""
    sc = s.sc
    pool = BlockPool(sc.decode.num_blocks)
    counts = {r["id"]: _need(sc, sc.decode, r["tokens"]) for r in spec["requests"]}
    owners: dict[str, dict] = {}
    quarantine: dict[tuple[str, int], dict] = {}
    attempts: list[dict] = []
    timeout = spec.get("config", {}).get(
        "transfer_timeout_s" if sc.mode == "pull" else "notif_timeout_s", 30.0
    )

    def reclaim() -> None:
        for token, q in list(quarantine.items()):
            if q["ranks"] <= s.settled.get(token, set()):
                pool.give(q["ids"])
                del quarantine[token]
                s.reclaim_log.append((token[0], token[1], time.time()))

    sent: dict[str, int] = {}
    for req in spec["requests"]:
        if req["id"] in owners:
            continue  # an earlier entry of this request succeeded
        if req.get("delay_s"):  # let earlier faults play out before this entry
            end = time.monotonic() + float(req["delay_s"])
            while time.monotonic() < end:
                if s.next_event(end - time.monotonic()) is not None:
                    raise RuntimeError("unexpected event while pausing")
        for _ in range(1 + int(spec.get("retries", 0))):
            attempt = sent[req["id"]] = sent.get(req["id"], 0) + 1
            salt = req["salt"]
            _before(s, faults, req["id"], attempt, req["engine"])
            reclaim()
            ids = pool.take(counts[req["id"]])
            wait_end = time.monotonic() + 2 * timeout + 10
            while ids is None and quarantine and time.monotonic() < wait_end:  # wait for blocks to settle
                ev = s.next_event(0.1)
                if ev is not None:
                    raise RuntimeError(f"unexpected event while waiting for blocks: {ev[:3]}")
                reclaim()
                ids = pool.take(counts[req["id"]])
            if ids is None:
                attempts.append(
                    {"request_id": req["id"], "attempt": attempt, "ok": False, "error": "no free blocks"}
                )
                break
            msg = {
                "id": req["id"],
                "attempt": attempt,
                "d_ids": ids,
                "p_ids": req["p_ids"],
                "tokens": req["tokens"],
                "engine": req["engine"],
                "salt": salt,
                "not_after": time.time() + timeout,
            }
            if sc.mode == "push":
                for n in s.inboxes:
                    if n[0] == req["engine"]:
                        s.inboxes[n].put(("push", msg))
            for n in s.d_ranks:
                s.inboxes[n].put(("req", msg))
            rows = {ev[2]: ev[3] for ev in s.expect("done", len(s.d_ranks))}
            for rank, row in sorted(rows.items()):
                if s.progress:
                    s.progress(dict(row, rank=rank))
            ok = all(r["ok"] for r in rows.values())
            attempts.append(
                {
                    "request_id": req["id"],
                    "attempt": attempt,
                    "ok": ok,
                    "ids": ids,
                    "engine": req["engine"],
                    "t_sent": msg["not_after"] - timeout,
                    "bad_at_completion": sum(r.get("bad_at_completion", 0) for r in rows.values()),
                    "errors": {k: r.get("error") for k, r in rows.items() if not r["ok"]},
                    "seconds": max(r.get("seconds", 0.0) for r in rows.values()),
                }
            )
            if ok:
                owners[req["id"]] = {"ids": ids, "tokens": req["tokens"], "salt": salt}
            else:
                failed = {k for k, r in rows.items() if not r["ok"]}
                for k in set(rows) - failed:
                    s.inboxes[("decode", k)].put(("drop", ids))
                quarantine[(req["id"], attempt)] = {"ids": ids, "ranks": failed}
            _after(s, faults, req["id"])
            if ok:
                break
    for n in s.d_ranks:
        s.inboxes[n].put(("finish", (float(spec.get("drain_s", 5.0)), float(spec.get("linger_s", 0.0)))))
    held = {ev[2]: ev[3] for ev in s.expect("finished", len(s.d_ranks))}
    reclaim()
    requests = [(o["ids"], 0, o["tokens"], True, o["salt"]) for o in owners.values()]
    groups = len(counts[spec["requests"][0]["id"]])
    free = [list(pool.free)] + [[] for _ in range(groups - 1)]
    for n in s.d_ranks:
        mine = {tuple(t) for t in held[n[1]]}
        skip = [b for token, q in quarantine.items() if token in mine for g in q["ids"] for b in g]
        s.inboxes[n].put(
            ("verify", {"requests": requests, "free": free, "skip": [skip] + [[] for _ in range(groups - 1)]})
        )
    s.fire_timers(all_now=True)  # pending SIGCONTs fire now: nothing stays stopped
    return attempts


def _flooders(faults: dict) -> int:
    """How many flood processes the ``flood`` fault runs (``processes``, default 1; 0 without it)."""
    return int(faults["flood"].get("processes", 1)) if "flood" in faults else 0


def _netns(spec: dict, engine: str) -> str | None:
    return spec.get("hosts", {}).get(engine, {}).get("netns")


def _hits(fault: dict, rid: str, attempt: int) -> bool:
    """Whether ``fault`` applies to this attempt (``at`` is a request id or a list of them)."""
    at = fault["at"] if isinstance(fault["at"], list) else [fault["at"]]
    return rid in at and fault.get("attempt", 1) == attempt


def _before(s: _Scheduler, faults: dict, rid: str, attempt: int, engine: str) -> None:
    stop = faults.get("stop")
    if stop and _hits(stop, rid, attempt) and stop.get("when", "before") == "before":
        s.stop_later(stop, 0.0)
        s.fire_timers()
    for net in faults.get("net", []):
        if _hits(net, rid, attempt) and net.get("when", "before") == "before":
            s.act_later(net)
            s.fire_timers()
    busy = faults.get("busy")
    if busy and _hits(busy, rid, attempt):
        for n in s.inboxes:
            if n[0] == busy["engine"] and busy.get("rank", n[1]) == n[1]:
                s.inboxes[n].put(
                    ("busy", {"seconds": float(busy["seconds"]), "refuse": bool(busy.get("refuse"))})
                )
    flood = faults.get("flood")
    if flood and _hits(flood, rid, attempt):
        for i in range(_flooders(faults)):
            s.inboxes[("flood", i)].put(("flood", flood))
        s.expect("flooding", _flooders(faults))
    rogue = faults.get("rogue")
    if rogue and _hits(rogue, rid, attempt):
        s.inboxes[("rogue", 0)].put(("forge", {"id": rid, "attempt": attempt, "engine": engine}))
        s.expect("forged", 1)


def _after(s: _Scheduler, faults: dict, rid: str) -> None:
    kill = faults.get("kill")
    if kill and kill["after"] == rid:
        for name, proc in s.group.procs.items():
            if name.startswith(kill["engine"] + "-"):
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5.0)
        s.killed.add(kill["engine"])
    if s.tell_after is not None:  # the attempt after a move ran without D knowing: now D is told
        for n in s.d_ranks:
            s.inboxes[n].put(("moved", s.tell_after))
        s.tell_after = None
    moved = faults.get("readdress")
    if moved and moved["after"] == rid:
        host = s.act(moved["action"])  # the host's address changes (the action returns the new one)
        ranks = [n for n in s.inboxes if n[0] == moved["engine"]]
        for n in ranks:
            s.inboxes[n].put(("rebind", host))
        where = {str(ev[2]): ev[3] for ev in s.expect("rebound", len(ranks))}
        if not _etcd(s.spec):  # D learns the new side channels only after its next attempt
            s.tell_after = {moved["engine"]: where}
    rereg = faults.get("reregister")
    if rereg and rereg["after"] == rid:
        ranks = [n for n in s.inboxes if n[0] == rereg["engine"]]
        for n in ranks:
            s.inboxes[n].put(("reregister", None))
        s.expect("reregistered", len(ranks))
