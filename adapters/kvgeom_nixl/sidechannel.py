"""A small, authenticated, bounded TCP side channel for the handshake between two ranks.

NIXL's agent metadata lets a peer connect and check descriptors, but it does not tell Python *where*
the peer's regions are, nor which geometry they hold; and NIXL's own metadata listener hands the
metadata to anyone and fails silently when nobody listens. So each rank serves a small JSON *payload*
(engine id, rank, agent name, agent metadata, geometry card, region addresses, device id,
``generation``) on a TCP port, and a peer fetches it with retries until a deadline.

Wire format (protocol version 3, see :mod:`kvgeom_nixl.wire`): at accept the server sends a 48-byte
*greeting* (its random ``incarnation`` and a random per-connection ``challenge``). The client sends a
132-byte *preamble* (op, body length, timestamp, nonce, the greeting's incarnation and challenge, the
body's SHA-256, and an HMAC-SHA256 tag over all of it), then the body: UTF-8 JSON (an object), empty for
``get`` and ``generation``. The server checks the preamble (tag, destination, freshness, length) before it
reads or allocates the body, so a client without the secret costs it at most the preamble's bytes. The
reply is a 4-byte big-endian length ``n``, a 32-byte tag and ``n - 32`` bytes of JSON; its tag binds
``"rep"`` and the request's nonce, so a reply cannot be replayed to another request. A request is valid
for one connection of one server incarnation: replayed anywhere else (another server sharing the secret,
the same server again, or after a restart) it is refused with :class:`ReplayError`. Requests must also be
within ``replay_window_s`` of the server's clock, and each nonce is accepted once. ``bytes`` values travel
as ``{"$b64": "<base64>"}``.

=========================================  ==================================================
request (op, body)                         reply
=========================================  ==================================================
``get``, empty                             ``{"ok": true, "payload": {...}}``
``exchange``, ``{"payload": {...}}``       same; the server keeps the client's (sealed) payload
``generation``, empty                      ``{"ok": true, "generation": <int>}``
refused                                    ``{"ok": false, "error": "...", ["refused": field]}``
=========================================  ==================================================

Every deadline covers a whole message (not one ``recv``): a peer that sends one byte at a time cannot
stretch it. The server bounds connections, bytes per message and how long and how many exchanged
payloads it keeps. Payloads are *sealed* (:func:`seal_payload`): one tag over the whole payload, so the
card, the NIXL metadata and the region bases are bound together and to the deployment's secret.

``generation`` is an integer the rank increments whenever it re-registers memory; a peer asks for it
before posting (:func:`check_generation`) to detect stale metadata without refetching the payload.

The side channel is four modules under this one, which re-exports their names: :mod:`~kvgeom_nixl.sidechannel_format`
(messages and payloads), :mod:`~kvgeom_nixl.sidechannel_server` (the server, with
:mod:`~kvgeom_nixl.sidechannel_sessions` and :mod:`~kvgeom_nixl.sidechannel_answers`) and
:mod:`~kvgeom_nixl.sidechannel_client`.
"""

from __future__ import annotations

from .sidechannel_client import (
    Liveness,
    Session,
    _check_reply,
    check_generation,
    fetch,
    probe,
    query_generation,
)
from .sidechannel_format import (
    MAX_MESSAGE_BYTES,
    MAX_NAME,
    MAX_REGIONS,
    _dumps,
    _frame,
    _recv_frame,
    decode,
    encode,
    make_payload,
    open_payload,
    seal_payload,
    validate_payload,
)
from .sidechannel_server import SideChannelServer
from .wire import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_MESSAGE_BYTES",
    "SideChannelServer",
    "make_payload",
    "seal_payload",
    "open_payload",
    "validate_payload",
    "fetch",
    "query_generation",
    "probe",
    "Liveness",
    "check_generation",
    "Session",
    "encode",
    "decode",
]
#: private helpers the tests and bench use, re-exported as before the split
_PRIVATE = (_check_reply, _dumps, _frame, _recv_frame, MAX_NAME, MAX_REGIONS)
