"""Shared by the pull benchmarks: P and D ranks as processes, a timed post->done pull, copy baselines.

``run_ranks`` starts every P rank and the D rank of a scenario in a :class:`ProcGroup` (``spawn``
processes, one NIXL agent each), hands D the P ranks' side-channel ports and pids, waits for D's
report and then ends the P ranks; every wait is bounded. ``timed_pull`` posts one planned request's
transfers and times them from the first post to the last completion (planning excluded).
``move_index`` turns byte moves into flat word indices for vectorised gather/scatter baselines.

Not a package: the bench scripts import it as a sibling module (``bench/`` is ``sys.path[0]`` when a
script there runs, and ``spawn`` children inherit the parent's ``sys.path``).
"""

from __future__ import annotations

import math
import queue as queue_mod
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a bare checkout (no editable install), e.g. on a lent GPU machine
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from kvgeom_lab.procs import ProcGroup  # noqa: E402

from kvgeom.layout.allocate import rank_geometry  # noqa: E402

STEP_S = 60.0  # bound of one coordination step (a port map arriving, a rank's report)
START_S = 300.0  # bound of the ranks' start (torch and the transport imported; over 60 s on a loaded machine)


# ----------------------------------------------------------------------------------------- sizing
def blocks_needed(model: Any, engine: Any, tokens: int) -> int:
    """Logical blocks one request of ``tokens`` takes on an engine (an :class:`EngineConfig`; attention
    groups: one per block of tokens, SSM groups: one state slot), as ``Scenario.request`` counts them."""
    groups = rank_geometry(model, engine).groups
    return sum(1 if g.is_ssm else math.ceil(tokens / engine.block_size) for g in groups)


def sized(scenario: dict[str, Any], tokens: list[int], slack: float) -> dict[str, Any]:
    """``scenario`` with each engine's ``num_blocks`` raised, if needed, to what ``tokens`` (disjoint
    requests) take times ``slack`` (> 1 leaves free blocks so that shuffled ids scatter)."""
    from kvgeom.tools.scenario import Scenario

    sc = Scenario.from_json(scenario)
    out = dict(scenario)
    for side, eng in (("prefill", sc.prefill), ("decode", sc.decode)):
        need = sum(blocks_needed(sc.model, eng, n) for n in tokens)
        out[side] = dict(scenario[side], num_blocks=max(eng.num_blocks, math.ceil(need * slack)))
    return out


