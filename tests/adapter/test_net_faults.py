"""What networks do, between P and D on separate hosts (UCX over TCP): a link cut while bytes move, delay
and loss, the P host's address changing after the handshake, etcd stopped mid-run and back without its
data. Each faulty request fails with a typed error within its stated bound, its blocks are zeroed and
quarantined until nothing can write them (late bytes land only there: every byte of D is checked when
each request completes, again at the end, after the late transfers could have landed), nothing hangs,
and requests succeed again once the link or etcd is back. Scenarios: ``kvgeom_lab.hostrun``."""

from __future__ import annotations

import pytest
from _slack import SLACK_S

pytest.importorskip("torch")
pytest.importorskip("nixl")

from kvgeom_lab.hostrun import etcd_restart, impaired, link_cut, readdress, summarize  # noqa: E402

pytestmark = pytest.mark.nixl

T = 2.5  # transfer / notification timeout of every attempt
# the link cut's: the cut request fails at it whatever it is, while ``backup`` serves two first contacts
# (handshake, UCX wire-up over TCP, 1.4 MB) within it; 2.5 s was too short for those with both cores
# kept busy and the suite's cpu half beside it (one of them failed there, 7 December 2026)
T_CUT = 4.0


def _check_bytes(s: dict) -> None:
    assert s["crashed"] == {}, s["crashed"]
    assert s["mismatches"] == [] and s["bad_bytes"] == 0 and s["bad_at_completion"] == 0, s
    assert s["held_at_end"] == [], s["held_at_end"]


def _attempts(s: dict) -> dict[tuple[str, int], dict]:
    return {(a["request"], a["attempt"]): a for a in s["attempts"]}


def _reused_only_once_released(s: dict, failed: tuple[str, int], first: tuple[str, int], later: list) -> None:
    """The failed attempt's blocks were held while the next request was sent (``first`` got none of them),
    and a later attempt holds any of them only if it was sent after D had settled them and the scheduler had
    taken them back: whether a retry comes before or after that depends on how fast the late transfer ends
    (on a busy machine ``backup``'s first contacts can outlast the cut), never on the quarantine."""
    a = _attempts(s)
    ids = set(a[failed]["ids"])
    back = s["reclaimed_at"].get(failed)
    assert back is not None, s["reclaimed_at"]  # settled before the end of the run
    assert not ids & set(a[first]["ids"]) and a[first]["t_sent"] < back, (a[first], back)
    for key in later:
        if ids & set(a[key]["ids"]):
            assert a[key]["t_sent"] >= back, (key, a[key]["t_sent"], back)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_link_cut_mid_transfer_fails_in_time_and_its_late_bytes_land_only_in_quarantine(lab, mode):
    """``p``'s cable is pulled 0.15 s after D starts r1 (at 15 Mbit/s r1's 1.4 MB take ~0.75 s) and plugged
    back 4.5 s later. r1 fails at its deadline (pull: the READ times out and stays live; push: the W
    notices do not come); ``backup`` serves r2 meanwhile, never with r1's blocks, then r1's retry; when the
    link is back the late transfer completes into the quarantined blocks, which are then settled and
    reused (by r3, on ``prefill`` again, or already by r1's retry where it came after the settling) with
    every byte correct."""
    s = summarize(lab.run(link_cut(lab, mode, T_CUT)))
    _check_bytes(s)
    a = _attempts(s)
    failed = {
        k: (v["error"], (v.get("message") or "")[:200], v["seconds"]) for k, v in a.items() if not v["ok"]
    }
    assert [k for k, v in a.items() if v["ok"]] == [("r0", 1), ("r2", 1), ("r1", 2), ("r3", 1)], failed
    r1 = a[("r1", 1)]
    if mode == "pull":
        assert (
            r1["error"] == "TransferError" and "TIMEOUT" in r1["message"] and "stays live" in r1["message"]
        ), r1
        assert s["handles"]["transfers"] == 0, s["handles"]  # the late READ ended: nothing left posted
    else:
        assert r1["error"] == "NotifTimeout", r1
    assert T_CUT - 0.1 < r1["seconds"] < T_CUT + SLACK_S, r1
    _reused_only_once_released(s, ("r1", 1), ("r2", 1), [("r1", 2), ("r3", 1)])
    held = s["settled"][("r1", 1)]
    assert held["held_s"] > 1.0, held  # released only after the link came back and the transfer ended
    if mode == "push":
        assert sorted(held["cleared_by"]) == ["prefill:0 late W", "prefill:1 late W"], held
    again = set(a[("r1", 2)]["ids"]) | set(a[("r3", 1)]["ids"])
    assert set(r1["ids"]) & again, "the settled blocks were handed out again"
    assert [x[0] for x in s["actions"]] == ["cut_p", "mend_p"]


