"""The side channel's client (:mod:`kvgeom_nixl.sidechannel`): one request per connection within a deadline (fetch, exchange, generation queries), liveness probes, and kept-open sessions."""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .auth import Auth
from .errors import (
    AdapterError,
    AuthenticationError,
    HandshakeTimeout,
    PeerGone,
    PeerUnknown,
    ProtocolError,
    ReplayError,
    StaleMetadata,
)
from .sidechannel_format import (
    MAX_MESSAGE_BYTES,
    _dumps,
    _recv_exact,
    _recv_frame,
    _send_all,
    decode,
    open_payload,
    seal_payload,
    validate_payload,
)
from .wire import GREETING_BYTES, PREAMBLE_BYTES, Greeting, make_request, parse_greeting

_RETRYABLE = (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


class _DeadlinePassed(TimeoutError):
    """The deadline passed before an attempt could start (keeps the previous attempt's error)."""


def _request(
    host: str,
    port: int,
    msg: Mapping[str, Any],
    deadline: float,
    auth: Auth,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> dict[str, Any]:
    """One connection, one request, one reply, all before the absolute ``deadline``: read the server's
    greeting, send a preamble tagged for it and the body (``msg`` without ``op``); the reply must be tagged
    for this request's nonce."""
    return _exchange(host, port, msg, deadline, auth, max_bytes)[0]


def _exchange(
    host: str,
    port: int,
    msg: Mapping[str, Any],
    deadline: float,
    auth: Auth,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> tuple[dict[str, Any], Greeting]:
    """:func:`_request`, also returning the server's greeting. The reply's tag binds the request's nonce,
    and the request's preamble binds the greeting's incarnation: an authenticated reply proves that a
    holder of the secret served this request as that incarnation."""
    where = f"{host}:{port}"
    rest = {k: v for k, v in msg.items() if k != "op"}
    body = _dumps(rest) if rest else b""
    if len(body) + PREAMBLE_BYTES > max_bytes:
        raise ValueError(f"message of {len(body)} bytes exceeds the limit of {max_bytes}")
    left = deadline - time.monotonic()
    if left <= 0:
        raise _DeadlinePassed("deadline passed")
    with socket.create_connection((host, port), timeout=left) as sock:
        greeting = parse_greeting(_recv_exact(sock, GREETING_BYTES, deadline), where)
        data, nonce = make_request(greeting, msg["op"], body, auth)
        _send_all(sock, data, deadline)
        tag, reply = _recv_frame(sock, deadline, max_bytes)
    return _check_reply(where, nonce.hex(), tag, reply, auth), greeting


def _check_reply(where: str, nonce: str, tag: bytes, body: bytes, auth: Auth) -> dict[str, Any]:
    """The decoded reply if it is tagged for ``nonce`` and says ``ok``; a typed error otherwise."""
    if not auth.check("sidechannel", tag, b"rep" + nonce.encode(), body):
        try:
            said = decode(body)
        except ProtocolError:
            said = {}
        if said.get("auth") is False or not said.get("error"):
            text = (
                "refused us: " + repr(said.get("error"))
                if said.get("error")
                else "sent a reply without a valid tag"
            )
            raise AuthenticationError(
                f"{where} {text} (do both sides have the same secret?)", stage="sidechannel", peer=where
            )
        raise ProtocolError(
            f"{where} refused the request: {said.get('error')!r}", stage="sidechannel", peer=where
        )
    reply = decode(body)
    if reply.get("auth") is False:  # (a client in the insecure mode accepts any tag)
        raise AuthenticationError(
            f"{where} refused us: {reply.get('error')!r} (do both sides have the same secret?)",
            stage="sidechannel",
            peer=where,
        )
    if reply.get("nonce") != nonce:
        raise AuthenticationError(
            f"{where} answered another request (nonce mismatch)", stage="sidechannel", peer=where
        )
    if isinstance(reply.get("refused"), str):
        raise ReplayError(
            f"{where} refused the request as not fresh: {reply.get('error')!r}",
            stage="sidechannel",
            peer=where,
            field=reply["refused"],
        )
    if reply.get("ok") is not True:
        raise ProtocolError(
            f"{where} refused the request: {reply.get('error')!r}", stage="sidechannel", peer=where
        )
    return reply


def fetch(
    host: str,
    port: int,
    my_payload: Mapping[str, Any] | None = None,
    timeout_s: float = 10.0,
    *,
    auth: Auth,
    retry_interval_s: float = 0.02,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> dict[str, Any]:
    """Get the peer's (sealed, checked) payload, and give it ``my_payload`` (sealed here) in the same
    round trip if given.

    Retries while the peer is not up yet (connection refused/reset) until ``timeout_s`` has passed,
    then raises :class:`HandshakeTimeout` naming ``host:port``. A peer that accepts but never answers,
    or answers one byte at a time, is bounded by the same deadline. A peer without the secret raises
    :class:`AuthenticationError` at once.
    """
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    msg: dict[str, Any] = {"op": "get"}
    if my_payload is not None:
        msg = {"op": "exchange", "payload": seal_payload(my_payload, auth)}
    attempts = 0
    last: BaseException | None = None
    pause = retry_interval_s
    while True:
        attempts += 1
        try:
            reply = _request(host, port, msg, deadline, auth, max_bytes)
        except _DeadlinePassed as e:
            last = last or e
            break
        except TimeoutError as e:  # connected (or connecting) but no whole answer before the deadline
            last = e
            break
        except _RETRYABLE as e:
            last = e
        except OSError as e:  # e.g. EHOSTUNREACH while an interface comes up: also retried
            last = e
        else:
            payload = open_payload(reply.get("payload"), auth, where)
            return validate_payload(payload, where, max_metadata_bytes=max_bytes)
        rem = deadline - time.monotonic()
        if rem <= 0:
            break
        time.sleep(min(pause, rem))
        pause = min(pause * 2, 0.25)
    raise HandshakeTimeout(
        f"side channel {where} did not answer within {timeout_s:.3g}s "
        f"({attempts} attempt(s), last error: {type(last).__name__}: {last})",
        stage="handshake",
        peer=where,
    )


def query_generation(host: str, port: int, timeout_s: float = 2.0, *, auth: Auth) -> int:
    """One cheap ``generation`` query, bounded as a whole by ``timeout_s``. Only positive evidence of
    death is :class:`PeerGone`: the connection refused (``ECONNREFUSED``: nothing listens on the port).
    Anything else that leaves us without an answer (a reset or an EOF before the reply, which a flooded
    server's accept-time close produces, a timeout, an unreachable route) is :class:`PeerUnknown`."""
    return probe(host, port, timeout_s, auth=auth).generation


@dataclass(frozen=True)
class Liveness:
    """An authenticated answer to a ``generation`` query: the peer's registration generation and the
    incarnation of the server that answered (a rank's server announces its process's incarnation)."""

    generation: int
    incarnation: bytes


def probe(host: str, port: int, timeout_s: float = 2.0, *, auth: Auth) -> Liveness:
    """:func:`query_generation`, with the answering server's authenticated incarnation: a different
    incarnation than the one a peer was known by is positive evidence that the process it knew is gone
    (another process serves its port). Errors as :func:`query_generation`."""
    where = f"{host}:{port}"
    try:
        reply, greeting = _exchange(host, port, {"op": "generation"}, time.monotonic() + timeout_s, auth)
    except ConnectionRefusedError as e:
        raise PeerGone(
            f"side channel {where} refused the connection ({e}): its process is gone",
            stage="generation",
            peer=where,
        ) from None
    except OSError as e:  # TimeoutError, ConnectionResetError, EOF, ENETUNREACH, ...: no evidence
        raise PeerUnknown(
            f"side channel {where} did not answer a generation query within {timeout_s:.3g}s "
            f"({type(e).__name__}: {e}); its process may be alive",
            stage="generation",
            peer=where,
            status=errno.errorcode.get(e.errno, None) if e.errno else None,
        ) from None
    gen = reply.get("generation")
    if isinstance(gen, bool) or not isinstance(gen, int):
        raise ProtocolError(f"{where} answered generation={gen!r}", stage="generation", peer=where)
    return Liveness(gen, greeting.incarnation)


def _liveness_errors(where: str, timeout_s: float, e: OSError) -> AdapterError:
    """What a failed connection tells (as :func:`probe`): refused is gone, anything else unknown."""
    if isinstance(e, ConnectionRefusedError):
        return PeerGone(
            f"side channel {where} refused the connection ({e}): its process is gone",
            stage="generation",
            peer=where,
        )
    return PeerUnknown(
        f"side channel {where} did not answer a generation query within {timeout_s:.3g}s "
        f"({type(e).__name__}: {e}); its process may be alive",
        stage="generation",
        peer=where,
        status=errno.errorcode.get(e.errno, None) if e.errno else None,
    )


class Session:
    """A kept-open, authenticated connection to one peer's side channel for its generation (the freshness
    check before each transfer): after the first query, each one is a 132-byte preamble and a short reply
    on the same connection, with no connect and no wait in the server's accept queue, so a flood of
    connections on the peer's port does not delay it. Each request names the challenge the server sent
    with its previous reply (and the server's incarnation), each reply is tagged for its request's nonce:
    as bound as a query on a new connection. Any error closes the session; the next query (or the rest of
    this one's deadline, if the session was old) opens a new one. Errors as :func:`probe`. Not
    thread-safe: one owner."""

    def __init__(self, host: str, port: int, auth: Auth) -> None:
        self.host, self.port, self.auth = host, int(port), auth
        self.where = f"{host}:{port}"
        self._sock: socket.socket | None = None
        self._greeting: Greeting | None = None
        self.opened = 0  # connections made (a new one after each failure)
        self.queries = 0
        self.answered_at: float | None = None  # monotonic time of the last authenticated answer

    def probe(self, timeout_s: float = 2.0) -> Liveness:
        """The peer's generation and incarnation, bounded as a whole by ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        if self._sock is not None:
            try:
                return self._ask(self._sock, self._greeting, deadline)
            except (OSError, AdapterError):  # a session the server closed (idle, evicted, restarted): renew
                self.close()
        try:
            sock = socket.create_connection(
                (self.host, self.port), timeout=max(deadline - time.monotonic(), 0.001)
            )
        except OSError as e:
            raise _liveness_errors(self.where, timeout_s, e) from None
        self.opened += 1
        self._sock = sock
        try:
            self._greeting = parse_greeting(_recv_exact(sock, GREETING_BYTES, deadline), self.where)
            return self._ask(sock, self._greeting, deadline)
        except OSError as e:
            self.close()
            raise _liveness_errors(self.where, timeout_s, e) from None
        except BaseException:
            self.close()
            raise

    def _ask(self, sock: socket.socket, greeting: Greeting | None, deadline: float) -> Liveness:
        if greeting is None:
            raise ProtocolError(
                f"{self.where}: session without a greeting", stage="generation", peer=self.where
            )
        data, nonce = make_request(greeting, "session", b"", self.auth)
        _send_all(sock, data, deadline)
        tag, body = _recv_frame(sock, deadline, MAX_MESSAGE_BYTES)
        reply = _check_reply(self.where, nonce.hex(), tag, body, self.auth)
        gen, challenge = reply.get("generation"), reply.get("challenge")
        if (
            isinstance(gen, bool)
            or not isinstance(gen, int)
            or not isinstance(challenge, bytes)
            or len(challenge) != 16
        ):
            raise ProtocolError(
                f"{self.where} answered a session query with generation={gen!r}, challenge={challenge!r}",
                stage="generation",
                peer=self.where,
            )
        self._greeting = Greeting(greeting.incarnation, challenge, greeting.started)
        self.queries += 1
        self.answered_at = time.monotonic()
        return Liveness(gen, greeting.incarnation)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = self._greeting = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_generation(
    host: str,
    port: int,
    expected: int,
    timeout_s: float = 2.0,
    *,
    auth: Auth,
    session: Session | None = None,
) -> int:
    """Raise :class:`StaleMetadata` unless the peer still serves ``expected``; return it otherwise. With
    ``session`` (a :class:`Session` to ``host:port``), asked over it (no new connection once it is open)."""
    if session is not None:
        seen = session.probe(timeout_s).generation
    else:
        seen = query_generation(host, port, timeout_s, auth=auth)
    if seen != expected:
        raise StaleMetadata(
            f"peer {host}:{port} re-registered: generation {seen}, our metadata is of generation {expected}",
            stage="generation",
            peer=f"{host}:{port}",
            expected=expected,
            seen=seen,
        )
    return seen
