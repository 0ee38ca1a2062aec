"""A recording stand-in for ``nixl._api.nixl_agent``: connectors' unit tests run their real NIXL calls
against it, then hand the recorded transfers, resolved into byte moves, to the oracle.

Nothing is copied and no memory is touched: addresses are numbers. A :class:`NixlFabric` is the
shared world (agents, registrations, notifications, executed transfers); each
:class:`RecordingAgent` offers the subset of ``nixl_agent`` a connector uses, with NIXL's
signatures, and validates like NIXL (nixl 1.5.1, see ``docs/testing.md``):

* ``prep_xfer_dlist`` / ``initialize_xfer``: every descriptor must lie inside one registered region of
  the same memory type and device (the local agent's, or the remote's as loaded with
  ``add_remote_agent``), else ``nixlNotFoundError`` (``NIXL_ERR_NOT_FOUND``);
* ``make_prepped_xfer``: equal, non-zero index counts, indices in range, equal lengths per pair, else
  ``nixlInvalidParamError`` (``NIXL_ERR_INVALID_PARAM``);
* released handles cannot be used; unknown memory types and operations raise ``KeyError``.

:meth:`NixlFabric.moves` resolves every posted transfer into rows ``(src_rank, src_region, src_offset,
dst_rank, dst_region, dst_offset, length)`` (:data:`kvgeom.plan.requestplan.MOVE_COLUMNS`): a READ moves remote
bytes into the initiator, a WRITE the initiator's into the remote. Regions are the registered
descriptors of each agent in registration order, unless set with :meth:`NixlFabric.set_regions`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvgeom.testing._nixl_values import (
    ExecutedTransfer,
    PreppedDList,
    XferDList,
    XferHandle,
    XferTelemetry,
    _Handle,
    nixlInvalidParamError,
    nixlNotFoundError,
)

__all__ = [
    "NixlFabric",
    "RecordingAgent",
    "ExecutedTransfer",
    "XferDList",
    "fake_bases",
    "nixlNotFoundError",
    "nixlInvalidParamError",
]

MEM_TYPES = {
    "DRAM": "DRAM",
    "VRAM": "VRAM",
    "FILE": "FILE",
    "BLOCK": "BLOCK",
    "OBJ": "OBJ",
    "cpu": "DRAM",
    "cuda": "VRAM",
}
OPS = ("READ", "WRITE")
INIT_AGENT = "NIXL_INIT_AGENT"


def fake_bases(region_sizes: Sequence[int], slot: int, gap: int = 4096) -> list[int]:
    """Made-up base addresses for regions of ``region_sizes`` bytes, in the private address window
    ``slot`` (``slot << 40``), ``gap`` bytes apart: for tests in which nothing is really copied."""
    bases, at = [], (slot + 1) << 40
    for size in region_sizes:
        bases.append(at)
        at += (int(size) + gap + gap - 1) // gap * gap
    return bases


def _as_bytes(msg: bytes | str) -> bytes:
    return msg.encode() if isinstance(msg, str) else bytes(msg)


def _op(operation: str) -> str:
    if operation not in OPS:
        raise KeyError(operation)  # as NIXL's ``nixl_ops[operation]``
    return operation


def _mem(mem_type: str | None) -> str:
    if mem_type is None:
        raise ValueError("a memory type is needed for descriptor lists (not tensors)")
    return MEM_TYPES[mem_type]  # KeyError for an unknown type, as NIXL


def _is_tensor(x: Any) -> bool:
    return all(hasattr(x, a) for a in ("data_ptr", "numel", "element_size"))


def _tensor_desc(t: Any) -> tuple[tuple[int, int, int], str]:
    if hasattr(t, "is_contiguous") and not t.is_contiguous():
        raise ValueError("Please use a list of contiguous Tensors")
    dev = t.get_device() if hasattr(t, "get_device") else -1
    return (
        int(t.data_ptr()),
        int(t.numel() * t.element_size()),
        max(int(dev), 0),
    ), "VRAM" if dev >= 0 else "DRAM"


def _descs(descs: Any, mem_type: str | None) -> XferDList:
    """NIXL's accepted descriptor forms: ``XferDList``, N x 3 / N x 5 (strided) arrays, lists of tuples,
    tensors or lists of tensors (duck-typed: ``data_ptr``, ``numel``, ``element_size``)."""
    if isinstance(descs, XferDList):
        return descs
    if _is_tensor(descs):
        descs = [descs]
    if isinstance(descs, (list, tuple)) and descs and _is_tensor(descs[0]):
        rows = [_tensor_desc(t) for t in descs]
        return XferDList(np.asarray([r for r, _ in rows], dtype=np.uint64).reshape(-1, 3), rows[0][1])
    arr = np.asarray([d[:3] for d in descs] if isinstance(descs, (list, tuple)) else descs)
    if arr.ndim != 2 or arr.shape[1] not in (3, 5) or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(
            f"descriptors must be N x 3 (addr, len, dev) or N x 5 strided, got shape {arr.shape}"
        )
    if arr.size and int(arr.min()) < 0:
        raise ValueError("descriptor fields must be >= 0")
    arr = arr.astype(np.uint64)
    if arr.shape[1] == 5:  # (addr, len, dev, stride, count): count descriptors addr + k * stride
        counts = arr[:, 4].astype(np.int64)
        rep = np.repeat(arr, counts, axis=0)
        k = np.arange(rep.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
        arr = np.column_stack([rep[:, 0] + k.astype(np.uint64) * rep[:, 3], rep[:, 1], rep[:, 2]])
    return XferDList(np.ascontiguousarray(arr, dtype=np.uint64), _mem(mem_type))


@dataclass(frozen=True)
class _Registration:
    addr: int
    length: int
    dev: int
    mem_type: str

    def covers(self, addr: int, length: int, dev: int, mem_type: str) -> bool:
        return (
            mem_type == self.mem_type
            and dev == self.dev
            and addr >= self.addr
            and addr + length <= self.addr + self.length
        )


def _check_covered(dlist: XferDList, regs: Sequence[_Registration], whose: str) -> None:
    for i, (addr, length, dev) in enumerate(dlist.descs.tolist()):
        if not any(r.covers(addr, length, dev, dlist.mem_type) for r in regs):
            raise nixlNotFoundError(
                f"descriptor {i} ({addr:#x}, {length}, dev {dev}, {dlist.mem_type}) is not "
                f"inside one memory region registered by {whose}"
            )


class NixlFabric:
    """The shared world of recording agents: who registered what, notifications, executed transfers."""

    def __init__(self) -> None:
        self.agents: dict[str, RecordingAgent] = {}
        self.executed: list[ExecutedTransfer] = []
        self._regions: dict[str, list[tuple[int, int]]] = {}

    def agent(self, name: str, engine: str = "", rank: int = 0) -> RecordingAgent:
        """A new agent ``name`` of engine ``engine`` (e.g. ``"P"`` or ``"D"``), TP rank ``rank``."""
        return RecordingAgent(name, fabric=self, engine=engine, rank=rank)

    def set_regions(self, agent: str, regions: Sequence[tuple[int, int]]) -> None:
        """Name ``agent``'s regions for :meth:`moves`: region ``i`` is ``regions[i] = (base, nbytes)``."""
        self._regions[agent] = [(int(b), int(n)) for b, n in regions]

    def regions(self, agent: str) -> list[tuple[int, int]]:
        """``agent``'s regions: as set, else every registered descriptor in registration order."""
        if agent in self._regions:
            return self._regions[agent]
        return [(r.addr, r.length) for r in self.agents[agent].registrations]

    def locate(self, agent: str, addr: int, length: int) -> tuple[int, int]:
        """``(region, offset)`` of ``[addr, addr + length)`` in ``agent``'s regions."""
        for i, (base, nbytes) in enumerate(self.regions(agent)):
            if base <= addr and addr + length <= base + nbytes:
                return i, addr - base
        raise ValueError(f"{agent}: bytes [{addr:#x}, {addr + length:#x}) lie in none of its regions")

    def moves(self, src_engine: str = "P", dst_engine: str = "D") -> np.ndarray:
        """Every executed transfer as N x 7 ``int64`` byte moves from ``src_engine`` to ``dst_engine``
        agents (ranks are the agents' ``rank``); a transfer in another direction raises ``ValueError``."""
        out = [np.zeros((0, 7), dtype=np.int64)]
        for x in self.executed:
            src, dst = (x.remote, x.initiator) if x.op == "READ" else (x.initiator, x.remote)
            if (self.agents[src].engine, self.agents[dst].engine) != (src_engine, dst_engine):
                raise ValueError(
                    f"{x.op} by {x.initiator} moves bytes from {src} (engine "
                    f"{self.agents[src].engine!r}) to {dst} (engine {self.agents[dst].engine!r})"
                )
            sd, dd = (x.remote_descs, x.local_descs) if x.op == "READ" else (x.local_descs, x.remote_descs)
            rows = np.empty((sd.shape[0], 7), dtype=np.int64)
            for i, ((sa, n, _), (da, _, _)) in enumerate(zip(sd.tolist(), dd.tolist())):
                rows[i, :3] = (self.agents[src].rank, *self.locate(src, sa, n))
                rows[i, 3:6] = (self.agents[dst].rank, *self.locate(dst, da, n))
                rows[i, 6] = n
            out.append(rows)
        return np.concatenate(out)


