"""Why does a flooded, *live* side channel refuse connections? (issue 22, docs/reliability.md)

A real :class:`~kvgeom_nixl.sidechannel.SideChannelServer` in its own process; ``--floods`` processes
without the secret each hold ``--connections`` connections to it and reopen every one it closes (as fast
as they can, like ``kvgeom_lab.cluster``'s ``flood`` fault but without a connect cap); meanwhile this
process sends ``--queries`` liveness probes, each on a new connection (``sidechannel.probe``), and the same
number over one :class:`~kvgeom_nixl.sidechannel.Session` opened before the flood. It reports how each
probe ended (answered, refused = ``PeerGone``, ``PeerUnknown`` and its errno), the longest run of
consecutive refusals and how long it lasted, and the kernel's TCP counters over the run (``/proc/net/netstat``
and ``/proc/net/snmp``: listen overflows, embryonic resets, resets sent, ...), which name the mechanism.

    python bench/probe_flood_refusals.py --runs 5 [--backlog 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import errno
import json
import multiprocessing as mp
import select
import socket
import time
from typing import Any

SECRET = b"probe-flood-refusals-secret-0123"
COUNTERS = (
    "ListenOverflows",
    "ListenDrops",
    "EmbryonicRsts",
    "TCPReqQFullDrop",
    "TCPReqQFullDoCookies",
    "SyncookiesSent",
    "SyncookiesRecv",
    "SyncookiesFailed",
    "TCPTimeWaitOverflow",
    "TW",
    "TCPChallengeACK",
    "TCPSYNChallenge",
    "OutRsts",
    "AttemptFails",
    "EstabResets",
)


def _kernel_counters() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in ("/proc/net/netstat", "/proc/net/snmp"):
        with open(path) as f:
            lines = f.read().splitlines()
        for head, vals in zip(lines[::2], lines[1::2]):
            names, values = head.split()[1:], vals.split()[1:]
            if head.split()[0] in ("TcpExt:", "Tcp:"):
                out.update({n: int(v) for n, v in zip(names, values)})
    return {k: out.get(k, 0) for k in COUNTERS}


def _server(q: Any, stop: Any, backlog: int) -> None:
    from kvgeom_nixl.auth import Auth
    from kvgeom_nixl.sidechannel import SideChannelServer

    srv = SideChannelServer(payload={"generation": 7}, auth=Auth(SECRET))
    if backlog != 1024:  # listen() again with another backlog (Linux applies it to the bound socket)
        srv._sock.listen(backlog)
    with srv:
        q.put(srv.port)
        stop.wait(600)
    q.put(dict(srv.stats))


def _flood(port: int, per: int, stop: Any, q: Any) -> None:
    poller = select.epoll()
    socks: dict[int, socket.socket] = {}
    out = {"connects": 0, "refused": 0, "closed": 0}

    def fill() -> None:
        while len(socks) < per:
            s = socket.socket()
            s.setblocking(False)
            out["connects"] += 1
            if s.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
                s.close()
                continue
            socks[s.fileno()] = s
            poller.register(s.fileno(), select.EPOLLIN | select.EPOLLRDHUP)

    while not stop.is_set():
        fill()
        for fd, _ in poller.poll(0.005):
            s = socks[fd]
            try:
                if s.recv(4096):
                    continue
                out["closed"] += 1
            except BlockingIOError:
                continue
            except ConnectionRefusedError:
                out["refused"] += 1
            except OSError:
                out["closed"] += 1
            poller.unregister(fd)
            del socks[fd]
            s.close()
    for s in socks.values():
        s.close()
    q.put(out)


def one_run(floods: int, connections: int, queries: int, backlog: int, ramp_s: float) -> dict[str, Any]:
    from kvgeom_nixl.auth import Auth
    from kvgeom_nixl.errors import PeerGone, PeerUnknown
    from kvgeom_nixl.sidechannel import Session, probe

    ctx = mp.get_context("spawn")
    q, stop, fstop = ctx.Queue(), ctx.Event(), ctx.Event()
    srv = ctx.Process(target=_server, args=(q, stop, backlog), daemon=True)
    srv.start()
    port = q.get(timeout=60)
    auth = Auth(SECRET)
    session = Session("127.0.0.1", port, auth)
    session.probe(5.0)
    fq = ctx.Queue()
    fl = [ctx.Process(target=_flood, args=(port, connections, fstop, fq), daemon=True) for _ in range(floods)]
    before = _kernel_counters()
    for p in fl:
        p.start()
    time.sleep(ramp_s)
    fresh: list[str] = []
    sess: list[str] = []
    refused_at: list[float] = []
    t0 = time.monotonic()
    for _ in range(queries):
        try:
            probe("127.0.0.1", port, timeout_s=0.25, auth=auth)
            fresh.append("answered")
        except PeerGone:
            fresh.append("refused")
            refused_at.append(time.monotonic() - t0)
        except PeerUnknown as e:
            fresh.append(f"unknown {e.status}")
        try:
            session.probe(0.25)
            sess.append("answered")
        except PeerGone:
            sess.append("refused")
        except PeerUnknown as e:
            sess.append(f"unknown {e.status}")
        time.sleep(0.02)
    seconds = time.monotonic() - t0
    after = _kernel_counters()
    fstop.set()
    flood = [fq.get(timeout=30) for _ in fl]
    for p in fl:
        p.join(10)
    session.close()
    stop.set()
    stats = q.get(timeout=30)
    srv.join(10)
    run, longest, longest_s, start = 0, 0, 0.0, 0.0
    times = iter(refused_at)
    for what in fresh:  # the longest run of consecutive refusals, and how long it lasted
        if what == "refused":
            t = next(times)
            start = t if run == 0 else start
            run += 1
            if run > longest:
                longest, longest_s = run, t - start
        else:
            run = 0
    count = lambda xs: {k: xs.count(k) for k in sorted(set(xs))}  # noqa: E731
    return {
        "fresh_connection": count(fresh),
        "session": count(sess),
        "longest_refused_run": longest,
        "longest_refused_run_s": round(longest_s, 3),
        "seconds": round(seconds, 2),
        "kernel": {k: after[k] - before[k] for k in COUNTERS},
        "flood": {k: sum(f[k] for f in flood) for k in flood[0]},
        "server": {k: stats[k] for k in ("served", "evicted", "broken", "dropped_slow", "session_queries")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--floods", type=int, default=2)
    ap.add_argument("--connections", type=int, default=900)
    ap.add_argument("--queries", type=int, default=150)
    ap.add_argument("--backlog", type=int, default=1024)
    ap.add_argument("--ramp-s", type=float, default=1.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    with open("/proc/sys/net/ipv4/tcp_syncookies") as f:
        cookies = f.read().strip()
    with open("/proc/sys/net/core/somaxconn") as f:
        somaxconn = f.read().strip()
    print(f"tcp_syncookies={cookies} somaxconn={somaxconn} backlog={a.backlog}")
    rows = []
    for i in range(a.runs):
        r = one_run(a.floods, a.connections, a.queries, a.backlog, a.ramp_s)
        rows.append(r)
        print(f"run {i + 1}: {json.dumps(r)}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tcp_syncookies": cookies, "somaxconn": somaxconn, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
