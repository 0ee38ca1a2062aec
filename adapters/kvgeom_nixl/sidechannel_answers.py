"""The side channel server's answers to authenticated requests (``get``, ``exchange``, ``generation``, ``session``) and its refusals."""

from __future__ import annotations

import hashlib
import socket
import time
from typing import Any

from .errors import AdapterError, AuthenticationError, ProtocolError, ReplayError
from .sidechannel_format import _dumps, _frame, _recv_exact, _send_all, decode, open_payload, validate_payload
from .wire import Preamble


def _busy() -> ProtocolError:
    return ProtocolError("server busy: every handler is taken", stage="sidechannel")


class _Answers:
    """What :class:`~kvgeom_nixl.sidechannel_server.SideChannelServer` answers (a mixin over its state): nonces remembered, refusals, the handler of one authenticated request, replies tagged for its nonce, exchanged payloads kept."""

    def _remember(self, pre: Preamble) -> None:
        """Accept each nonce once (within twice the replay window)."""
        now = time.monotonic()
        nonce = pre.nonce_hex
        with self._lock:
            while self._nonces and next(iter(self._nonces.values())) < now - 2 * self._window:
                self._nonces.popitem(last=False)
            if nonce in self._nonces:
                raise ReplayError(
                    f"request field 'nonce': {nonce} already used (replayed request)",
                    stage="sidechannel",
                    field="nonce",
                    expected=None,
                    seen=nonce,
                )
            self._nonces[nonce] = now
            while len(self._nonces) > 1 << 16:
                self._nonces.popitem(last=False)

    def _refuse(
        self, conn: socket.socket, err: AdapterError, nonce: str | None = None, key: str | None = None
    ) -> None:
        """Count ``err``, send its short reply (best effort, never blocking) and close."""
        self.refusals.append(err)
        if key is None:
            key = "broken"
            if isinstance(err, AuthenticationError):
                key = "refused_replay" if isinstance(err, ReplayError) else "refused_auth"
        self._count(key)
        try:
            conn.send(self._refusal(err, nonce))
        except OSError:
            pass
        conn.close()

    def _refusal(self, err: AdapterError, nonce: str | None) -> bytes:
        if nonce is not None:
            body: dict[str, Any] = {"ok": False, "error": str(err)[:300], "nonce": nonce}
            if isinstance(err, ReplayError):
                body["refused"] = err.field
            return self._reply(nonce, _dumps(body))
        auth = False if isinstance(err, AuthenticationError) else None
        return _frame(
            _dumps({"auth": auth, "error": str(err)[:200], "ok": False}), None, b"", self._max_bytes
        )

    # -- the authenticated phase (a handler thread per request)
    def _handle(self, conn: socket.socket, pre: Preamble) -> None:
        deadline = time.monotonic() + self._io_timeout_s
        got = self._slots.acquire(timeout=self._io_timeout_s)
        try:
            with conn:
                if not got:
                    self._refuse(conn, _busy(), pre.nonce_hex, "refused_busy")
                    return
                try:
                    body = _recv_exact(conn, pre.length, deadline) if pre.length else b""
                    if hashlib.sha256(body).digest() != pre.digest:
                        raise ProtocolError(
                            "request body does not match its preamble's digest", stage="sidechannel"
                        )
                    reply = self._answer(pre, decode(body) if body else {})
                    _send_all(conn, reply, deadline)
                    self._count("served")
                except (OSError, ProtocolError, ValueError, TypeError, RecursionError, MemoryError):
                    self._count("broken")  # a broken client must not disturb the server
        finally:
            if got:
                self._slots.release()
            with self._lock:
                self._handlers -= 1
                self._lock.notify_all()

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def _reply(self, nonce: str, body: bytes) -> bytes:
        return _frame(body, self._auth, b"rep" + nonce.encode(), self._max_bytes)

    def _error(self, nonce: str, text: str) -> bytes:
        return self._reply(nonce, _dumps({"ok": False, "error": text, "nonce": nonce}))

    def _answer(self, pre: Preamble, msg: dict[str, Any]) -> bytes:
        nonce, op = pre.nonce_hex, pre.op
        if op == "generation":
            with self._lock:
                gen = self._generation
            return self._reply(nonce, _dumps({"ok": True, "generation": gen, "nonce": nonce}))
        if op == "exchange":
            try:
                peer = validate_payload(
                    open_payload(msg.get("payload"), self._auth), max_metadata_bytes=self._max_bytes
                )
            except ProtocolError as e:
                return self._error(nonce, f"exchange refused: {e}")
            self._keep_peer(peer)
        with self._lock:
            payload = self._payload_json
        head = _dumps({"nonce": nonce, "ok": True})[:-1]
        return self._reply(nonce, head + b',"payload":' + payload + b"}")

    def _keep_peer(self, peer: dict[str, Any]) -> None:
        with self._lock:
            key = peer["agent_name"]
            self._peers.pop(key, None)
            self._peers[key] = (time.monotonic(), peer)
            self._expire()
            while len(self._peers) > self._max_peers:
                self._peers.popitem(last=False)
            self._lock.notify_all()
