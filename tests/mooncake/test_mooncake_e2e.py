"""End to end over Mooncake's transfer engine (TCP, host memory): P TP2 -> D TP1 of a Mamba2 hybrid with
different block and kernel block sizes (P 32 tokens in kernel blocks of 8, D 64 in 16), every rank a separate process with its own
TransferEngine; P holds known content, and every byte of D's regions is checked against the layout model
(kvgeom.testing.content.verify_report: content where a request put it, zero where the plan zeroes,
poison everywhere else). Pull and push, a prefix hit, a producer stopped (timeout, quarantine) and a
producer killed with its batch in flight (typed failure, the request's blocks zeroed, no other byte
touched)."""

from __future__ import annotations

import signal
import time

import pytest
from _mooncake_ranks import Blocks, Pair, wait_dead

from kvgeom import AttentionSpec, MambaSpec, ModelSpec

_LAYERS = [
    AttentionSpec(num_kv_heads=4, head_size=32, dtype="bfloat16")
    if i % 4 == 3
    else MambaSpec.mamba2(
        num_heads=8,
        head_dim=16,
        n_groups=2,
        state_size=16,
        conv_kernel=4,
        conv_dtype="bfloat16",
        ssm_dtype="float32",
    )
    for i in range(12)
]
MODEL = ModelSpec.from_layers("mooncake-e2e-mamba2-hybrid", _LAYERS)


def scenario(mode: str, p_kernel: int = 8) -> dict:
    """P TP2 (blocks of 32 tokens, kernel blocks of ``p_kernel``) -> D TP1 (64 in 16). Pull uses P kernel
    blocks of 8 (the same kernel blocks per block on both sides: prefix caching allowed); push needs P's
    kernel block to be a multiple of D's (kvgeom refuses 8 into 16), so it uses 16."""
    return {
        "model": MODEL.to_json(),
        "mode": mode,
        "compat": "kvgeom",
        "prefill": {"tp_size": 2, "block_size": 32, "kernel_block_size": p_kernel, "num_blocks": 256},
        "decode": {"tp_size": 1, "block_size": 64, "kernel_block_size": 16, "num_blocks": 128},
    }


TOKENS = [97, 1000, 2500, 31]
MAX_TOKENS = 2500
pytestmark = pytest.mark.usefixtures("mooncake_engine")


def _requests(pair: Pair, tokens: list[int], prefix: int = 0, first_salt: int = 0) -> list[dict]:
    blocks = getattr(pair, "blocks", None) or Blocks(pair.sc)
    pair.blocks = blocks  # type: ignore[attr-defined]
    out = []
    for i, n in enumerate(tokens):
        out.append(
            {
                "id": f"r{first_salt + i}",
                "tokens": n,
                "salt": first_salt + i,
                "p_ids": blocks.take("prefill", n),
                "d_ids": blocks.take("decode", n, skip=prefix),
                "first": prefix * pair.sc.decode.block_size,
                "ok": True,
            }
        )
    return out


def _fill(pair: Pair, reqs: list[dict]) -> None:
    for p in pair.p:
        assert p.call("fill", reqs) > 0


def _pull(d, r: dict, **kw) -> dict:
    return d.call(
        "pull",
        {
            "engine_id": "prefill",
            "local_ids": r["d_ids"],
            "remote_ids": r["p_ids"],
            "request_id": r["id"],
            "num_tokens": r["tokens"],
            **kw,
        },
    )


def _verify(d, reqs: list[dict]) -> dict:
    rep = d.call("verify", {"requests": reqs}, timeout=120)
    assert rep["mismatches"] == [] and rep["bad"] == 0, rep
    assert rep["checked"] == rep["total"]  # every byte of D's regions, nothing skipped
    return rep


@pytest.fixture
def pull_pair():
    pair = Pair(scenario("pull"), MAX_TOKENS)
    try:
        yield pair
    finally:
        pair.end()


def test_pull_tp2_to_tp1_hetero_blocks_and_prefix_hit(pull_pair: Pair) -> None:
    pair = pull_pair
    d = pair.d[0]
    reqs = _requests(pair, TOKENS)
    hit = _requests(pair, [1777], prefix=3, first_salt=len(reqs))  # D already holds 3 blocks (192 tokens)
    _fill(pair, reqs + hit)
    d.call("connect", {"engine": "prefill", "payloads": pair.payloads("prefill")})
    for r in reqs:
        res = _pull(d, r)
        assert res["ok"] and res["batches"] == 2  # one READ batch per P rank
        assert 0 < res["posted"] <= res["descriptors"]  # merged where both sides are contiguous
        assert res["bytes_moved"] > 0
    d.call(
        "connect",
        {"engine": "prefill", "payloads": pair.payloads("prefill"), "opts": {"prefix_caching": True}},
    )
    res = _pull(d, hit[0])
    assert res["ok"] and res["bytes_moved"] > 0
    _verify(d, reqs + hit)


