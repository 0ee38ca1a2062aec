"""Hypothesis strategies of models, P/D engine pairs and requests, for property-testing transfer plans.

Every strategy shrinks towards small, plain examples (one dense attention layer, TP1, small blocks):
choices are ``sampled_from`` lists in order of simplicity and small integers are drawn first.

* :func:`model_specs` -- dense attention (optionally with sliding-window layers), MLA, and hybrids of
  attention or MLA with Mamba1 / Mamba2 / GDN / KDA layers, or SSM-only models; head counts include
  fewer KV heads than ranks; several dtypes; on request (``families=("csa-linear",)``,
  :func:`csa_linear_models`) CSA-linear models: MLA layers with a ring overlaid, a sharded SSM state and
  a TP-replicated state page on their tensors;
* :func:`engine_configs` -- one engine for a model (TP size, logical and kernel block sizes, pool size,
  layouts); a hybrid's block size comes from :func:`~kvgeom.layout.geometry.align_hybrid_block_size`, so the
  attention page holds the SSM state (TP-dependent, as in vLLM);
* :func:`pd_pairs` -- a :class:`PDPair` (model, P engine, D engine, mode, compat) that
  :meth:`~kvgeom.plan.pairing.Pairing.create` accepts on every local rank (MLA models, with or without SSM
  layers, sometimes with decode context parallelism on either side; models without SSM state sometimes in pipeline stages; pure MLA
  models sometimes with packed block-outermost rows);
* :func:`requests` -- a :class:`~kvgeom.testing.oracle.Request` for a pair: token count, sparse and
  shuffled block ids, prefix hits on D;
* :func:`cases` -- a :class:`Case` (pair + request); ``case.run()`` returns the oracle's report.

Example::

    from hypothesis import given
    from kvgeom.testing import strategies as kst

    @given(kst.cases(mode="pull"))
    def test_pull_plans_are_correct(case):
        assert case.run().ok
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, cast

from hypothesis import assume, event
from hypothesis import strategies as st

from kvgeom.errors import KvgeomError
from kvgeom.layout.engine import ConvLayout, EngineConfig, KVLayout
from kvgeom.model.layers import (
    AttentionSpec,
    MLASpec,
    ReplicatedStateSpec,
)
from kvgeom.model.spec import ModelSpec
from kvgeom.modes import policy_of
from kvgeom.plan.exchange import prefill_tokens
from kvgeom.testing._modelgen import (
    TP_SIZES,
    _block_size,
    _divisors,
    _engine,
    _group_count,
    attention_specs,
    csa_linear_models,
    engine_configs,
    mla_specs,
    model_specs,
    ssm_specs,
    valid_tp_sizes,
)
from kvgeom.testing._pairs import PDPair, _permutable, check_geometries, plannable_class
from kvgeom.testing._report import Report
from kvgeom.testing.oracle import Request, engine_geometries

__all__ = [
    "TP_SIZES",
    "PDPair",
    "Case",
    "attention_specs",
    "mla_specs",
    "ssm_specs",
    "model_specs",
    "csa_linear_models",
    "valid_tp_sizes",
    "engine_configs",
    "pd_pairs",
    "check_geometries",
    "one_sided_windows",
    "plannable_class",
    "requests",
    "cases",
]

MODES = ("pull", "push")
COMPATS = ("kvgeom", "vllm")


@st.composite
def pd_pairs(
    draw: st.DrawFn,
    mode: str | None = None,
    compat: str | None = None,
    models: st.SearchStrategy[ModelSpec] | None = None,
    equal_blocks: bool = False,
    pipeline: bool = True,
) -> PDPair:
    """A P/D pair kvgeom accepts. Choices are steered towards pairs kvgeom can plan (the local kernel
    block, D's in pull and P's in push, a multiple of the remote one; head-major layouts when TP splits
    heads in vllm mode; DS conv layouts across TP sizes; no prefix caching for Mamba hybrids whose kernel blocks per
    logical block differ); a pair kvgeom still refuses is rejected (``assume``). ``equal_blocks``: P and
    D use the same logical block size (for a hybrid, a common multiple of both aligned sizes); kernel
    blocks may still differ. ``pipeline=False``: no engine in pipeline stages (for a connector that runs one
    stage per engine)."""
    model = draw(models if models is not None else model_specs())
    mode = mode or draw(st.sampled_from(MODES))
    compat = compat or draw(st.sampled_from(COMPATS))
    tps = valid_tp_sizes(model)
    p_tp, d_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
    p_block, d_block, p_kernel, d_kernel = _draw_blocks(draw, model, mode, p_tp, d_tp, equal_blocks)
    layout, kv_split, conv = _draw_layouts(draw, model, compat, p_tp, d_tp)
    groups = _group_count(model)
    p_nb, d_nb = (draw(st.integers(groups + 1, 3 * groups + 6)) for _ in range(2))
    p_dcp, d_dcp, d_block, d_kernel = _draw_dcp(
        draw, model, (p_tp, d_tp), (p_block, p_kernel), (d_block, d_kernel)
    )
    p_pp, d_pp = _draw_stages(draw, model, mode, compat, pipeline and p_dcp == d_dcp == 1)
    p_packed, d_packed = _draw_packed(draw, model, kv_split)
    p_conv = d_conv = conv
    if model.has_ssm and draw(st.integers(0, 7)) == 0:  # mixed conv layouts (equal or unequal TP): refused
        p_conv, d_conv = draw(
            st.sampled_from(((ConvLayout.DS, ConvLayout.SD), (ConvLayout.SD, ConvLayout.DS)))
        )
    p = _engine(model, p_tp, p_block, p_kernel, p_nb, layout, kv_split, p_conv, p_dcp, p_pp, p_packed)
    d = _engine(model, d_tp, d_block, d_kernel, d_nb, layout, kv_split, d_conv, d_dcp, d_pp, d_packed)
    d = _draw_separate_group(draw, model, mode, p, d, equal_blocks)
    p, d = _draw_permute(draw, model, mode, compat, p, d)
    prefix_caching = False if model.has_ssm and p.ppl != d.ppl else draw(st.booleans())
    return _accepted(PDPair(model, p, d, mode, compat, prefix_caching))


def _draw_blocks(
    draw: st.DrawFn, model: ModelSpec, mode: str, p_tp: int, d_tp: int, equal_blocks: bool
) -> tuple[int, int, int, int]:
    """P's and D's logical and kernel block sizes ``(p_block, d_block, p_kernel, d_kernel)``: the local
    kernel block a multiple of the remote one where the sizes allow; a CSA-linear model's pages alike."""
    p_block, d_block = draw(_block_size(model, p_tp)), draw(_block_size(model, d_tp))
    if equal_blocks:
        p_block = d_block = math.lcm(p_block, d_block)
    local_block, remote_block = (d_block, p_block) if mode == "pull" else (p_block, d_block)
    usable = [k for k in _divisors(remote_block) if any(x % k == 0 for x in _divisors(local_block))]
    remote_kernel = draw(st.sampled_from(usable or _divisors(remote_block)))
    fitting = [k for k in _divisors(local_block) if k % remote_kernel == 0]
    local_kernel = draw(st.sampled_from(fitting or _divisors(local_block)))
    p_kernel, d_kernel = (remote_kernel, local_kernel) if mode == "pull" else (local_kernel, remote_kernel)
    if (
        model.is_csa_linear
    ):  # equal page geometry (a ring is not cut by token); ppl dividing the replicated page
        p_block = d_block = math.lcm(p_block, d_block)
        ple = max(la.spec.state_bytes(1) for la in model.layers if isinstance(la.spec, ReplicatedStateSpec))
        ppl = draw(st.sampled_from([q for q in (1, 2, 4) if p_block % q == 0 and ple % q == 0]))
        p_kernel = d_kernel = p_block // ppl
    return p_block, d_block, p_kernel, d_kernel


