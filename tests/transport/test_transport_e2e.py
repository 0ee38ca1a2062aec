"""End to end over both transports (the ``transport`` fixture: ``nixl``, ``mooncake``), each case written
once against :class:`_transport_pair.TransportPair`: P TP2 -> D TP1 of a Mamba2 hybrid with different
block and kernel block sizes (P 32 tokens in kernel blocks of 8, D 64 in 16), every rank a separate
process; P holds known content, and every byte of D's regions is checked against the layout model
(kvgeom.testing.content.verify_report: content where a request put it, zero where the plan zeroes or a
request failed, poison everywhere else). Pull with a prefix hit, push, a producer killed with its transfer
in flight, a producer stalled past the deadline (timeout, quarantine until it is gone), a push writer that
never writes, and a pull between network namespaces over TCP."""

from __future__ import annotations

import time

import pytest
from _transport_pair import Failed
from _transport_ranks import scenario

TOKENS = [97, 1000, 2500, 31]
MAX_TOKENS = 2500


def test_pull_tp2_to_tp1_hetero_blocks_and_prefix_hit(make_pair) -> None:
    pair = make_pair(scenario("pull"), MAX_TOKENS)
    reqs = pair.requests(TOKENS)
    hit = pair.requests([1777], prefix=3)  # D already holds 3 blocks (192 tokens)
    pair.fill(reqs + hit)
    pair.connect()
    for r in reqs + hit:
        res = pair.pull(r)
        assert res["ok"] and res["transfers"] == 2  # one transfer per P rank
        assert 0 < res["posted"] <= res["descriptors"]  # merged where both sides are contiguous
        assert res["bytes_moved"] > 0
    pair.verify(reqs + hit)


def test_push_tp2_to_tp1(make_pair) -> None:
    pair = make_pair(scenario("push", p_kernel=16), MAX_TOKENS)
    reqs = pair.requests([1000, 31, 2500])
    pair.fill(reqs)
    pair.connect()
    for r in reqs:
        pushed, got = pair.push(r)
        assert all(p["ok"] and p["transfers"] == 1 and p["bytes_moved"] > 0 for p in pushed), pushed
        assert got["ok"], got
    pair.verify(reqs)


def test_producer_killed_with_its_transfer_in_flight(make_pair, transport: str) -> None:
    """P rank 1 moves nothing more, D posts the request's transfers (rank 0's complete, rank 1's waits),
    then rank 1 is killed: a typed failure, the request's blocks zeroed (rank 0's bytes that landed too)
    and free at once (nothing can write them), every other byte untouched."""
    pair = make_pair(scenario("pull"), MAX_TOKENS)
    good, doomed = pair.requests([1000, 2500])
    pair.fill([good, doomed])
    pair.connect()
    assert pair.pull(good)["ok"]  # both P ranks' connections are up before one stalls
    pair.stall(1)
    pair.start_pull(doomed, timeout_s=60.0)
    time.sleep(1.0)  # D plans and posts both transfers
    pair.kill(1)
    with pytest.raises(Failed) as e:
        pair.outcome(timeout=60)
    assert e.value.kind(transport) == "killed", e.value
    token = [doomed["id"], 1]
    held = pair.quarantined()  # NIXL holds every failed attempt until the next settle(), Mooncake only
    assert held in ([], [token])  # one with a batch still running: either way nothing is running now
    assert pair.settle() == held  # so the first settle gives it back
    assert pair.quarantined() == []
    pair.verify([good, dict(doomed, ok=False)])


def test_producer_stalled_past_the_deadline_is_fenced_until_gone(make_pair, transport: str) -> None:
    """P rank 0 moves nothing more: D's pull ends at its deadline, the transfer still running cannot be
    cancelled, so the blocks stay quarantined (refused by the next pull, not settled) until the
    producers are killed and the transfers end; then they come back zeroed. (Rank 1 is killed too: under
    load one READ stayed ``PROC`` for the whole bound in 3 of 38 runs, once the READ towards rank 1, a
    live producer that kept polling; docs/reliability.md. Its death ends it.)"""
    pair = make_pair(scenario("pull"), MAX_TOKENS)
    good, late = pair.requests([640, 1777])
    pair.fill([good, late])
    pair.connect()
    assert pair.pull(good)["ok"]
    pair.stall(0)
    t0 = time.monotonic()
    with pytest.raises(Failed) as e:
        pair.pull(late, timeout_s=1.5)
    assert e.value.kind(transport) == "late", e.value
    assert time.monotonic() - t0 >= 1.5
    token = [late["id"], 1]
    assert pair.quarantined() == [token]
    assert pair.settle() == []  # the stalled rank's transfer may still write: held
    with pytest.raises(Failed) as again:
        pair.pull(late)
    assert again.value.kind(transport) == "held" and again.value.fields["field"] == "local_ids"
    pair.kill(0)
    pair.kill(1)
    # each READ ends in error, or is ended once its producer's process is proven gone
    assert pair.settle_until(token) == [token], pair.stats()
    assert pair.quarantined() == []
    pair.verify([good, dict(late, ok=False)])


