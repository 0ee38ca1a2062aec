"""Discovery through etcd: every rank publishes its handshake payload under the deployment's prefix, and
a peer finds the ranks of an engine there instead of asking each one's side channel.

Each rank keeps one key, ``<prefix>/engines/<engine id>/<rank>``, attached to an etcd *lease* that a
background thread keeps alive (:class:`Registration`): a rank that dies disappears from etcd within the
lease's TTL; one that re-registers its memory (or moves to another address) overwrites its key with a
new ``generation``. The value is a *record*: the same sealed payload the side channel serves (engine,
rank, agent name, NIXL agent metadata, geometry card, region bases, generation, side-channel address),
encrypted and MACed under the deployment's secret::

    {"v": 2, "nonce": "<24 hex>", "box": "<base64>"}

``box`` is the sealed payload's JSON encrypted with AES-256-GCM (:meth:`Auth.encrypt`, the
``cryptography`` package; a key derived from the secret for this purpose only, a random 96-bit nonce per
record) with the record's etcd key name as associated data: a record cannot be read, altered or moved to
another rank's key without the secret. So the card travels with the metadata, atomically,
and etcd learns nothing a side-channel eavesdropper without the secret would not.

:class:`Directory` reads records: it checks the tag, decrypts, opens the payload's seal, validates every
field as the side channel does, checks that the record is the rank it is stored for, and refuses a record
older than one already seen (same incarnation, lower generation; or an earlier incarnation): a stale or
replayed entry is never used. :meth:`Directory.check` is the per-request freshness check (the
side channel's generation check, kept): one ``keys_only`` range request compares the key's
``mod_revision`` with the one loaded; only when it moved is the record read again and its generation
compared.

The client speaks etcd v3's JSON gateway (``POST /v3/kv/range`` etc., keys and values base64) over
HTTP with the standard library; every call is bounded as a whole, tries each endpoint, ignores proxy
settings, and reads at most ``max_bytes``. It does not use NIXL's own etcd exchange
(``send_local_metadata`` / ``fetch_remote_metadata`` with ``NIXL_ETCD_ENDPOINTS``): that one publishes
from a background thread whose failures are only logged, and loads whatever metadata the key holds
straight into the agent, without any authentication (see docs/deployment.md).

The etcd client itself is :mod:`kvgeom_nixl.etcd_client` (re-exported here).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from typing import Any

from .auth import Auth
from .errors import (
    AdapterError,
    AuthenticationError,
    HandshakeTimeout,
    PeerGone,
    ProtocolError,
    StaleMetadata,
)
from .etcd_client import EtcdClient, Revision, _b64, _unb64
from .sidechannel_format import (
    MAX_MESSAGE_BYTES,
    _dumps,
    decode,
    open_payload,
    seal_payload,
    validate_payload,
)

__all__ = [
    "EtcdClient",
    "Registration",
    "Directory",
    "Revision",
    "engine_key",
    "seal_record",
    "open_record",
    "RECORD_VERSION",
]

RECORD_VERSION = 2


# ------------------------------------------------------------------------------------------- records
def engine_key(prefix: str, engine_id: str, rank: int | None = None) -> str:
    """``<prefix>/engines/<engine id>/<rank>`` (or the engine's directory, with a trailing ``/``)."""
    base = f"{prefix.rstrip('/')}/engines/{engine_id}/"
    return base if rank is None else f"{base}{int(rank)}"


def seal_record(
    payload: Mapping[str, Any], auth: Auth, key: str, max_bytes: int = MAX_MESSAGE_BYTES
) -> bytes:
    """The etcd value for ``payload`` stored at ``key``: sealed (as the side channel does), encrypted and
    MACed (see the module docstring)."""
    plain = _dumps(seal_payload(payload, auth))
    nonce, box = auth.encrypt("etcd-record", plain, key.encode())
    value = json.dumps(
        {"v": RECORD_VERSION, "nonce": nonce.hex(), "box": _b64(box)}, separators=(",", ":")
    ).encode()
    if len(value) > max_bytes:
        raise ValueError(f"record of {len(value)} bytes exceeds the limit of {max_bytes}")
    return value


def open_record(value: bytes, auth: Auth, key: str, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """The checked payload in an etcd ``value`` read from ``key``: size, MAC (bound to ``key``), decryption,
    the payload's seal, every field (:func:`validate_payload`). :class:`AuthenticationError` for a record
    without a valid tag or seal, :class:`ProtocolError` for a malformed one."""
    where = f"etcd:{key}"
    if len(value) > max_bytes:
        raise ProtocolError(
            f"record of {len(value)} bytes exceeds the limit of {max_bytes}", stage="discovery", peer=where
        )
    try:
        rec = json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ProtocolError("record is not JSON", stage="discovery", peer=where) from None
    if not isinstance(rec, dict) or rec.get("v") != RECORD_VERSION:
        raise ProtocolError(
            f"record of an unknown version {rec.get('v') if isinstance(rec, dict) else rec!r}",
            stage="discovery",
            peer=where,
        )
    try:
        nonce, box = bytes.fromhex(rec["nonce"]), _unb64(rec["box"])
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(
            "record fields nonce/box missing or malformed", stage="discovery", peer=where
        ) from None
    plain = auth.decrypt("etcd-record", nonce, box, key.encode())
    if plain is None:
        raise AuthenticationError(
            "etcd record is not sealed with this deployment's secret (or was moved from another key)",
            stage="discovery",
            peer=where,
        )
    payload = open_payload(decode(plain), auth, where)
    validate_payload(payload, where, max_metadata_bytes=max_bytes)
    _check_extras(payload, where)
    return payload


def _check_extras(payload: Mapping[str, Any], where: str) -> None:
    """What a record needs beyond a side-channel payload: where its side channel is, and its incarnation."""
    sc = payload.get("sidechannel")
    if sc is None or not sc[1]:
        raise ProtocolError(
            f"payload field 'sidechannel': a record needs [host, port], got {str(sc)[:80]}",
            stage="discovery",
            peer=where,
        )
    if not payload.get("incarnation"):
        raise ProtocolError("payload field 'incarnation': a record needs one", stage="discovery", peer=where)


# ------------------------------------------------------------------------------------------- publishing
class Registration:
    """Keep one rank's record in etcd: a lease of ``ttl_s``, refreshed every ``ttl_s / 3`` by a daemon
    thread, and the record attached to it. When etcd was unreachable or lost the lease (restarted without
    its data, or down past the TTL) the thread grants a new lease and writes the record again as soon
    as etcd answers. :meth:`close` revokes the lease (the key goes with it)."""

    def __init__(self, client: EtcdClient, key: str, ttl_s: float = 10.0) -> None:
        if ttl_s < 1:
            raise ValueError(f"etcd lease TTL: at least 1 s, got {ttl_s!r}")
        self.client, self.key, self.ttl_s = client, key, float(ttl_s)
        self._value: bytes | None = None
        self._lease: int | None = None
        self._dirty = False
        self._cv = threading.Condition()
        self._stop = False
        self._published = 0  # version of the value last written
        self._version = 0
        self.state = "new"  # new | registered | unavailable | closed
        self.last_error: str | None = None
        self.stats = {"puts": 0, "grants": 0, "keepalives": 0, "errors": 0, "lost_leases": 0}
        self._thread = threading.Thread(target=self._run, name=f"etcd:{key}", daemon=True)
        self._thread.start()

    def publish(self, value: bytes, wait_s: float = 0.0) -> bool:
        """Make ``value`` the record (written by the thread at once); wait up to ``wait_s`` for it to be in
        etcd. Returns whether it is."""
        with self._cv:
            self._value = bytes(value)
            self._version += 1
            self._dirty = True
            version = self._version
            self._cv.notify_all()
            end = time.monotonic() + wait_s
            while self._published < version and not self._stop:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            return self._published >= version

    def _tick(self) -> None:
        c = self.client
        if self._lease is not None:
            self.stats["keepalives"] += 1
            if not c.keepalive(self._lease):
                self.stats["lost_leases"] += 1
                self._lease = None
        if self._lease is None:
            self._lease = c.grant(self.ttl_s)
            self.stats["grants"] += 1
            self._dirty = True
        with self._cv:
            value, version, dirty = self._value, self._version, self._dirty
        if dirty and value is not None:
            c.put(self.key, value, self._lease)
            self.stats["puts"] += 1
            with self._cv:
                self._published = version
                if self._version == version:
                    self._dirty = False
                self._cv.notify_all()

    def _run(self) -> None:
        period = max(0.2, self.ttl_s / 3)
        while True:
            with self._cv:
                if self._stop:
                    return
                if self._value is None:
                    self._cv.wait(period)
                    continue
            try:
                self._tick()
                self.state, self.last_error = "registered", None
            except AdapterError as e:
                self.state, self.last_error = "unavailable", str(e)
                self.stats["errors"] += 1
                self._lease = self._lease  # kept: keepalive tells at the next tick whether it survived
            except Exception as e:  # never let the thread die
                self.state, self.last_error = "unavailable", f"{type(e).__name__}: {e}"
                self.stats["errors"] += 1
            with self._cv:
                if self._stop:
                    return
                if not self._dirty:
                    self._cv.wait(period if self.state == "registered" else min(period, 0.5))

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop refreshing and revoke the lease (removing the record); bounded by ``timeout_s``."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        if self._lease is not None:
            try:
                self.client.revoke(self._lease, time.monotonic() + timeout_s)
            except AdapterError:
                pass  # etcd unreachable: the record goes when the lease expires
            self._lease = None
        self.state = "closed"


# ------------------------------------------------------------------------------------------- reading
def _pause(deadline: float, pause: float) -> bool:
    """Sleep ``pause`` (at most until ``deadline``); ``False`` if the deadline has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    time.sleep(min(pause, left))
    return time.monotonic() < deadline


class Directory:
    """Read and check the records of a deployment (see the module docstring); remembers, per rank, the
    newest record accepted, so that an older one is refused."""

    def __init__(
        self, client: EtcdClient, prefix: str, auth: Auth, max_bytes: int = MAX_MESSAGE_BYTES
    ) -> None:
        self.client, self.prefix, self.auth, self.max_bytes = client, prefix, auth, max_bytes
        self._seen: dict[tuple[str, int], tuple[float, str, int]] = {}  # (started, incarnation, generation)
        self._rev: dict[tuple[str, int], Revision] = {}  # revision of the record last loaded

    def _accept(
        self, engine_id: str, rank: int, payload: dict[str, Any], rev: Revision, key: str
    ) -> dict[str, Any]:
        where = f"etcd:{key}"
        if payload["engine_id"] != engine_id or payload["rank"] != rank:
            raise ProtocolError(
                f"{key} holds the record of engine {payload['engine_id']!r} rank {payload['rank']}",
                stage="discovery",
                peer=where,
            )
        me = (float(payload["started"]), payload["incarnation"], payload["generation"])
        seen = self._seen.get((engine_id, rank))
        if seen is not None and (me[0] < seen[0] or (me[1] == seen[1] and me[2] < seen[2])):
            raise StaleMetadata(
                f"{key} holds an older record (generation {me[2]}) than one already seen "
                f"(generation {seen[2]}): replayed or reverted, not used",
                stage="discovery",
                peer=where,
                expected=seen[2],
                seen=me[2],
            )
        self._seen[(engine_id, rank)] = me
        self._rev[(engine_id, rank)] = rev
        return payload

    def rank(self, engine_id: str, rank: int, deadline: float) -> dict[str, Any]:
        """The checked payload of one rank, waiting (until ``deadline``) for it to be registered."""
        key = engine_key(self.prefix, engine_id, rank)
        pause = 0.02
        while True:
            got = self.client.get(key, deadline)
            if got is not None:
                return self._accept(
                    engine_id, rank, open_record(got[0], self.auth, key, self.max_bytes), got[1], key
                )
            if not _pause(deadline, pause):
                raise HandshakeTimeout(
                    f"engine {engine_id!r} rank {rank} is not registered in etcd under {key}",
                    stage="discovery",
                    peer=f"etcd:{key}",
                )
            pause = min(pause * 2, 0.25)

    def engine(self, engine_id: str, deadline: float) -> dict[int, dict[str, Any]]:
        """Every rank's checked payload of ``engine_id``, waiting (until ``deadline``) until all ranks of the
        engine (its TP size, from the cards) are registered."""
        base = engine_key(self.prefix, engine_id)
        pause = 0.02
        while True:
            found: dict[int, tuple[bytes, Revision, str]] = {}
            for key, value, rev in self.client.prefix(base, deadline):
                tail = key[len(base) :]
                if tail.isdigit() and len(tail) < 6:
                    found[int(tail)] = (value, rev, key)
            tp = None
            if found:
                r0 = min(found)
                payload = open_record(found[r0][0], self.auth, found[r0][2], self.max_bytes)
                card = payload.get("card") or {}
                tp = (card.get("engine") or {}).get("tp_size") if isinstance(card, dict) else None
                if not isinstance(tp, int) or isinstance(tp, bool) or not 0 < tp <= 1 << 16:
                    raise ProtocolError(
                        f"{found[r0][2]}: card without a valid engine.tp_size",
                        stage="discovery",
                        peer=f"etcd:{found[r0][2]}",
                    )
            if tp is not None and all(r in found for r in range(tp)):
                return {
                    r: self._accept(
                        engine_id,
                        r,
                        open_record(found[r][0], self.auth, found[r][2], self.max_bytes),
                        found[r][1],
                        found[r][2],
                    )
                    for r in range(tp)
                }
            if not _pause(deadline, pause):
                have = sorted(found)
                raise HandshakeTimeout(
                    f"engine {engine_id!r}: ranks {have} of {tp if tp else '?'} registered in etcd "
                    f"under {base} at the deadline",
                    stage="discovery",
                    peer=f"etcd:{base}",
                )
            pause = min(pause * 2, 0.25)

    def check(self, engine_id: str, rank: int, generation: int, agent: str, deadline: float) -> int:
        """Raise :class:`StaleMetadata` unless rank ``rank`` of ``engine_id`` still publishes ``generation``
        under agent ``agent`` (what we loaded); :class:`PeerGone` if it is no longer registered;
        :class:`DiscoveryError` if etcd does not answer. One keys-only request when nothing changed."""
        key = engine_key(self.prefix, engine_id, rank)
        rev = self.client.mod_revision(key, deadline)
        if rev is None:
            raise PeerGone(
                f"engine {engine_id!r} rank {rank} is no longer registered in etcd ({key}: its lease "
                "expired or it unregistered)",
                stage="generation",
                peer=f"etcd:{key}",
            )
        if rev == self._rev.get((engine_id, rank)):
            return generation
        got = self.client.get(key, deadline)
        if got is None:
            raise PeerGone(
                f"engine {engine_id!r} rank {rank} unregistered from etcd ({key})",
                stage="generation",
                peer=f"etcd:{key}",
            )
        payload = self._accept(
            engine_id, rank, open_record(got[0], self.auth, key, self.max_bytes), got[1], key
        )
        if payload["generation"] != generation or payload["agent_name"] != agent:
            raise StaleMetadata(
                f"engine {engine_id!r} rank {rank} re-registered: etcd has generation "
                f"{payload['generation']} of agent {payload['agent_name']!r}, our metadata is "
                f"generation {generation} of {agent!r}",
                stage="generation",
                peer=f"etcd:{key}",
                expected=generation,
                seen=payload["generation"],
            )
        return generation