def _draw_layouts(
    draw: st.DrawFn, model: ModelSpec, compat: str, p_tp: int, d_tp: int
) -> tuple[KVLayout, bool, ConvLayout]:
    """Both engines' KV layout, ``kv_split`` and conv layout (before the mixed and permuted variants)."""
    attn = model.attention_spec
    head_split = attn is not None and attn.heads_per_rank(p_tp) != attn.heads_per_rank(d_tp)
    # vllm mode needs head-major pages when TP splits heads; kvgeom mode cuts token-major pages per token
    layout = (
        KVLayout.HEAD_MAJOR
        if head_split and policy_of(compat).engine_refusals
        else draw(st.sampled_from((KVLayout.HEAD_MAJOR, KVLayout.TOKEN_MAJOR)))
    )
    single_attention = not model.has_ssm and not model.is_mla and _group_count(model) == 1
    kv_split = draw(st.booleans()) if single_attention else False
    conv = (
        draw(st.sampled_from((ConvLayout.DS, ConvLayout.SD)))
        if model.has_ssm and p_tp == d_tp
        else ConvLayout.DS
    )
    return layout, kv_split, conv


def _draw_dcp(
    draw: st.DrawFn,
    model: ModelSpec,
    tps: tuple[int, int],
    p_sizes: tuple[int, int],
    d_sizes: tuple[int, int],
) -> tuple[int, int, int, int]:
    """Decode context parallelism on either side, sometimes (MLA models only): ``(p_dcp, d_dcp, d_block,
    d_kernel)``, D's block sizes made P's for some DCP pairs."""
    (p_tp, d_tp), (d_block, d_kernel) = tps, d_sizes
    p_dcp = d_dcp = 1
    mla_only = all(isinstance(la.spec, MLASpec) for la in model.layers if not la.kind.is_ssm)
    if model.is_mla and mla_only and draw(st.integers(0, 2)) == 0:
        # decode context parallelism: pages of a request sharded over the ranks (a hybrid: equal DCP sizes)
        p_dcp, d_dcp = draw(st.sampled_from((p_tp, 1))), draw(st.sampled_from((d_tp, 1)))
        if (p_dcp % d_dcp and d_dcp % p_dcp) or (model.has_ssm and p_dcp != d_dcp):
            p_dcp = d_dcp = 1
        elif (p_dcp > 1 or d_dcp > 1) and draw(st.booleans()):
            d_block, d_kernel = p_sizes  # equal page geometry (what vLLM pairs right most often)
    return p_dcp, d_dcp, d_block, d_kernel