def test_delay_and_loss_slow_requests_and_one_past_its_deadline_is_fenced(lab):
    """With 100 ms of delay, 5 % loss and 16 Mbit/s on what ``p`` sends, a small request (150 KB) still
    completes, correct; a 6 MiB one misses its deadline and is fenced (its READ stays live, then completes once the
    impairment is lifted, into quarantined blocks); ``backup`` is unaffected; after the impairment,
    ``prefill`` serves again."""
    s = summarize(lab.run(impaired(lab, "pull", T)))
    _check_bytes(s)
    a = _attempts(s)
    assert [k for k, v in a.items() if v["ok"]] == [("r0", 1), ("r1", 1), ("r3", 1), ("r4", 1)], s["attempts"]
    r2 = a[("r2", 1)]
    assert (
        r2["error"] == "TransferError" and "TIMEOUT" in r2["message"] and T - 0.1 < r2["seconds"] < T + 1.5
    ), r2
    assert s["settled"][("r2", 1)]["held_s"] > 0.5
    _reused_only_once_released(s, ("r2", 1), ("r3", 1), [("r4", 1)])
    assert a[("r1", 1)]["seconds"] > a[("r0", 1)]["seconds"]  # the same engine, slower through the impairment
    assert [x[0] for x in s["actions"]] == ["impair_p", "clear_p"]


@pytest.mark.parametrize("discovery", ["sidechannel", "etcd"])
def test_the_p_host_changing_address_after_the_handshake(request, discovery):
    """After r0, ``p`` gets a new address and ``prefill``'s ranks rebind to it (new agents, new side
    channels, a higher generation). r1's first attempt fails before anything is posted: through the side
    channel D's freshness check cannot reach the old address (HandshakeTimeout, PeerUnknown or PeerGone at the
    attempt's deadline); through etcd D sees the new generation at once (StaleMetadata, milliseconds).
    D then connects to the new address (side channel: once told, as an orchestrator would; etcd: by
    itself) and r1's second attempt and r2 succeed."""
    lab = request.getfixturevalue("etcd_lab" if discovery == "etcd" else "lab")
    out = lab.run(readdress(lab, "pull", T))
    s = summarize(out)
    _check_bytes(s)
    a = _attempts(s)
    assert [k for k, v in a.items() if v["ok"]] == [("r0", 1), ("r1", 2), ("r2", 1)], s["attempts"]
    r1 = a[("r1", 1)]
    if discovery == "etcd":
        assert r1["error"] == "StaleMetadata" and r1["seconds"] < SLACK_S, r1
    else:
        assert (
            r1["error"] in ("HandshakeTimeout", "PeerUnknown", "PeerGone") and r1["seconds"] < T + SLACK_S
        ), r1
    new = s["actions"][0][1]
    d = out["results"]["decode-0"]
    assert d["peer_hosts"]["prefill"] == [new] and d["via"]["prefill"] == [discovery], d["peer_hosts"]


def test_etcd_stopped_mid_run_and_back_without_its_data(etcd_lab):
    """etcd is killed as r2 (the first request to ``backup``) is sent and restarts 6 s later with no data.
    r2's handshake through etcd fails at the handshake bound (3 s), its blocks zeroed; r3, to the already
    connected ``prefill``, succeeds meanwhile: its freshness check falls back to P's own side channel.
    Once etcd is back the ranks register again by themselves, and r2's retry and r4 succeed."""
    out = etcd_lab.run(etcd_restart(etcd_lab, "pull", T))
    s = summarize(out)
    _check_bytes(s)
    a = _attempts(s)
    assert [k for k, v in a.items() if v["ok"]] == [("r0", 1), ("r1", 1), ("r3", 1), ("r2", 2), ("r4", 1)], s[
        "attempts"
    ]
    r2 = a[("r2", 1)]
    assert r2["error"] in ("DiscoveryError", "HandshakeTimeout") and r2["seconds"] < 3.0 + 0.5, r2
    assert ("r2", 1) in s["settled"]  # nothing was posted: free again at once
    assert s["stats"]["etcd_fallbacks"] >= 1 and a[("r3", 1)]["seconds"] < T, (s["stats"], a[("r3", 1)])
    assert [x[0] for x in s["actions"]] == ["etcd_stop", "etcd_wipe_start"]


def test_a_reregistered_engine_is_picked_up_from_etcd(etcd_lab):
    """``prefill`` re-registers its memory after r0: through etcd D's next freshness check sees the new
    generation (StaleMetadata, before anything is posted), re-reads the records and the retry succeeds."""
    reqs = [
        {"id": "r0", "tokens": 900, "engine": "prefill"},
        {"id": "r1", "tokens": 900, "engine": "prefill"},
        {"id": "r1", "tokens": 900, "engine": "prefill"},
        {"id": "r2", "tokens": 600, "engine": "prefill"},
    ]
    spec = etcd_lab.spec("pull", reqs, T, faults={"reregister": {"engine": "prefill", "after": "r0"}})
    s = summarize(etcd_lab.run(spec))
    _check_bytes(s)
    a = _attempts(s)
    assert [k for k, v in a.items() if v["ok"]] == [("r0", 1), ("r1", 2), ("r2", 1)], s["attempts"]
    assert a[("r1", 1)]["error"] == "StaleMetadata" and a[("r1", 1)]["seconds"] < 0.5, a[("r1", 1)]
