"""Both transports receive the same moves from the same plan: the NIXL adapter (kvgeom_nixl.KVRank) and the
Mooncake adapter (kvgeom_mooncake.MooncakeRank), each run through its own code path (handshake, plan,
post) in this process against a recording double of its transfer library (kvgeom.testing's NIXL double;
a recording Mooncake engine here), pull one request of a P TP2 -> D TP1 Mamba2 hybrid. What each library
was handed, resolved to ``(src rank, src region, src offset, dst rank, dst region, dst offset, length)``
and merged into maximal runs, is the same, and is the plan's own ``RequestPlan.moves`` merged the same way.
Also: merging keeps every byte (unit checks of ``merge_runs``)."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
from _transport_ranks import scenario

from kvgeom import Pairing, plan_request
from kvgeom.plan.requestplan import contiguous_runs
from kvgeom.tools.scenario import Scenario

SECRET = "kvgeom-same-moves-secret-0123456789"
TOKENS = 1000


def _merged(moves: np.ndarray) -> np.ndarray:
    """Moves as maximal runs: rows ordered by destination, neighbours contiguous on both sides joined."""
    from kvgeom_mooncake import merge_runs

    m = np.asarray(moves, dtype=np.int64).reshape(-1, 7)
    src = (m[:, 0] << 56) | (m[:, 1] << 44) | m[:, 2]
    dst = (m[:, 3] << 56) | (m[:, 4] << 44) | m[:, 5]
    d, s, n = merge_runs(dst, src, m[:, 6])
    return np.stack(
        [s >> 56, (s >> 44) & 0xFFF, s & ((1 << 44) - 1), d >> 56, (d >> 44) & 0xFFF, d & ((1 << 44) - 1), n],
        1,
    )


def _request(sc: Scenario, sequential: bool) -> tuple[list[list[int]], list[list[int]]]:
    """Block ids drawn from shuffled pools, or handed out in order (neighbouring blocks: runs to merge)."""
    from _transport_ranks import Blocks

    b = Blocks(sc, seed=3)
    if sequential:
        b.free = {side: list(range(sc.engine(side).num_blocks))[::-1] for side in b.free}
    return b.take("decode", TOKENS), b.take("prefill", TOKENS)


class _RecordingEngine:
    """What kvgeom_mooncake.rank uses of its Engine, recording each batch instead of moving it."""

    log: list[tuple] = []
    count = 0

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        _RecordingEngine.count += 1
        self.session = f"{host}:{20000 + _RecordingEngine.count}"
        self.registered: list[tuple[int, int]] = []
        self.posted = self.descriptors = 0

    def register(self, addr: int, nbytes: int) -> None:
        self.registered.append((int(addr), int(nbytes)))

    def start(self, op, session, local, remote, lengths, notify=None) -> Future:
        _RecordingEngine.log.append((self.session, op, session, list(local), list(remote), list(lengths)))
        f: Future = Future()
        f.set_result(0)
        return f

    def notifications(self) -> list:
        return []

    def close(self) -> None:
        pass


def _locate(regions: list[tuple[int, int]], addr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    base = np.asarray([b for b, _ in regions], dtype=np.int64)
    size = np.asarray([n for _, n in regions], dtype=np.int64)
    idx = np.searchsorted(base, addr, side="right") - 1
    assert (idx >= 0).all() and (addr < base[idx] + size[idx]).all()
    return idx, addr - base[idx]


def mooncake_moves(monkeypatch, sc: Scenario, d_ids, p_ids) -> np.ndarray:
    import kvgeom_mooncake.rank as rank_mod

    monkeypatch.setattr(rank_mod, "Engine", _RecordingEngine)
    _RecordingEngine.log = []
    cfg = rank_mod.MooncakeConfig(secret=SECRET)
    ps = [rank_mod.MooncakeRank(c, cfg) for c in sc.cards("prefill")]
    d = rank_mod.MooncakeRank(sc.cards("decode")[0], cfg)
    d.connect("prefill", {p.rank: p.payload() for p in ps})
    d.pull("prefill", d_ids, p_ids, "r0", num_tokens=TOKENS)
    by_session = {p.session: p for p in ps}
    rows = []
    for _, op, session, local, remote, lengths in _RecordingEngine.log:
        assert op == "READ"
        p = by_session[session]
        sr, so = _locate(sorted(p.engine.registered), np.asarray(remote, np.int64))
        dr, do = _locate(sorted(d.engine.registered), np.asarray(local, np.int64))
        order_p = np.argsort([b for b, _ in p.engine.registered])  # registration order is region order
        order_d = np.argsort([b for b, _ in d.engine.registered])
        n = np.asarray(lengths, np.int64)
        rows.append(
            np.stack(
                [np.full(n.size, p.rank), order_p[sr], so, np.zeros(n.size, np.int64), order_d[dr], do, n], 1
            )
        )
    return np.concatenate(rows)


def nixl_moves(monkeypatch, sc: Scenario, d_ids, p_ids) -> np.ndarray:
    import nixl._api as nixl_api
    from kvgeom_nixl import TransportConfig
    from kvgeom_nixl.kvrank import KVRank

    from kvgeom.testing import NixlFabric

    fabric = NixlFabric()

    def agent(name, cfg=None):
        engine, rank = name.split("-")[0], int(name.split("-")[1])
        return fabric.agent(name, "P" if engine == "prefill" else "D", rank)

    monkeypatch.setattr(nixl_api, "nixl_agent", agent)
    cfg = TransportConfig(
        secret=SECRET, handshake_timeout_s=10.0, transfer_timeout_s=10.0, notif_timeout_s=10.0
    )
    ps = [KVRank(c, cfg) for c in sc.cards("prefill")]
    d = KVRank(sc.cards("decode")[0], cfg)
    try:
        d.connect("prefill", {p.rank: p.port for p in ps})
        d.pull("prefill", d_ids, p_ids, "r0", "r0", num_tokens=TOKENS)
        for x in [d, *ps]:
            fabric.set_regions(x.ep.name, [(r.addr, r.nbytes) for r in x.regions])
        return fabric.moves("P", "D")
    finally:
        for x in [d, *ps]:
            x.close()


def _same_blocks_tp1() -> dict:
    s = scenario("pull")
    s["prefill"] = dict(s["decode"], num_blocks=512)
    return s


@pytest.mark.parametrize(
    "pair, sequential, merges",
    [
        (scenario("pull"), False, False),
        # P TP2 -> D TP1 with D blocks of two P blocks: every piece of a P rank lands between the other
        # rank's heads, so even neighbouring blocks give no run to merge
        (scenario("pull"), True, False),
        (_same_blocks_tp1(), True, True),  # TP1 -> TP1, equal blocks, neighbouring blocks: runs merge
    ],
    ids=["tp2-tp1-shuffled", "tp2-tp1-sequential", "tp1-tp1-sequential"],
)
def test_both_transports_receive_the_plans_moves(
    monkeypatch, pair: dict, sequential: bool, merges: bool
) -> None:
    sc = Scenario.from_json(pair)
    d_ids, p_ids = _request(sc, sequential)
    pairing = Pairing.create(sc.cards("decode")[0], sc.cards("prefill"), "pull", "kvgeom")
    plan = plan_request(pairing, d_ids, p_ids, "r0", num_tokens=TOKENS)
    want = _merged(plan.moves(pairing))
    with monkeypatch.context() as m:
        moon = mooncake_moves(m, sc, d_ids, p_ids)
    with monkeypatch.context() as m:
        nixl = nixl_moves(m, sc, d_ids, p_ids)
    runs = contiguous_runs(plan.moves(pairing))
    # kvgeom mode: both transports post one descriptor per maximal run contiguous on both sides
    assert len(nixl) == len(moon) == runs
    assert (runs < plan.num_descriptors) == merges
    np.testing.assert_array_equal(_merged(moon), want)
    np.testing.assert_array_equal(_merged(nixl), want)
    assert int(moon[:, 6].sum()) == int(nixl[:, 6].sum()) == int(plan.moves(pairing)[:, 6].sum())


def test_merge_runs_keeps_every_byte() -> None:
    from kvgeom_mooncake import merge_runs

    rng = np.random.default_rng(0)
    # 600 disjoint 64-byte pieces of one 64 KiB span, each moved to a disjoint place; some neighbours on both sides
    order = rng.permutation(1024)[:600]
    local = order * 64
    remote = order * 64 + np.where(order < 512, 7, 70000)  # neighbours merge within each half
    length = np.full(order.size, 64)
    lo, re, ln = merge_runs(local, remote, length)
    assert int(ln.sum()) == int(length.sum())
    assert lo.size < local.size
    src = np.zeros(1 << 18, np.uint8)
    src[:] = rng.integers(0, 256, src.size)
    a, b = np.zeros(1 << 17, np.uint8), np.zeros(1 << 17, np.uint8)
    for x, y, n in zip(local, remote, length):
        a[x : x + n] = src[y : y + n]
    for x, y, n in zip(lo, re, ln):
        b[x : x + n] = src[y : y + n]
    np.testing.assert_array_equal(a, b)
    # merged runs are contiguous on both sides inside, and no two results could be merged further
    assert not ((lo[:-1] + ln[:-1] == lo[1:]) & (re[:-1] + ln[:-1] == re[1:])).any()


def test_merge_runs_drops_empty_moves() -> None:
    from kvgeom_mooncake import merge_runs

    lo, re, ln = merge_runs(np.array([0, 10, 20]), np.array([100, 110, 120]), np.array([10, 0, 10]))
    assert lo.tolist() == [0, 20] and re.tolist() == [100, 120] and ln.tolist() == [10, 10]
