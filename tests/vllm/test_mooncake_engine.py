"""kvgeom_vllm.mooncake's worker over the REAL Mooncake transfer engine: two processes, P
(``kv_producer``) and D (``kv_consumer``), each a ``KvgeomMooncakeConnectorWorker`` on CPU tensors of
opt-125m's 12 attention layers, wired as vLLM wires them (P's bootstrap server, D's query, the ZMQ side
channel, P's sender writing with ``batch_transfer_sync_write`` over Mooncake's TCP transport on loopback).
One request: D's blocks receive exactly P's bytes, block for block and layer for layer, and no other byte
of D changes. vLLM's own Mooncake tests (run through the connector in tests/vllm/run.sh) mock the engine;
this one does not (docs/mooncake.md). Needs the Mooncake wheel in the vLLM venv (run.sh installs it)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
from typing import Any

import pytest
from _mooncake_engine import GDN_LAYER, LAYERS, POISON, rank_main

BLOCK, NUM_BLOCKS = 32, 12  # vLLM's CPU attention takes blocks of a multiple of 32
P_IDS, D_IDS = [3, 7, 8, 1], [10, 2, 5, 6]  # 4 blocks: up to 128 tokens of one request
P_GDN, D_GDN = [9], [4]  # the hybrid's state: one block
STEP_S = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Rank:
    def __init__(self, ctx: Any, role: str, port: int, hybrid: bool) -> None:
        self.role = role
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=rank_main, args=(role, BLOCK, NUM_BLOCKS, port, hybrid, self.inbox, self.outbox)
        )
        self.proc.start()

    def answer(self, timeout: float = STEP_S) -> Any:
        try:
            got = self.outbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.role}: no answer in {timeout}s") from None
        if got[0] == "err":
            raise AssertionError(f"{self.role}: {got[1]}: {got[2]}\n{got[3]}")
        return got[1]

    def call(self, cmd: str, kw: Any = None, timeout: float = STEP_S) -> Any:
        self.inbox.put((cmd, kw))
        return self.answer(timeout)

    def end(self) -> None:
        if self.proc.is_alive():
            try:
                self.inbox.put(("stop", None))
                self.outbox.get(timeout=10)
            except Exception:
                pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        for q in (self.inbox, self.outbox):
            q.close()
            q.cancel_join_thread()


@pytest.fixture(params=[False, True], ids=["attention", "hybrid-gdn"])
def pair(request):
    pytest.importorskip("mooncake.engine", reason="tests/vllm/run.sh installs the Mooncake wheel")
    ctx = mp.get_context("spawn")
    port = _free_port()
    ranks: list[_Rank] = []
    try:
        ranks.append(_Rank(ctx, "kv_producer", port, request.param))
        ranks.append(
            _Rank(ctx, "kv_consumer", port, request.param)
        )  # D asks P's bootstrap server only once told to receive
        ready = (ranks[0].answer(), ranks[1].answer())
        yield ranks[0], ranks[1], port, ready, request.param
    finally:
        for r in ranks:
            r.end()


def test_d_blocks_receive_exactly_ps_bytes_over_the_real_engine(pair) -> None:
    """Attention: opt-125m's 12 layers. Hybrid: plus one GDN layer in a second group (TP1 -> TP1: kvgeom
    refuses recurrent state only across TP sizes), its state page in a padded block stride."""
    p, d, port, ready, hybrid = pair
    import kvgeom_vllm

    for r in ready:  # the real engine, and the connector of the checkout under test
        assert r["engine"] == "mooncake.engine" and r["kvgeom_vllm"] == kvgeom_vllm.__file__, r
    p_ids, d_ids = [P_IDS, P_GDN] if hybrid else [P_IDS], [D_IDS, D_GDN] if hybrid else [D_IDS]
    p.call("send", {"request_id": "p-req", "transfer_id": "xfer-1", "block_ids": p_ids})
    d.call(
        "recv", {"request_id": "d-req", "transfer_id": "xfer-1", "block_ids": d_ids, "bootstrap_port": port}
    )
    got_d = d.call("finished", {"request_id": "d-req", "timeout_s": 60})
    assert got_d == {"done": True, "failed": []}, got_d
    assert p.call("finished", {"request_id": "p-req", "timeout_s": 30})["done"]
    sent = p.call("blocks", {"attn": P_IDS, "gdn": P_GDN})
    received = d.call("blocks", {"attn": D_IDS, "gdn": D_GDN})
    layers = LAYERS + ([GDN_LAYER] if hybrid else [])
    assert sorted(received) == sorted(sent) == sorted(layers)
    for name in layers:
        # attention: K and V of 12 heads of 64 per token, float16; GDN: its state page (conv + ssm), not its pad
        page = 44 if name == GDN_LAYER else BLOCK * 12 * 128 * 2
        assert len(received[name]) == len(P_GDN if name == GDN_LAYER else P_IDS) * page
        assert received[name] != bytes([POISON]) * len(received[name])
        assert received[name] == sent[name], name  # every byte of the request's blocks, in block order
    assert d.call("untouched", {"attn": D_IDS, "gdn": D_GDN})  # every other block of D is still poison
