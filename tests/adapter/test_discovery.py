"""Discovery through etcd against a real etcd member (Debian's etcd-server) in a network namespace: records
are encrypted, sealed and bound to their key; a stale or replayed record is never used; a registration
outlives etcd restarts (even one that lost its data) and dies with its lease; an unreachable etcd is a
typed error within its bound. And NIXL's own etcd exchange, checked: it works, and loads whatever the key
holds (why kvgeom does not use it)."""

from __future__ import annotations

import base64
import os
import signal
import threading
import time

import pytest
from _slack import SLACK_S
from kvgeom_lab.netns import EtcdServer, VirtualNet
from kvgeom_nixl import (
    AuthenticationError,
    DiscoveryError,
    PeerGone,
    ProtocolError,
    StaleMetadata,
    TransportConfig,
)
from kvgeom_nixl.auth import Auth
from kvgeom_nixl.discovery import Directory, EtcdClient, Registration, engine_key, open_record, seal_record
from kvgeom_nixl.sidechannel import make_payload

from kvgeom import AttentionSpec, GeometryCard, ModelSpec
from kvgeom.layout.engine import EngineConfig

SECRET = b"discovery-tests-secret-0123456789"
AUTH = Auth(SECRET)
PREFIX = "/kvgeom-test"
MODEL = ModelSpec.from_layers("dense-2l", [AttentionSpec(2, 16, "bfloat16")] * 2)


def _payload(
    rank: int,
    generation: int,
    *,
    engine: str = "prefill",
    agent: str | None = None,
    tp: int = 2,
    incarnation: str = "inc-1",
    started: float = 1000.0,
) -> dict:
    card = GeometryCard(engine, MODEL, EngineConfig(tp_size=tp, tp_rank=rank, block_size=16, num_blocks=32))
    return make_payload(
        engine_id=engine,
        rank=rank,
        agent_name=agent or f"{engine}-{rank}-abcd",
        agent_metadata=b"NIXL-METADATA-" + bytes(range(200)),
        card=card.to_json(),
        regions=[(1 << 20, 4096, 0)],
        generation=generation,
        sidechannel=["10.77.0.1", 4000 + rank],
        incarnation=incarnation,
        started=started,
    )


