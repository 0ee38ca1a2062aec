"""Side-channel flood scenarios (issue 22), each one function that runs a whole cluster
(:func:`~kvgeom_lab.cluster.run_cluster`: real NIXL, separate processes, every byte of D checked) and returns
a :class:`FloodRun`. Shared by the regression tests (``tests/adapter/test_fencing.py``) and the fault
matrix's bench (``bench/quarantine_faults.py``), so that the rows in docs/reliability.md are the tests' own
scenarios.

* :func:`live_producer_flood`: push; ``prefill`` alive (its side channel answering) but busy past the
  timeout, so its WRITE of r1 lands late, while a process without the secret holds connections to
  ``prefill``'s side channels. r1 fails; its blocks must stay held until the late ``W`` notices (before
  issue 22, D's probes read the flood's resets as death and handed the blocks to r2).
* :func:`legit_requests_under_flood`: pull or push; no fault but the flood: a process without the secret
  holds more connections than the server keeps unauthenticated (so it keeps evicting), plus slow drips, on
  the side channel that each attempt's freshness check asks (the producer's in pull, D's in push), while
  ``n`` requests run. Every one of them must be served.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .cluster import run_cluster
from .demo import DEFAULT_SCENARIO

__all__ = ["T", "CONFIG", "FloodRun", "spec", "result", "live_producer_flood", "legit_requests_under_flood"]

T = 2.5  # transfer / notification timeout of every attempt
CONFIG: dict[str, Any] = {
    "handshake_timeout_s": 3.0,
    "transfer_timeout_s": T,
    "notif_timeout_s": T,
    "secret": "flood-scenarios-secret-0123456789",
}
ENGINES = ["prefill", "backup"]

Key = tuple[str, int]  # (request id, attempt)


@dataclass
class FloodRun:
    """What one run showed: per attempt, whether it was served, its error and time; for the ``faulty``
    attempts (those the scenario makes fail), how long and how many blocks were held and what cleared them;
    D's byte check at the end; the flood process's counters; the raw ``run_cluster`` record."""

    served: list[Key]  # attempts that succeeded, in order
    failed: dict[Key, str]  # attempt -> its first error ("Type: message")
    seconds: dict[Key, float]  # attempt -> its time (to success, or to its typed error)
    faulty: list[Key]
    held_s: dict[Key, float]  # faulty attempt -> from its failure until settle() returned its blocks
    cleared_by: dict[Key, list[str]]
    blocks_held: dict[Key, int]
    reused_while_held: int  # blocks of a faulty attempt handed to an attempt made while it was held
    bad_at_completion: int  # wrong bytes seen in served requests when each completed
    bytes_damaged: int  # wrong bytes anywhere in D at the end
    skipped_bytes: int
    mismatches: list[str]
    stats: dict[str, int]  # D's KVRank.stats
    flood: dict[str, Any]
    out: dict[str, Any] = field(repr=False)

    @property
    def requests_failed(self) -> int:
        """Failed attempts other than the faulty ones: legitimate requests the flood made fail."""
        return sum(1 for k in self.failed if k not in self.faulty)

    @property
    def requests_served(self) -> int:
        return len(self.served)

    def row(self) -> dict[str, Any]:
        """The fault matrix's numbers (JSON-ready)."""
        return {
            "served": self.requests_served,
            "failed": self.requests_failed,
            "failed_errors": sorted(
                {self.failed[k].split(":")[0] for k in self.failed if k not in self.faulty}
            ),
            "outcome": [self.failed.get(k, "ok").split(":")[0] for k in self.faulty],
            "time_to_fail": [round(self.seconds[k], 3) for k in self.faulty],
            "worst_served_s": round(max((self.seconds[k] for k in self.served), default=0.0), 3),
            "held_s": [self.held_s.get(k) for k in self.faulty],
            "cleared_by": [self.cleared_by.get(k) for k in self.faulty],
            "blocks_held": [self.blocks_held[k] for k in self.faulty],
            "reused_while_held": self.reused_while_held,
            "bytes_damaged": self.bytes_damaged,
            "bad_at_completion": self.bad_at_completion,
            "mismatches": len(self.mismatches),
            "flood": self.flood,
            "stats": {
                k: self.stats.get(k)
                for k in ("probes_unknown", "probes_refused", "retired", "retired_blocks")
            },
        }


def spec(mode: str, requests: list[dict], faults: dict, **extra: Any) -> dict[str, Any]:
    """A ``run_cluster`` spec: the demo Mamba2 hybrid (P TP2 -> D TP1), engines ``prefill`` and ``backup``,
    the timeouts above, P's own deadline check off (so that a late WRITE happens), 10 s of drain."""
    return {
        "scenario": dict(DEFAULT_SCENARIO, mode=mode),
        "requests": requests,
        "prefill_engines": ENGINES,
        "config": dict(CONFIG, **extra.pop("config", {})),
        "drain_s": extra.pop("drain_s", 10.0),
        "push_deadline": False,
        "faults": faults,
        **extra,
    }


