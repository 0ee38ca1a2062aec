"""Cross-host runs: P and D engines on separate hosts of a :class:`~kvgeom_lab.netns.VirtualNet`, found
through the side channel or through etcd, moving bytes over UCX's TCP transport, with the network faults
of docs/deployment.md. Shared by the cross-host tests and ``bench/bench_hosts.py``.

A :class:`Lab` is four hosts: ``p`` (engine ``prefill``), ``b`` (engine ``backup``: serves requests while
``prefill`` is cut off), ``d`` (engine ``decode``) and ``e`` (an etcd member, started when the lab uses
etcd). Every rank runs with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=kvh0`` (without them UCX moves the
bytes between namespaces of one machine with CMA, see :mod:`kvgeom_lab.ucxinfo`) and, if asked, writes
UCX's protocol report to a log per rank.

:data:`FAULTS` builds each fault scenario: its requests, its fault entries for ``run_cluster`` and what
must be set up; :func:`summarize` turns a run into the fault table's row.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from .cluster import run_cluster
from .demo import DEFAULT_SCENARIO
from .netns import DEVICE, EtcdServer, VirtualNet

__all__ = ["Lab", "FAULTS", "ENGINE_HOSTS", "summarize", "ucx_env"]

ENGINE_HOSTS = {"prefill": "p", "backup": "b", "decode": "d"}
SLOW_MBIT = 15.0  # the cut scenarios slow ``p``'s link so that the cut lands while bytes are moving (r1's
# 1.4 MB take ~0.75 s: the cut, 0.15 s after the post, lands mid-transfer even on a busy machine)
IMPAIRED_MBIT = 16.0  # the delay-and-loss scenario's rate cap: its 6 MiB request cannot make 2.5 s (with
# delay and loss alone, one of three did: TCP's BBR keeps its rate through 5 % loss)


def ucx_env(log: str | None = None, tcp: bool = True) -> dict[str, str]:
    """UCX's environment for a rank: TCP on the host's interface; its protocol report to ``log`` if given
    (``%p`` is replaced by the pid)."""
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": DEVICE} if tcp else {}
    if log:
        env.update(UCX_PROTO_INFO="y", UCX_LOG_FILE=log)
    return env


class Lab:
    """Hosts ``p``, ``b``, ``d``, ``e`` (see the module docstring); with ``etcd``, an etcd member on ``e``."""

    def __init__(
        self,
        etcd: bool = False,
        *,
        impairable: bool = True,
        proto_logs: bool = False,
        prefix: str = "/kvgeom-lab",
    ) -> None:
        self.net = VirtualNet(["p", "b", "d", "e"], impairable=impairable)
        self.proto_logs = proto_logs
        self.prefix = prefix
        self.etcd: EtcdServer | None = None
        try:
            if etcd:
                self.etcd = EtcdServer(self.net, "e").start()
        except BaseException:
            self.net.close()
            raise

    def log_pattern(self, engine: str) -> str:
        """Where the UCX protocol reports of ``engine``'s ranks go (a glob)."""
        return os.path.join(self.net.workdir, f"ucx-{engine}.*.log")

    def hosts(self) -> dict[str, dict[str, Any]]:
        out = {}
        for engine, h in ENGINE_HOSTS.items():
            log = os.path.join(self.net.workdir, f"ucx-{engine}.%p.log") if self.proto_logs else None
            out[engine] = {"netns": self.net[h].netns, "host": self.net[h].addr, "env": ucx_env(log)}
        return out

    def config(self, timeout_s: float, **extra: Any) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "handshake_timeout_s": 3.0,
            "transfer_timeout_s": timeout_s,
            "notif_timeout_s": timeout_s,
            "secret": "kvgeom-hosts-lab-secret-0123456789",
        }
        if self.etcd is not None:
            cfg.update(
                discovery="etcd",
                etcd_endpoints=[self.etcd.endpoint],
                etcd_prefix=self.prefix,
                etcd_timeout_s=1.0,
                etcd_lease_ttl_s=3.0,
            )
        cfg.update(extra)
        return cfg

    def spec(self, mode: str, requests: list[dict], timeout_s: float = 10.0, **extra: Any) -> dict[str, Any]:
        """A ``run_cluster`` spec: the demo Mamba2 hybrid (P TP2, 32-token blocks -> D TP1, 64-token blocks),
        engines ``prefill`` and ``backup`` on their hosts, D on ``d``."""
        spec = {
            "scenario": dict(DEFAULT_SCENARIO, mode=mode),
            "requests": requests,
            "hosts": self.hosts(),
            "prefill_engines": ["prefill", "backup"],
            "config": self.config(timeout_s),
            "drain_s": 15.0,
        }
        spec.update(extra)
        return spec

    def actions(self) -> dict[str, Callable[[], Any]]:
        """The fault actions ``run_cluster`` may run (by name)."""
        net = self.net
        acts: dict[str, Callable[[], Any]] = {
            "cut_p": lambda: net.link_down("p"),
            "mend_p": lambda: net.link_up("p"),
            "impair_p": lambda: net.netem("p", delay_ms=100, loss_pct=5, rate_mbit=IMPAIRED_MBIT),
            "clear_p": lambda: net.clear_netem("p"),
            "readdress_p": lambda: net.readdress("p"),
        }
        if self.etcd is not None:
            etcd = self.etcd
            acts.update(
                etcd_stop=lambda: etcd.stop(signal.SIGKILL),
                etcd_start=lambda: etcd.start(),
                etcd_wipe_start=lambda: etcd.start(wipe=True),
            )
        return acts

    def run(self, spec: dict[str, Any], timeout_s: float = 150.0) -> dict[str, Any]:
        t0 = time.monotonic()
        out = run_cluster(spec, timeout_s=timeout_s, actions=self.actions())
        out["elapsed_s"] = time.monotonic() - t0
        return out

    def close(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()
        self.net.close()

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------- faults
def _req(rid: str, tokens: int, engine: str, **kw: Any) -> dict[str, Any]:
    return {"id": rid, "tokens": tokens, "engine": engine, **kw}


def link_cut(lab: Lab, mode: str, t: float) -> dict[str, Any]:
    """``p``'s cable pulled 0.15 s after D starts r1 (its bytes are moving: ``p``'s link is slowed to
    ``SLOW_MBIT``), plugged back ``t + 2`` s later. ``backup`` serves r2 and r1's retry meanwhile; r3 goes to
    ``prefill`` once the link is back."""
    lab.net.netem("p", rate_mbit=SLOW_MBIT)
    reqs = [
        _req("r0", 900, "prefill"),
        _req("r1", 900, "prefill"),
        _req("r2", 900, "backup"),
        _req("r1", 900, "backup"),
        _req("r3", 600, "prefill", delay_s=t + 2.5),
    ]
    faults = {
        "net": [
            {
                "at": "r1",
                "when": "after_post",
                "delay_s": 0.15,
                "do": "cut_p",
                "undo": "mend_p",
                "seconds": t + 2.0,
            }
        ]
    }
    return lab.spec(mode, reqs, t, faults=faults, retries=0, linger_s=t + 3.0, push_deadline=False)


def impaired(lab: Lab, mode: str, t: float) -> dict[str, Any]:
    """``p`` sends with 100 ms of delay, 5 % loss and at most 16 Mbit/s (netem) from r1 on: a small request
    (r1, 150 KB) still makes it, a large one (r2, 6 MiB) misses its deadline; ``backup`` serves r3; the
    impairment is lifted ``t + 3`` s after r1 started, and r4 goes to ``prefill`` after that."""
    reqs = [
        _req("r0", 900, "prefill"),
        _req("r1", 97, "prefill"),
        _req("r2", 4096, "prefill"),
        _req("r3", 900, "backup"),
        _req("r4", 600, "prefill", delay_s=t + 2.0),
    ]
    faults = {
        "net": [{"at": "r1", "when": "before", "do": "impair_p", "undo": "clear_p", "seconds": t + 3.0}]
    }
    return lab.spec(mode, reqs, t, faults=faults, linger_s=t + 3.0, push_deadline=False)


def readdress(lab: Lab, mode: str, t: float) -> dict[str, Any]:
    """After r0, ``p``'s address changes and ``prefill``'s ranks rebind to the new one (new NIXL agents,
    new side channels, a higher generation). r1 is tried up to three times, then r2."""
    reqs = [
        _req("r0", 900, "prefill"),
        _req("r1", 900, "prefill"),
        _req("r1", 900, "prefill"),
        _req("r1", 900, "prefill"),
        _req("r2", 600, "prefill"),
    ]
    faults = {"readdress": {"engine": "prefill", "after": "r0", "action": "readdress_p"}}
    return lab.spec(mode, reqs, t, faults=faults)


def etcd_restart(lab: Lab, mode: str, t: float) -> dict[str, Any]:
    """etcd is killed as r2 (the first request to ``backup``) is sent and comes back 6 s later without its
    data. r2 needs a handshake through etcd; r3 goes to ``prefill``, already connected; r2 is retried
    once etcd is back; then r4."""
    reqs = [
        _req("r0", 900, "prefill"),
        _req("r1", 900, "prefill"),
        _req("r2", 900, "backup"),
        _req("r3", 600, "prefill"),
        _req("r2", 900, "backup", delay_s=4.0),
        _req("r4", 600, "prefill"),
    ]
    faults = {
        "net": [{"at": "r2", "when": "before", "do": "etcd_stop", "undo": "etcd_wipe_start", "seconds": 6.0}]
    }
    return lab.spec(mode, reqs, t, faults=faults)


FAULTS: dict[str, Callable[[Lab, str, float], dict[str, Any]]] = {
    "link_cut": link_cut,
    "impaired": impaired,
    "readdress": readdress,
    "etcd_restart": etcd_restart,
}


# ------------------------------------------------------------------------------------------- outcome
def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """What a fault table row needs: every attempt (ok, error type, seconds), the quarantine of each failed
    one (how long, cleared by what), D's verification (bytes checked, bad bytes at the end and at each
    request's completion), and the ranks' errors."""
    attempts = []
    for a in out["attempts"]:
        err = next(iter((a.get("errors") or {}).values()), None)
        attempts.append(
            {
                "request": a["request_id"],
                "attempt": a["attempt"],
                "ok": a["ok"],
                "error": err.split(":")[0] if err else None,
                "message": err,
                "seconds": round(float(a.get("seconds", 0.0)), 3),
                "engine": a.get("engine"),
                "t_sent": a.get("t_sent"),
                "ids": sorted(b for g in a.get("ids", []) for b in g),
            }
        )
    settled = {
        (rid, att): {"held_s": round(held, 3), "cleared_by": list(by)}
        for _, rid, att, held, by in out["settled"]
    }
    d = out["results"].get("decode-0", {})
    crashed = {k: v.get("error") for k, v in out["results"].items() if "traceback" in v}
    return {
        "attempts": attempts,
        "settled": settled,
        "reclaimed_at": {(rid, att): t for rid, att, t in out.get("reclaimed", [])},
        "crashed": crashed,
        "checked_bytes": d.get("checked_bytes", 0),
        "bad_bytes": d.get("bad_bytes"),
        "bad_at_completion": sum(int(a.get("bad_at_completion") or 0) for a in out["attempts"]),
        "mismatches": d.get("mismatches"),
        "held_at_end": d.get("held"),
        "stats": d.get("stats", {}),
        "handles": d.get("handles", {}),
        "elapsed_s": round(out.get("elapsed_s", 0.0), 1),
        "actions": [(name, str(res)) for _, name, res in out.get("actions", [])],
    }