class Counting(EtcdClient):
    """An etcd client that counts its requests per path."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.calls: dict[str, int] = {}

    def call(self, path, body, deadline=None):
        self.calls[path] = self.calls.get(path, 0) + 1
        return super().call(path, body, deadline)


@pytest.fixture
def etcd(no_leftovers, watchdog):
    with VirtualNet(["e", "c"], impairable=False) as net:
        server = EtcdServer(net, "e").start()
        yield net, server
        server.stop()


def _in(net, fn, timeout_s=60.0):
    """Run ``fn`` on host c (its sockets there)."""
    return net.call("c", fn, timeout_s=timeout_s)


def test_a_record_is_encrypted_sealed_and_bound_to_its_key(etcd):
    net, server = etcd
    c = EtcdClient([server.endpoint])
    key0, key1 = engine_key(PREFIX, "prefill", 0), engine_key(PREFIX, "prefill", 1)
    p = _payload(0, 1)

    def body():
        value = seal_record(p, AUTH, key0)
        c.put(key0, value)
        raw = c.get(key0)[0]
        out = {"raw": raw}
        d = Directory(c, PREFIX, AUTH)
        out["read"] = d.rank("prefill", 0, time.monotonic() + 2)
        rec = __import__("json").loads(raw)
        box = bytearray(base64.b64decode(rec["box"]))
        box[len(box) // 2] ^= 1
        tampered = __import__("json").dumps(dict(rec, box=base64.b64encode(bytes(box)).decode())).encode()
        liar = seal_record(_payload(0, 1), AUTH, key1)  # a secret holder storing rank 0's record as rank 1
        cases = {
            "tampered": (key0, tampered),
            "moved to rank 1": (key1, raw),
            "not json": (key0, b"{]"),
            "wrong version": (key0, b'{"v": 9}'),
            "rank 0 at rank 1's key": (key1, liar),
        }
        for name, (key, value) in cases.items():
            c.put(key, value)
            try:
                Directory(c, PREFIX, AUTH).rank("prefill", int(key[-1]), time.monotonic() + 2)
                out[name] = "accepted"
            except (AuthenticationError, ProtocolError) as e:
                out[name] = type(e).__name__
        c.put(key0, value)
        try:
            Directory(c, PREFIX, Auth(os.urandom(32))).rank("prefill", 0, time.monotonic() + 2)
            out["other secret"] = "accepted"
        except AuthenticationError as e:
            out["other secret"] = type(e).__name__
        return out

    out = _in(net, body)
    raw = out["raw"]
    for secret_part in (
        p["agent_metadata"],
        base64.b64encode(p["agent_metadata"]),
        b"prefill-0-abcd",
        b"dense-2l",
        b"10.77.0.1",
    ):
        assert secret_part not in raw, secret_part  # etcd holds ciphertext only
    assert {k: v for k, v in out["read"].items()} == p
    assert out["tampered"] == out["moved to rank 1"] == out["other secret"] == "AuthenticationError", out
    assert out["not json"] == out["wrong version"] == out["rank 0 at rank 1's key"] == "ProtocolError", out
    with pytest.raises(ProtocolError, match="exceeds"):
        open_record(b"x" * 100, AUTH, key0, max_bytes=50)


def test_a_stale_or_replayed_record_is_never_used(etcd):
    """The per-request check costs one keys-only request while nothing changed; a re-registration (higher
    generation) is a StaleMetadata; an older record put back (replay, or a revert) is refused, by the
    check and by a fresh read; a restart (new incarnation, later start) is accepted; a rank whose key is
    gone is PeerGone."""
    net, server = etcd
    c = Counting([server.endpoint])
    key = engine_key(PREFIX, "prefill", 0)

    def body():
        out = {}
        gen1 = seal_record(_payload(0, 1), AUTH, key)
        c.put(key, gen1)
        d = Directory(c, PREFIX, AUTH)
        p = d.rank("prefill", 0, time.monotonic() + 2)
        c.calls.clear()
        d.check("prefill", 0, p["generation"], p["agent_name"], time.monotonic() + 2)
        out["fast path calls"] = dict(c.calls)
        c.put(key, seal_record(_payload(0, 2), AUTH, key))
        for name, fn in (
            ("re-registered", lambda: d.check("prefill", 0, 1, p["agent_name"], time.monotonic() + 2)),
        ):
            try:
                fn()
                out[name] = "used"
            except StaleMetadata as e:
                out[name] = (type(e).__name__, e.expected, e.seen)
        c.put(key, gen1)  # the old record, replayed
        for name, fn in (
            ("replay, check", lambda: d.check("prefill", 0, 2, p["agent_name"], time.monotonic() + 2)),
            ("replay, read", lambda: d.rank("prefill", 0, time.monotonic() + 2)),
        ):
            try:
                fn()
                out[name] = "used"
            except StaleMetadata as e:
                out[name] = type(e).__name__
        c.put(
            key,
            seal_record(
                _payload(0, 1, agent="prefill-0-new", incarnation="inc-2", started=2000.0), AUTH, key
            ),
        )
        out["restart"] = d.rank("prefill", 0, time.monotonic() + 2)["agent_name"]
        c.delete(key)
        try:
            d.check("prefill", 0, 1, "prefill-0-new", time.monotonic() + 2)
            out["gone"] = "used"
        except PeerGone as e:
            out["gone"] = type(e).__name__
        return out

    out = _in(net, body)
    assert out["fast path calls"] == {"/v3/kv/range": 1}, out
    assert out["re-registered"] == ("StaleMetadata", 1, 2), out
    assert out["replay, check"] == out["replay, read"] == "StaleMetadata", out
    assert out["restart"] == "prefill-0-new" and out["gone"] == "PeerGone", out


def test_an_engine_is_found_when_all_its_ranks_are_registered(etcd):
    """``Directory.engine`` waits (within its deadline) until every rank of the engine's TP size is there,
    and names the missing ones when the deadline passes."""
    net, server = etcd
    c = EtcdClient([server.endpoint])

    def body():
        d = Directory(c, PREFIX, AUTH)
        c.put(
            engine_key(PREFIX, "prefill", 0),
            seal_record(_payload(0, 1), AUTH, engine_key(PREFIX, "prefill", 0)),
        )
        t0 = time.monotonic()
        try:
            d.engine("prefill", time.monotonic() + 0.5)
            missing = "found"
        except Exception as e:
            missing = (type(e).__name__, str(e), time.monotonic() - t0)
        key1 = engine_key(PREFIX, "prefill", 1)
        threading.Timer(0.3, lambda: c.put(key1, seal_record(_payload(1, 1), AUTH, key1))).start()
        t0 = time.monotonic()
        found = d.engine("prefill", time.monotonic() + 5)
        return missing, sorted(found), time.monotonic() - t0

    missing, found, waited = _in(net, body)
    assert (
        missing[0] == "HandshakeTimeout"
        and "ranks [0] of 2" in missing[1]
        and 0.4 < missing[2] < 0.5 + SLACK_S
    ), missing
    assert found == [0, 1] and 0.25 < waited < 1.0 + SLACK_S, (found, waited)


def test_a_registration_survives_etcd_restarts_and_dies_with_its_lease(etcd):
    """A rank's record is written again by its registration thread after etcd restarts without its data
    (measured bound: a third of the TTL plus one request); a rank that dies without unregistering
    disappears when its lease expires (TTL); ``close`` removes it at once."""
    net, server = etcd
    key = engine_key(PREFIX, "prefill", 0)
    ttl = 2.0

    def present(c):
        return c.mod_revision(key) is not None

    def wait_for(cond, bound):
        t0 = time.monotonic()
        while time.monotonic() - t0 < bound:
            if cond():
                return time.monotonic() - t0
            time.sleep(0.05)
        return None

    c = EtcdClient([server.endpoint], timeout_s=0.5)
    canary = f"{PREFIX}/canary"  # a key nobody writes again: shows the restarted member has no data
    _in(net, lambda: c.put(canary, b"old member"))
    reg = _in(net, lambda: Registration(EtcdClient([server.endpoint], timeout_s=0.5), key, ttl))
    try:
        assert _in(net, lambda: reg.publish(seal_record(_payload(0, 1), AUTH, key), wait_s=2.0))
        puts = reg.stats["puts"]
        server.stop(signal.SIGKILL)
        server.start(wipe=True)
        # the registration thread may already have written the record back by now (it runs on its own
        # period), so the wipe is shown by the canary, and the rewrite by the thread's own counters
        assert _in(net, lambda: c.mod_revision(canary)) is None
        back = _in(net, lambda: wait_for(lambda: present(c) and reg.stats["puts"] > puts, 10.0))
        assert back is not None and back < ttl / 3 + 1.0 + SLACK_S, back
        assert reg.stats["lost_leases"] >= 1 and reg.state == "registered", reg.stats
    finally:
        reg._stop = True  # dies without unregistering: the thread stops, the lease is not revoked
        with reg._cv:
            reg._cv.notify_all()
        reg._thread.join(2)
    gone = _in(net, lambda: wait_for(lambda: not present(c), 10.0))
    assert gone is not None and gone < ttl + 1.0 + SLACK_S, gone
    reg2 = _in(net, lambda: Registration(EtcdClient([server.endpoint]), key, 30.0))
    assert _in(net, lambda: reg2.publish(seal_record(_payload(0, 1), AUTH, key), wait_s=2.0))
    _in(net, reg2.close)
    assert not _in(net, lambda: present(c))  # revoked: gone at once, not after 30 s


def test_an_unreachable_etcd_is_a_typed_error_within_its_bound(etcd):
    """A stopped member (connections refused) and a cut link (nothing answers) both end a request with a
    DiscoveryError at its deadline; a registration made meanwhile reports that it is not in etcd, and gets
    there once etcd is back."""
    net, server = etcd
    key = engine_key(PREFIX, "prefill", 0)
    c = EtcdClient([server.endpoint], timeout_s=0.5)

    def timed():
        t0 = time.monotonic()
        try:
            c.mod_revision(key)
            return "answered", time.monotonic() - t0
        except DiscoveryError as e:
            return type(e).__name__, time.monotonic() - t0

    server.stop(signal.SIGKILL)
    refused = _in(net, timed)
    reg = _in(net, lambda: Registration(EtcdClient([server.endpoint], timeout_s=0.5), key, 2.0))
    try:
        published = _in(net, lambda: reg.publish(seal_record(_payload(0, 1), AUTH, key), wait_s=1.0))
        state = reg.state
        server.start()
        net.link_down("e")
        cut = _in(net, timed)
        net.link_up("e")
        t0 = time.monotonic()
        back = _in(net, lambda: reg.publish(seal_record(_payload(0, 1), AUTH, key), wait_s=10.0))
        back_s = time.monotonic() - t0
    finally:
        _in(net, reg.close)
    assert refused[0] == "DiscoveryError" and 0.45 < refused[1] < 0.5 + SLACK_S, refused
    assert cut[0] == "DiscoveryError" and 0.45 < cut[1] < 0.5 + SLACK_S, cut
    assert published is False and state == "unavailable", (published, state)
    assert back is True and back_s < 3.0 + SLACK_S, back_s


def test_discovery_settings_are_checked_and_read_from_the_environment():
    c = TransportConfig.from_env(
        {
            "KVGEOM_NIXL_DISCOVERY": "etcd",
            "KVGEOM_NIXL_ETCD_ENDPOINTS": "http://10.0.0.5:2379, http://10.0.0.6:2379",
            "KVGEOM_NIXL_ETCD_PREFIX": "/prod",
            "KVGEOM_NIXL_ETCD_LEASE_TTL_S": "5",
            "KVGEOM_NIXL_SECRET": "s" * 16,
        }
    )
    assert (c.discovery, c.etcd_endpoints, c.etcd_prefix, c.etcd_lease_ttl_s) == (
        "etcd",
        ("http://10.0.0.5:2379", "http://10.0.0.6:2379"),
        "/prod",
        5.0,
    )
    for bad, field in (
        ({"discovery": "dns"}, "discovery"),
        ({"discovery": "etcd"}, "etcd_endpoints"),
        ({"etcd_prefix": "kvgeom"}, "etcd_prefix"),
        ({"etcd_lease_ttl_s": 0.5}, "etcd_lease_ttl_s"),
        ({"etcd_timeout_s": 0}, "etcd_timeout_s"),
    ):
        with pytest.raises(ValueError, match=field):
            TransportConfig(**bad)


@pytest.mark.nixl
def test_nixl_own_etcd_exchange_works_and_loads_whatever_the_key_holds(etcd):
    """Checked rather than assumed (docs/deployment.md): this NIXL build publishes and fetches agent
    metadata through etcd (``NIXL_ETCD_ENDPOINTS``), and when someone who can write etcd puts another
    agent's metadata under an agent's key, a fetch of that agent loads the other one, unchecked. kvgeom's
    records are authenticated instead."""
    pytest.importorskip("nixl")
    from _netchildren import nixl_etcd_exchange
    from kvgeom_lab import ProcGroup

    net, server = etcd
    with ProcGroup() as g:
        g.spawn(nixl_etcd_exchange, (server.endpoint, "/nixl-test"), "nixl", netns=net["c"].netns)
        res = g.collect(60)["nixl"]
    assert res.ok, res.traceback
    out = res.value
    assert out["loaded_a"] is True and out["fetch_s"] < 3.0 + SLACK_S, out
    assert out["loaded_m_when_asking_for_a"] is True, out
