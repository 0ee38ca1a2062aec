"""A userspace link impairer: what ``tc netem`` does (delay, jitter, loss, a rate cap), for kernels built
without ``sch_netem``.

It forwards Ethernet frames between two interfaces of the switch namespace of a
:class:`~kvgeom_lab.netns.VirtualNet` (the host's switch port, taken off the bridge, and one end of a
veth pair whose other end is on the bridge), with ``AF_PACKET`` sockets. Frames *leaving* the host (the
direction ``tc netem`` on the host's interface affects) are delayed by ``delay_ms`` (+ uniform jitter),
dropped with probability ``loss_pct`` and paced to ``rate_mbit``; frames towards the host pass at once
(``both=True`` impairs them too). Order is kept per direction (a frame never overtakes an earlier one,
as with netem's default).

The frames must be checksummed when they leave a host: the hosts' interfaces are created with TX checksum
offload off (``ethtool -K kvh0 tx off``, see ``VirtualNet(impairable=True)``), which also makes the kernel
segment to the MTU before sending. Otherwise a frame read here carries a partial checksum (completed by
"hardware" that a veth does not have) and is dropped by the receiver (measured: every TCP segment
counted in ``InCsumErrors``).

Run as ``python -m kvgeom_lab.impair --netns NS --host-port p1 --bridge-port q1 --delay-ms 100
--loss-pct 5`` (``VirtualNet.netem`` does it); ends on SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import random
import select
import signal
import socket
import sys
import threading
import time

__all__ = ["main", "forward"]

_ETH_P_ALL = 0x0003
_MAX_FRAME = 65536
_MAX_QUEUE = 200_000  # frames held at once (beyond: dropped, like a full netem queue)


def _open(ifname: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
    s.bind((ifname, 0))
    s.setblocking(False)
    for opt in (getattr(socket, "SO_RCVBUFFORCE", 33), getattr(socket, "SO_SNDBUFFORCE", 32)):
        try:
            s.setsockopt(socket.SOL_SOCKET, opt, 16 << 20)
        except OSError:
            pass
    return s


class _Direction:
    """Frames of one direction: a FIFO of ``(due, frame)``, a loss draw and a rate pacer."""

    def __init__(
        self,
        out: socket.socket,
        delay_s: float,
        jitter_s: float,
        loss: float,
        rate_bps: float | None,
        rng: random.Random,
    ) -> None:
        self.out, self.delay_s, self.jitter_s, self.loss, self.rate = out, delay_s, jitter_s, loss, rate_bps
        self.rng = rng
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.next_free = 0.0  # pacer: when the link is free for the next frame
        self.stats = {"in": 0, "lost": 0, "out": 0, "overflow": 0, "send_errors": 0}

    def take(self, frame: bytes, now: float) -> None:
        self.stats["in"] += 1
        if self.loss and self.rng.random() < self.loss:
            self.stats["lost"] += 1
            return
        if len(self.queue) >= _MAX_QUEUE:
            self.stats["overflow"] += 1
            return
        due = now + self.delay_s + (self.rng.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0)
        if self.queue and due < self.queue[-1][0]:
            due = self.queue[-1][0]  # keep order
        if self.rate:
            start = max(due, self.next_free)
            self.next_free = start + len(frame) * 8 / self.rate
            due = start
        self.queue.append((due, frame))

    def flush(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            _, frame = self.queue.popleft()
            try:
                self.out.send(frame)
                self.stats["out"] += 1
            except OSError:
                self.stats["send_errors"] += 1  # the port is down (a cut link): the frame is lost

    def due(self) -> float | None:
        return self.queue[0][0] if self.queue else None


def forward(
    host_port: str,
    bridge_port: str,
    *,
    delay_ms: float = 0.0,
    jitter_ms: float = 0.0,
    loss_pct: float = 0.0,
    rate_mbit: float | None = None,
    both: bool = False,
    seed: int = 0,
    stop_after_s: float | None = None,
) -> dict[str, dict[str, int]]:
    """Forward frames between ``host_port`` and ``bridge_port`` until SIGTERM (or ``stop_after_s``),
    impairing those that leave the host (both directions with ``both``). Returns per-direction counts."""
    rng = random.Random(seed)
    a, b = _open(host_port), _open(bridge_port)
    rate = rate_mbit * 1e6 if rate_mbit else None
    imp = (delay_ms / 1e3, jitter_ms / 1e3, loss_pct / 100.0, rate)
    clear = (0.0, 0.0, 0.0, None)
    dirs = {a.fileno(): _Direction(b, *imp, rng), b.fileno(): _Direction(a, *(imp if both else clear), rng)}
    socks = {a.fileno(): a, b.fileno(): b}
    stopping = []
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    end = None if stop_after_s is None else time.monotonic() + stop_after_s
    try:
        while not stopping and (end is None or time.monotonic() < end):
            dues = [d for d in (x.due() for x in dirs.values()) if d is not None]
            wait = max(0.0, min(dues) - time.monotonic()) if dues else 0.2
            try:
                ready, _, _ = select.select(list(socks.values()), [], [], min(wait, 0.2))
            except InterruptedError:
                continue
            now = time.monotonic()
            for s in ready:
                d = dirs[s.fileno()]
                for _ in range(256):
                    try:
                        frame, addr = s.recvfrom(_MAX_FRAME)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        break  # the port is down
                    if addr[2] == socket.PACKET_OUTGOING:
                        continue  # our own send, seen on the way out
                    d.take(frame, now)
            now = time.monotonic()
            for d in dirs.values():
                d.flush(now)
    finally:
        a.close()
        b.close()
    return {"egress": dirs[a.fileno()].stats, "ingress": dirs[b.fileno()].stats}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvgeom_lab.impair", description=__doc__.splitlines()[0])
    ap.add_argument("--netns", help="enter this network namespace first (the switch of a VirtualNet)")
    ap.add_argument("--host-port", required=True)
    ap.add_argument("--bridge-port", required=True)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--loss-pct", type=float, default=0.0)
    ap.add_argument("--rate-mbit", type=float, default=None)
    ap.add_argument("--both", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.netns:
        from .netns import _setns_net

        _setns_net(args.netns)
    stats = forward(
        args.host_port,
        args.bridge_port,
        delay_ms=args.delay_ms,
        jitter_ms=args.jitter_ms,
        loss_pct=args.loss_pct,
        rate_mbit=args.rate_mbit,
        both=args.both,
        seed=args.seed,
    )
    print(stats, flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
