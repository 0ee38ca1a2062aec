"""Posting READ/WRITE requests on an :class:`~kvgeom_nixl.agent.Endpoint`: from descriptor ids into prepared lists (:meth:`_Posting.post`) or from per-request descriptor lists (:meth:`_Posting.post_descs`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .agent_handles import OPS, Prepped, Transfer, _as_descs, _as_ids, _release_quietly, _wrap
from .errors import StaleMetadata, TransferError


class _Posting:
    """The posting calls of :class:`~kvgeom_nixl.agent.Endpoint` (a mixin over its state): prepared ids or per-request descriptor lists made into one NIXL request and posted."""

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
