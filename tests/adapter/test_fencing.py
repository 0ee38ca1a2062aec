"""Late, forged and foreign transfers never touch a request's blocks (issue 8 items 1, 2, 6, 9), with
real NIXL in separate processes: two P engines (TP2) and one D rank, a scheduler that hands blocks out
LIFO (a block given back is the next one handed out), every byte of D checked when each request
completes and again at the end.

The faults make transfers *late*: a producer SIGSTOPped past the timeout and then continued (push), or
alive but not driving NIXL (busy) while D's READs wait over UCX's TCP transport (pull). Without the
quarantine, the blocks of the failed attempt go to the next request, and the late bytes land in it
(checked by mutation: with the fence's release condition removed, the push test finds ~1.3 MB and the
pull test ~0.6 MB of wrong bytes in a request that had been verified)."""

from __future__ import annotations

import signal
import time

import pytest
from _slack import SLACK_S

pytest.importorskip("torch")
pytest.importorskip("nixl")

from kvgeom_lab.cluster import run_cluster  # noqa: E402
from kvgeom_lab.demo import DEFAULT_SCENARIO  # noqa: E402
from kvgeom_lab.floods import legit_requests_under_flood, live_producer_flood  # noqa: E402

pytestmark = pytest.mark.nixl

T = 2.5  # transfer / notification timeout of every attempt
CONFIG = {
    "handshake_timeout_s": 3.0,
    "transfer_timeout_s": T,
    "notif_timeout_s": T,
    "secret": "fencing-tests-secret-0123456789",
}
ENGINES = ["prefill", "backup"]


def _run(mode: str, requests: list[dict], faults: dict, **extra) -> dict:
    spec = {
        "scenario": dict(DEFAULT_SCENARIO, mode=mode),
        "requests": requests,
        "prefill_engines": ENGINES,
        "config": CONFIG,
        "drain_s": 10.0,
        "push_deadline": False,
        "faults": faults,
        **extra,
    }
    out = run_cluster(spec, timeout_s=400)  # generous: a stressed 2-core machine took over 150 s
    for name, v in out["results"].items():
        assert "traceback" not in v, f"{name}: {v['error']}\n{v['traceback']}"
    return out


def _by_attempt(out: dict) -> dict[tuple[str, int], dict]:
    return {(a["request_id"], a["attempt"]): a for a in out["attempts"]}


def _ids(a: dict) -> set[int]:
    return {b for g in a["ids"] for b in g}


def _decode(out: dict) -> dict:
    return out["results"]["decode-0"]


def test_push_late_writes_land_only_in_quarantine_and_never_complete_a_retry():
    """Items 1, 2 and 9. ``prefill`` is stopped past the timeout during r1's first attempt and then
    continues: its WRITE and its notice arrive late. r2, served by ``backup`` meanwhile, must not get
    r1's blocks (old code: it did, and was overwritten after it was verified). r1's second attempt goes
    to ``backup``, busy past the timeout: the late notice of attempt 1 and the rogue's forged notices
    must not complete it (old code: a leftover notification completed a retry whose blocks were never
    written). The third attempt succeeds. The rogue (no secret, but the ranks' NIXL metadata leaked to
    it) is refused by every side channel."""
    reqs = [
        {"id": "r0", "tokens": 300, "engine": "prefill"},
        {"id": "r1", "tokens": 900, "engine": "prefill"},
        {"id": "r2", "tokens": 900, "engine": "backup"},
        {"id": "r1", "tokens": 900, "engine": "backup"},
        {"id": "r1", "tokens": 900, "engine": "backup"},
        {"id": "r3", "tokens": 600, "engine": "backup"},
    ]
    faults = {
        "stop": {"engine": "prefill", "at": "r1", "seconds": T + 1.5},
        "busy": {"engine": "backup", "at": "r1", "attempt": 2, "seconds": T + 1.0},
        "rogue": {"at": "r1", "attempt": 2},
    }
    out = _run("push", reqs, faults)
    a = _by_attempt(out)
    assert [k for k, v in a.items() if v["ok"]] == [("r0", 1), ("r2", 1), ("r1", 3), ("r3", 1)], a
    for key in (("r1", 1), ("r1", 2)):
        assert "NotifTimeout" in a[key]["errors"][0], a[key]
        assert T - 0.1 < a[key]["seconds"] < T + SLACK_S
    assert all(v["bad_at_completion"] == 0 for v in a.values() if v["ok"])
    assert not _ids(a[("r1", 1)]) & _ids(a[("r2", 1)])  # handed out while quarantined: never
    assert _ids(a[("r1", 1)]) & (_ids(a[("r1", 3)]) | _ids(a[("r3", 1)]))  # once settled: reused
    settled = {(rid, att): cleared for _, rid, att, _, cleared in out["settled"]}
    assert sorted(settled[("r1", 1)]) == ["prefill:0 late W", "prefill:1 late W"]
    assert sorted(settled[("r1", 2)]) == ["backup:0 late W", "backup:1 late W"]
    d = _decode(out)
    assert d["mismatches"] == [] and d["bad_bytes"] == 0 and d["skipped_bytes"] == 0 and d["held"] == []
    assert d["stats"]["rejected_notices"] >= 5 and d["stats"]["late_notices"] == 4, d["stats"]
    late = [r for r in out["pushed"] if (r["request_id"], r["attempt"]) == ("r1", 1)]
    assert len(late) == 2 and all(r["ok"] for r in late)  # P delivered, late: D had refused the attempt
    rogue = out["results"]["rogue"]
    assert {x[4] for x in rogue["sidechannel"]} == {"AuthenticationError"} and len(rogue["sidechannel"]) == 20
    assert all(x[5] < SLACK_S for x in rogue["sidechannel"])


