"""Child programs of the cross-host tests (module-level, so that ``spawn`` can import them). Each runs
inside a host (network namespace) of a VirtualNet and returns plain data."""

from __future__ import annotations

import os
import queue
import time
from typing import Any

import numpy as np

STEP_S = 20.0


def read_peer(env: dict, peer_q: Any, done_q: Any, nbytes: int) -> dict:
    """D: load the peer's metadata from ``peer_q``, READ its ``nbytes`` region once, check the bytes."""
    os.environ.update(env)
    import torch
    from kvgeom_nixl import Endpoint, TransportConfig

    with Endpoint("reader", TransportConfig(insecure=True, net_devices="all")) as ep:
        t = torch.zeros(nbytes // 4, dtype=torch.int32)
        (r,) = ep.register_tensors([t])
        md, addr = peer_q.get(timeout=STEP_S)
        ep.add_peer("served", md)
        local = ep.prep_local(np.array([[r.addr, nbytes, 0]], dtype=np.uint64))
        remote = ep.prep_remote("served", np.array([[addr, nbytes, 0]], dtype=np.uint64))
        ep.post("READ", local, [0], remote, [0]).wait(timeout_s=STEP_S)
        ok = bool((t == torch.arange(nbytes // 4, dtype=torch.int32)).all())
        done_q.put("done")
        return {"ok": ok}


def serve_region(env: dict, peer_q: Any, done_q: Any, nbytes: int) -> dict:
    """P: register ``nbytes`` of known content, hand its metadata to ``peer_q``, drive progress until done."""
    os.environ.update(env)
    import torch
    from kvgeom_nixl import Endpoint, TransportConfig

    with Endpoint("served", TransportConfig(insecure=True, net_devices="all")) as ep:
        t = torch.arange(nbytes // 4, dtype=torch.int32)
        (r,) = ep.register_tensors([t])
        peer_q.put((ep.metadata(), r.addr))
        end = time.monotonic() + STEP_S
        while time.monotonic() < end:
            ep.notifications()
            try:
                done_q.get_nowait()
                return {"served": True}
            except queue.Empty:
                time.sleep(0.001)
        return {"served": False}


def nixl_etcd_exchange(endpoint: str, namespace: str, forged_key_writer: Any = None) -> dict:
    """NIXL's own etcd exchange (``NIXL_ETCD_ENDPOINTS``): A publishes, B fetches; then A's key is
    overwritten with the metadata of another agent (M) and B fetches A again. Returns what B loaded."""
    os.environ["NIXL_ETCD_ENDPOINTS"] = endpoint
    os.environ["NIXL_ETCD_NAMESPACE"] = namespace
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    def agent(name: str) -> Any:
        a = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        t = torch.arange(1024, dtype=torch.int32)
        a.register_memory(a.get_reg_descs([t]))
        a._keep = t
        return a

    def wait(cond: Any, bound: float = 10.0) -> float:
        t0 = time.monotonic()
        while not cond() and time.monotonic() - t0 < bound:
            time.sleep(0.01)
        return time.monotonic() - t0

    a, b, m = agent("agent-a"), agent("agent-b"), agent("agent-m")
    a.send_local_metadata()
    b.fetch_remote_metadata("agent-a")
    fetch_s = wait(lambda: b.check_remote_metadata("agent-a"))
    loaded_a = b.check_remote_metadata("agent-a")
    b.remove_remote_agent("agent-a")
    # anyone who can write etcd replaces A's metadata with M's: B asks for A again
    from kvgeom_nixl.discovery import EtcdClient

    EtcdClient([endpoint]).put(f"{namespace}/agent-a/metadata", m.get_agent_metadata())
    b.fetch_remote_metadata("agent-a")
    forged_s = wait(lambda: b.check_remote_metadata("agent-m"), 5.0)
    return {
        "loaded_a": loaded_a,
        "fetch_s": fetch_s,
        "loaded_m_when_asking_for_a": b.check_remote_metadata("agent-m"),
        "forged_s": forged_s,
    }
