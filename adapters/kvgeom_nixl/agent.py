"""One NIXL agent, wrapped so that every call is bounded and every failure is typed.

An :class:`Endpoint` owns a ``nixl_agent``: it registers torch tensors, loads peers' metadata,
prepares descriptor lists (N×3 ``uint64`` arrays of ``addr, nbytes, device_id``), posts READ/WRITE
requests as :class:`Transfer` objects and collects notifications. It caches nothing beyond what it
must release on :meth:`Endpoint.close`; reuse of prepared handles is the caller's business.

NIXL and torch are imported lazily (inside methods), so importing this module is cheap. An endpoint
is not thread-safe: use it from one thread (NIXL agents are created with ``sync_mode`` NONE).

Facts this module relies on (nixl 1.5.1, see ``docs/adapter.md``): descriptor bounds are checked only
at prep time, against the initiator's copy of the peer's metadata; ``add_remote_agent`` *adds* to a
peer's old registrations unless the peer is removed first; a notification means only "that transfer
completed"; with the progress thread off the target must poll ``get_new_notifs`` to make progress.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .config import TransportConfig
from .errors import AdapterError, NotifTimeout, PeerGone, StaleMetadata, TransferError
from .ifaces import ucx_net_devices, with_env

__all__ = ["Region", "Telemetry", "Prepped", "Transfer", "Endpoint", "MEM_TYPES", "OPS"]

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
        self, endpoint: Endpoint, handle: Any, peer: str | None, mem_type: str, count: int, generation: int
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
        endpoint: Endpoint,
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


class Endpoint:
    """A named NIXL agent plus the registrations, peers and handles it must release.

    ``host`` is the address the rank serves on: with ``config.net_devices="auto"`` UCX then uses, and
    listens on, only the interface that holds it (``lo`` for ``127.0.0.1``; without a host, loopback
    only); :attr:`net_devices` is what ``UCX_NET_DEVICES`` was for this agent (``None``: the
    environment's, or UCX's default). The agent is created under a process-wide lock
    (:func:`~kvgeom_nixl.ifaces.with_env`): endpoints made at once from several threads each get their
    own ``UCX_NET_DEVICES``.

    >>> ep = Endpoint("decode-0")                       # doctest: +SKIP
    >>> regions = ep.register_tensors([kv])             # doctest: +SKIP
    >>> ep.add_peer("prefill-0", peer_metadata)         # doctest: +SKIP
    >>> lh = ep.prep_local(local_descs); rh = ep.prep_remote("prefill-0", remote_descs)
    >>> ep.post("READ", lh, ids, rh, ids, b"req-7").wait()   # doctest: +SKIP
    """

    def __init__(self, name: str, config: TransportConfig | None = None, host: str | None = None) -> None:
        if not name:
            raise ValueError("name: an agent needs a non-empty name")
        self.name = str(name)
        self.config = config if config is not None else TransportConfig()
        # where UCX may listen: the interface of ``host`` (the rank's side-channel address) by default
        self.net_devices = ucx_net_devices(self.config.net_devices, host)
        from nixl._api import nixl_agent, nixl_agent_config  # lazy: ~1-2 s and ~200 MiB

        cfg = nixl_agent_config(
            enable_prog_thread=self.config.progress_thread,
            enable_listen_thread=False,
            capture_telemetry=self.config.telemetry,
            backends=list(self.config.backends),
        )
        try:
            with with_env("UCX_NET_DEVICES", self.net_devices):
                self._agent = nixl_agent(self.name, cfg)
        except Exception as e:
            raise AdapterError(
                f"cannot create NIXL agent {self.name!r}: {type(e).__name__}: {e}", stage="agent"
            ) from e
        missing = [b for b in self.config.backends if b not in self._agent.backends]
        if missing:
            raise AdapterError(
                f"backend(s) {missing} not available; plugins: {self._agent.get_plugin_list()}", stage="agent"
            )
        self.generation = 0
        self._regs: list[
            tuple[Any, list[Any], list[Region]]
        ] = []  # (nixlRegDList, tensors kept alive, regions)
        self._peers: dict[str, bytes] = {}
        self._peer_gen: dict[str, int] = {}
        self._prepped: set[Prepped] = set()
        self._transfers: set[Transfer] = set()
        self._leaked: list[Any] = []
        self._notifs: deque[tuple[float, str, bytes]] = deque()  # (arrival, peer, message), oldest first
        self.dropped_notifs = 0  # expired or over the cap, never consumed
        self._closed = False

    # ------------------------------------------------------------------------------ registration
    @property
    def regions(self) -> list[Region]:
        """All regions currently registered, in registration order."""
        return [r for _, _, regs in self._regs for r in regs]

    def register_tensors(self, tensors: Any) -> list[Region]:
        """Register one contiguous tensor or a sequence of them (CPU -> ``DRAM``, CUDA -> ``VRAM``).

        Returns one :class:`Region` per tensor, in order. Raises ``ValueError`` for a non-contiguous,
        empty or non-CPU/CUDA tensor (nothing is registered then). Bumps :attr:`generation`.
        """
        self._check_open()
        import torch

        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensors = list(tensors)
        if not tensors:
            raise ValueError("register_tensors: no tensors given")
        by_type: dict[str, list[tuple[int, Region]]] = {}
        out: list[Region | None] = [None] * len(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"tensors[{i}]: expected a torch.Tensor, got {type(t).__name__}")
            if not t.is_contiguous():
                raise ValueError(
                    f"tensors[{i}]: tensor of shape {tuple(t.shape)} and stride {t.stride()} is not contiguous; "
                    "register the contiguous base buffer and describe sub-blocks with descriptors"
                )
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                raise ValueError(f"tensors[{i}]: empty tensor")
            if t.device.type == "cpu":
                mem, dev = "DRAM", 0
            elif t.device.type == "cuda":
                mem, dev = "VRAM", int(t.device.index or 0)
            else:
                raise ValueError(f"tensors[{i}]: device {t.device} is neither cpu nor cuda")
            r = Region(int(t.data_ptr()), int(nbytes), dev, mem)
            out[i] = r
            by_type.setdefault(mem, []).append((i, r))
        for mem, items in by_type.items():
            arr = np.array([[r.addr, r.nbytes, r.device_id] for _, r in items], dtype=np.uint64)
            try:
                reg = self._agent.register_memory(arr, mem)
            except Exception as e:
                raise AdapterError(
                    f"register_memory of {len(items)} {mem} region(s) failed: {e}",
                    stage="register",
                    status=_status_of(e),
                ) from e
            self._regs.append((reg, [tensors[i] for i, _ in items], [r for _, r in items]))
        self.generation += 1
        return [r for r in out if r is not None]

    def deregister_all(self) -> None:
        """Deregister every region (peers that still hold our old metadata can no longer prep them
        after they re-load fresh metadata). Bumps :attr:`generation`."""
        self._check_open()
        errors = []
        while self._regs:
            reg, _, _ = self._regs.pop()
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                errors.append(e)
        self.generation += 1
        if errors:
            raise AdapterError(f"deregister_memory failed: {errors[0]}", stage="deregister") from errors[0]

    def metadata(self) -> bytes:
        """Our agent metadata (take it *after* registering: it lists the registrations)."""
        self._check_open()
        return bytes(self._agent.get_agent_metadata())

    # ------------------------------------------------------------------------------ peers
    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._peers)

    def peer_generation(self, name: str) -> int:
        """How many times ``name``'s metadata was (re)loaded; remote :class:`Prepped` carry it."""
        return self._peer_gen.get(name, 0)

    def add_peer(self, name: str, metadata: bytes) -> str:
        """Load a peer's metadata. Same metadata again: no-op. Changed metadata: the peer is removed
        first (dropping its stale registrations and our prepared handles towards it), then loaded."""
        self._check_open()
        metadata = bytes(metadata)
        old = self._peers.get(name)
        if old == metadata:
            return name
        if old is not None:
            self.remove_peer(name)
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise AdapterError(
                f"add_remote_agent failed: {type(e).__name__}: {e}",
                stage="add_peer",
                peer=name,
                status=_status_of(e),
            ) from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            try:
                self._agent.remove_remote_agent(loaded)
            except Exception:
                pass
            raise StaleMetadata(
                f"metadata is of agent {loaded!r}, expected {name!r}", stage="add_peer", peer=name
            )
        self._peers[name] = metadata
        self._peer_gen[name] = self._peer_gen.get(name, 0) + 1
        return name

    def remove_peer(self, name: str) -> None:
        """Forget a peer: release our prepared handles towards it and drop its metadata. Unknown: no-op.
        Refused (``TransferError``, status ``BUSY``) while transfers towards it are live: removing the
        peer does not stop their bytes (measured), and their handles refer to its metadata."""
        self._check_open()
        live = [x for x in self._transfers if x.peer == name and x.live]
        if live:
            raise TransferError(
                f"{len(live)} transfer(s) towards {name} are still live; let them end first",
                stage="remove_peer",
                peer=name,
                status="BUSY",
            )
        for p in [p for p in self._prepped if p.peer == name]:
            p.release()
        if self._peers.pop(name, None) is None:
            return
        try:
            self._agent.remove_remote_agent(name)
        except Exception:
            pass  # already gone on NIXL's side

    # ------------------------------------------------------------------------------ preparation
    def prep_local(self, descs: Any, mem_type: str = "DRAM") -> Prepped:
        """Prepare our side: ``descs`` is N×3 (addr, nbytes, device_id) or N×5 strided, each descriptor
        inside one registered region. Raises :class:`TransferError` (``NIXL_ERR_NOT_FOUND``) if one is not."""
        return self._prep(None, descs, mem_type)

    def prep_remote(self, peer: str, descs: Any, mem_type: str = "DRAM") -> Prepped:
        """Prepare the peer's side, checked against the peer's metadata we hold (nothing else checks:
        an address outside the peer's registrations fails here with ``NIXL_ERR_NOT_FOUND``)."""
        if peer not in self._peers:
            raise TransferError(
                f"unknown peer {peer!r}; add_peer() it first",
                stage="prep_remote",
                peer=peer,
                status="NIXL_ERR_NOT_FOUND",
            )
        return self._prep(peer, descs, mem_type)

    def _prep(self, peer: str | None, descs: Any, mem_type: str) -> Prepped:
        self._check_open()
        if mem_type not in MEM_TYPES:
            raise ValueError(f"mem_type: expected one of {MEM_TYPES}, got {mem_type!r}")
        stage = "prep_local" if peer is None else "prep_remote"
        arr = _as_descs(descs, stage)
        try:
            h = self._agent.prep_xfer_dlist("" if peer is None else peer, arr, mem_type)
        except Exception as e:
            where = (
                "our registrations" if peer is None else f"{peer}'s registrations (as we last loaded them)"
            )
            raise _wrap(
                e,
                f"{arr.shape[0]} {mem_type} descriptor row(s) not all covered by {where}",
                stage=stage,
                peer=peer,
            ) from e
        gen = self.generation if peer is None else self._peer_gen[peer]
        count = int(arr[:, 4].sum()) if arr.shape[1] == 5 else int(arr.shape[0])
        p = Prepped(self, h, peer, mem_type, count, gen)
        self._prepped.add(p)
        return p

    # ------------------------------------------------------------------------------ transfers
    def post(
        self,
        op: str,
        local: Prepped,
        local_ids: Any,
        remote: Prepped,
        remote_ids: Any,
        notif: bytes = b"",
    ) -> Transfer:
        """Make and post one request: descriptor ``local_ids[i]`` of ``local`` moves to/from
        ``remote_ids[i]`` of ``remote``. ``READ`` pulls from the peer, ``WRITE`` pushes to it. ``notif``
        reaches the peer once *all* descriptors are done (and means nothing more)."""
        peer = self._check_prepped(op, local, remote)
        lids = _as_ids(local_ids, local.count, "local_ids")
        rids = _as_ids(remote_ids, remote.count, "remote_ids")
        if lids.size != rids.size or lids.size == 0:
            raise TransferError(
                f"need equal, non-zero id counts, got local {lids.size} remote {rids.size}",
                stage="make",
                peer=peer,
                status="NIXL_ERR_INVALID_PARAM",
            )
        notif = notif.encode() if isinstance(notif, str) else bytes(notif)
        try:
            h = self._agent.make_prepped_xfer(op, local._handle, lids, remote._handle, rids, notif)
        except Exception as e:
            raise _wrap(
                e, f"make_prepped_xfer({op}, {lids.size} descriptors)", stage="make", peer=peer
            ) from e
        return self._launch(h, op, peer, int(lids.size))

    def _check_prepped(self, op: str, local: Prepped, remote: Prepped) -> str:
        """``post``'s checks of its two prepared lists (ours from prep_local, the peer's from prep_remote,
        neither released, the remote one against the peer's current metadata); returns the peer."""
        self._check_open()
        if op not in OPS:
            raise ValueError(f"op: expected one of {OPS}, got {op!r}")
        if local.peer is not None or remote.peer is None:
            raise ValueError("post: 'local' must come from prep_local and 'remote' from prep_remote")
        peer = remote.peer
        for p, what in ((local, "local"), (remote, "remote")):
            if p.released:
                raise StaleMetadata(
                    f"{what} prepared list was released (peer re-loaded or closed); prep again",
                    stage="post",
                    peer=peer,
                )
        if self._peer_gen.get(peer) != remote.generation:
            raise StaleMetadata(
                f"remote list was prepared against older metadata of {peer}",
                stage="post",
                peer=peer,
                expected=remote.generation,
                seen=self._peer_gen.get(peer),
            )
        return peer

    def _launch(self, h: Any, op: str, peer: str, n: int, owned: Sequence[Any] = ()) -> Transfer:
        """Post a made request ``h`` of ``n`` descriptors; on a failed post, ``h`` and the per-request
        lists it ``owned`` are released and the error raised."""
        t0 = time.monotonic()
        try:
            state = self._agent.transfer(h)
        except Exception as e:
            _release_quietly(h, self._leaked)
            for d in owned:
                _release_quietly(d, self._leaked)
            raise _wrap(e, f"posting {op} of {n} descriptors", stage="post", peer=peer) from e
        if state == "ERR":
            _release_quietly(h, self._leaked)
            for d in owned:
                _release_quietly(d, self._leaked)
            raise TransferError(
                f"posting {op} of {n} descriptors returned ERR", stage="post", peer=peer, status="ERR"
            )
        xfer = Transfer(self, h, op, peer, n, t0, state, owned)
        self._transfers.add(xfer)
        return xfer

    def post_descs(
        self,
        op: str,
        local_descs: Any,
        peer: str,
        remote_descs: Any,
        notif: bytes = b"",
        mem_type: str = "DRAM",
        path: str = "initialize",
    ) -> Transfer:
        """Make and post one request from per-request descriptor lists (N×3 ``addr, nbytes, device_id``,
        row ``i`` of ``local_descs`` moving to/from row ``i`` of ``remote_descs``), not ids into prepared
        tables. ``path="initialize"``: NIXL's ``initialize_xfer`` on the two lists; ``path="prep"``: both
        lists prepared for this request (``prep_xfer_dlist``), ``make_prepped_xfer`` on every row, and the
        two prepared lists released when the transfer ends. NIXL checks every descriptor against the
        registrations (ours, and the peer's as we loaded them) either way: one outside them raises
        :class:`TransferError` (``NIXL_ERR_NOT_FOUND``) and nothing is posted."""
        self._check_open()
        if op not in OPS:
            raise ValueError(f"op: expected one of {OPS}, got {op!r}")
        if path not in ("initialize", "prep"):
            raise ValueError(f"path: expected 'initialize' or 'prep', got {path!r}")
        if peer not in self._peers:
            raise TransferError(
                f"unknown peer {peer!r}; add_peer() it first",
                stage="make",
                peer=peer,
                status="NIXL_ERR_NOT_FOUND",
            )
        loc = _as_descs(local_descs, "local_descs")
        rem = _as_descs(remote_descs, "remote_descs")
        if loc.shape != rem.shape or loc.shape[1] != 3:
            raise TransferError(
                f"need two N×3 lists of one length, got local {loc.shape} remote {rem.shape}",
                stage="make",
                peer=peer,
                status="NIXL_ERR_INVALID_PARAM",
            )
        notif = notif.encode() if isinstance(notif, str) else bytes(notif)
        h, owned = self._make_descs(op, loc, peer, rem, notif, mem_type, path)
        return self._launch(h, op, peer, int(loc.shape[0]), owned)

    def _make_descs(
        self, op: str, loc: np.ndarray, peer: str, rem: np.ndarray, notif: bytes, mem_type: str, path: str
    ) -> tuple[Any, list[Any]]:
        """The request of ``post_descs`` along ``path``, and the per-request lists it owns ("prep")."""
        n = int(loc.shape[0])
        owned: list[Any] = []
        try:
            if path == "initialize":
                h = self._agent.initialize_xfer(
                    op,
                    self._agent.get_xfer_descs(loc, mem_type),
                    self._agent.get_xfer_descs(rem, mem_type),
                    peer,
                    notif,
                )
            else:
                owned.append(self._agent.prep_xfer_dlist("", loc, mem_type))
                owned.append(self._agent.prep_xfer_dlist(peer, rem, mem_type))
                ids = np.arange(n, dtype=np.int32)
                h = self._agent.make_prepped_xfer(op, owned[0], ids, owned[1], ids, notif)
        except Exception as e:
            for d in owned:
                _release_quietly(d, self._leaked)
            raise _wrap(e, f"{path} of a {op} of {n} descriptors", stage="make", peer=peer) from e
        return h, owned

    # ------------------------------------------------------------------------------ notifications
    def _pull_notifs(self) -> None:
        """Move NIXL's new notifications into our bounded, expiring store (drives progress too)."""
        try:
            new = self._agent.get_new_notifs()
        except Exception as e:
            raise _wrap(e, "get_new_notifs", stage="notif", peer=None) from e
        now = time.monotonic()
        for peer, msgs in new.items():
            peer = peer.decode() if isinstance(peer, bytes) else str(peer)
            self._notifs.extend((now, peer, bytes(m)) for m in msgs)
        old = now - self.config.notif_ttl_s
        cap = self.config.max_pending_notifs
        while self._notifs and (self._notifs[0][0] < old or len(self._notifs) > cap):
            self._notifs.popleft()
            self.dropped_notifs += 1

    def notifications(self) -> dict[str, Counter[bytes]]:
        """Drain NIXL's new notifications into our store and return a per-peer count of what is pending
        (not consumed). Also drives progress: a target must call this (or :meth:`take_notifications`,
        :meth:`wait_notifications`) while transfers towards it are in flight when the progress thread
        is off. Unconsumed notifications expire after ``notif_ttl_s``; at most ``max_pending_notifs``
        are kept."""
        self._check_open()
        self._pull_notifs()
        out: dict[str, Counter[bytes]] = {}
        for _, p, m in self._notifs:
            out.setdefault(p, Counter())[m] += 1
        return out

    def take_notifications(self) -> list[tuple[str, bytes]]:
        """Drain and consume every pending notification: ``[(peer, message), ...]`` in arrival order.
        ``peer`` is the name the sender *claims* (NIXL does not authenticate it)."""
        self._check_open()
        self._pull_notifs()
        out = [(p, m) for _, p, m in self._notifs]
        self._notifs.clear()
        return out

    def wait_notifications(
        self,
        peer: str | None,
        tag_prefix: bytes = b"",
        count: int = 1,
        deadline: float | None = None,
        *,
        timeout_s: float | None = None,
    ) -> list[tuple[str, bytes]]:
        """Wait until ``count`` notifications starting with ``tag_prefix`` arrived (from ``peer``, or
        from anyone if ``None``), consume and return them as ``(peer, message)``. Raises
        :class:`NotifTimeout` at the deadline (default now + ``notif_timeout_s``), consuming nothing.
        Prefix matching is for simple tools and tests; :class:`~kvgeom_nixl.kvrank.KVRank` matches
        authenticated notices exactly instead."""
        end = _deadline(deadline, timeout_s, self.config.notif_timeout_s)
        tag_prefix = tag_prefix.encode() if isinstance(tag_prefix, str) else bytes(tag_prefix)
        pause = self.config.poll_interval_s
        while True:
            self._check_open()
            self._pull_notifs()
            hits = [
                i
                for i, (_, p, m) in enumerate(self._notifs)
                if (peer is None or p == peer) and m.startswith(tag_prefix)
            ]
            if len(hits) >= count:
                keep = set(hits[:count])
                taken = [(p, m) for i, (_, p, m) in enumerate(self._notifs) if i in keep]
                self._notifs = deque(x for i, x in enumerate(self._notifs) if i not in keep)
                return taken
            now = time.monotonic()
            if now >= end:
                raise NotifTimeout(
                    f"{len(hits)} of {count} notification(s) with prefix {tag_prefix!r} arrived before the deadline",
                    stage="notif",
                    peer=peer,
                    status="TIMEOUT",
                )
            if pause:
                time.sleep(min(pause, max(0.0, end - now)))

    def send_notif(self, peer: str, msg: bytes) -> None:
        """Send a standalone notification (no ordering with respect to transfers)."""
        self._check_open()
        msg = msg.encode() if isinstance(msg, str) else bytes(msg)
        try:
            self._agent.send_notif(peer, msg)
        except Exception as e:
            raise _wrap(e, "send_notif", stage="notif", peer=peer) from e

    # ------------------------------------------------------------------------------ accounting
    def live_transfers(self, peer: str | None = None) -> list[Transfer]:
        """Transfers posted and not yet ended (towards ``peer``, or all)."""
        return [x for x in self._transfers if x.live and (peer is None or x.peer == peer)]

    def handle_counts(self) -> dict[str, int]:
        """What this endpoint holds: prepared lists, live transfers, handles NIXL refused to release,
        peers, pending (unconsumed) notifications. Flat across requests in a healthy process."""
        return {
            "prepped": len(self._prepped),
            "transfers": len(self._transfers),
            "leaked": len(self._leaked),
            "peers": len(self._peers),
            "pending_notifs": len(self._notifs),
        }

    # ------------------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise AdapterError(f"endpoint {self.name!r} is closed", stage="closed")

    def _drain(self, seconds: float) -> None:
        """Drive progress (by polling notifications) for ``seconds``; keeps what arrives."""
        end = time.monotonic() + seconds
        while True:
            try:
                self._pull_notifs()
            except Exception:
                pass
            if time.monotonic() >= end:
                return
            time.sleep(0.001)

    def close(self) -> None:
        """Cancel/release live transfers, release prepared handles, drop peers, deregister memory.
        Drives progress for ``config.close_drain_s`` on the way (see :class:`TransportConfig`).
        Idempotent; never raises for NIXL cleanup failures."""
        if self._closed:
            return
        for x in list(self._transfers):
            x._fail()
        for p in list(self._prepped):
            p.release()
        half = self.config.close_drain_s / 2
        if half:
            self._drain(half)
        for h in self._leaked:
            try:
                h.release()
            except Exception:
                pass
        self._leaked.clear()
        for name in list(self._peers):
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                pass
        self._peers.clear()
        if half:
            self._drain(half)
        while self._regs:
            reg, _, _ = self._regs.pop()
            try:
                self._agent.deregister_memory(reg)
            except Exception:
                pass
        self._closed = True
        self._agent = None

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Endpoint({self.name!r}, regions={len(self.regions)}, peers={list(self._peers)}, "
            f"generation={self.generation}, closed={self._closed})"
        )


def _release_quietly(handle: Any, leaked: list[Any]) -> None:
    try:
        handle.release()
    except Exception:
        leaked.append(handle)


def descs_from_regions(regions: Sequence[Region] | Iterable[Sequence[int]]) -> np.ndarray:
    """N×3 uint64 array covering whole regions (handy for tests and for one-descriptor-per-region)."""
    return np.array([[int(r[0]), int(r[1]), int(r[2])] for r in regions], dtype=np.uint64).reshape(-1, 3)
