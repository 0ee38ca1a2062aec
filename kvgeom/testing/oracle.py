"""The byte oracle (docs/vllm-behaviour.md Part D): execute a request's transfer on tagged byte arrays
and check I1-I6.

Every byte of every rank's regions carries an ``int64`` *tag* (:mod:`kvgeom.testing._coords`):

* on P, a byte of the request's blocks holds the tag of its logical coordinate; every other P byte
  (neighbours' blocks, page padding) a *location* tag naming itself, so a read from the wrong place
  is caught, not just a missing one;
* on D, the request's destination blocks start as ``POISON`` (those holding only tokens D computes
  itself, in the N-1 flow, as ``ZERO``: the engine zeroed them when it allocated them); every other D
  byte holds its own location tag, so any change outside the request is caught.

The expected D content comes from :mod:`kvgeom.testing._layout`, an independent per-element model of
the layout (never the planner's address arithmetic). Moves are executed as plain copies, then the
consumer's post-receive step (regroup, then zero ranges), then :meth:`Oracle.report` checks:

* **I1** every D byte outside the request's blocks is unchanged;
* **I2** every written content byte holds the coordinate D's layout expects; descriptor pairs have equal
  lengths;
* **I3** every needed byte (tokens in ``[prefix tokens, prefill tokens)``: those P computed and D has not,
  and the whole SSM state) holds it;
* **I4** every other content byte of the destination blocks holds its coordinate or ``ZERO``;
* **I5** no content byte is written twice with different tags (padding may take any bytes);
* **I6** every move, zero range and regroup lies inside its region (and every descriptor id inside its table).

``run_pull`` / ``run_push`` plan a request with kvgeom for every rank and run it; ``check_moves``
checks arbitrary moves (a connector's, e.g. recorded with :mod:`kvgeom.testing.nixl_double`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvgeom.layout.engine import EngineConfig
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.pairing import Pairing
from kvgeom.plan.receive import receive_step
from kvgeom.plan.request import plan_request
from kvgeom.plan.requestplan import Regroup
from kvgeom.testing._coords import POISON, ZERO
from kvgeom.testing._oracle import Oracle, RankPlan
from kvgeom.testing._report import Report
from kvgeom.testing._request import Request, RequestError, engine_geometries

__all__ = [
    "Request",
    "RequestError",
    "Oracle",
    "RankPlan",
    "engine_geometries",
    "pull_plans",
    "push_plans",
    "run",
    "run_plans",
    "run_pull",
    "run_push",
    "check_moves",
    "POISON",
    "ZERO",
]


# -- planning every rank with kvgeom -----------------------------------------------------------------
def _prefix_caching(request: Request, prefix_caching: bool | None) -> bool:
    return request.prefix_blocks > 0 if prefix_caching is None else prefix_caching


def _told(
    request: Request, tell_num_tokens: bool, tell_prefill_tokens: bool | None
) -> tuple[int | None, int | None]:
    """The token counts a planner is told: ``num_tokens`` and ``prefill_tokens`` (the latter, by default,
    when the former is)."""
    tell_p = tell_num_tokens if tell_prefill_tokens is None else tell_prefill_tokens
    return (request.num_tokens if tell_num_tokens else None), (request.p_tokens if tell_p else None)


def _plans(
    mode: str,
    model: ModelSpec,
    p_engine: EngineConfig,
    d_engine: EngineConfig,
    request: Request,
    compat: str,
    prefix_caching: bool | None,
    tell_num_tokens: bool,
    tell_prefill_tokens: bool | None = None,
) -> list[RankPlan]:
    """Every local rank (D in pull, P in push) paired with each pipeline stage of the other engine (one
    pairing per stage), and its plan."""
    p_geoms, d_geoms = engine_geometries(model, p_engine), engine_geometries(model, d_engine)
    local, remote = (d_geoms, p_geoms) if mode == "pull" else (p_geoms, d_geoms)
    remote_tp = (p_engine if mode == "pull" else d_engine).tp_size
    stages = [remote[s : s + remote_tp] for s in range(0, len(remote), remote_tp)]
    local_ids, remote_ids = (
        (request.d_ids, request.p_ids) if mode == "pull" else (request.p_ids, request.d_ids)
    )
    n, computed = _told(request, tell_num_tokens, tell_prefill_tokens)
    out = []
    for geom in local:
        for stage in stages:
            pairing = Pairing.create(geom, stage, mode, compat, _prefix_caching(request, prefix_caching))
            plan = plan_request(pairing, local_ids, remote_ids, num_tokens=n, prefill_tokens=computed)
            out.append(RankPlan(geom.global_rank, pairing, plan))
    return out


def pull_plans(
    model: ModelSpec,
    p_engine: EngineConfig,
    d_engine: EngineConfig,
    request: Request,
    compat: str = "kvgeom",
    prefix_caching: bool | None = None,
    *,
    tell_num_tokens: bool = True,
    tell_prefill_tokens: bool | None = None,
) -> list[RankPlan]:
    """Every D rank paired with the P ranks (pull) and its plan for ``request``. The pairs are made with
    ``prefix_caching`` (default: whether the request has a prefix hit); the planner is told the request's
    ``num_tokens`` unless ``tell_num_tokens`` is false, and its ``prefill_tokens`` unless
    ``tell_prefill_tokens`` (default: ``tell_num_tokens``) is false."""
    return _plans(
        "pull",
        model,
        p_engine,
        d_engine,
        request,
        compat,
        prefix_caching,
        tell_num_tokens,
        tell_prefill_tokens,
    )


def push_plans(
    model: ModelSpec,
    p_engine: EngineConfig,
    d_engine: EngineConfig,
    request: Request,
    compat: str = "kvgeom",
    prefix_caching: bool | None = None,
    *,
    tell_num_tokens: bool = True,
    tell_prefill_tokens: bool | None = None,
) -> list[RankPlan]:
    """Every P rank paired with the D ranks (push) and its plan for ``request`` (options as in
    :func:`pull_plans`)."""
    return _plans(
        "push",
        model,
        p_engine,
        d_engine,
        request,
        compat,
        prefix_caching,
        tell_num_tokens,
        tell_prefill_tokens,
    )


def run_plans(
    model: ModelSpec,
    p_engine: EngineConfig,
    d_engine: EngineConfig,
    request: Request,
    plans: Sequence[RankPlan],
    oracle: Oracle | None = None,
    *,
    tell_num_tokens: bool = True,
    tell_prefill_tokens: bool | None = None,
) -> Report:
    """Execute ``plans`` (from :func:`pull_plans` or :func:`push_plans`, possibly altered) and check them.
    After push plans every D rank runs kvgeom's :func:`~kvgeom.plan.receive.receive_step` (told the token counts
    as in :func:`pull_plans`, and the pairs' ``prefix_caching``)."""
    oracle = oracle or Oracle.for_engines(model, p_engine, d_engine, request)
    for rp in plans:
        oracle.run_plan(rp)
    if plans and plans[0].plan.mode == "push":
        n, computed = _told(request, tell_num_tokens, tell_prefill_tokens)
        caching = plans[0].pairing.prefix_caching
        for d in oracle.d:
            regroups, zero = receive_step(d, oracle.p[0], request.d_ids, request.p_ids, n, caching, computed)
            oracle.receive(d.global_rank, regroups, zero, f"push receive step of D rank {d.global_rank}")
    return oracle.report()