class RecordingAgent:
    """A ``nixl_agent`` look-alike that records instead of moving bytes (see the module docstring)."""

    def __init__(
        self,
        name: str,
        nixl_conf: Any = None,
        instantiate_all: bool = False,
        *,
        fabric: NixlFabric | None = None,
        engine: str = "",
        rank: int = 0,
    ) -> None:
        if not name:
            raise ValueError("agent name must not be empty")
        self.name, self.engine, self.rank = name, engine, rank
        self.fabric = fabric if fabric is not None else NixlFabric()
        if name in self.fabric.agents:
            raise ValueError(f"agent {name!r} already exists in this fabric")
        self.fabric.agents[name] = self
        self.backends: dict[str, int] = {"UCX": 0}
        self.registrations: list[_Registration] = []
        self._remote: dict[str, list[_Registration]] = {}
        self._inbox: dict[str, list[bytes]] = {}
        self.notifs: dict[str, list[bytes]] = {}

    # -- backends and memory ------------------------------------------------------------------------
    def get_plugin_list(self) -> list[str]:
        return ["UCX"]

    def get_reg_descs(self, descs: Any, mem_type: str | None = None) -> XferDList:
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple) and len(descs[0]) != 4:
            raise ValueError("4-tuple list (addr, len, dev, meta) needed for registration")
        return _descs(descs, mem_type)

    def register_memory(
        self, reg_list: Any, mem_type: str | None = None, backends: Sequence[str] = ()
    ) -> XferDList:
        """Register ``reg_list`` (N x 3 array, list of 4-tuples, tensor(s)); each entry is one region."""
        regs = self.get_reg_descs(reg_list, mem_type)
        self.registrations += [_Registration(a, n, d, regs.mem_type) for a, n, d in regs.descs.tolist()]
        return regs

    def deregister_memory(self, dereg_list: XferDList, backends: Sequence[str] = ()) -> None:
        for a, n, d in dereg_list.descs.tolist():
            self.registrations.remove(_Registration(a, n, d, dereg_list.mem_type))

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> XferDList:
        return _descs(descs, mem_type)

    # -- metadata -----------------------------------------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        regs = [[r.addr, r.length, r.dev, r.mem_type] for r in self.registrations]
        return json.dumps({"nixl_double_agent": self.name, "registrations": regs}).encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Load a peer's metadata (NIXL *adds* to registrations already loaded for it); returns its name."""
        md = json.loads(bytes(metadata))
        name = str(md["nixl_double_agent"])
        known = self._remote.setdefault(name, [])
        known += [_Registration(*r) for r in md["registrations"] if _Registration(*r) not in known]
        return name.encode()

    def remove_remote_agent(self, agent: str) -> None:
        self._remote.pop(agent.decode() if isinstance(agent, bytes) else agent, None)

    # -- preparation and transfers ------------------------------------------------------------------
    def _registrations_of(self, agent: str) -> list[_Registration]:
        if agent == self.name:
            return self.registrations
        if agent not in self._remote:
            raise nixlNotFoundError(f"metadata for remote agent {agent!r} not found")
        return self._remote[agent]

    def prep_xfer_dlist(
        self, agent_name: str, xfer_list: Any, mem_type: str | None = None, backends: Sequence[str] = ()
    ) -> PreppedDList:
        """Prepare descriptors of this agent (``""`` or ``"NIXL_INIT_AGENT"``) or of ``agent_name``."""
        is_strided = isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5
        if is_strided and mem_type is None:
            raise ValueError("Please specify a mem type for strided descriptors")
        dlist = _descs(xfer_list, mem_type)
        local = agent_name in ("", INIT_AGENT)
        owner = self.name if local else agent_name
        _check_covered(dlist, self._registrations_of(owner), owner)
        return PreppedDList(self.name, agent=None if local else agent_name, dlist=dlist)

    def _live(self, h: _Handle, what: str) -> None:
        if h.released:
            raise nixlInvalidParamError(f"{what} was released")
        if h.owner != self.name:
            raise nixlInvalidParamError(f"{what} belongs to agent {h.owner!r}")

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: PreppedDList,
        local_indices: Any,
        remote_xfer_side: PreppedDList,
        remote_indices: Any,
        notif_msg: bytes | str = b"",
        backends: Sequence[str] = (),
        skip_desc_merge: bool = False,
    ) -> XferHandle:
        op = _op(operation)
        self._live(local_xfer_side, "local dlist handle")
        self._live(remote_xfer_side, "remote dlist handle")
        if local_xfer_side.agent is not None or remote_xfer_side.agent is None:
            raise nixlInvalidParamError(
                "local side must be prepared for the initiator, remote side for a peer"
            )
        li, ri = np.asarray(local_indices).reshape(-1), np.asarray(remote_indices).reshape(-1)
        if li.size != ri.size or li.size == 0:
            raise nixlInvalidParamError(
                f"different number of indices for local ({li.size}), remote ({ri.size})"
            )
        ld, rd = local_xfer_side.dlist, remote_xfer_side.dlist
        assert ld is not None and rd is not None
        for side, idx, n in (("local", li, len(ld)), ("remote", ri, len(rd))):
            if idx.dtype.kind not in "iu":
                raise nixlInvalidParamError(f"{side} indices must be integers")
            bad = np.flatnonzero((idx < 0) | (idx >= n))
            if bad.size:
                raise nixlInvalidParamError(
                    f"{side} index out of range at index {int(bad[0])} with value {int(idx[bad[0]])}"
                )
        return self._pair(op, remote_xfer_side.agent, ld.descs[li], rd.descs[ri], notif_msg)

    def initialize_xfer(
        self,
        operation: str,
        local_descs: Any,
        remote_descs: Any,
        remote_agent: str,
        notif_msg: bytes | str = b"",
        backends: Sequence[str] = (),
    ) -> XferHandle:
        op = _op(operation)
        ld, rd = _descs(local_descs, None), _descs(remote_descs, None)
        _check_covered(ld, self.registrations, self.name)
        _check_covered(rd, self._registrations_of(remote_agent), remote_agent)
        if len(ld) != len(rd) or not len(ld):
            raise nixlInvalidParamError(
                f"different number of descriptors for local ({len(ld)}), remote ({len(rd)})"
            )
        return self._pair(op, remote_agent, ld.descs, rd.descs, notif_msg)

    def _pair(
        self, op: str, remote: str, local: np.ndarray, remote_descs: np.ndarray, notif: bytes | str
    ) -> XferHandle:
        bad = np.flatnonzero(local[:, 1] != remote_descs[:, 1])
        if bad.size:
            i = int(bad[0])
            raise nixlInvalidParamError(
                f"length mismatch at index {i}: local {int(local[i, 1])}, remote {int(remote_descs[i, 1])}"
            )
        return XferHandle(
            self.name,
            op=op,
            remote=remote,
            local_descs=local.copy(),
            remote_descs=remote_descs.copy(),
            notif=_as_bytes(notif),
        )

    def transfer(self, handle: XferHandle, notif_msg: bytes | str = b"") -> str:
        """Record the transfer as executed (synchronously) and deliver its notification: ``"DONE"``."""
        self._live(handle, "transfer handle")
        notif = _as_bytes(notif_msg) or handle.notif
        self.fabric.executed.append(
            ExecutedTransfer(
                handle.op, self.name, handle.remote, handle.local_descs, handle.remote_descs, notif
            )
        )
        handle.posts += 1
        if notif:
            self._deliver(handle.remote, notif)
        return "DONE"

    def check_xfer_state(self, handle: XferHandle) -> str:
        self._live(handle, "transfer handle")
        return "DONE" if handle.posts else "ERR"

    def get_xfer_telemetry(self, handle: XferHandle) -> XferTelemetry:
        """Bytes and descriptor count after merging pairs contiguous on both sides (as NIXL merges)."""
        ld, rd = handle.local_descs.astype(np.int64), handle.remote_descs.astype(np.int64)
        if not len(ld):
            return XferTelemetry(0, 0)
        joined = (ld[1:, 0] == ld[:-1, 0] + ld[:-1, 1]) & (rd[1:, 0] == rd[:-1, 0] + rd[:-1, 1])
        return XferTelemetry(int(ld[:, 1].sum()), int(len(ld) - joined.sum()))

    def release_xfer_handle(self, handle: XferHandle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: PreppedDList) -> None:
        handle.release()

    # -- notifications ------------------------------------------------------------------------------
    def _deliver(self, target: str, msg: bytes) -> None:
        if target not in self.fabric.agents:
            raise nixlNotFoundError(f"agent {target!r} is not in this fabric")
        self.fabric.agents[target]._inbox.setdefault(self.name, []).append(msg)

    def send_notif(self, remote_agent_name: str, notif_msg: bytes | str, backend: str | None = None) -> None:
        self._registrations_of(remote_agent_name)  # NOT_FOUND unless its metadata was loaded
        self._deliver(remote_agent_name, _as_bytes(notif_msg))

    def get_new_notifs(self, backends: Sequence[str] = ()) -> dict[str, list[bytes]]:
        new, self._inbox = self._inbox, {}
        return new

    def update_notifs(self, backends: Sequence[str] = ()) -> dict[str, list[bytes]]:
        for peer, msgs in self.get_new_notifs().items():
            self.notifs.setdefault(peer, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(
        self,
        remote_agent_name: str,
        lookup_tag: bytes,
        backends: Sequence[str] = (),
        tag_is_prefix: bool = True,
    ) -> bool:
        self.update_notifs()
        for msg in self.notifs.get(remote_agent_name, []):
            if msg.startswith(lookup_tag) if tag_is_prefix else lookup_tag in msg:
                self.notifs[remote_agent_name].remove(msg)
                return True
        return False
