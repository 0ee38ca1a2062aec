"""A rank in its own process for the exposure tests (``test_exposure.py``): it reports the TCP sockets it
listens on and its side channel's counters and memory, on request, until told to exit."""

from __future__ import annotations

import ipaddress
import os
import queue
import socket
import struct
import time
from typing import Any


def listening() -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket this process listens on (``/proc/self/net/tcp{,6}``)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for path, v6 in (("/proc/self/net/tcp", False), ("/proc/self/net/tcp6", True)):
        for line in open(path).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # state LISTEN, one of ours
                addr, port = f[1].split(":")
                out.append((_addr(addr, v6), int(port, 16)))
    return out


def _addr(hexaddr: str, v6: bool) -> str:
    raw = bytes.fromhex(hexaddr)
    if not v6:
        return socket.inet_ntoa(raw[::-1])
    words = struct.unpack("<4I", raw)  # /proc writes each 32-bit word in host order
    return str(ipaddress.IPv6Address(struct.pack(">4I", *words)))


def memory_kib() -> dict[str, int]:
    """``VmRSS`` (now) and ``VmHWM`` (peak) of this process, in KiB."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def exposed_rank(spec: dict, to_parent: Any, inbox: Any) -> dict:
    """A KVRank on ``spec['host']`` (config overrides in ``spec['config']``). Commands on ``inbox``:
    ``stats`` (reply with the side channel's counters, buffered bytes and memory), ``exit``."""
    from dataclasses import replace

    from _inproc import CONFIG, card
    from kvgeom_nixl.kvrank import KVRank

    rank = KVRank(
        card(spec.get("engine", "prefill")), replace(CONFIG, **spec.get("config", {})), host=spec["host"]
    )
    try:
        info = {"port": rank.port, "listening": listening(), "net_devices": rank.ep.net_devices}
        to_parent.put(("rank", "ready", dict(info, **memory_kib())))
        deadline = time.monotonic() + spec.get("linger_s", 60.0)
        while time.monotonic() < deadline:
            try:
                _, cmd, _ = inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if cmd == "exit":
                return info
            srv = rank.server
            refused = [(type(e).__name__, getattr(e, "field", None)) for e in srv.refusals]
            stats = dict(srv.stats, pending_bytes=srv.pending_bytes, refusals=refused, **memory_kib())
            to_parent.put(("rank", "stats", stats))
        return info
    finally:
        rank.close()


def concurrent_endpoints(settings: list[str], to_parent: Any) -> dict:
    """Create one Endpoint per entry of ``settings`` (its ``net_devices``) from as many threads at once,
    then report every TCP socket this process listens on, and each agent's ``net_devices``."""
    import threading

    from kvgeom_nixl import Endpoint, TransportConfig

    barrier = threading.Barrier(len(settings))
    made: dict[int, Any] = {}
    errors: list[str] = []

    def make(i: int, setting: str) -> None:
        try:
            barrier.wait(30.0)
            made[i] = Endpoint(f"c{i}-{os.getpid()}", TransportConfig(insecure=True, net_devices=setting))
        except Exception as e:  # reported, not raised: the parent asserts on it
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=make, args=(i, s)) for i, s in enumerate(settings)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120.0)
    try:
        return {
            "listening": listening(),
            "net_devices": {i: ep.net_devices for i, ep in made.items()},
            "errors": errors,
            "alive": sum(t.is_alive() for t in threads),
        }
    finally:
        for ep in made.values():
            ep.close()


def endpoint_without_host(config: dict, to_parent: Any) -> dict:
    """An Endpoint made without a host (``config``: TransportConfig overrides): the sockets it listens on."""
    from kvgeom_nixl import Endpoint, TransportConfig

    with Endpoint(f"nohost-{os.getpid()}", TransportConfig(insecure=True, **config)) as ep:
        return {"listening": listening(), "net_devices": ep.net_devices}
