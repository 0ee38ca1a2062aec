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

Its parts: :mod:`~kvgeom_nixl.agent_handles` (regions, prepared lists, transfers, telemetry) and
:mod:`~kvgeom_nixl.agent_posts` (posting requests); this module re-exports their names.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

import numpy as np

from .agent_handles import (
    MEM_TYPES,
    OPS,
    Prepped,
    Region,
    Telemetry,
    Transfer,
    _as_descs,
    _deadline,
    _status_of,
    _wrap,
    descs_from_regions,
)
from .agent_posts import _Posting
from .config import TransportConfig
from .errors import AdapterError, NotifTimeout, StaleMetadata, TransferError
from .ifaces import ucx_net_devices, with_env

__all__ = ["Region", "Telemetry", "Prepped", "Transfer", "Endpoint", "MEM_TYPES", "OPS"]
_REEXPORTED = (descs_from_regions,)


class Endpoint(_Posting):
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