def result(out: dict[str, Any], faulty: Iterable[Key] = (), during: Iterable[Key] = ()) -> FloodRun:
    """A :class:`FloodRun` from a ``run_cluster`` record. ``faulty``: the attempts the scenario makes fail;
    ``during``: the attempts handed blocks while the faulty ones were held."""
    for name, v in out["results"].items():
        if "traceback" in v:
            raise RuntimeError(f"{name}: {v['error']}\n{v['traceback']}")
    d = out["results"]["decode-0"]
    a = {(x["request_id"], x["attempt"]): x for x in out["attempts"]}
    ids = {k: {b for g in v.get("ids", []) for b in g} for k, v in a.items()}
    settled = {(r, n): (held, list(by)) for _, r, n, held, by in out["settled"]}
    order, during = sorted(set(faulty)), set(during)
    return FloodRun(
        served=[k for k, v in a.items() if v["ok"]],
        failed={k: _error(v) for k, v in a.items() if not v["ok"]},
        seconds={k: float(v.get("seconds", 0.0)) for k, v in a.items()},
        faulty=order,
        held_s={k: settled[k][0] for k in order if k in settled},
        cleared_by={k: settled[k][1] for k in order if k in settled},
        blocks_held={k: len(ids.get(k, ())) for k in order},
        reused_while_held=sum(len(ids[k] & ids[o]) for k in order for o in during if k in ids and o in ids),
        bad_at_completion=sum(int(v.get("bad_at_completion") or 0) for v in a.values()),
        bytes_damaged=int(d["bad_bytes"]),
        skipped_bytes=int(d["skipped_bytes"]),
        mismatches=list(d["mismatches"]),
        stats=dict(d["stats"]),
        flood=_flood_counters(out["results"]),
        out=out,
    )


def _flood_counters(results: dict[str, Any]) -> dict[str, Any]:
    """The flood processes' counters, summed (``processes``: how many there were)."""
    floods = [v for k, v in results.items() if k == "flood" or k.startswith("flood-")]
    total: dict[str, Any] = {"processes": len(floods)}
    for v in floods:
        for k, x in v.items():
            total[k] = total.get(k, 0) + x
    return total


def _error(attempt: dict[str, Any]) -> str:
    errors = attempt.get("errors") or {}
    return str(next(iter(errors.values()), None) or attempt.get("error") or "failed")


def live_producer_flood(
    connections: int = 40, max_connects: int = 60000, processes: int = 1, refuse: bool = False
) -> FloodRun:
    """Issue 22, finding 1 (push). r0 to ``prefill``; r1 to ``prefill``, busy past the timeout (its WRITE
    lands ~3 s late) while the flood holds ``connections`` per side channel of ``prefill`` for ``T + 6`` s,
    from each of ``processes`` processes; r2 to ``backup`` meanwhile (it must not get r1's blocks); r3 to
    ``backup`` after the late WRITE. With ``refuse``, ``prefill``'s side-channel ports also refuse every
    fresh connect from r1 on, while it lives (what a heavy flood did to some connects of a live server:
    docs/reliability.md); D must not read that as its death. ``faulty``: r1's attempt."""
    reqs = [
        {"id": "r0", "tokens": 300, "engine": "prefill"},
        {"id": "r1", "tokens": 900, "engine": "prefill"},
        {"id": "r2", "tokens": 900, "engine": "backup"},
        {"id": "r3", "tokens": 300, "engine": "backup", "delay_s": 5.0},  # past the late WRITE
    ]
    faults = {
        "busy": {"engine": "prefill", "at": "r1", "seconds": T + 3.0, "refuse": refuse},
        "flood": {
            "engine": "prefill",
            "at": "r1",
            "seconds": T + 6.0,
            "connections": connections,
            "max_connects": max_connects,
            "processes": processes,
        },
    }
    out = run_cluster(spec("push", reqs, faults, linger_s=2.0), timeout_s=400)  # stressed: > 150 s
    return result(out, {("r1", 1)}, {("r2", 1)})


def legit_requests_under_flood(
    mode: str,
    n: int = 12,
    connections: int = 700,
    drips: int = 100,
    processes: int = 2,
    max_connects: int = 400_000,
    config: dict[str, Any] | None = None,
    flooded: list[str] | None = None,
) -> FloodRun:
    """Legitimate requests while the side channel their freshness check asks is flooded (issue 22, what
    was left of finding 1). One request to each engine first, unflooded (the handshakes); then ``n`` requests of 300
    tokens to ``prefill`` while a process without the secret holds
    ``connections`` connections per flooded side channel, from each of ``processes`` processes (more than the server's ``max_pending``, 512 by
    default: the server evicts one for each new one, as fast as the flood reconnects; its accept queue
    overflows) and ``drips`` slow drips (one byte every 0.1 s). ``config``: TransportConfig overrides. Pull floods both producers' side channels (D asks them before posting its
    READs); push floods D's (each producer rank asks it before posting its WRITE). No attempt is faulty:
    every failure is one the flood caused. ``flooded``: other engines to flood instead."""
    reqs = [{"id": f"r0-{e}", "tokens": 300, "engine": e} for e in ENGINES]  # the handshakes, unflooded
    reqs += [{"id": f"q{i}", "tokens": 300, "engine": "prefill"} for i in range(n)]
    if flooded is None:
        flooded = ["prefill"] if mode == "pull" else ["decode"]
    faults = {
        "flood": {
            "engine": flooded,
            "at": "q0",
            "seconds": 120.0,  # until the run ends (the scheduler tells it)
            "connections": connections,
            "drips": drips,
            "processes": processes,
            "max_connects": max_connects,
        }
    }
    out = run_cluster(spec(mode, reqs, faults, config=config or {}, drain_s=2.0), timeout_s=420)
    return result(out)
