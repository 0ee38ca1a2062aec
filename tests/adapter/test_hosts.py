"""P and D on separate hosts (network namespaces joined through a virtual switch), UCX over TCP between
them, found through the side channel or through etcd: the demo Mamba2 hybrid, P TP2 (32-token blocks) ->
D TP1 (64-token blocks), pull and push, every byte of D checked against the oracle. Which transport
carried the bytes is read from UCX's own protocol report. And the hosts themselves: nothing survives a
test, whether it passes, fails, is interrupted or is killed (then the next run's check finds it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("nixl")

from kvgeom_lab import ProcGroup  # noqa: E402
from kvgeom_lab.hostrun import summarize, ucx_env  # noqa: E402
from kvgeom_lab.netns import VirtualNet, leftovers, remove_leftovers  # noqa: E402
from kvgeom_lab.ucxinfo import read_logs, transports  # noqa: E402
from kvgeom_nixl.discovery import EtcdClient  # noqa: E402

pytestmark = pytest.mark.nixl

D_CACHE_BYTES = 256 * 64 * 1536  # the demo D rank's cache: 256 blocks of 64 tokens, 1,536 bytes per token
REQUESTS = [
    {"id": "r0", "tokens": 97, "engine": "prefill"},
    {"id": "r1", "tokens": 1000, "engine": "prefill"},
    {"id": "r2", "tokens": 2500, "engine": "backup"},
    {"id": "r3", "tokens": 640, "engine": "prefill"},
]


@pytest.mark.parametrize("discovery", ["sidechannel", "etcd"])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_cross_host_hybrid_tp2_to_tp1_every_byte_verified(request, mode, discovery):
    """Four requests from two P engines on two hosts to D on a third; each request's bytes are checked when
    it completes, and every byte of D's cache at the end. UCX reports its READ (pull) or WRITE (push)
    protocols as ``inter-node`` over ``tcp/kvh0`` and nothing else. With etcd, D found P only there (no
    side-channel request reached P but, in push, D's liveness session to each writer) and the records are gone once the ranks closed (leases revoked)."""
    the_lab = request.getfixturevalue("etcd_lab" if discovery == "etcd" else "lab")
    out = the_lab.run(the_lab.spec(mode, [dict(r) for r in REQUESTS], 10.0), timeout_s=120)
    s = summarize(out)
    assert s["crashed"] == {}, s["crashed"]
    assert [a["ok"] for a in s["attempts"]] == [True] * 4, s["attempts"]
    assert s["mismatches"] == [] and s["bad_bytes"] == 0 and s["bad_at_completion"] == 0
    assert s["checked_bytes"] == D_CACHE_BYTES
    op, engines = (
        ("remote memory read", ["decode"])
        if mode == "pull"
        else ("remote memory write", ["prefill", "backup"])
    )
    for engine in engines:  # ``self`` tables are each worker's loopback endpoint, printed at start
        seen = transports(read_logs(the_lab.log_pattern(engine)), op)
        assert {k: v for k, v in seen.items() if k != "self"} == {"inter-node": {"tcp/kvh0"}}, (engine, seen)
    d = out["results"]["decode-0"]
    producers = {k: v for k, v in out["results"].items() if k != "decode-0"}
    if mode == "pull":
        assert d["via"] == {"prefill": [discovery], "backup": [discovery]}, d["via"]
        assert sorted(producers["prefill-0"]["released"]) == ["r0", "r1", "r3"]
        assert sorted(producers["backup-1"]["released"]) == ["r2"]
    else:
        assert all(r["ok"] for p in producers.values() for r in p["results"])
        assert sum(len(p["results"]) for p in producers.values()) == 8  # 4 requests x 2 P ranks
    # requests other than the liveness sessions D keeps to its writers in push (opened when an attempt
    # starts waiting for them, so that a later flood cannot hide a live writer: docs/reliability.md)
    ranks = [*producers.values(), d]
    served = sum(p["sidechannel"]["served"] - p["sidechannel"]["session_queries"] for p in ranks)
    if discovery == "etcd":
        assert served == 0 and d["stats"]["etcd_fallbacks"] == 0, (served, d["stats"])
        if mode == "pull":  # no writers: no liveness session either
            assert sum(p["sidechannel"]["session_queries"] for p in ranks) == 0
        left = the_lab.net.call("e", EtcdClient([the_lab.etcd.endpoint]).prefix, the_lab.prefix)
        assert left == [], [k for k, _, _ in left]
    else:
        assert served > 0


def test_namespaces_alone_do_not_make_ucx_use_the_network(no_leftovers, watchdog):
    """Why the tests pin ``UCX_TLS=tcp``: between two namespaces of one machine UCX finds the peer
    ``intra-node`` and copies with CMA, the network unused; pinned, the same READ is ``inter-node`` over
    ``tcp/kvh0``. (Also the check that the transport assertion above can fail.)"""
    from _netchildren import read_peer, serve_region

    seen = {}
    with VirtualNet(["p", "d"], impairable=False) as net:
        for label, tcp in (("unpinned", False), ("pinned", True)):
            log = os.path.join(net.workdir, f"ucx-{label}-%p.log")
            with ProcGroup() as g:
                peer_q, done_q = g.queue(), g.queue()
                g.spawn(serve_region, (ucx_env(log, tcp), peer_q, done_q, 1 << 20), "p", netns=net["p"].netns)
                g.spawn(read_peer, (ucx_env(log, tcp), peer_q, done_q, 1 << 20), "d", netns=net["d"].netns)
                res = g.collect(60)
            assert res["d"].ok and res["d"].value["ok"], res["d"]
            assert res["p"].ok and res["p"].value["served"], res["p"]
            seen[label] = transports(
                read_logs(os.path.join(net.workdir, f"ucx-{label}-*.log")), "remote memory read"
            )
    assert seen["unpinned"] == {"intra-node": {"cma/memory"}}, seen
    assert seen["pinned"] == {"inter-node": {"tcp/kvh0"}}, seen


_CHILD = r"""
import sys, time
from kvgeom_lab.netns import VirtualNet, EtcdServer
net = VirtualNet(["a", "b"])
etcd = EtcdServer(net, "b").start()
net.netem("a", delay_ms=5)
print(" ".join(net.namespaces), " ".join(str(p.pid) for p in net._procs), flush=True)  # etcd, impairer
if sys.argv[1] == "raise":
    raise RuntimeError("a failing test")
time.sleep(60)
"""


def _child(how: str) -> tuple[subprocess.Popen, list[str], list[int]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen(
        [sys.executable, "-c", _CHILD, how],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = p.stdout.readline().split()
    assert line, p.stderr.read()
    pids = [int(x) for x in line if x.isdigit()]
    return p, [x for x in line if not x.isdigit()], pids


def _gone(names: list[str], pids: list[int], bound_s: float = 10.0) -> bool:
    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        present = set(os.listdir("/var/run/netns")) & set(names)
        alive = [
            pid
            for pid in pids
            if os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
        ]
        if not present and not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["raise", "sigterm", "sigint", "sigkill"])
def test_hosts_are_removed_on_failure_and_interrupt_and_found_after_a_kill(how, no_leftovers, watchdog):
    """A process holding a virtual network (3 namespaces, an etcd member, an impairer) that fails, is sent
    SIGTERM or SIGINT removes every namespace and ends every process it started. One that is SIGKILLed
    cannot: its namespaces are then what the next run's check (:func:`leftovers`) finds and removes."""
    p, names, pids = _child(how)
    assert len(names) == 3 and len(pids) == 2 and all(os.path.exists(f"/var/run/netns/{n}") for n in names)
    if how != "raise":
        p.send_signal({"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigkill": signal.SIGKILL}[how])
    p.wait(20)
    if how == "sigkill":
        assert sorted(n for n in leftovers() if n in names) == sorted(names)
        # ours among what it removes (a run killed beside this one may leave its own, also removed)
        assert sorted(n for n in remove_leftovers() if n in names) == sorted(names)
    assert _gone(names, pids), (names, pids)
    assert not [n for n in leftovers() if n in names]