def _draw_stages(draw: st.DrawFn, model: ModelSpec, mode: str, compat: str, allowed: bool) -> tuple[int, int]:
    """Pipeline stages ``(p_pp, d_pp)``, sometimes where ``allowed`` (models without SSM state): vLLM runs
    them on the side that moves bytes (P in push, D in pull); kvgeom on either."""
    stages = min(3, model.num_hidden_layers)
    if not (allowed and not model.has_ssm and stages > 1 and draw(st.integers(0, 3)) == 0):
        return 1, 1
    local_pp = draw(st.integers(2, stages))
    remote_pp = draw(st.sampled_from((1, 1, 2))) if policy_of(compat).routed else 1
    return (remote_pp, local_pp) if mode == "pull" else (local_pp, remote_pp)


def _draw_packed(draw: st.DrawFn, model: ModelSpec, kv_split: bool) -> tuple[bool, bool]:
    """Block-outermost (packed) rows on P and D, sometimes: pure MLA models, mostly on both sides; a
    CSA-linear model with SSM state on both."""
    if (
        model.is_mla
        and not model.has_ssm
        and all(isinstance(la.spec, MLASpec) for la in model.layers)
        and not kv_split
        and draw(st.integers(0, 2)) == 0
    ):  # block-outermost rows, mostly on both sides
        return draw(st.sampled_from(((True, True), (True, True), (True, False), (False, True))))
    if model.is_csa_linear and model.has_ssm and draw(st.integers(0, 2)) == 0:
        return True, True  # vLLM's block-outermost allocation of a CSA-linear model (kvgeom.layout.csarows)
    return False, False