def test_pull_over_tcp_a_partial_timeout_fences_the_late_read():
    """Items 1 and 6. Over UCX's TCP transport a READ needs the producer to drive NIXL: with
    ``prefill`` rank 1 busy past the timeout, r1's READ from rank 1 times out while the one from rank 0
    completes (a partial failure). The live READ is kept and polled (cancelling it would not stop its
    bytes), r1's blocks stay quarantined until it ends, and r2 (served by ``backup`` meanwhile) never
    gets them (old code: 4-5 of 5 late READs landed in reused blocks; 95 transfers were left posted
    after 100 timeouts)."""
    reqs = [
        {"id": "r0", "tokens": 300, "engine": "prefill"},
        {"id": "r1", "tokens": 900, "engine": "prefill"},
        {"id": "r2", "tokens": 900, "engine": "backup"},
        {"id": "r1", "tokens": 900, "engine": "backup"},
        {"id": "r3", "tokens": 600, "engine": "backup"},
    ]
    faults = {"busy": {"engine": "prefill", "rank": 1, "at": "r1", "seconds": T + 1.5}}
    t0 = time.monotonic()
    out = _run("pull", reqs, faults, env={"UCX_TLS": "tcp"}, linger_s=T + 2.0)
    a = _by_attempt(out)
    assert [k for k, v in a.items() if v["ok"]] == [("r0", 1), ("r2", 1), ("r1", 2), ("r3", 1)], a
    err = a[("r1", 1)]["errors"][0]
    assert "TIMEOUT" in err and "prefill-1-" in err and "stays live" in err, err
    assert all(v["bad_at_completion"] == 0 for v in a.values() if v["ok"])
    assert not _ids(a[("r1", 1)]) & _ids(a[("r2", 1)])
    settled = {(rid, att): held for _, rid, att, held, _ in out["settled"]}
    assert ("r1", 1) in settled and settled[("r1", 1)] > 0.5  # released when the late READ ended
    d = _decode(out)
    assert d["mismatches"] == [] and d["bad_bytes"] == 0 and d["held"] == []
    assert d["handles"]["transfers"] == 0, d["handles"]  # nothing left posted
    producers = {k: v for k, v in out["results"].items() if k.startswith("prefill")}
    assert all("r1" not in v["released"] for v in producers.values())  # P keeps r1: D never said done
    assert time.monotonic() - t0 < 120


def test_push_a_connection_flood_on_the_live_producer_never_releases_its_blocks():
    """Issue 22 finding 1 (:func:`kvgeom_lab.floods.live_producer_flood`). ``prefill`` is alive, its side
    channel answers, but it is busy past the timeout, so its WRITE of r1 lands late. Meanwhile a process
    without the secret only holds TCP connections to ``prefill``'s side channels. Before: the server closed
    the surplus at accept, D's liveness probes read a reset or an EOF, that was PeerGone, D released r1's
    blocks within a second, r2 got them, and the late WRITE damaged the verified r2 (~1.3 MB). Now the
    server keeps answering authenticated probes under the flood, and a reset or an EOF would be no evidence
    anyway: the blocks stay held until the late ``W`` notices, and no byte lands outside r1's blocks."""
    run = live_producer_flood()
    r1 = ("r1", 1)
    assert run.served == [("r0", 1), ("r2", 1), ("r3", 1)], run.failed
    assert run.failed[r1].startswith("NotifTimeout"), run.failed
    assert run.reused_while_held == 0  # handed out while the writer lived: never
    assert run.blocks_held[r1] > 0
    assert sorted(run.cleared_by[r1]) == ["prefill:0 late W", "prefill:1 late W"], run.cleared_by
    assert run.mismatches == [] and run.bytes_damaged == 0 and run.skipped_bytes == 0, run.mismatches[:3]
    assert run.bad_at_completion == 0
    assert run.flood["closed_by_server"] >= 1 and run.flood["connects"] >= 80, run.flood


