"""Mooncake only, end to end (the cases both transports share are in tests/transport): a P rank's link
cut during a pull between network namespaces. Mooncake's engine is told nothing: its batch stalls, D's
deadline passes (TransferTimeout), and the blocks stay quarantined while the batch may still land; the
link back, the batch ends and settle() gives them back zeroed; every byte of D checked. (kvgeom_nixl
asks a producer's side channel for its generation before it posts: over the cut link that check fails
first and nothing is posted, so the NIXL version of this case is another one, tests/adapter's
test_net_faults.py.)"""

from __future__ import annotations

import time

import pytest
from _transport_pair import Failed, TransportPair
from _transport_ranks import scenario

pytestmark = [pytest.mark.usefixtures("mooncake_engine"), pytest.mark.mooncake]


def test_a_link_cut_during_a_pull_holds_the_blocks_until_the_stalled_batch_ends() -> None:
    from kvgeom_lab.netns import VirtualNet, missing_tools

    missing = [t for t in missing_tools() if t in ("ip", "root")]
    assert not missing, f"network namespaces need {missing} (Debian: apt-get install iproute2; run as root)"
    with VirtualNet(["p0", "p1", "d0"], impairable=False) as net:
        hosts = {
            ("prefill", 0): (net["p0"].netns, net["p0"].addr),
            ("prefill", 1): (net["p1"].netns, net["p1"].addr),
            ("decode", 0): (net["d0"].netns, net["d0"].addr),
        }
        pair = TransportPair("mooncake", scenario("pull"), 2500, hosts)
        try:
            good, cut = pair.requests([1000, 1777])
            pair.fill([good, cut])
            pair.connect()
            assert pair.pull(good)["ok"]
            net.link_down("p1")
            try:
                with pytest.raises(Failed) as e:
                    pair.pull(cut, timeout_s=2.0)
                assert e.value.kind("mooncake") == "late", e.value
                assert pair.settle() == []
            finally:
                net.link_up("p1")
            token = [cut["id"], 1]
            t0 = time.monotonic()
            assert pair.settle_until(token, bound_s=45) == [token]
            assert time.monotonic() - t0 < 45
            pair.verify([good, dict(cut, ok=False)])
        finally:
            pair.end()
