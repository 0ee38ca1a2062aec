"""End-to-end NIXL transport tests: real agents in separate processes, loopback, UCX on DRAM.

Each test runs a prefill rank ``P`` and a decode rank ``D`` (``_ranks.py``) in a :class:`ProcGroup`,
so every child is ended whatever happens, and every wait (events, results, transfers,
notifications, handshakes) has a deadline.
"""

from __future__ import annotations

import queue
import socket
import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("nixl")

from _ranks import decode_rank, prefill_rank  # noqa: E402
from kvgeom_lab import ProcGroup  # noqa: E402

pytestmark = pytest.mark.nixl

NBYTES = 4 << 20
BLOCK = 64 << 10
NBLK = NBYTES // BLOCK
PERM = [int(x) for x in np.random.default_rng(7).permutation(NBLK)]
RESULT_S = 40.0  # bound on a whole scenario once both ranks run
EVENT_S = 25.0  # bound on one coordination event (includes process start-up: ~2 s each)


def _spec(mode: str, **kw) -> dict:
    return {"mode": mode, "nbytes": NBYTES, "block": BLOCK, "perm": PERM, **kw}


def _expect(g: ProcGroup, events, who: str, event: str, timeout_s: float = EVENT_S):
    """Wait for ``event`` from ``who``; fail fast (with the child's traceback) if a child dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            w, ev, data = events.get(timeout=0.1)
        except queue.Empty:
            dead = [n for n, p in g.procs.items() if not p.is_alive()]
            if dead:
                res = g.collect(2.0, dead)
                raise AssertionError(f"child died while waiting for {who}:{event}: {res}") from None
            continue
        assert (w, ev) == (who, event), f"expected {who}:{event}, got {w}:{ev} ({data})"
        return data
    raise AssertionError(f"no {who}:{event} within {timeout_s}s")


def _start(g: ProcGroup, spec_p: dict, spec_d: dict):
    events, to_p, to_d = g.queue(), g.queue(), g.queue()
    g.spawn(prefill_rank, (spec_p, events, to_p), "P")
    g.spawn(decode_rank, (spec_d, events, to_d), "D")  # starts in parallel; fetch retries until P is up
    ready = _expect(g, events, "P", "ready")
    to_d.put(("parent", "port", ready))
    return events, to_p, to_d


def test_read_scattered_pull_and_notification():
    with ProcGroup() as g:
        _start(g, _spec("serve", expect=[b"read-done"]), _spec("read"))
        res = g.collect(RESULT_S)
    d, p = res["D"].unwrap(), res["P"].unwrap()
    assert d["ok"], "decode read wrong bytes"
    tel = d["telemetry"]
    assert tel.total_bytes == NBYTES
    assert tel.desc_count == d["expected_desc_count"]  # NIXL merges only runs dense on both sides
    assert ("D", b"read-done") in p["notifs"]


def test_write_push_and_notification():
    with ProcGroup() as g:
        _start(g, _spec("push"), _spec("receive"))
        res = g.collect(RESULT_S)
    d, p = res["D"].unwrap(), res["P"].unwrap()
    assert d["notifs"] == [("P", b"write-done")]
    assert d["ok"], "decode received wrong bytes"
    assert p["telemetry"].total_bytes == NBYTES
    assert p["notifs"] == [("D", b"verified")]


def test_silent_side_channel_is_a_bounded_handshake_timeout():
    silent = socket.socket()  # listens (the kernel accepts into the backlog) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    port = silent.getsockname()[1]
    try:
        with ProcGroup() as g:
            to_d = g.queue()
            g.spawn(decode_rank, (_spec("silent", handshake_timeout_s=1.0), g.queue(), to_d), "D")
            to_d.put(("parent", "port", {"port": port}))
            res = g.collect(RESULT_S)
    finally:
        silent.close()
    d = res["D"].unwrap()
    assert d["error"] == "HandshakeTimeout" and f"127.0.0.1:{port}" in d["message"]
    assert 0.95 < d["elapsed_s"] < 2.0


def test_peer_killed_before_post_is_reported_not_hung():
    with ProcGroup() as g:
        events, _, to_d = _start(g, _spec("serve"), _spec("kill_before"))
        _expect(g, events, "D", "armed")
        g.procs["P"].kill()
        assert g.procs["P"].join(5.0) == -9
        to_d.put(("parent", "killed", None))
        res = g.collect(15.0, ["D"])
    d = res["D"].unwrap()
    stages = {stage: (etype, dt) for stage, etype, dt in d["errors"]}
    assert stages["generation"][0] == "PeerGone"  # side channel refuses: the process is gone
    assert stages["post"][0] in ("PeerGone", "TransferError")  # NIXL itself, posting anyway
    assert all(dt < 6.0 for _, dt in stages.values()), stages


def test_peer_killed_while_transferring_is_reported_not_hung():
    with ProcGroup() as g:
        big = {"nbytes": 64 << 20, "block": 1 << 20, "perm": list(range(64))}  # ~15 ms per READ
        events, _, _ = _start(g, _spec("serve", **big), _spec("kill_during", **big))
        _expect(g, events, "D", "looping")
        time.sleep(0.2)  # let a few READs complete
        t_kill = time.monotonic()
        g.procs["P"].kill()
        res = g.collect(15.0, ["D"])
    d = res["D"].unwrap()
    assert d["n_ok"] >= 1
    [(stage, etype, t_err)] = d["errors"]
    assert etype in ("PeerGone", "TransferError"), d
    assert t_err - t_kill < 6.0, f"decode noticed the dead peer only after {t_err - t_kill:.2f}s"


def test_stale_metadata_detected_then_rehandshake_succeeds():
    with ProcGroup() as g:
        events, to_p, to_d = _start(g, _spec("serve", expect=[b"second"]), _spec("stale"))
        _expect(g, events, "D", "first-done")
        to_p.put(("parent", "reregister", None))
        gen = _expect(g, events, "P", "reregistered")["generation"]
        to_d.put(("parent", "go", None))
        res = g.collect(RESULT_S)
    d, p = res["D"].unwrap(), res["P"].unwrap()
    assert d["first"]["ok"]
    assert d["detected"] == {"type": "StaleMetadata", "expected": 1, "seen": gen}
    assert d["new_generation"] == gen
    assert d["old_handle"] == "StaleMetadata"  # handle prepared on old metadata refused before NIXL
    assert d["old_region"] == "NIXL_ERR_NOT_FOUND"  # stale registration dropped by remove-then-add
    assert d["second"]["ok"]
    assert ("D", b"second") in p["notifs"] and ("D", b"never") not in p["notifs"]


def test_bad_descriptors_surface_as_transfer_error():
    with ProcGroup() as g:
        _start(g, _spec("serve", expect=[b"after-bad"]), _spec("bad"))
        res = g.collect(RESULT_S)
    d = res["D"].unwrap()
    for case in (
        "remote_tail_oob",
        "remote_unregistered",
        "local_oob",
        "remote_vram",
        "initialize_remote_tail_oob",
        "initialize_local_oob",
        "prep_remote_tail_oob",
        "prep_local_oob",
    ):
        assert d[case] == ("TransferError", "NIXL_ERR_NOT_FOUND"), (case, d[case])
    for case in ("bad_ids", "unequal_ids"):
        assert d[case] == ("TransferError", "NIXL_ERR_INVALID_PARAM"), (case, d[case])
    assert d["after"]["ok"], "endpoint unusable after refused requests"
    res["P"].unwrap()