def run(
    model: ModelSpec,
    p_engine: EngineConfig,
    d_engine: EngineConfig,
    request: Request,
    mode: str = "pull",
    compat: str = "kvgeom",
    prefix_caching: bool | None = None,
    *,
    tell_num_tokens: bool = True,
    tell_prefill_tokens: bool | None = None,
) -> Report:
    """Plan ``request`` with kvgeom on every local rank (D in pull, P in push), execute the plans and the
    D ranks' post-receive steps, and check I1-I6. A pair or request kvgeom refuses raises its
    :class:`~kvgeom.errors.KvgeomError`. Options as in :func:`pull_plans`."""
    if mode not in ("pull", "push"):
        raise RequestError("mode", f"must be 'pull' or 'push', got {mode!r}", value=mode)
    oracle = Oracle.for_engines(model, p_engine, d_engine, request)  # checks the request first
    make = pull_plans if mode == "pull" else push_plans
    plans = make(
        model,
        p_engine,
        d_engine,
        request,
        compat,
        prefix_caching,
        tell_num_tokens=tell_num_tokens,
        tell_prefill_tokens=tell_prefill_tokens,
    )
    return run_plans(
        model,
        p_engine,
        d_engine,
        request,
        plans,
        oracle,
        tell_num_tokens=tell_num_tokens,
        tell_prefill_tokens=tell_prefill_tokens,
    )


def run_pull(
    model: ModelSpec,
    p_engine: EngineConfig,
    d_engine: EngineConfig,
    request: Request,
    compat: str = "kvgeom",
    prefix_caching: bool | None = None,
    *,
    tell_num_tokens: bool = True,
    tell_prefill_tokens: bool | None = None,
) -> Report:
    """:func:`run` in pull mode: every D rank plans its reads, executes them, regroups and zeroes."""
    return run(
        model,
        p_engine,
        d_engine,
        request,
        "pull",
        compat,
        prefix_caching,
        tell_num_tokens=tell_num_tokens,
        tell_prefill_tokens=tell_prefill_tokens,
    )


def run_push(
    model: ModelSpec,
    p_engine: EngineConfig,
    d_engine: EngineConfig,
    request: Request,
    compat: str = "kvgeom",
    prefix_caching: bool | None = None,
    *,
    tell_num_tokens: bool = True,
    tell_prefill_tokens: bool | None = None,
) -> Report:
    """:func:`run` in push mode: every P rank plans its writes; then every D rank's receive step."""
    return run(
        model,
        p_engine,
        d_engine,
        request,
        "push",
        compat,
        prefix_caching,
        tell_num_tokens=tell_num_tokens,
        tell_prefill_tokens=tell_prefill_tokens,
    )


def check_moves(
    model: ModelSpec,
    p_engine: EngineConfig,
    d_engine: EngineConfig,
    request: Request,
    moves: np.ndarray,
    zero: Mapping[int, np.ndarray] | None = None,
    regroup: Mapping[int, Sequence[Regroup]] | None = None,
) -> Report:
    """Check arbitrary moves (e.g. a connector's, recorded with the NIXL double) for ``request``:
    execute ``moves``, then per D rank its ``regroup`` steps and ``zero`` ranges, and check I1-I6."""
    oracle = Oracle.for_engines(model, p_engine, d_engine, request)
    oracle.execute(moves, "move")
    for rank in range(len(oracle.d)):
        oracle.receive(
            rank,
            (regroup or {}).get(rank, ()),
            (zero or {}).get(rank, np.zeros((0, 3), np.int64)),
            f"D rank {rank}",
        )
    return oracle.report()