# ----------------------------------------------------------------------------------------- processes
def run_ranks(
    producer: Callable[..., Any],
    consumer: Callable[..., Any],
    spec: dict[str, Any],
    num_p: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Run ``producer(spec, rank, events, inbox)`` for each P rank and ``consumer(spec, events, inbox)``
    for the D rank. Producers put ``("ready", rank, port, pid)`` on ``events`` and serve until ``"exit"``
    arrives in their inbox; the consumer gets ``("ranks", {rank: (port, pid)})`` and returns its report.
    Returns ``{"decode": report, "prefill-<r>": report}``; a failed rank raises with its traceback."""
    deadline = time.monotonic() + timeout_s
    with ProcGroup() as group:
        events = group.queue()
        inboxes = {r: group.queue() for r in range(num_p)}
        d_inbox = group.queue()
        for r in range(num_p):
            group.spawn(producer, (spec, r, events, inboxes[r]), f"prefill-{r}")
        group.spawn(consumer, (spec, events, d_inbox), "decode")
        ranks: dict[int, tuple[int, int]] = {}
        while len(ranks) < num_p:
            kind, rank, port, pid = _next_event(events, min(deadline, time.monotonic() + START_S), group)
            if kind == "ready":
                ranks[rank] = (port, pid)
        d_inbox.put(("ranks", ranks))
        d = group.collect(max(1.0, deadline - time.monotonic()), ["decode"])["decode"]
        for r in range(num_p):
            inboxes[r].put(("exit", None))
        p = group.collect(
            min(STEP_S, max(1.0, deadline - time.monotonic())), [f"prefill-{r}" for r in range(num_p)]
        )
    out = {"decode": d.unwrap()}
    out.update({name: res.unwrap() for name, res in p.items()})
    return out


def _next_event(events: Any, deadline: float, group: ProcGroup) -> tuple:
    while time.monotonic() < deadline:
        try:
            return events.get(timeout=0.1)
        except queue_mod.Empty:
            dead = [n for n, p in group.procs.items() if not p.is_alive()]
            if dead:
                res = group.collect(1.0, dead)
                raise RuntimeError(
                    "rank(s) died before they were ready:\n"
                    + "\n".join(f"{n}: {res[n].error}\n{res[n].traceback or ''}" for n in dead)
                ) from None
    raise TimeoutError("the P ranks were not ready in time")


def wait_ranks(inbox: Any) -> dict[int, tuple[int, int]]:
    """D side: the P ranks' ``{rank: (side-channel port, pid)}``."""
    cmd, data = inbox.get(timeout=START_S)
    if cmd != "ranks":
        raise RuntimeError(f"expected the rank map, got {cmd!r}")
    return {int(r): (int(v[0]), int(v[1])) for r, v in data.items()}


def serve(kv: Any, inbox: Any, poll_s: float, limit_s: float) -> int:
    """P side: keep NIXL progressing (the target polls its notifications when the progress thread is
    off) until ``"exit"`` arrives or ``limit_s`` passed. Returns the number of notifications seen."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        kv.ep.notifications()
        try:
            cmd, _ = inbox.get_nowait()
        except queue_mod.Empty:
            if poll_s:
                time.sleep(poll_s)
            continue
        if cmd == "exit":
            break
    return sum(sum(c.values()) for c in kv.ep.notifications().values())


# ----------------------------------------------------------------------------------------- NIXL pull
class LocalTables:
    """Our prepared local tables, one per plan key, prepared on first use (as KVRank does)."""

    def __init__(self, kv: Any, engine_id: str) -> None:
        self.kv, self.engine_id, self._prepped = kv, engine_id, {}

    def __getitem__(self, key: tuple[int, int]) -> Any:
        if key not in self._prepped:
            kv = self.kv
            rows = (
                kv.pairings[self.engine_id]
                .local_table(key)
                .bind_strided([r.addr for r in kv.regions], kv.regions[0].device_id)
            )
            self._prepped[key] = kv.ep.prep_local(rows, kv.mem_type)
        return self._prepped[key]


def timed_pull(
    kv: Any,
    engine_id: str,
    plan: Any,
    tables: LocalTables,
    timeout_s: float,
    sync: Callable[[], None] | None = None,
) -> tuple[float, list[Any]]:
    """Post every transfer of ``plan`` (one per source rank, as KVRank does: a READ carries no
    notification, the producers learn of completion from notices sent afterwards, not timed here) and
    wait for all; returns (seconds from the first post to the last completion, per-transfer Telemetry).
    ``make_prepped_xfer`` is inside the timed span (NIXL's per-request cost)."""
    links = kv.links[engine_id]
    deadline = time.monotonic() + timeout_s
    if sync:
        sync()
    t0 = time.perf_counter()
    posted = [
        kv.ep.post(plan.op, tables[t.local_table], t.local_ids, links[t.remote_rank].prepped, t.remote_ids)
        for t in plan.transfers
    ]
    tels = [x.wait(deadline) for x in posted]
    if sync:
        sync()
    return time.perf_counter() - t0, tels


# ----------------------------------------------------------------------------------------- helpers
def median_time(fn: Callable[[], Any], reps: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall seconds of ``fn()`` over ``reps`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def word_size(moves: np.ndarray, sizes: list[int]) -> int:
    """The largest of 8, 4, 2, 1 bytes dividing every offset and length of ``moves`` and every buffer
    size: the unit in which a gather/scatter of these moves can be indexed."""
    vals = np.concatenate([moves[:, 2], moves[:, 5], moves[:, 6], np.asarray(sizes, dtype=np.int64)])
    g = int(np.gcd.reduce(vals)) if vals.size else 1
    return next(w for w in (8, 4, 2, 1) if g % w == 0)


def move_index(starts: np.ndarray, lengths: np.ndarray, w: int) -> np.ndarray:
    """Flat int64 word indices of byte ranges ``[start, start + length)`` (all multiples of ``w``)."""
    s, n = starts // w, lengths // w
    total = int(n.sum())
    first = np.cumsum(n) - n
    return np.repeat(s - first, n) + np.arange(total, dtype=np.int64)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")
