"""A small etcd v3 client over its JSON gateway (:class:`EtcdClient`): bounded requests to the first member that answers, key/value, prefix, lease calls; used by :mod:`kvgeom_nixl.discovery`."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import DiscoveryError
from .sidechannel_format import MAX_MESSAGE_BYTES


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def _unb64(text: Any) -> bytes:
    return base64.b64decode(str(text).encode("ascii"), validate=True)


def _prefix_end(prefix: bytes) -> bytes:
    """etcd's ``range_end`` for every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


Revision = tuple[str, int]
"""Where a key's value comes from: etcd's cluster id and the key's ``mod_revision`` (a cluster that lost its
data restarts revisions, and gets a new id)."""


def _revision(reply: Mapping[str, Any], kv: Mapping[str, Any]) -> Revision:
    return str((reply.get("header") or {}).get("cluster_id", "")), int(kv.get("mod_revision", 0))


class _Status(DiscoveryError):
    """etcd answered with an error status (e.g. code 5, ``NotFound``, for a lease that expired)."""

    def __init__(self, message: str, code: int | None, **kw: Any) -> None:
        self.code = code
        super().__init__(message, **kw)


# ------------------------------------------------------------------------------------------- client
def _answer(ep: str, path: str, raw: bytes) -> dict[str, Any]:
    """A member's answer to ``path``: a JSON object (:class:`DiscoveryError` otherwise)."""
    try:
        out = json.loads(raw)
    except ValueError:
        raise DiscoveryError(
            f"etcd at {ep} answered {path} with invalid JSON", stage="discovery", peer=ep
        ) from None
    if not isinstance(out, dict):
        raise DiscoveryError(
            f"etcd at {ep} answered {path} with a {type(out).__name__}",
            stage="discovery",
            peer=ep,
        )
    return out


def _refusal(ep: str, path: str, e: urllib.error.HTTPError) -> _Status:
    """An error status from a member: its gRPC code and message, when its body has them."""
    try:
        detail = json.loads(e.read(1 << 16))
    except Exception:
        detail = {}
    code = detail.get("code") if isinstance(detail, dict) else None
    msg = detail.get("message") or detail.get("error") if isinstance(detail, dict) else None
    return _Status(
        f"etcd at {ep} refused {path}: HTTP {e.code} {msg or e.reason}",
        code,
        stage="discovery",
        peer=ep,
    )