def _draw_separate_group(
    draw: st.DrawFn, model: ModelSpec, mode: str, p: EngineConfig, d: EngineConfig, equal_blocks: bool
) -> EngineConfig:
    """``d``, sometimes (pull, one attention group) with some layers in a group of their own (a HiSparse
    decoder): regions paired region by region (with DCP: by global page position, per remote rank)."""
    if not (
        mode == "pull"
        and _group_count(model) == 1
        and not model.has_ssm
        and len(model.layers) > 1
        and p.pp_size == d.pp_size == 1
        and not (p.packed_rows or d.packed_rows)
        and draw(st.integers(0, 4)) == 0
    ):
        return d
    names = [la.name for la in model.layers]
    own = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names) - 1, unique=True))
    block = (
        p.block_size if equal_blocks else p.kernel * d.ppl
    )  # equal kernel blocks (and, asked, equal blocks)
    return replace(d, separate_group=tuple(own), kernel_block_size=p.kernel, block_size=block)


def _draw_permute(
    draw: st.DrawFn, model: ModelSpec, mode: str, compat: str, p: EngineConfig, d: EngineConfig
) -> tuple[EngineConfig, EngineConfig]:
    """``(p, d)``, sometimes a head-major P moved into a token-major D that permutes on receive (vLLM's
    enable_permute_local_kv; vLLM pulls it only, kvgeom mode pushes it too)."""
    if (
        (mode == "pull" or not policy_of(compat).engine_refusals)
        and _permutable(model)
        and p.dcp_size == d.dcp_size == 1
        and not d.separate_group
        and draw(st.integers(0, 4)) == 0
    ):
        return replace(p, kv_layout=KVLayout.HEAD_MAJOR), replace(
            d, kv_layout=KVLayout.TOKEN_MAJOR, permute_local_kv=True
        )
    return p, d


def _accepted(pair: PDPair) -> PDPair:
    """``pair`` if kvgeom pairs it; a refused pair of a plannable class fails, any other is discarded."""
    cls = plannable_class(pair)
    event(f"pair class: {cls or 'other'}")
    try:
        pair.check()
        if pair.p_engine.conv_layout is not pair.d_engine.conv_layout:  # a DS page copied into an SD page
            raise AssertionError(f"mixed conv layouts accepted: {pair}")
    except KvgeomError as exc:
        if cls is not None:  # a verdict, not a discard: this class is always plannable
            raise AssertionError(f"plannable class {cls!r} refused at handshake: {pair}: {exc}") from exc
        event(f"pair refused: {type(exc).__name__} {exc.field}")
        assume(False)
    return pair


# -- requests ---------------------------------------------------------------------------------------
@st.composite
def one_sided_windows(draw: st.DrawFn, /, **pair_options: Any) -> tuple[PDPair, ModelSpec, ModelSpec]:
    """A pair kvgeom accepts (:func:`pd_pairs`, ``pair_options`` passed on) and the models its two sides
    would run if one attention or MLA layer had a sliding window on one side only (or windows of different
    sizes): ``(pair, p_model, d_model)``, one of the two models being ``pair.model``. Such a pair must be
    refused at the handshake (the sides would read different tokens of that layer)."""
    pair = draw(pd_pairs(models=model_specs(("dense", "mla", "attn+ssm", "mla+ssm")), **pair_options))
    spans = [i for i, la in enumerate(pair.model.layers) if isinstance(la.spec, (AttentionSpec, MLASpec))]
    i = draw(st.sampled_from(spans))
    spec = cast("AttentionSpec | MLASpec", pair.model.layers[i].spec)  # spans holds such layers only
    window = draw(st.sampled_from([w for w in (None, 4, 8, 64) if w != spec.sliding_window]))
    specs = [la.spec for la in pair.model.layers]
    specs[i] = replace(spec, sliding_window=window)
    other = ModelSpec.from_layers(pair.model.name, specs)
    return (pair, pair.model, other) if draw(st.booleans()) else (pair, other, pair.model)


