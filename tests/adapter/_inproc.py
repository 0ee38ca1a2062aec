"""In-process fixtures for the attack tests: a P and a D rank (real NIXL agents) in the test process, a
pump thread that drives P's NIXL progress (the first READ needs both sides), and side-channel servers
that answer whatever a test wants, with a valid tag (a hostile peer that holds the secret) or none."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvgeom_nixl import Auth, TransportConfig
from kvgeom_nixl.sidechannel import _dumps, _frame, decode
from kvgeom_nixl.wire import serve_request

from kvgeom import AttentionSpec, GeometryCard, ModelSpec
from kvgeom.layout.engine import EngineConfig

HOST = "127.0.0.1"
SECRET = b"attack-tests-shared-secret-0123456789"
AUTH = Auth(SECRET)
MODEL = ModelSpec.from_layers("dense-4l", [AttentionSpec(4, 32, "bfloat16")] * 4)
CONFIG = TransportConfig(
    secret=SECRET, handshake_timeout_s=3.0, transfer_timeout_s=3.0, notif_timeout_s=3.0, close_drain_s=0.05
)


def card(engine_id: str, num_blocks: int = 64, block_size: int = 16, mode: str = "pull") -> GeometryCard:
    return GeometryCard(
        engine_id, MODEL, EngineConfig(tp_size=1, block_size=block_size, num_blocks=num_blocks), mode
    )


class Pump:
    """Drive NIXL progress of ranks or endpoints from a thread (use them from the test thread only
    while the pump is stopped)."""

    def __init__(self, *ranks: Any) -> None:
        self.eps = [getattr(r, "ep", r) for r in ranks]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Pump:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            for ep in self.eps:
                ep.notifications()
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)


class ReplyServer:
    """A side channel that answers each connection with ``reply(request) -> body bytes``, tagged with
    ``auth`` for the request's nonce (``auth=None``: an untagged reply)."""

    def __init__(self, reply: Callable[[dict], bytes], auth: Auth | None = AUTH) -> None:
        self.reply, self.auth = reply, auth
        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                try:
                    req = read_request(conn, time.monotonic() + 2.0)
                    out = self.reply(req)
                    bind = b"rep" + str(req.get("nonce", "")).encode()
                    conn.settimeout(5.0)
                    conn.sendall(_frame(out, self.auth, bind, 1 << 30))
                except Exception:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.sock.close()

    def __enter__(self) -> ReplyServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_request(conn: socket.socket, deadline: float) -> dict:
    """One request on a hand-made server (greeting sent, nothing checked): its body with ``op`` and
    ``nonce`` (hex) added, as the replies here need them."""
    _, pre, body = serve_request(conn, deadline, 64 << 20)
    return dict(decode(body) if body else {}, op=pre.op, nonce=pre.nonce_hex)


def payload_reply(payload: Any, auth: Auth = AUTH, seal: bool = True) -> Callable[[dict], bytes]:
    """Reply with ``payload`` (sealed with ``auth`` unless ``seal`` is False) in an ok message."""
    from kvgeom_nixl.sidechannel import seal_payload

    def reply(req: dict) -> bytes:
        p = seal_payload(payload, auth) if seal and isinstance(payload, dict) else payload
        return _dumps({"nonce": req["nonce"], "ok": True, "payload": p})

    return reply
