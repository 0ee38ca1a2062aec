"""Rank programs for the NIXL transport tests. Each runs in its own ``spawn`` process (see
``kvgeom_lab.procs``), talks to the parent through queues of ``(who, event, data)`` tuples, and
returns a plain dict of observations that the test asserts on.

Buffers: a rank's region is ``nbytes`` of int64, seen as ``nblocks`` blocks of ``block`` bytes. The
prefill rank fills it with ``pattern(gen)`` so that the decode rank can check what it received
without any extra communication.
"""

from __future__ import annotations

import queue
import time
from typing import Any

import numpy as np
from kvgeom_nixl import (
    AdapterError,
    Auth,
    Endpoint,
    HandshakeTimeout,
    PeerGone,
    SideChannelServer,
    StaleMetadata,
    TransferError,
    TransportConfig,
    check_generation,
    fetch,
    make_payload,
)

HOST = "127.0.0.1"
STEP_S = 20.0  # bound of every single wait inside a rank
AUTH = Auth(b"transport-test-secret-0123456789")


def pattern(nbytes: int, gen: int) -> np.ndarray:
    """Known content of the prefill region of generation ``gen`` (int64 words)."""
    return np.arange(nbytes // 8, dtype=np.int64) * 3 + 1_000_003 * (gen + 1)


def block_descs(base: int, nblocks: int, block: int) -> np.ndarray:
    """N×3 uint64 descriptors of consecutive blocks starting at ``base``."""
    d = np.zeros((nblocks, 3), dtype=np.uint64)
    d[:, 0] = np.uint64(base) + np.arange(nblocks, dtype=np.uint64) * np.uint64(block)
    d[:, 1] = block
    return d


def merged_runs(local_ids: np.ndarray, remote_ids: np.ndarray) -> int:
    """Number of descriptors after NIXL merges pairs that are consecutive on both sides."""
    if local_ids.size == 0:
        return 0
    joins = (np.diff(local_ids) == 1) & (np.diff(remote_ids) == 1)
    return int(local_ids.size - joins.sum())


def _config() -> TransportConfig:
    return TransportConfig(handshake_timeout_s=STEP_S, transfer_timeout_s=STEP_S, notif_timeout_s=STEP_S)


def _get(q: Any, event: str, timeout_s: float = STEP_S) -> Any:
    """Next message on ``q``; it must be ``event``. Returns its data."""
    who, ev, data = q.get(timeout=timeout_s)
    if ev != event:
        raise AssertionError(f"expected event {event!r}, got {ev!r} from {who}")
    return data


def _payload(ep: Endpoint, engine: str, tensors_regions, gen: int) -> dict:
    return make_payload(
        engine_id=engine,
        rank=0,
        agent_name=ep.name,
        agent_metadata=ep.metadata(),
        card={"kind": "test", "block": None},
        regions=[(r.addr, r.nbytes, r.device_id) for r in tensors_regions],
        device_id=0,
        generation=gen,
    )


# --------------------------------------------------------------------------------------- prefill
def prefill_rank(spec: dict, to_parent: Any, inbox: Any) -> dict:
    """Owns the source region. Modes: ``serve`` (wait for the notifications in ``spec['expect']``,
    obeying ``reregister``/``exit`` commands meanwhile) and ``push`` (WRITE into decode's region)."""
    import torch

    t0 = time.monotonic()
    nbytes = spec["nbytes"]
    out: dict[str, Any] = {"notifs": []}
    keep = []  # old tensors stay alive so that a re-registered buffer gets a new address
    with Endpoint("P", _config()) as ep:
        out["agent_s"] = time.monotonic() - t0
        src = torch.from_numpy(pattern(nbytes, 0))
        regions = ep.register_tensors(src)
        server = SideChannelServer(
            HOST, 0, _payload(ep, "prefill", regions, ep.generation), auth=AUTH
        ).start()
        try:
            to_parent.put(("P", "ready", {"port": server.port, "generation": ep.generation}))
            if spec["mode"] == "push":
                peer = server.wait_peer("D", STEP_S)
                ep.add_peer("D", peer["agent_metadata"])
                blk, nblk = spec["block"], nbytes // spec["block"]
                dst_base = peer["regions"][0][0]
                lh = ep.prep_local(block_descs(regions[0].addr, nblk, blk))
                rh = ep.prep_remote("D", block_descs(dst_base, nblk, blk))
                perm = np.asarray(spec["perm"], dtype=np.int32)
                tel = ep.post("WRITE", lh, perm, rh, np.arange(nblk, dtype=np.int32), b"write-done").wait()
                out["telemetry"] = tel
                # WRITE is done on our side; decode confirms that it verified before we free the memory.
                out["notifs"] += ep.wait_notifications("D", b"verified", 1)
                return out
            expect = list(spec.get("expect", []))
            deadline = time.monotonic() + STEP_S
            while time.monotonic() < deadline:
                seen = ep.notifications()  # also drives progress: we have no progress thread
                out["notifs"] = sorted((p, m) for p, c in seen.items() for m in c.elements())
                if expect and all(any(m == e for _, m in out["notifs"]) for e in expect):
                    return out
                try:
                    _, cmd, data = inbox.get_nowait()
                except queue.Empty:
                    time.sleep(0.002)
                    continue
                if cmd == "exit":
                    return out
                if cmd == "reregister":
                    keep.append(src)
                    ep.deregister_all()
                    src = torch.from_numpy(pattern(nbytes, 1))
                    regions = ep.register_tensors(src)
                    server.update(_payload(ep, "prefill", regions, ep.generation))
                    to_parent.put(("P", "reregistered", {"generation": ep.generation}))
            raise TimeoutError(f"prefill: expected {expect}, got {out['notifs']} within {STEP_S}s")
        finally:
            server.close()


# --------------------------------------------------------------------------------------- decode
class _Link:
    """Decode's view of the prefill peer: handshake data and the prepared lists for it."""

    def __init__(self, ep: Endpoint, port: int, block: int, my_payload: dict) -> None:
        self.ep, self.port, self.block = ep, port, block
        self.handshake(my_payload)

    def handshake(self, my_payload: dict) -> None:
        t0 = time.monotonic()
        peer = fetch(HOST, self.port, my_payload, timeout_s=STEP_S, auth=AUTH)
        self.generation = peer["generation"]
        self.name = self.ep.add_peer(peer["agent_name"], peer["agent_metadata"])
        self.base, self.nbytes, _ = peer["regions"][0]
        self.nblocks = self.nbytes // self.block
        self.remote = self.ep.prep_remote(self.name, block_descs(self.base, self.nblocks, self.block))
        self.handshake_s = time.monotonic() - t0


def decode_rank(spec: dict, to_parent: Any, inbox: Any) -> dict:
    """Owns the destination region; pulls (READ) from prefill, or receives its WRITE."""
    import torch

    t0 = time.monotonic()
    nbytes, blk = spec["nbytes"], spec["block"]
    nblk = nbytes // blk
    out: dict[str, Any] = {}
    with Endpoint("D", _config()) as ep:
        out["agent_s"] = time.monotonic() - t0
        dst = torch.zeros(nbytes // 8, dtype=torch.int64)
        regions = ep.register_tensors(dst)
        me = _payload(ep, "decode", regions, ep.generation)
        port = _get(inbox, "port")["port"]
        if spec["mode"] == "silent":  # the peer's side channel accepts but never answers
            t0 = time.monotonic()
            try:
                fetch(HOST, port, me, timeout_s=spec["handshake_timeout_s"], auth=AUTH)
            except HandshakeTimeout as e:
                return {"error": type(e).__name__, "message": str(e), "elapsed_s": time.monotonic() - t0}
            return {"error": None}
        link = _Link(ep, port, blk, me)
        out["handshake_s"] = link.handshake_s
        local = ep.prep_local(block_descs(regions[0].addr, nblk, blk))
        perm = np.asarray(spec["perm"], dtype=np.int32)
        ids = np.arange(nblk, dtype=np.int32)
        mode = spec["mode"]

        def read_and_verify(gen: int, notif: bytes) -> dict:
            dst.zero_()
            check_generation(HOST, port, link.generation, auth=AUTH)
            tel = ep.post("READ", local, ids, link.remote, perm, notif).wait()
            want = pattern(nbytes, gen).reshape(nblk, -1)[perm]
            ok = bool(np.array_equal(dst.numpy().reshape(nblk, -1), want))
            return {"telemetry": tel, "ok": ok}

        if mode == "read":
            out.update(read_and_verify(0, b"read-done"))
            out["expected_desc_count"] = merged_runs(ids, perm)
        elif mode == "receive":
            # prefill wrote its block perm[i] into our block i
            out["notifs"] = ep.wait_notifications("P", b"write-done", 1)
            want = pattern(nbytes, 0).reshape(nblk, -1)[perm]
            out["ok"] = bool(np.array_equal(dst.numpy().reshape(nblk, -1), want))
            ep.send_notif("P", b"verified")
        elif mode == "stale":
            out["first"] = read_and_verify(0, b"first")
            old_remote, old_base = link.remote, link.base
            to_parent.put(("D", "first-done", None))
            _get(inbox, "go")
            try:
                read_and_verify(1, b"never")
                out["detected"] = None
            except StaleMetadata as e:
                out["detected"] = {"type": type(e).__name__, "expected": e.expected, "seen": e.seen}
            link.handshake(me)  # fresh payload, add_peer removes the stale metadata first
            out["new_generation"] = link.generation
            try:
                ep.post("READ", local, ids, old_remote, perm, b"never").wait()
                out["old_handle"] = None
            except StaleMetadata as e:
                out["old_handle"] = type(e).__name__
            try:  # the old region is no longer in the peer's registrations we hold
                ep.prep_remote(link.name, block_descs(old_base, 1, blk))
                out["old_region"] = None
            except TransferError as e:
                out["old_region"] = e.status
            out["second"] = read_and_verify(1, b"second")
        elif mode in ("kill_before", "kill_during"):
            out.update(_decode_kill(ep, link, local, ids, perm, port, mode, to_parent, inbox))
        elif mode == "bad":
            out.update(_decode_bad(ep, link, local, ids, perm, regions, blk))
            out["after"] = read_and_verify(0, b"after-bad")
        else:
            raise ValueError(mode)
        return out


def _decode_kill(ep, link, local, ids, perm, port, mode, to_parent, inbox) -> dict:
    out: dict[str, Any] = {"errors": []}
    if mode == "kill_before":
        ep.post("READ", local, ids, link.remote, perm, b"warm").wait()  # connection is up
        to_parent.put(("D", "armed", None))
        _get(inbox, "killed")
        t0 = time.monotonic()
        try:
            check_generation(HOST, port, link.generation, timeout_s=2.0, auth=AUTH)
        except AdapterError as e:
            out["errors"].append(("generation", type(e).__name__, time.monotonic() - t0))
        t0 = time.monotonic()
        try:  # post anyway: NIXL itself must report the dead peer, bounded
            ep.post("READ", local, ids, link.remote, perm, b"ghost").wait(timeout_s=5.0)
        except (PeerGone, TransferError) as e:
            out["errors"].append(("post", type(e).__name__, time.monotonic() - t0))
        return out
    # kill_during: keep READs in flight until the peer dies under us
    ep.post("READ", local, ids, link.remote, perm, b"").wait(timeout_s=5.0)
    n_ok = 1
    to_parent.put(("D", "looping", None))
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        try:
            ep.post("READ", local, ids, link.remote, perm, b"").wait(timeout_s=5.0)
            n_ok += 1
        except (PeerGone, TransferError) as e:
            out["errors"].append((f"loop:{e.stage}", type(e).__name__, time.monotonic()))
            out["status"] = e.status
            break
    out["n_ok"] = n_ok
    return out


def _decode_bad(ep, link, local, ids, perm, regions, blk) -> dict:
    out: dict[str, Any] = {}
    end = link.base + link.nbytes
    cases = {
        "remote_tail_oob": lambda: ep.prep_remote(
            link.name, np.array([[end - blk // 2, blk, 0]], dtype=np.uint64)
        ),
        "remote_unregistered": lambda: ep.prep_remote(
            link.name, np.array([[end + (1 << 30), blk, 0]], dtype=np.uint64)
        ),
        "local_oob": lambda: ep.prep_local(
            np.array([[regions[0].addr + regions[0].nbytes, blk, 0]], dtype=np.uint64)
        ),
        "remote_vram": lambda: ep.prep_remote(
            link.name, np.array([[link.base, blk, 0]], dtype=np.uint64), "VRAM"
        ),
        "bad_ids": lambda: ep.post("READ", local, ids, link.remote, ids + 1, b""),
        "unequal_ids": lambda: ep.post("READ", local, ids[:2], link.remote, ids[:3], b""),
    }
    here = np.array([[regions[0].addr, blk, 0]], dtype=np.uint64)
    for path in ("initialize", "prep"):  # per-request lists (kvgeom mode's merged runs) are checked too
        cases[f"{path}_remote_tail_oob"] = lambda path=path: ep.post_descs(
            "READ", here, link.name, np.array([[end - blk // 2, blk, 0]], dtype=np.uint64), path=path
        )
        cases[f"{path}_local_oob"] = lambda path=path: ep.post_descs(
            "READ",
            np.array([[regions[0].addr + regions[0].nbytes - blk // 2, blk, 0]], dtype=np.uint64),
            link.name,
            np.array([[link.base, blk, 0]], dtype=np.uint64),
            path=path,
        )
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except TransferError as e:
            out[name] = (type(e).__name__, e.status)
    return out
