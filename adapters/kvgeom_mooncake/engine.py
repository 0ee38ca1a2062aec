"""A thin, typed wrapper over ``mooncake.engine.TransferEngine`` (P2P handshake, no metadata server).

Only this module imports ``mooncake``, lazily: importing :mod:`kvgeom_mooncake` without the wheel works,
creating an :class:`Engine` raises :class:`~kvgeom_mooncake.errors.MooncakeMissing` with the install hint.

What the wrapper relies on (mooncake-transfer-engine-non-cuda 0.3.13.post1, checked by tests/mooncake):

* ``initialize(host, "P2PHANDSHAKE", protocol, "")`` returns 0 and ``get_rpc_port()`` the port peers name
  as ``"host:port"`` (the *session*);
* ``register_memory(addr, nbytes)`` returns 0; a peer may then read or write inside that range only (the
  serving side refuses a range outside every registered buffer, the batch fails);
* ``batch_transfer_sync(session, local, remote, lengths, opcode, notify=None)`` moves every descriptor of
  the batch and returns 0, or -1 when any of it failed: **one status for the whole batch**, no
  per-descriptor status and no byte count, so after -1 which bytes landed is unknown. It blocks (the GIL
  released) until done, failed, or Mooncake's own deadline (``MC_TRANSFER_TIMEOUT``, default 30 s, at
  least 5 s, plus the batch's length at 1 GiB/s); a ``TransferNotify(name, msg)`` reaches the peer's
  ``get_notifies()`` after the batch's bytes.

Not used, and why (0.3.13.post1, seen here): ``transfer_check_status(batch)`` of an asynchronous batch
reported it done (and freed it) while most of its descriptors had not moved (D read wrong bytes in
tests/mooncake until the adapter stopped using it; Mooncake's source of that era checks task 0 only);
``get_batch_transfer_status`` crashed the process (SIGSEGV) on a batch id from
``batch_transfer_async_read``. So each batch is one synchronous call on a worker thread
(:meth:`Engine.start`), and the adapter's deadline is its own wait on that thread; a batch still running
at the deadline cannot be cancelled: its thread is the fence.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .errors import EngineInitError, MooncakeMissing, RegistrationError, TransferFailed

__all__ = ["Engine", "load", "available"]


def load() -> Any:
    """The ``mooncake.engine`` module, or :class:`MooncakeMissing` saying how to install it."""
    try:
        import mooncake.engine as m
    except Exception as exc:  # ImportError, or OSError of a missing libibverbs / librdmacm
        raise MooncakeMissing(exc) from exc
    return m


def available() -> str | None:
    """``None`` if the transfer engine loads here, else why not (one line)."""
    try:
        load()
    except MooncakeMissing as exc:
        return str(exc)
    return None


class Engine:
    """One ``TransferEngine`` of one rank: ``session`` is what peers address it by."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        self._m = load()
        self.host, self.protocol = host, protocol
        self._te = self._m.TransferEngine()
        rc = self._te.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise EngineInitError(
                f"TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}) returned {rc}",
                stage="init",
                status=rc,
            )
        self.port = int(self._te.get_rpc_port())
        self.session = f"{host}:{self.port}"
        self.registered: list[tuple[int, int]] = []
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(8, thread_name_prefix="mooncake-batch")
        self.posted = 0  # batches submitted
        self.descriptors = 0  # descriptors submitted

    def register(self, addr: int, nbytes: int) -> None:
        rc = self._te.register_memory(int(addr), int(nbytes))
        if rc != 0:
            raise RegistrationError(
                f"register_memory({addr:#x}, {nbytes}) returned {rc}", stage="register", status=rc
            )
        self.registered.append((int(addr), int(nbytes)))

    def transfer(
        self,
        op: str,
        session: str,
        local: Sequence[int],
        remote: Sequence[int],
        lengths: Sequence[int],
        notify: tuple[str, str] | None = None,
    ) -> int:
        """One batch, synchronously (``op`` ``"READ"``: remote into local, ``"WRITE"``: local into remote);
        Mooncake's status (0: every byte moved). ``notify``: ``(name, msg)`` delivered after the bytes."""
        opcode = self._m.TransferOpcode.Read if op == "READ" else self._m.TransferOpcode.Write
        note = self._m.TransferNotify(*notify) if notify is not None else None
        return int(
            self._te.batch_transfer_sync(session, list(local), list(remote), list(lengths), opcode, note)
        )

    def start(
        self,
        op: str,
        session: str,
        local: Sequence[int],
        remote: Sequence[int],
        lengths: Sequence[int],
        notify: tuple[str, str] | None = None,
    ) -> Future[int]:
        """:meth:`transfer` on a worker thread (one per batch in flight): its future."""
        if self._pool is None:
            raise TransferFailed("the engine is closed", stage="post", status=None, peer=session)
        self.posted += 1
        self.descriptors += len(lengths)
        return self._pool.submit(self.transfer, op, session, local, remote, lengths, notify)

    def notifications(self) -> list[tuple[str, str]]:
        return [(str(n.name), str(n.msg)) for n in self._te.get_notifies()]

    def close(self) -> None:
        """Unregister and drop the engine; waits for running batches (each ends by Mooncake's own
        deadline at the latest)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for addr, _ in self.registered:
            try:
                self._te.unregister_memory(addr)
            except Exception:
                pass
        self.registered.clear()
        self._te = None