def test_push_tp2_to_tp1(tmp_path) -> None:
    pair = Pair(scenario("push", p_kernel=16), MAX_TOKENS)
    try:
        d = pair.d[0]
        reqs = _requests(pair, [1000, 31, 2500])
        _fill(pair, reqs)
        d.call("watch", {"engine": "prefill", "payloads": pair.payloads("prefill")})
        for p in pair.p:
            p.call(
                "connect", {"engine": "decode", "payloads": pair.payloads("decode"), "opts": {"mode": "push"}}
            )
        for r in reqs:
            d.send(
                "wait_received",
                {
                    "producer_engine": "prefill",
                    "local_ids": r["d_ids"],
                    "producer_ids": r["p_ids"],
                    "request_id": r["id"],
                    "num_tokens": r["tokens"],
                },
            )
            for p in pair.p:
                res = p.call(
                    "push",
                    {
                        "engine_id": "decode",
                        "local_ids": r["p_ids"],
                        "remote_ids": r["d_ids"],
                        "request_id": r["id"],
                        "num_tokens": r["tokens"],
                    },
                )
                assert res["ok"] and res["batches"] == 1 and res["bytes_moved"] > 0
            got = d.answer()
            assert got[0] == "ok" and got[1]["ok"], got
        _verify(d, reqs)
    finally:
        pair.end()


def test_producer_killed_with_its_batch_in_flight(pull_pair: Pair) -> None:
    pair = pull_pair
    d = pair.d[0]
    good, doomed = _requests(pair, [1000, 2500])
    _fill(pair, [good, doomed])
    d.call("connect", {"engine": "prefill", "payloads": pair.payloads("prefill")})
    assert _pull(d, good)["ok"]
    victim = pair.p[1]
    victim.signal(signal.SIGSTOP)  # rank 1 accepts nothing more: its batch stays in flight
    d.send(
        "pull",
        {
            "engine_id": "prefill",
            "local_ids": doomed["d_ids"],
            "remote_ids": doomed["p_ids"],
            "request_id": doomed["id"],
            "num_tokens": doomed["tokens"],
            "timeout_s": 60.0,
        },
    )
    time.sleep(1.0)  # D plans and posts both batches (rank 0's completes, rank 1's waits)
    victim.signal(signal.SIGKILL)
    wait_dead(victim.proc)
    got = d.answer(timeout=60)
    assert got[0] == "err" and got[1] == "TransferFailed", got
    assert got[2]["stage"] in ("wait", "post")
    assert d.call("quarantined") == []  # nothing pending: zeroed and free at once
    _verify(d, [good, dict(doomed, ok=False)])  # rank 0's bytes that landed were zeroed too


def test_producer_stopped_then_gone(pull_pair: Pair) -> None:
    pair = pull_pair
    d = pair.d[0]
    good, late = _requests(pair, [640, 1777])
    _fill(pair, [good, late])
    d.call("connect", {"engine": "prefill", "payloads": pair.payloads("prefill")})
    assert _pull(d, good)["ok"]  # both P ranks' sessions are open before one stops
    victim = pair.p[0]
    victim.signal(signal.SIGSTOP)
    d.send(
        "pull",
        {
            "engine_id": "prefill",
            "local_ids": late["d_ids"],
            "remote_ids": late["p_ids"],
            "request_id": late["id"],
            "num_tokens": late["tokens"],
            "timeout_s": 1.5,
        },
    )
    got = d.answer(timeout=60)
    assert got[0] == "err" and got[1] == "TransferTimeout", got
    assert d.call("quarantined") == [[late["id"], 1]]
    assert d.call("settle") == []  # the stopped rank's batch may still write: held
    d.send(
        "pull",
        {
            "engine_id": "prefill",
            "local_ids": late["d_ids"],
            "remote_ids": late["p_ids"],
            "request_id": late["id"],
            "num_tokens": late["tokens"],
        },
    )
    again = d.answer()
    assert again[0] == "err" and again[1] == "QuarantinedBlockError" and again[2]["field"] == "local_ids", (
        again
    )
    victim.signal(signal.SIGKILL)
    wait_dead(victim.proc)
    end, settled = time.monotonic() + 30, []
    while not settled and time.monotonic() < end:
        settled = d.call("settle")
        time.sleep(0.05)
    assert settled == [[late["id"], 1]]
    assert d.call("quarantined") == []
    _verify(d, [good, dict(late, ok=False)])


