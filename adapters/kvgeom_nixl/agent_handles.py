"""What an :class:`~kvgeom_nixl.agent.Endpoint` hands out: registered regions, prepared descriptor lists (:class:`Prepped`) and posted requests (:class:`Transfer`, bounded waits, :class:`Telemetry`), and the checks and error wrapping its calls share."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .errors import AdapterError, PeerGone, TransferError

MEM_TYPES = ("DRAM", "VRAM")
OPS = ("READ", "WRITE")


class Region(NamedTuple):
    """One registered memory region: base address, size in bytes, device id (GPU ordinal for VRAM,
    0 for DRAM) and NIXL memory type."""

    addr: int
    nbytes: int
    device_id: int
    mem_type: str


@dataclass(frozen=True)
class Telemetry:
    """What one completed transfer cost. ``desc_count`` is NIXL's count *after* merging adjacent
    descriptors; the NIXL fields are ``None`` when telemetry is disabled. Durations in microseconds
    (NIXL's clock) and ``wall_s`` in seconds (ours: from post to observed completion)."""

    desc_count: int | None
    total_bytes: int | None
    post_us: int | None
    xfer_us: int | None
    wall_s: float


def _status_of(exc: BaseException) -> str:
    """NIXL status name of a NIXL exception (``str(e)`` is the status, e.g. ``NIXL_ERR_NOT_FOUND``)."""
    text = str(exc)
    if text.startswith("NIXL_"):
        return text.split()[0]
    return type(exc).__name__


def _is_disconnect(exc: BaseException) -> bool:
    return type(exc).__name__ == "nixlRemoteDisconnectError" or "REMOTE_DISCONNECT" in str(exc)


def _wrap(exc: BaseException, message: str, *, stage: str, peer: str | None) -> AdapterError:
    """Turn an exception raised by NIXL into our typed error (the original is chained by the caller)."""
    status = _status_of(exc)
    if _is_disconnect(exc):
        return PeerGone(f"{message}: peer disconnected ({status})", stage=stage, peer=peer, status=status)
    return TransferError(f"{message}: {type(exc).__name__}: {exc}", stage=stage, peer=peer, status=status)


def _deadline(deadline: float | None, timeout_s: float | None, default_s: float) -> float:
    if deadline is not None:
        return float(deadline)
    return time.monotonic() + (default_s if timeout_s is None else float(timeout_s))


def _as_descs(descs: Any, what: str) -> np.ndarray:
    """Validate an N×3 descriptor array, or an N×5 strided one ``(addr, nbytes, device_id, stride, count)``
    (NIXL >= 1.5 expands it, descriptor ids in row order), and return it as C-contiguous uint64."""
    arr = np.asarray(descs)
    if arr.ndim != 2 or arr.shape[1] not in (3, 5):
        raise ValueError(
            f"{what}: expected an N×3 array of (addr, nbytes, device_id) or an N×5 strided "
            f"array, got shape {arr.shape}"
        )
    if arr.shape[0] == 0:
        raise ValueError(f"{what}: empty descriptor list")
    if arr.dtype != np.uint64:
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{what}: descriptors must be integers, got dtype {arr.dtype}")
        if arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise ValueError(f"{what}: negative address, length or device id")
        arr = arr.astype(np.uint64)
    return np.ascontiguousarray(arr)


def _as_ids(ids: Any, count: int, what: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D array of descriptor ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: ids must be integers, got dtype {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= count:
            raise TransferError(
                f"{what}: ids must lie in [0, {count}), got min {lo} max {hi}",
                stage="make",
                status="NIXL_ERR_INVALID_PARAM",
            )
    return np.ascontiguousarray(arr, dtype=np.int32)


class Prepped:
    """A prepared descriptor list (local side when ``peer`` is ``None``). Release it when done, or let
    :meth:`Endpoint.close` (or :meth:`Endpoint.remove_peer`, for remote ones) release it."""

    __slots__ = ("_endpoint", "_handle", "peer", "mem_type", "count", "generation", "_released")

    def __init__(
        self, endpoint: Any, handle: Any, peer: str | None, mem_type: str, count: int, generation: int
    ):
        self._endpoint = endpoint
        self._handle = handle
        self.peer = peer
        self.mem_type = mem_type
        self.count = count
        self.generation = generation  # peer-metadata version (local: our registration generation)
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._endpoint._prepped.discard(self)
        try:
            self._handle.release()
        except Exception:  # best effort: NIXL frees everything with the agent anyway
            pass

    def __repr__(self) -> str:
        side = "local" if self.peer is None else f"peer={self.peer}"
        return f"Prepped({side}, {self.mem_type}, count={self.count}, released={self._released})"


class Transfer:
    """A posted READ or WRITE. :meth:`wait` releases the NIXL handle once the transfer ended (done or
    error). At the deadline it raises but leaves the transfer *live*: NIXL's cancellation (releasing an
    active handle) does not stop bytes that are still on their way (measured: a cancelled READ over TCP
    still landed all of its bytes once the peer resumed), so the caller keeps the destination fenced and
    polls it (:meth:`poll`) until it ends (see docs/reliability.md)."""

    def __init__(
        self,
        endpoint: Any,  # the Endpoint that posted it (kvgeom_nixl.agent imports this module)
        handle: Any,
        op: str,
        peer: str,
        count: int,
        t_post: float,
        state: str,
        owned: Sequence[Any] = (),
    ):
        self._endpoint = endpoint
        self._handle = handle
        self._owned = tuple(owned)  # per-request prepared dlists: released after the transfer's handle
        self.op = op
        self.peer = peer
        self.count = count
        self._t_post = t_post
        self._state = state  # "PROC" | "DONE" | "ERR"
        self._released = False
        self._telemetry: Telemetry | None = None

    @property
    def state(self) -> str:
        return self._state

    @property
    def live(self) -> bool:
        """Posted and not yet ended: its bytes may still land."""
        return not self._released

    def poll(self) -> str:
        """One non-blocking state check (also drives progress when the progress thread is off)."""
        if self._state != "PROC" or self._released:
            return self._state
        try:
            self._state = self._endpoint._agent.check_xfer_state(self._handle)
            if self._state == "DONE" and self._telemetry is None:
                self._finish()
            elif self._state == "ERR":
                self._fail()
        except Exception as e:
            self._fail()
            raise _wrap(
                e, f"{self.op} of {self.count} descriptors failed", stage="wait", peer=self.peer
            ) from e
        return self._state

    def abandon(self) -> None:
        """End a live transfer whose peer's process is proven gone: nothing can move its bytes any more
        (after a drain of what the peer sent before dying, which is the caller's job). Its handle is
        released (kept for :meth:`Endpoint.close` if NIXL refuses)."""
        if not self._released:
            self._fail()

    def wait(self, deadline: float | None = None, *, timeout_s: float | None = None) -> Telemetry:
        """Poll until DONE; raise :class:`TransferError` on an error state or at the deadline (absolute
        ``time.monotonic()``; default now + ``transfer_timeout_s``; the transfer then stays live),
        :class:`PeerGone` if the peer disconnected. Returns the transfer's :class:`Telemetry`."""
        if self._telemetry is not None:
            return self._telemetry
        if self._released:
            raise TransferError(
                f"transfer already ended in state {self._state}",
                stage="wait",
                peer=self.peer,
                status=self._state,
            )
        cfg = self._endpoint.config
        end = _deadline(deadline, timeout_s, cfg.transfer_timeout_s)
        pause = cfg.poll_interval_s
        while True:
            state = self.poll()
            if state == "DONE":
                return self._finish()
            if state == "ERR":
                raise TransferError(
                    f"{self.op} of {self.count} descriptors ended in state ERR",
                    stage="wait",
                    peer=self.peer,
                    status="ERR",
                )
            now = time.monotonic()
            if now >= end:
                raise TransferError(
                    f"{self.op} of {self.count} descriptors not done after {now - self._t_post:.3f}s; the "
                    "transfer stays live (releasing it would not stop its bytes): poll it until it ends",
                    stage="wait",
                    peer=self.peer,
                    status="TIMEOUT",
                )
            if pause:
                time.sleep(min(pause, max(0.0, end - now)))

    def _finish(self) -> Telemetry:
        if self._telemetry is not None:
            return self._telemetry
        wall = time.monotonic() - self._t_post
        desc = total = post = xfer = None
        ep = self._endpoint
        if ep.config.telemetry:
            try:
                t = ep._agent.get_xfer_telemetry(self._handle)
                desc, total = int(t.descCount), int(t.totalBytes)
                post, xfer = int(t.postDuration), int(t.xferDuration)
            except Exception:  # NIXL_ERR_NO_TELEMETRY: keep the wall time only
                pass
        self._telemetry = Telemetry(desc, total, post, xfer, wall)
        self._release()
        return self._telemetry

    def _fail(self) -> None:
        if self._state != "DONE":
            self._state = "ERR"
        self._release()

    def _release(self) -> None:
        ep = self._endpoint
        ep._transfers.discard(self)
        if self._released:
            return
        self._released = True
        _release_quietly(self._handle, ep._leaked)  # cancels an active transfer, or is retried at close
        for h in self._owned:
            _release_quietly(h, ep._leaked)

    def __repr__(self) -> str:
        return f"Transfer({self.op}, peer={self.peer}, count={self.count}, state={self._state})"


def _release_quietly(handle: Any, leaked: list[Any]) -> None:
    try:
        handle.release()
    except Exception:
        leaked.append(handle)


def descs_from_regions(regions: Sequence[Region] | Iterable[Sequence[int]]) -> np.ndarray:
    """N×3 uint64 array covering whole regions (handy for tests and for one-descriptor-per-region)."""
    return np.array([[int(r[0]), int(r[1]), int(r[2])] for r in regions], dtype=np.uint64).reshape(-1, 3)
