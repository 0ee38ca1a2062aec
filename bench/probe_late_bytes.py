"""What stops a late transfer? A probe with raw NIXL endpoints in two processes (docs/reliability.md).

    .venv/bin/python bench/probe_late_bytes.py

64 MiB between a P and a D process. Each case makes a transfer late (the peer is SIGSTOPped before the
bytes move), lets D try one way of stopping it, zeroes D's buffer, continues (or kills) the peer, drives
D's progress for 3 s and counts the bytes that landed in D afterwards:

* pull (D READs), UCX over TCP: ``release`` (NIXL's cancellation of the active handle), ``remove``
  (release, then ``remove_remote_agent`` of P), ``keep`` (keep polling the handle: it ends), ``kill``
  (keep polling, P is SIGKILLed instead of continued);
* push (P WRITEs), over TCP and over CMA: ``none``, ``remove`` (D connects back to P, then removes it),
  ``dereg`` (D deregisters the destination memory).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "adapters"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import numpy as np  # noqa: E402
from kvgeom_lab import ProcGroup  # noqa: E402
from kvgeom_nixl import Auth, Endpoint, SideChannelServer, TransportConfig, fetch, make_payload  # noqa: E402

N = 64 << 20
BLK = 1 << 20
AUTH = Auth(b"probe-late-bytes-secret-0123456789")


def _descs(base: int) -> np.ndarray:
    d = np.zeros((N // BLK, 3), np.uint64)
    d[:, 0] = base + np.arange(N // BLK, dtype=np.uint64) * BLK
    d[:, 1] = BLK
    return d


def _producer(tls: str | None, mode: str, events, inbox) -> str:
    if tls:
        os.environ["UCX_TLS"] = tls
    import torch

    src = torch.full((N,), 0x5A, dtype=torch.uint8)
    with Endpoint("P", TransportConfig(close_drain_s=0.2)) as ep:
        (r,) = ep.register_tensors(src)
        srv = SideChannelServer(
            "127.0.0.1",
            0,
            make_payload(
                engine_id="p",
                rank=0,
                agent_name="P",
                agent_metadata=ep.metadata(),
                card={},
                regions=[(r.addr, r.nbytes, 0)],
            ),
            auth=AUTH,
        ).start()
        try:
            events.put(("port", srv.port))
            if mode == "push":
                peer = srv.wait_peer("D", 20)
                ep.add_peer("D", peer["agent_metadata"])
                lh, rh = ep.prep_local(_descs(r.addr)), ep.prep_remote("D", _descs(peer["regions"][0][0]))
                inbox.get(timeout=30)  # "go": arrives while we are stopped, read when we continue
                x = ep.post("WRITE", lh, np.arange(N // BLK), rh, np.arange(N // BLK), b"late")
                try:
                    x.wait(timeout_s=10)
                except Exception as exc:  # noqa: BLE001 - reported
                    return repr(exc)
            end = time.monotonic() + 30
            while time.monotonic() < end:
                ep.notifications()
                try:
                    if inbox.get_nowait() == "exit":
                        break
                except queue.Empty:
                    time.sleep(0.001)
            return "ok"
        finally:
            srv.close()


def _consumer(tls: str | None, mode: str, case: str, events, inbox) -> dict:
    if tls:
        os.environ["UCX_TLS"] = tls
    import torch

    dst = torch.zeros(N, dtype=torch.uint8)
    out: dict = {}
    with Endpoint("D", TransportConfig(close_drain_s=0.2)) as ep:
        (r,) = ep.register_tensors(dst)
        port = inbox.get(timeout=30)
        me = make_payload(
            engine_id="d",
            rank=0,
            agent_name="D",
            agent_metadata=ep.metadata(),
            card={},
            regions=[(r.addr, r.nbytes, 0)],
        )
        peer = fetch("127.0.0.1", port, me, timeout_s=10, auth=AUTH)
        ids = np.arange(N // BLK)
        if mode == "pull":
            ep.add_peer("P", peer["agent_metadata"])
            lh, rh = ep.prep_local(_descs(r.addr)), ep.prep_remote("P", _descs(peer["regions"][0][0]))
            ep.post("READ", lh, ids, rh, ids).wait(timeout_s=10)  # connection up
            events.put(("stop", None))
            inbox.get(timeout=30)
            x = ep.post("READ", lh, ids, rh, ids)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.5:
                x.poll()
                time.sleep(0.01)
            out["state_at_deadline"] = x.state
            if case in ("release", "remove"):
                x._handle.release()  # NIXL's cancellation: reports success
                x._released = True
                ep._transfers.discard(x)
            if case == "remove":
                ep.remove_peer("P")
            dst.zero_()
            events.put(("resume", None))
            inbox.get(timeout=30)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3:
                ep.notifications()
                if case in ("keep", "kill") and x.live:
                    try:
                        x.poll()
                    except Exception as exc:  # noqa: BLE001 - reported
                        out["ended"] = f"{type(exc).__name__} after {time.monotonic() - t0:.3f}s"
                time.sleep(0.005)
            out["state_after"] = x.state
        else:
            if case == "remove":
                ep.add_peer("P", peer["agent_metadata"])
                ep.send_notif("P", b"hello")
            events.put(("stop", None))
            inbox.get(timeout=30)
            if case == "remove":
                ep.remove_peer("P")
            if case == "dereg":
                ep.deregister_all()
            dst.zero_()
            events.put(("resume", None))
            inbox.get(timeout=30)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3:
                ep.notifications()
                time.sleep(0.005)
            out["notification"] = sum(c[b"late"] for c in ep.notifications().values())
        out["landed"] = int((dst != 0).sum())
        return out


def probe(tls: str | None, mode: str, case: str) -> dict:
    with ProcGroup() as g:
        ev, to_p, to_d = g.queue(), g.queue(), g.queue()
        g.spawn(_producer, (tls, mode, ev, to_p), "P")
        g.spawn(_consumer, (tls, mode, case, ev, to_d), "D")
        _, port = ev.get(timeout=60)
        to_d.put(port)
        pid = g.procs["P"].pid
        assert ev.get(timeout=60)[0] == "stop"
        os.kill(pid, signal.SIGSTOP)
        if mode == "push":
            to_p.put("go")  # P reads it when it continues, and posts its WRITE then: late
        to_d.put("ok")
        assert ev.get(timeout=60)[0] == "resume"
        os.kill(pid, signal.SIGKILL if case == "kill" else signal.SIGCONT)
        to_d.put("ok")
        res = g.collect(60, ["D"])["D"]
        to_p.put("exit")
        g.collect(15)
    return res.value if res.ok else {"error": res.error}


def main() -> int:
    cases = [("tcp", "pull", c) for c in ("release", "remove", "keep", "kill")]
    cases += [(t, "push", c) for t in ("tcp", None) for c in ("none", "remove", "dereg")]
    print(f"| mode | transport | what D did | bytes of {N >> 20} MiB that landed afterwards | notes |")
    print("| --- | --- | --- | --- | --- |")
    for tls, mode, case in cases:
        r = probe(tls, mode, case)
        notes = ", ".join(f"{k}={v}" for k, v in r.items() if k != "landed")
        print(f"| {mode} | {tls or 'cma'} | {case} | {r.get('landed')} | {notes} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