def test_push_with_a_writer_that_never_writes(make_pair, transport: str) -> None:
    """Push: P rank 1 never writes; D's wait ends at its deadline (NotifTimeout), the request's blocks are
    zeroed (rank 0's bytes had landed) and held while the silent writer could still write; once it is
    gone they come back; every byte of D checked."""
    pair = make_pair(scenario("push", p_kernel=16), MAX_TOKENS)
    good, doomed = pair.requests([640, 1000])
    pair.fill([good, doomed])
    pair.connect()
    assert pair.push(good)[1]["ok"]
    pair.start_wait(doomed, timeout_s=3.0)
    assert pair.push_from(0, doomed)["ok"]  # rank 0's half lands
    with pytest.raises(Failed) as e:
        pair.outcome(timeout=60)
    assert e.value.kind(transport) == "notif", e.value
    token = [doomed["id"], 1]
    assert pair.quarantined() == [token]
    assert pair.settle() == []
    pair.kill(1)
    assert pair.writer_gone(token) == [token]
    assert pair.quarantined() == []
    pair.verify([good, dict(doomed, ok=False)])


def test_push_writer_late_past_the_deadline_its_late_notice_gives_the_blocks_back(
    make_pair, transport: str
) -> None:
    """Push: P rank 1 is stalled past D's deadline, then writes after all. D's wait ends at its deadline
    (NotifTimeout), the blocks are zeroed and held; the late WRITE lands in them (held: no harm) and its
    notice, which comes after its bytes, is positive evidence that nothing more of that attempt can
    come: settle() gives the blocks back, zeroed again, without the deployment's release."""
    pair = make_pair(scenario("push", p_kernel=16), MAX_TOKENS)
    good, late = pair.requests([640, 1000])
    pair.fill([good, late])
    pair.connect()
    assert pair.push(good)[1]["ok"]
    pair.stall(1, seconds=5.0)  # past D's deadline (2 s) by 3 s: D gives up, then rank 1 writes
    pair.start_wait(late, timeout_s=2.0)
    assert pair.push_from(0, late)["ok"]
    pair.push_from(1, late, wait=False)  # taken once rank 1 runs again
    with pytest.raises(Failed) as e:
        pair.outcome(timeout=60)
    assert e.value.kind(transport) == "notif", e.value
    token = [late["id"], 1]
    assert pair.quarantined() == [token] and pair.settle() == []  # rank 1 may still write
    assert pair.pushed(1, timeout=60)["ok"]  # delivered, late: D had given up on the attempt
    assert pair.settle_until(token, bound_s=20) == [token]
    assert pair.quarantined() == []
    pair.verify([good, dict(late, ok=False)])


def test_pull_across_network_namespaces_over_tcp(make_pair) -> None:
    """Each rank on a host of its own (a network namespace with its own address, joined by a virtual
    switch): the transport's TCP between addresses, not loopback; every byte of D checked."""
    from kvgeom_lab.netns import VirtualNet, missing_tools

    missing = [t for t in missing_tools() if t in ("ip", "root")]
    assert not missing, f"network namespaces need {missing} (Debian: apt-get install iproute2; run as root)"
    with VirtualNet(["p0", "p1", "d0"], impairable=False) as net:
        hosts = {
            ("prefill", 0): (net["p0"].netns, net["p0"].addr),
            ("prefill", 1): (net["p1"].netns, net["p1"].addr),
            ("decode", 0): (net["d0"].netns, net["d0"].addr),
        }
        pair = make_pair(scenario("pull"), MAX_TOKENS, hosts)
        try:
            assert pair.served_at("prefill") == {net["p0"].addr, net["p1"].addr}
            reqs = pair.requests([1000, 2500, 31])
            pair.fill(reqs)
            pair.connect()
            for r in reqs:
                assert pair.pull(r)["ok"]
            pair.verify(reqs)
        finally:
            pair.end()  # before the namespaces go
