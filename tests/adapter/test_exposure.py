"""Exposure of a rank's sockets (issue 22, finding 4), each kept as a regression test: a rank (real NIXL
agent, its own process) listens only on the configured interface, and a flood of unauthenticated
connections plus a slow drip, all to 127.0.0.1, neither stop its side channel from answering the
deployment's peers within their deadlines nor make it buffer more than a bounded amount."""

from __future__ import annotations

import ipaddress
import os
import queue
import socket
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("nixl")

from _exposed import concurrent_endpoints, endpoint_without_host, exposed_rank  # noqa: E402
from _inproc import AUTH, HOST  # noqa: E402
from kvgeom_lab import ProcGroup  # noqa: E402
from kvgeom_nixl import Auth, fetch, query_generation  # noqa: E402
from kvgeom_nixl.ifaces import interfaces  # noqa: E402
from kvgeom_nixl.wire import GREETING_BYTES, PREAMBLE_BYTES, make_request, parse_greeting  # noqa: E402

pytestmark = pytest.mark.nixl

EVENT_S = 30.0  # one coordination event
# a rank's start (torch and NIXL imported, agent and side channel up) before its first event: 30 s was too
# short once at load 12-20 (three vLLM engines starting beside test-core, 3 December 2026)
READY_S = 180.0
MAX_PENDING = 512  # SideChannelServer's default
DRIPS = 200
FLOOD_S = 4.0
FLOOD_MAX = 3000  # connections the flood opens at most