class EtcdClient:
    """A small, bounded etcd v3 client over the JSON gateway (see the module docstring).

    ``endpoints``: ``"http://host:port"`` (or ``"host:port"``) of one or more members; a call tries them in
    turn, starting with the last one that answered, until its deadline (``timeout_s`` from its start).
    Raises :class:`DiscoveryError` when no member answered in time."""

    def __init__(
        self, endpoints: Sequence[str] | str, timeout_s: float = 2.0, max_bytes: int = MAX_MESSAGE_BYTES
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e.strip()]
        eps = [e.strip().rstrip("/") for e in endpoints]
        eps = [e if "://" in e else "http://" + e for e in eps]
        if not eps:
            raise ValueError("etcd endpoints: need at least one, got none")
        self.endpoints = eps
        self.timeout_s = float(timeout_s)
        self.max_bytes = int(max_bytes)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
        self._first = 0
        self._lock = threading.Lock()

    def _read(self, resp: Any, deadline: float) -> bytes:
        buf = bytearray()
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError("etcd reply not complete at the deadline")
            chunk = resp.read1(1 << 16) if hasattr(resp, "read1") else resp.read(1 << 16)
            if not chunk:
                return bytes(buf)
            buf += chunk
            if len(buf) > self.max_bytes:
                raise DiscoveryError(f"etcd reply exceeds {self.max_bytes} bytes", stage="discovery")

    def call(self, path: str, body: Mapping[str, Any], deadline: float | None = None) -> dict[str, Any]:
        """POST ``body`` (JSON) to ``path`` (e.g. ``/v3/kv/range``) on the first member that answers before
        ``deadline`` (absolute ``time.monotonic()``; default now + ``timeout_s``)."""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        data = json.dumps(body).encode()
        errors: list[str] = []
        pause = 0.02
        with self._lock:
            first = self._first
        n = len(self.endpoints)
        attempt = 0
        while True:
            ep = self.endpoints[(first + attempt) % n]
            attempt += 1
            left = deadline - time.monotonic()
            if left <= 0:
                break
            req = urllib.request.Request(ep + path, data=data, headers={"Content-Type": "application/json"})
            try:
                with self._opener.open(req, timeout=max(0.01, left)) as resp:
                    raw = self._read(resp, deadline)
                with self._lock:
                    self._first = (first + attempt - 1) % n
                return _answer(ep, path, raw)
            except urllib.error.HTTPError as e:  # etcd answered: an error status, not unavailability
                raise _refusal(ep, path, e) from None
            except (urllib.error.URLError, OSError, TimeoutError, ConnectionError) as e:
                reason = getattr(e, "reason", e)
                errors.append(f"{ep}: {type(reason).__name__}: {reason}")
            if attempt % n == 0:  # every member failed once: back off a little
                rem = deadline - time.monotonic()
                if rem <= 0:
                    break
                time.sleep(min(pause, rem))
                pause = min(pause * 2, 0.25)
        last = errors[-1] if errors else "deadline passed before a request could be sent"
        raise DiscoveryError(
            f"etcd {self.endpoints} did not answer {path} in time ({len(errors)} attempt(s); last: {last})",
            stage="discovery",
        )

    # -- kv
    def put(self, key: str, value: bytes, lease: int = 0, deadline: float | None = None) -> int:
        out = self.call(
            "/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": str(int(lease))}, deadline
        )
        return int(out.get("header", {}).get("revision", 0))

    def get(self, key: str, deadline: float | None = None) -> tuple[bytes, Revision] | None:
        """``(value, revision)`` of ``key``, or ``None`` if it does not exist."""
        out = self.call("/v3/kv/range", {"key": _b64(key)}, deadline)
        kvs = out.get("kvs") or []
        if not kvs:
            return None
        return _unb64(kvs[0].get("value", "")), _revision(out, kvs[0])

    def mod_revision(self, key: str, deadline: float | None = None) -> Revision | None:
        """The revision of ``key``'s last change (no value is transferred), or ``None`` if it does not exist."""
        out = self.call("/v3/kv/range", {"key": _b64(key), "keys_only": True}, deadline)
        kvs = out.get("kvs") or []
        return _revision(out, kvs[0]) if kvs else None

    def prefix(
        self, prefix: str, deadline: float | None = None, limit: int = 1024
    ) -> list[tuple[str, bytes, Revision]]:
        """``(key, value, revision)`` of every key under ``prefix`` (at most ``limit``)."""
        p = prefix.encode()
        out = self.call(
            "/v3/kv/range", {"key": _b64(p), "range_end": _b64(_prefix_end(p)), "limit": str(limit)}, deadline
        )
        return [
            (_unb64(kv["key"]).decode("utf-8", "replace"), _unb64(kv.get("value", "")), _revision(out, kv))
            for kv in out.get("kvs") or []
        ]

    def delete(self, key: str, deadline: float | None = None) -> None:
        self.call("/v3/kv/deleterange", {"key": _b64(key)}, deadline)

    # -- leases
    def grant(self, ttl_s: float, deadline: float | None = None) -> int:
        out = self.call("/v3/lease/grant", {"TTL": str(max(1, int(round(ttl_s))))}, deadline)
        if out.get("error"):
            raise DiscoveryError(f"etcd refused a lease: {out['error']}", stage="discovery")
        return int(out["ID"])

    def keepalive(self, lease: int, deadline: float | None = None) -> bool:
        """Refresh ``lease``; ``False`` if it no longer exists (expired or revoked)."""
        try:
            out = self.call("/v3/lease/keepalive", {"ID": str(lease)}, deadline)
        except _Status as e:
            if e.code == 5:
                return False
            raise
        result = out.get("result", out)
        return int(result.get("TTL", 0) or 0) > 0

    def revoke(self, lease: int, deadline: float | None = None) -> None:
        """Drop ``lease`` and every key attached to it (a lease that is already gone is fine)."""
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease)}, deadline)
        except _Status as e:
            if e.code != 5:
                raise