@st.composite
def requests(draw: st.DrawFn, pair: PDPair) -> Request:
    """A request fitting both pools: token count, P and D ids drawn as shuffled, sparse pool slices
    (SSM groups one slot each), and, if the pair caches prefixes, a hit on some leading D blocks. P may
    stop short of the last tokens (the N-1 flow: backoff 1 for SSM models as vLLM does, sometimes 0 or a
    lookahead window; sometimes 1 for others), so D may hold a block more than P sent."""
    p_geom = engine_geometries(pair.model, pair.p_engine)[0]
    d_geom = engine_geometries(pair.model, pair.d_engine)[0]
    ssm = list(p_geom.group_one_block)  # one block per request: SSM states, rings
    n_attn, n_ssm = max(ssm.count(False), len(d_geom.groups) - ssm.count(True)), ssm.count(True)
    pb, db = p_geom.scheduler_block, d_geom.scheduler_block  # tokens per list entry (DCP: a page per rank)
    if n_attn:
        most = min(
            (p_geom.logical_num_blocks - n_ssm) // n_attn * pb,
            (d_geom.logical_num_blocks - n_ssm) // n_attn * db,
        )
        least = db + 1 if pair.prefix_caching and most > db else 1  # room for a prefix hit
        num_tokens = draw(st.integers(least, most))
    else:
        num_tokens = draw(st.integers(1, 64))
    d_blocks = math.ceil(num_tokens / db)
    hit = draw(st.integers(0, d_blocks - 1)) if pair.prefix_caching and n_attn else 0
    backoff = draw(st.sampled_from((1, 0, 1, 3) if pair.model.has_ssm else (0, 0, 0, 1)))
    computed = prefill_tokens(num_tokens, backoff)
    sides = []
    for geom, count in ((p_geom, math.ceil(computed / pb)), (d_geom, d_blocks - hit)):
        pool = draw(st.permutations(range(geom.logical_num_blocks)))
        ids, used = [], 0
        for one in geom.group_one_block:
            n = 1 if one else count
            ids.append(tuple(pool[used : used + n]))
            used += n
        sides.append(tuple(ids))
    return Request(num_tokens, sides[0], sides[1], hit, computed if computed < num_tokens else None)


@dataclass(frozen=True)
class Case:
    """A pair and a request: ``run()`` plans it with kvgeom on every rank and returns the oracle's report."""

    pair: PDPair
    request: Request

    def run(self, tell_num_tokens: bool = True) -> Report:
        return self.pair.run(self.request, tell_num_tokens)

    def __str__(self) -> str:
        r = self.request
        computed = f" (P computed {r.prefill_tokens})" if r.prefill_tokens is not None else ""
        return (
            f"{self.pair}; {r.num_tokens} tokens{computed}, prefix {r.prefix_blocks}, P ids {r.p_ids}, "
            f"D ids {r.d_ids}"
        )


@st.composite
def cases(
    draw: st.DrawFn,
    mode: str | None = None,
    compat: str | None = None,
    models: st.SearchStrategy[ModelSpec] | None = None,
    equal_blocks: bool = False,
    pipeline: bool = True,
) -> Case:
    """A :class:`Case`: a pair from :func:`pd_pairs` (same arguments) and a request from :func:`requests`."""
    pair = draw(pd_pairs(mode, compat, models, equal_blocks, pipeline))
    return Case(pair, draw(requests(pair)))