def _event(g: ProcGroup, events, name: str, timeout_s: float = EVENT_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            _, ev, data = events.get(timeout=0.2)
        except queue.Empty:
            dead = [n for n, p in g.procs.items() if not p.is_alive()]
            if dead:
                pytest.fail(f"rank died while waiting for {name!r}: {g.collect(2.0, dead)}")
            continue
        if ev == name:
            return data
    pytest.fail(f"no {name!r} from the rank within {timeout_s}s")


def _rank(g: ProcGroup, name: str, **spec) -> tuple[dict, object]:
    events, inbox = g.queue(), g.queue()
    g.spawn(exposed_rank, (dict(spec, host=spec.get("host", HOST)), events, inbox), name)
    return _event(g, events, "ready", READY_S), (events, inbox)


def _external() -> list[str]:
    return [str(i.ip) for i in interfaces().values() if not i.ip.is_loopback]


def test_rank_listens_only_on_the_configured_interface():
    """Finding 4: each rank listened on the side channel plus two UCX listeners, one of them on the
    external interface in a loopback-only run. With ``net_devices="auto"`` UCX now gets the interface of
    the rank's host (``lo``): every listening socket of the rank's process is on 127.0.0.0/8. The control
    arm (``net_devices="all"``, UCX's default) shows the check would see an external listener."""
    with ProcGroup() as g:
        ready, (_, inbox) = _rank(g, "auto")
        control, (_, inbox2) = _rank(g, "all", config={"net_devices": "all"})
        inbox.put(("parent", "exit", None))
        inbox2.put(("parent", "exit", None))
        g.collect(EVENT_S)
    addrs = {ipaddress.ip_address(a) for a, _ in ready["listening"]}
    assert ready["net_devices"] == "lo"
    assert len(ready["listening"]) == 2, ready["listening"]  # the side channel and one UCX listener
    assert all(a.is_loopback for a in addrs), ready["listening"]
    assert (HOST, ready["port"]) in ready["listening"]
    if _external():  # this machine has an external interface: UCX's default listens there
        assert control["net_devices"] is None
        assert any(not ipaddress.ip_address(a).is_loopback for a, _ in control["listening"]), control


def test_agents_created_at_once_in_one_process_each_get_their_own_net_devices():
    """``UCX_NET_DEVICES`` is set in the process's environment while an agent is created, so without a
    lock an agent made by one thread could be created under another thread's value (or under none, once
    the other restored it). Six endpoints made at once from six threads, alternately with ``lo`` and with
    UCX's default (``all``): each ``lo`` agent listens on loopback only, each ``all`` one on the external
    interface too, so the process holds exactly one external listener per ``all`` agent."""
    settings = ["lo", "all"] * 3
    with ProcGroup() as g:
        g.spawn(concurrent_endpoints, (settings, g.queue()), "threads")
        res = g.collect(EVENT_S * 4)["threads"]
    assert res.ok, res.error
    out = res.value
    assert out["errors"] == [] and out["alive"] == 0, out
    assert out["net_devices"] == {i: ("lo" if s == "lo" else None) for i, s in enumerate(settings)}
    loop = [a for a, _ in out["listening"] if ipaddress.ip_address(a).is_loopback]
    outside = [a for a, _ in out["listening"] if not ipaddress.ip_address(a).is_loopback]
    assert len(loop) == len(settings), out["listening"]  # one UCX listener per agent on 127.0.0.1
    if _external():  # this machine has an external interface: the "all" agents (and only they) use it
        assert len(outside) == settings.count("all"), out["listening"]
    else:
        assert outside == [], out["listening"]


def test_an_endpoint_without_a_host_listens_on_loopback_only():
    """An :class:`Endpoint` made on its own, without a host: nothing was configured, so under
    ``net_devices="auto"`` UCX gets the loopback interface only (before: UCX's default, every interface).
    ``net_devices="all"`` still opens every interface (shown where this machine has an external one)."""
    with ProcGroup() as g:
        g.spawn(endpoint_without_host, ({}, g.queue()), "auto")
        g.spawn(endpoint_without_host, ({"net_devices": "all"}, g.queue()), "all")
        res = g.collect(EVENT_S * 2)
    assert res["auto"].ok and res["all"].ok, (res["auto"].error, res["all"].error)
    auto, every = res["auto"].value, res["all"].value
    assert auto["net_devices"] == "lo" and every["net_devices"] is None
    assert auto["listening"] and all(ipaddress.ip_address(a).is_loopback for a, _ in auto["listening"])
    if _external():
        assert any(not ipaddress.ip_address(a).is_loopback for a, _ in every["listening"]), every


def test_a_ranks_side_channel_runs_with_the_configured_bounds():
    """``TransportConfig.max_pending`` and ``preamble_timeout_s`` reach the rank's side channel (a rank in
    its own process): with ``max_pending=4``, ten idle connections leave at most four held (the oldest
    dropped for each new one); with ``preamble_timeout_s=2.5`` the four left are still held 1.5 s later
    (past the 1 s default) and dropped after 2.5 s."""
    from _slack import SLACK_S

    with ProcGroup() as g:
        ready, (events, inbox) = _rank(g, "bounds", config={"max_pending": 4, "preamble_timeout_s": 2.5})

        def stats() -> dict:
            inbox.put(("parent", "stats", None))
            return _event(g, events, "stats")

        t0 = time.monotonic()
        socks = [socket.create_connection((HOST, ready["port"]), timeout=2.0) for _ in range(10)]
        try:
            deadline = time.monotonic() + 20.0
            early = stats()
            while early["evicted"] < 6 and time.monotonic() < deadline:
                early = stats()
            time.sleep(max(0.0, t0 + 1.5 - time.monotonic()))
            early = stats()
            late = stats()
            while late["dropped_slow"] < 4 and time.monotonic() < deadline:
                late = stats()
            waited = time.monotonic() - t0
        finally:
            for s in socks:
                s.close()
        inbox.put(("parent", "exit", None))
        g.collect(EVENT_S)
    assert early["peak_pending"] == 4 and early["evicted"] == 6 and early["dropped_slow"] == 0, early
    assert late["dropped_slow"] == 4 and 2.5 <= waited < 2.5 + SLACK_S, (late, waited)


class _Attack:
    """``DRIPS`` connections that send one byte every 0.1 s (reconnecting when dropped) and a flood of
    connections that each send a preamble tagged with a wrong secret announcing a 1 MiB body, then the
    body; all to 127.0.0.1, for at most ``FLOOD_S`` and ``FLOOD_MAX`` connections."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.flooded = self.drips_dropped = 0
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._drip, self._flood)]

    def __enter__(self) -> _Attack:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10.0)
        assert not any(t.is_alive() for t in self.threads)

    def _drip(self) -> None:
        socks: list[socket.socket | None] = [None] * DRIPS
        try:
            while not self.stop.is_set():
                for i in range(DRIPS):
                    socks[i] = self._drip_one(socks[i])
                self.stop.wait(0.1)
        finally:
            for s in socks:
                if s is not None:
                    s.close()

    def _drip_one(self, s: socket.socket | None) -> socket.socket | None:
        try:
            if s is None:
                s = socket.create_connection((HOST, self.port), timeout=1.0)
            s.send(b"\x00")
            return s
        except OSError:
            if s is not None:
                s.close()
                self.drips_dropped += 1
            return None

    def _flood(self) -> None:
        wrong, body = Auth(os.urandom(32)), os.urandom(1 << 20)
        t_end = time.monotonic() + FLOOD_S
        while not self.stop.is_set() and time.monotonic() < t_end and self.flooded < FLOOD_MAX:
            try:
                with socket.create_connection((HOST, self.port), timeout=1.0) as s:
                    greeting = parse_greeting(s.recv(GREETING_BYTES, socket.MSG_WAITALL))
                    s.sendall(make_request(greeting, "exchange", body, wrong)[0])
            except OSError:
                pass  # the server refused after the preamble and closed: the rest of the body is reset
            self.flooded += 1


def test_flood_and_slow_drip_do_not_starve_authenticated_peers():
    """Finding 4: a client without the secret could make the side channel buffer ~connections x max
    message bytes before the tag was checked (575 MB peak measured), and 200 slow-drip connections made the
    first legitimate fetch time out and the first liveness probe report PeerGone. Now unauthenticated
    connections cost at most one preamble of buffer each and are dropped at the preamble deadline; every
    authenticated generation query and fetch during the attack succeeds within its deadline."""
    with ProcGroup() as g:
        ready, (events, inbox) = _rank(g, "rank")
        port = ready["port"]
        assert query_generation(HOST, port, timeout_s=2.0, auth=AUTH) >= 0
        gen_s, fetch_s = [], []
        with _Attack(port) as attack:
            time.sleep(0.5)  # the drips are connected
            t_end = time.monotonic() + FLOOD_S - 0.5
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                query_generation(HOST, port, timeout_s=1.0, auth=AUTH)  # PeerGone or a timeout fails the test
                gen_s.append(time.monotonic() - t0)
                t0 = time.monotonic()
                fetch(HOST, port, timeout_s=2.0, auth=AUTH)
                fetch_s.append(time.monotonic() - t0)
                time.sleep(0.1)
            inbox.put(("parent", "stats", None))
            stats = _event(g, events, "stats")
        inbox.put(("parent", "exit", None))
        g.collect(EVENT_S)
    print(
        f"\nflood: {attack.flooded} connections, drips dropped {attack.drips_dropped}; generation "
        f"max {max(gen_s) * 1e3:.0f} ms, fetch max {max(fetch_s) * 1e3:.0f} ms ({len(gen_s)} each); "
        f"peak pending {stats['peak_pending']} conns / {stats['peak_pending_bytes']} B; "
        f"RSS {ready['VmRSS']} -> {stats['VmRSS']} KiB, peak {ready['VmHWM']} -> {stats['VmHWM']} KiB"
    )
    assert len(gen_s) >= 5 and max(gen_s) < 1.0 and max(fetch_s) < 2.0
    assert attack.flooded >= 100 and stats["refused_auth"] >= 100
    assert stats["dropped_slow"] >= DRIPS and attack.drips_dropped >= DRIPS  # cut at the preamble deadline
    assert stats["peak_pending_bytes"] <= MAX_PENDING * PREAMBLE_BYTES
    assert stats["VmHWM"] - ready["VmHWM"] < 64 << 10, stats  # KiB: far below one 16 MiB message each