def test_pull_across_network_namespaces() -> None:
    """Each rank on a host of its own (a network namespace with its own address, joined by a virtual
    switch): Mooncake's TCP transport between addresses, not loopback; then a P rank's link down during a
    pull (timeout, quarantine until the stalled batch ends after the link is back); every byte of D
    checked."""
    from kvgeom_lab.netns import VirtualNet, missing_tools

    missing = [t for t in missing_tools() if t in ("ip", "root")]
    assert not missing, f"network namespaces need {missing} (Debian: apt-get install iproute2; run as root)"
    with VirtualNet(["p0", "p1", "d0"], impairable=False) as net:
        hosts = {
            ("prefill", 0): (net["p0"].netns, net["p0"].addr),
            ("prefill", 1): (net["p1"].netns, net["p1"].addr),
            ("decode", 0): (net["d0"].netns, net["d0"].addr),
        }
        pair = Pair(scenario("pull"), MAX_TOKENS, hosts)
        try:
            assert {p.payload["session"].split(":")[0] for p in pair.p} == {net["p0"].addr, net["p1"].addr}
            d = pair.d[0]
            reqs = _requests(pair, [1000, 2500])
            cut = _requests(pair, [1777], first_salt=len(reqs))[0]
            _fill(pair, reqs + [cut])
            d.call("connect", {"engine": "prefill", "payloads": pair.payloads("prefill")})
            for r in reqs:
                assert _pull(d, r)["ok"]
            # P rank 1's cable pulled: its batch stalls (nobody is told), D's deadline passes, the blocks
            # stay quarantined while the batch may still land; the cable back, the batch ends, and
            # settle() gives the blocks back zeroed again
            net.link_down("p1")
            try:
                d.send(
                    "pull",
                    {
                        "engine_id": "prefill",
                        "local_ids": cut["d_ids"],
                        "remote_ids": cut["p_ids"],
                        "request_id": cut["id"],
                        "num_tokens": cut["tokens"],
                        "timeout_s": 2.0,
                    },
                )
                got = d.answer(timeout=60)
                assert got[0] == "err" and got[1] == "TransferTimeout", got
                assert d.call("settle") == []
            finally:
                net.link_up("p1")
            end, settled = time.monotonic() + 45, []
            while not settled and time.monotonic() < end:
                settled = d.call("settle")
                time.sleep(0.1)
            assert settled == [[cut["id"], 1]]
            _verify(d, reqs + [dict(cut, ok=False)])
        finally:
            pair.end()


def test_push_with_a_writer_stopped() -> None:
    """Push: P rank 1 is stopped before it writes; D's wait ends at its deadline (NotifTimeout), the
    request's blocks are zeroed (rank 0's bytes had landed) and held until the deployment releases them
    (the stopped writer could still write); every byte of D checked."""
    pair = Pair(scenario("push", p_kernel=16), MAX_TOKENS)
    try:
        d = pair.d[0]
        good, doomed = _requests(pair, [640, 1000])
        _fill(pair, [good, doomed])
        d.call("watch", {"engine": "prefill", "payloads": pair.payloads("prefill")})
        for p in pair.p:
            p.call(
                "connect", {"engine": "decode", "payloads": pair.payloads("decode"), "opts": {"mode": "push"}}
            )

        def wait(r: dict, **kw) -> None:
            d.send(
                "wait_received",
                {
                    "producer_engine": "prefill",
                    "local_ids": r["d_ids"],
                    "producer_ids": r["p_ids"],
                    "request_id": r["id"],
                    "num_tokens": r["tokens"],
                    **kw,
                },
            )

        def push(p, r: dict) -> dict:
            return p.call(
                "push",
                {
                    "engine_id": "decode",
                    "local_ids": r["p_ids"],
                    "remote_ids": r["d_ids"],
                    "request_id": r["id"],
                    "num_tokens": r["tokens"],
                },
            )

        wait(good)
        for p in pair.p:
            assert push(p, good)["ok"]
        assert d.answer()[1]["ok"]
        pair.p[1].signal(signal.SIGSTOP)
        wait(doomed, timeout_s=3.0)
        assert push(pair.p[0], doomed)["ok"]  # rank 0's half lands
        got = d.answer(timeout=60)
        assert got[0] == "err" and got[1] == "NotifTimeout", got
        assert d.call("quarantined") == [[doomed["id"], 1]]
        pair.p[1].signal(signal.SIGKILL)
        wait_dead(pair.p[1].proc)
        assert d.call("release", {"request_id": doomed["id"], "attempt": 1}) == [doomed["id"], 1]
        _verify(d, [good, dict(doomed, ok=False)])
    finally:
        pair.end()