def test_push_a_live_producer_whose_port_refuses_under_a_heavy_flood_is_never_declared_gone():
    """Issue 22, the refusals under a heavy flood: ``prefill`` is alive and busy past the timeout (its
    WRITE of r1 lands late) while 2 processes without the secret hold 900 connections each on each of its
    side channels, and its ports refuse every fresh connect meanwhile (a live server's port was measured to
    refuse some under such a flood: docs/reliability.md). Before (a probe on a new connection, one refusal
    = gone): D read the first refusal as death, released r1's blocks, r2 got them and the late WRITE
    landed in it. Now D probes over the session it opened when r1 started waiting, which the live
    producer answers: r1's blocks stay held until its late ``W`` notices, and no byte lands elsewhere."""
    run = live_producer_flood(connections=900, processes=2, max_connects=300_000, refuse=True)
    r1 = ("r1", 1)
    print(f"\nrefuse+flood: {run.row()}")
    assert run.served == [("r0", 1), ("r2", 1), ("r3", 1)], run.failed
    assert run.failed[r1].startswith("NotifTimeout"), run.failed
    assert run.reused_while_held == 0 and run.blocks_held[r1] > 0
    assert sorted(run.cleared_by[r1]) == ["prefill:0 late W", "prefill:1 late W"], run.cleared_by
    assert run.mismatches == [] and run.bytes_damaged == 0 and run.skipped_bytes == 0, run.mismatches[:3]
    assert run.bad_at_completion == 0
    assert run.flood["processes"] == 2 and run.flood["closed_by_server"] >= 1000, run.flood  # refused


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_flood_on_the_freshness_checks_side_channel_fails_no_legitimate_request(mode):
    """What was left of issue 22 finding 1 (:func:`kvgeom_lab.floods.legit_requests_under_flood`): before
    each transfer the initiator asks the peer's side channel for its generation (stale metadata is never
    used). Three processes without the secret hold 700 connections each on that side channel (more than
    the 512 it keeps unauthenticated: it evicts one per new one, and its accept queue overflows) plus 100
    slow drips each, while 20 requests run with a 1 s transfer timeout. Before (one new connection per
    check): 2 of 10 flooded pulls failed, ``PeerUnknown`` at the 1 s deadline, waiting in the accept queue.
    Now the check goes over a session kept open since the first one: every request is served, within its
    deadline, and every byte checks out."""
    run = legit_requests_under_flood(mode, n=20, processes=3, config={"transfer_timeout_s": 1.0})
    print(f"\n{mode}: {run.row()}")
    assert run.requests_failed == 0, run.failed
    assert run.requests_served == 22
    assert max(run.seconds.values()) < 1.0 + SLACK_S
    assert run.bytes_damaged == 0 and run.mismatches == [] and run.bad_at_completion == 0
    assert run.flood["processes"] == 3 and run.flood["closed_by_server"] >= 1000, run.flood  # it evicted
    assert run.flood["drip_bytes"] >= 1000, run.flood


def test_push_a_stopped_producer_past_the_bound_retires_its_blocks_and_d_serves_on():
    """Issue 22 finding 3. ``prefill`` is SIGSTOPped with r1's WRITE not yet posted, long past the
    quarantine bound (1.5 s here). D retires r1's blocks (reported while the producer is still stopped),
    serves r2 from its remaining blocks meanwhile, and after SIGCONT the late WRITE lands only in the
    retired blocks; its late ``W`` notices then return them, and r3 may reuse them safely."""
    bound = 1.5
    stop_s = T + bound + 4.0
    reqs = [
        {"id": "r0", "tokens": 300, "engine": "prefill"},
        {"id": "r1", "tokens": 900, "engine": "prefill"},
        {"id": "r2", "tokens": 900, "engine": "backup", "delay_s": bound + 1.0},  # after the retirement
        {"id": "r3", "tokens": 900, "engine": "backup", "delay_s": 6.0},  # after SIGCONT
    ]
    faults = {"stop": {"engine": "prefill", "at": "r1", "seconds": stop_s}}
    out = _run("push", reqs, faults, config=dict(CONFIG, quarantine_bound_s=bound), linger_s=2.0)
    a = _by_attempt(out)
    assert [k for k, v in a.items() if v["ok"]] == [("r0", 1), ("r2", 1), ("r3", 1)], a
    assert "NotifTimeout" in a[("r1", 1)]["errors"][0]
    [(_, rid, att, held_s, ids, t_retired)] = out["retired"]
    assert (rid, att) == ("r1", 1) and bound <= held_s < bound + 3.0, out["retired"]
    cont = [t for t, e, sig in out["signals"] if e == "prefill" and sig == signal.SIGCONT]
    assert cont and t_retired < min(cont), (t_retired, out["signals"])  # retired while still stopped
    assert not _ids(a[("r1", 1)]) & _ids(a[("r2", 1)])
    settled = {(r, n): cleared for _, r, n, _, cleared in out["settled"]}
    assert sorted(settled[("r1", 1)]) == ["prefill:0 late W", "prefill:1 late W"]
    d = _decode(out)
    assert d["stats"]["retired"] == 1 and d["stats"]["retired_blocks"] == 0, d["stats"]
    assert d["mismatches"] == [] and d["bad_bytes"] == 0 and d["skipped_bytes"] == 0 and d["held"] == []
