"""Whole requests: kvgeom's plans against what vLLM 0.33.0's own pull path moves, byte by byte.

Pairs and requests come from :mod:`kvgeom.testing.strategies` (every model family, TP 1-8 on each side,
kernel and logical block sizes that differ, prefix hits, the N-1 flow, DCP, pipeline stages, packed rows);
each D rank's pull, or each P rank's push, runs through vLLM's real connector code (:mod:`_e2e`) and
kvgeom plans the same request. In ``compat="vllm"`` mode
kvgeom must post exactly vLLM's descriptor pairs and leave exactly vLLM's bytes after the receive step,
or refuse, and then the byte oracle must find vLLM's result wrong (or vLLM must refuse too). In
``compat="kvgeom"`` mode every request vLLM moves correctly must be planned, and every kvgeom plan must
pass the oracle. See :mod:`test_differential` for how to run.
"""

from __future__ import annotations

from types import SimpleNamespace

import _e2e as E
import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvgeom.errors import KvgeomError
from kvgeom.layout.engine import ConvLayout, EngineConfig
from kvgeom.model.csa import csa_linear_model
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.plan.receive import receive_step
from kvgeom.testing import ZERO, Oracle, Request, engine_geometries
from kvgeom.testing import strategies as kst
from kvgeom.testing.oracle import pull_plans, push_plans, run_plans

E2E_EXAMPLES = 600
"""Examples per test (four tests: pull and push, each mode)."""


def _vllm(case: kst.Case) -> tuple[Oracle | None, list[np.ndarray], BaseException | None]:
    """vLLM's transfer of ``case`` on every local rank (D in pull, P in push): the oracle after its moves and
    (pull) receive steps, the moves per rank, or the exception it refused with. vLLM's D never zeroes in
    push; every D rank then zeroes the bytes no write reached (:func:`_receive`), so what is judged is vLLM's
    moves."""
    pair, request = case.pair, case.request
    p_geoms, d_geoms = (
        engine_geometries(pair.model, pair.p_engine),
        engine_geometries(pair.model, pair.d_engine),
    )
    oracle = Oracle(pair.model, p_geoms, d_geoms, request)
    moves = []
    pull = pair.mode == "pull"
    for geom in d_geoms if pull else p_geoms:
        try:
            if pull:
                pulled = E.pull(
                    geom,
                    p_geoms,
                    [list(x) for x in request.d_ids],
                    [list(x) for x in request.p_ids],
                    request.prefix_blocks,
                    request.p_tokens,
                    pair.prefix_caching,
                )
            else:
                pushed = E.push(
                    geom,
                    d_geoms,
                    [list(x) for x in request.p_ids],
                    [list(x) for x in request.d_ids],
                    pair.prefix_caching,
                )
        except E.HARNESS_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - vLLM's refusals: asserts, ValueError, RuntimeError, ...
            return None, moves, exc
        moves.append(pulled.moves if pull else pushed)
        oracle.execute(moves[-1], f"vLLM {pair.mode} of rank {geom.global_rank}")
        if pull:
            E.apply_post(oracle, geom.global_rank, pulled.post)
    if not pull:
        _receive(oracle, case)
    return oracle, moves, None


def _receive(oracle: Oracle, case: kst.Case) -> None:
    """After a push, every D rank zeroes the bytes of its blocks that no write reached (kvgeom's
    :func:`~kvgeom.plan.receive.receive_step` ranges, applied to unwritten bytes only, so that a wrong write stays
    visible to the oracle)."""
    r = case.request
    for d in oracle.d:
        _, zero = receive_step(
            d, oracle.p[0], r.d_ids, r.p_ids, r.num_tokens, case.pair.prefix_caching, r.p_tokens
        )
        rank = d.global_rank
        for region, offset, length in zero.tolist():
            unwritten = oracle.writer[rank][region][offset : offset + length] == np.iinfo(np.int64).min
            oracle.dst[rank][region][offset : offset + length][unwritten] = ZERO


def _cases(mode: str):  # noqa: ANN202 - a hypothesis strategy
    return kst.cases(mode=mode, compat="kvgeom").filter(
        lambda c: not c.pair.p_engine.kv_split and c.pair.p_engine.conv_layout is ConvLayout.DS
    )


def _shape(case: kst.Case) -> None:
    """Record what the case exercises (``--hypothesis-show-statistics``)."""
    p, d, r = case.pair.p_engine, case.pair.d_engine, case.request
    for name, on in (
        ("DCP", p.dcp_size > 1 or d.dcp_size > 1),
        ("N-1 flow", r.p_tokens < r.num_tokens),
        ("prefix hit", r.prefix_blocks > 0),
        ("TP differs", p.tp_size != d.tp_size),
        ("kernel blocks differ", p.kernel != d.kernel),
        ("SSM", case.pair.model.has_ssm),
        ("pipeline stages", p.pp_size > 1 or d.pp_size > 1),
        ("packed rows", p.packed_rows or d.packed_rows),
        ("CSA-linear", case.pair.model.is_csa_linear),
        ("separate groups", bool(p.separate_group or d.separate_group)),
        (
            "separate groups with DCP",
            bool(p.separate_group or d.separate_group) and max(p.dcp_size, d.dcp_size) > 1,
        ),
        (
            "CSA-linear head-sharded main KV",
            case.pair.model.is_csa_linear and case.pair.model.attention_spec is not None,
        ),
    ):
        if on:
            event(f"shape: {name}")


def _plan(case: kst.Case, compat: str) -> tuple[list, KvgeomError | None]:
    pair = case.pair
    make = pull_plans if pair.mode == "pull" else push_plans
    try:
        return make(pair.model, pair.p_engine, pair.d_engine, case.request, compat, pair.prefix_caching), None
    except KvgeomError as exc:
        return [], exc


def _vllm_mode_posts_vllms_transfers(case: kst.Case) -> None:
    _shape(case)
    vllm, vllm_moves, vllm_refused = _vllm(case)
    plans, refused = _plan(case, "vllm")
    if refused is not None:
        if vllm_refused is not None:
            event(f"both refused: vLLM {type(vllm_refused).__name__}, kvgeom {type(refused).__name__}")
            return
        report = vllm.report()
        assert not report.ok, f"kvgeom refused ({refused}) what vLLM moves correctly: {case}"
        event(
            f"kvgeom refused ({type(refused).__name__} {refused.field}), vLLM moves wrong bytes "
            f"({sorted({v.invariant for v in report.violations})})"
        )
        return
    assert vllm_refused is None, f"vLLM refused ({vllm_refused!r}) what vllm mode planned: {case}"
    ours = Oracle(case.pair.model, vllm.p, vllm.d, case.request)
    for rp, theirs in zip(plans, vllm_moves, strict=True):
        mine = ours.moves_of(rp)
        assert np.array_equal(mine, theirs), (
            f"rank {rp.rank}: kvgeom's descriptor pairs differ from vLLM's: {case}"
        )
        ours.run_plan(rp)
    if case.pair.mode == "push":
        _receive(ours, case)
    for rank, (a, b) in enumerate(zip(ours.dst, vllm.dst)):
        for region, (x, y) in enumerate(zip(a, b)):
            diff = np.flatnonzero(x != y)
            assert not diff.size, (
                f"D rank {rank} region {region}: bytes from byte {int(diff[0])} differ after the "
                f"receive step: {case}"
            )
    report = vllm.report()
    assert report.ok, f"vllm mode reproduced vLLM's wrong bytes instead of refusing: {case}\n{report}"
    event("equal")


def _kvgeom_mode_plans_what_vllm_moves_right(case: kst.Case) -> None:
    _shape(case)
    vllm, _, vllm_refused = _vllm(case)
    vllm_ok = vllm_refused is None and vllm.report().ok
    plans, refused = _plan(case, "kvgeom")
    if refused is not None:
        assert not vllm_ok, f"kvgeom mode refused ({refused}) a request vLLM moves correctly: {case}"
        event("both refused or vLLM wrong")
        return
    pair = case.pair
    report = run_plans(pair.model, pair.p_engine, pair.d_engine, case.request, plans)
    assert report.ok, f"{case}\n{report}"
    event("vLLM correct, kvgeom correct" if vllm_ok else "vLLM refused or wrong, kvgeom correct")


CSA_EXAMPLES = 150
"""Examples per CSA-linear test (four tests: pull and push, each mode)."""


def _csa_cases(mode: str):  # noqa: ANN202 - a hypothesis strategy
    """CSA-linear pairs (rings on MLA pages, a sharded SSM state, a replicated state page; B.6.14)."""
    return kst.cases(mode=mode, compat="kvgeom", models=kst.model_specs(("csa-linear",))).filter(
        lambda c: (
            c.pair.p_engine.conv_layout is ConvLayout.DS and c.pair.d_engine.conv_layout is ConvLayout.DS
        )
    )


@settings(max_examples=CSA_EXAMPLES)
@given(_csa_cases("pull"))
def test_csa_linear_vllm_mode_posts_vllms_transfers(case: kst.Case) -> None:
    _vllm_mode_posts_vllms_transfers(case)


@settings(max_examples=CSA_EXAMPLES)
@given(_csa_cases("pull"))
def test_csa_linear_kvgeom_mode_plans_what_vllm_moves_right(case: kst.Case) -> None:
    _kvgeom_mode_plans_what_vllm_moves_right(case)


@settings(max_examples=CSA_EXAMPLES)
@given(_csa_cases("push"))
def test_csa_linear_vllm_mode_posts_vllms_writes(case: kst.Case) -> None:
    _vllm_mode_posts_vllms_transfers(case)


@settings(max_examples=CSA_EXAMPLES)
@given(_csa_cases("push"))
def test_csa_linear_kvgeom_mode_plans_what_vllm_writes_right(case: kst.Case) -> None:
    _kvgeom_mode_plans_what_vllm_moves_right(case)


def _packed_csa_cases() -> list[kst.Case]:
    """CSA-linear pairs in vLLM's block-outermost allocation (kvgeom.layout.csarows): the default model, and one with a
    head-sharded main KV of 2 heads (bucketed with the compressed keys), at equal TP 1 and 2, pull and push, 40
    tokens (3 token blocks, a ring block, a GDN slot and a PLE slot)."""
    out = []
    for model in (csa_linear_model(), csa_linear_model(main_kv_heads=2)):
        for tp in (1, 2):
            p, d = (EngineConfig(tp_size=tp, block_size=16, num_blocks=8, packed_rows=True) for _ in "pd")
            for mode in ("pull", "push"):
                out.append(kst.Case(kst.PDPair(model, p, d, mode), Request.simple(model, p, d, 40)))
    return out


PACKED_CSA = _packed_csa_cases()


@settings(max_examples=len(PACKED_CSA))
@given(st.sampled_from(PACKED_CSA))
def test_packed_csa_linear_vllm_mode_posts_vllms_transfers(case: kst.Case) -> None:
    _vllm_mode_posts_vllms_transfers(case)


@settings(max_examples=len(PACKED_CSA))
@given(st.sampled_from(PACKED_CSA))
def test_packed_csa_linear_kvgeom_mode_plans_what_vllm_moves_right(case: kst.Case) -> None:
    _kvgeom_mode_plans_what_vllm_moves_right(case)


def _gqa_csa_cases() -> list[kst.Case]:
    """CSA-linear pairs with head-sharded main KV (as vLLM's ``Qwen4ExpQSAAttention``; B.6.14), pull and push,
    40 tokens: 2 KV heads at equal TP 1 and 2 and across TP 2 and 4 (one head per rank, replicated at TP4;
    GDN(4, 4, 4, 4) so that no SSM unit is replicated); 4 KV heads across TP 1 and 2 (several heads per page,
    head slices)."""
    gdn4 = MambaSpec.gdn(4, 4, 4, 4)
    setups = [
        (2, None, 1, 1),
        (2, None, 2, 2),
        (2, gdn4, 2, 4),
        (2, gdn4, 4, 2),
        (4, None, 1, 2),
        (4, None, 2, 1),
    ]
    out = []
    for heads, gdn, p_tp, d_tp in setups:
        model = csa_linear_model(main_kv_heads=heads, gdn=gdn)
        p, d = (EngineConfig(tp_size=t, block_size=16, num_blocks=16) for t in (p_tp, d_tp))
        for mode in ("pull", "push"):
            out.append(kst.Case(kst.PDPair(model, p, d, mode), Request.simple(model, p, d, 40)))
    return out


GQA_CSA = _gqa_csa_cases()


def _packed_gqa_csa_cases() -> list[kst.Case]:
    """Packed CSA-linear rows with a head-sharded main KV (and, for contrast, without one) across TP sizes, pull
    and push, 40 tokens: the regions of a row start at other bytes on the two sides (the GDN page before the
    GDN-only region halves with TP; 4 KV heads: the main-KV page before the compressed keys halves too).
    vLLM copies every token group's blocks through every region, onto other layers' pages: vllm mode refuses
    and the shared-row oracle finds vLLM's bytes wrong; kvgeom mode plans each group through its own pages."""
    gdn4 = MambaSpec.gdn(4, 4, 4, 4)
    setups = [
        (2, gdn4, 2, 4),
        (2, gdn4, 4, 2),
        (4, None, 1, 2),
        (4, None, 2, 1),
        (0, None, 1, 2),
        (0, None, 2, 1),
    ]
    out = []
    for heads, gdn, p_tp, d_tp in setups:
        model = (
            csa_linear_model(main_kv_heads=heads, gdn=gdn) if gdn else csa_linear_model(main_kv_heads=heads)
        )
        p, d = (EngineConfig(tp_size=t, block_size=16, num_blocks=8, packed_rows=True) for t in (p_tp, d_tp))
        for mode in ("pull", "push"):
            out.append(kst.Case(kst.PDPair(model, p, d, mode), Request.simple(model, p, d, 40)))
    return out


PACKED_GQA_CSA = _packed_gqa_csa_cases()


@settings(max_examples=len(PACKED_GQA_CSA))
@given(st.sampled_from(PACKED_GQA_CSA))
def test_packed_csa_linear_across_tp_vllm_mode_refuses_what_vllm_gets_wrong(case: kst.Case) -> None:
    vllm, _, vllm_refused = _vllm(case)
    assert _plan(case, "vllm")[1] is not None  # refused: regions start at other row bytes on the peer
    assert vllm_refused is not None or not vllm.report().ok, f"vLLM moves it right: {case}"
    _vllm_mode_posts_vllms_transfers(case)


@settings(max_examples=len(PACKED_GQA_CSA))
@given(st.sampled_from(PACKED_GQA_CSA))
def test_packed_csa_linear_across_tp_kvgeom_mode_plans_it(case: kst.Case) -> None:
    assert _plan(case, "kvgeom")[1] is None  # every one of them planned (and judged by the oracle below)
    _kvgeom_mode_plans_what_vllm_moves_right(case)


@settings(max_examples=len(GQA_CSA))
@given(st.sampled_from(GQA_CSA))
def test_gqa_csa_linear_vllm_mode_posts_vllms_transfers(case: kst.Case) -> None:
    assert _plan(case, "vllm")[1] is None  # vLLM moves every one of them right: planned, never refused
    _vllm_mode_posts_vllms_transfers(case)


@settings(max_examples=len(GQA_CSA))
@given(st.sampled_from(GQA_CSA))
def test_gqa_csa_linear_kvgeom_mode_plans_what_vllm_moves_right(case: kst.Case) -> None:
    _kvgeom_mode_plans_what_vllm_moves_right(case)


def _permute_cases() -> list[kst.Case]:
    """A head-major P pulled by a token-major D with ``permute_local_kv`` (vLLM's ``enable_permute_local_kv``,
    B.6.15): two full-attention layers of 4 KV heads (8 x fp16 each), 37 tokens, across TP sizes (1-4 on each
    side) and block-size ratios 1, 2 and 4; 2 KV heads replicated by D (TP 4) or by P (TP 4 into TP 1); one
    prefix hit; and the same pairs without the flag (refused by both). vLLM moves every permuted pair right
    except P_TP > D_TP with bsr > 1 or with P replicating the heads (it refuses; so does vllm mode, and kvgeom
    mode plans them)."""
    four = ModelSpec.from_layers("dense", [AttentionSpec(4, 8, "float16")] * 2)
    two = ModelSpec.from_layers("dense", [AttentionSpec(2, 8, "float16")] * 2)
    setups = [  # model, P TP, D TP, P block, D block, prefix blocks, permute
        (four, 1, 1, 16, 16, 0, True),
        (four, 1, 1, 8, 16, 0, True),
        (four, 1, 1, 4, 16, 0, True),
        (four, 1, 2, 16, 16, 0, True),
        (four, 1, 2, 8, 16, 0, True),
        (four, 2, 4, 4, 16, 0, True),
        (four, 2, 1, 16, 16, 0, True),
        (four, 4, 2, 16, 16, 0, True),
        (four, 2, 1, 8, 16, 0, True),
        (two, 1, 4, 8, 16, 0, True),
        (two, 4, 1, 16, 16, 0, True),
        (four, 1, 1, 16, 16, 1, True),
        (four, 1, 1, 16, 16, 0, False),
        (four, 1, 2, 8, 16, 0, False),
    ]
    out = []
    for model, p_tp, d_tp, p_bs, d_bs, prefix, permute in setups:
        p = EngineConfig(tp_size=p_tp, block_size=p_bs, num_blocks=16)
        d = EngineConfig(
            tp_size=d_tp, block_size=d_bs, num_blocks=16, kv_layout="token_major", permute_local_kv=permute
        )
        request = Request.simple(model, p, d, 37, prefix_blocks=prefix)
        out.append(kst.Case(kst.PDPair(model, p, d, "pull", prefix_caching=prefix > 0), request))
    return out


PERMUTE = _permute_cases()


def _vllm_plans_permute(case: kst.Case) -> bool:
    """Whether vllm mode plans a permute case: the flag is set, and not P_TP > D_TP with bsr > 1 or with P
    replicating the KV heads."""
    p, d = case.pair.p_engine, case.pair.d_engine
    heads = case.pair.model.num_kv_heads
    down = p.tp_size > d.tp_size
    return d.permute_local_kv and not (down and (d.block_size > p.block_size or p.tp_size > heads))


@settings(max_examples=len(PERMUTE))
@given(st.sampled_from(PERMUTE))
def test_permute_vllm_mode_posts_vllms_transfers(case: kst.Case) -> None:
    vllm, _, vllm_refused = _vllm(case)
    refused = _plan(case, "vllm")[1]
    assert (refused is None) == _vllm_plans_permute(case), f"{case}: {refused}"
    assert (vllm_refused is None) == _vllm_plans_permute(case), f"{case}: {vllm_refused!r}"
    _vllm_mode_posts_vllms_transfers(case)


@settings(max_examples=len(PERMUTE))
@given(st.sampled_from(PERMUTE))
def test_permute_kvgeom_mode_plans_what_vllm_moves_right(case: kst.Case) -> None:
    assert (_plan(case, "kvgeom")[1] is None) == case.pair.d_engine.permute_local_kv
    _kvgeom_mode_plans_what_vllm_moves_right(case)


def _push_permute_cases() -> list[kst.Case]:
    """A head-major P pushing into a token-major D with ``permute_local_kv`` (B.6.15): the model and request
    of :func:`_permute_cases`, TP 1-4 on each side, P blocks equal to D's or twice them (one head per P rank),
    once with the flag set on P's engine too (vLLM's setting is per engine). vLLM refuses every one."""
    four = ModelSpec.from_layers("dense", [AttentionSpec(4, 8, "float16")] * 2)
    setups = [  # P TP, D TP, P block, flag on P too
        (1, 1, 16, False),
        (1, 2, 16, False),
        (2, 1, 16, False),
        (2, 4, 16, False),
        (4, 2, 16, False),
        (4, 1, 32, False),
        (1, 2, 16, True),
    ]
    out = []
    for p_tp, d_tp, p_bs, p_flag in setups:
        p = EngineConfig(tp_size=p_tp, block_size=p_bs, num_blocks=16, permute_local_kv=p_flag)
        d = EngineConfig(
            tp_size=d_tp, block_size=16, num_blocks=16, kv_layout="token_major", permute_local_kv=True
        )
        out.append(kst.Case(kst.PDPair(four, p, d, "push"), Request.simple(four, p, d, 37)))
    return out


PUSH_PERMUTE = _push_permute_cases()


@pytest.mark.parametrize("case", PUSH_PERMUTE, ids=str)
def test_push_permute_vllm_refuses_at_ps_handshake_and_so_does_vllm_mode(case: kst.Case) -> None:
    """vLLM's push P validates D's handshake metadata (``add_remote_agent``): its LBHNC against D's LBNHC is
    refused whatever the flag, as its permute takes only an LBHNC remote into an LBNHC local; vllm mode refuses
    the pair, typed, before any plan."""
    _, moves, vllm_refused = _vllm(case)
    assert isinstance(vllm_refused, RuntimeError) and moves == [], repr(vllm_refused)
    assert "kv_cache_layout (local LBHNC, remote LBNHC)" in str(vllm_refused)
    refused = _plan(case, "vllm")[1]
    assert refused is not None and refused.field == "kv_layout", refused
    assert refused.values == {"local": "head_major", "remote": "token_major"}


@pytest.mark.parametrize("case", PUSH_PERMUTE[:3], ids=str)
def test_push_permute_ds_notification_handshake_never_marks_it_permuting(case: kst.Case) -> None:
    """vLLM's push D loads P's metadata for notifications only (``_add_notif_only_remote_agent``): no layout
    check, and D's worker stays unmarked, so even a P that wrote head-major pages would find D not permuting."""
    pair = case.pair
    p = engine_geometries(pair.model, pair.p_engine)[0]
    for d in engine_geometries(pair.model, pair.d_engine):
        w = E.worker(d, "push", False, "D", E.D_SIDE)
        w._add_notif_only_remote_agent(E.agent_metadata(p, "push", E.P_SIDE, "P"), p.tp_size)
        assert w.kv_cache_layout == "LBNHC" and w.kv_transfer_config.enable_permute_local_kv is True
        assert w.enable_permute_local_kv is False


@pytest.mark.parametrize("case", PUSH_PERMUTE, ids=str)
def test_push_permute_kvgeom_mode_plans_it_and_the_oracle_agrees(case: kst.Case) -> None:
    """Where vLLM refuses, kvgeom mode writes P's head-major pages and D's receive step permutes them: every
    D byte right (the oracle), and without the permute wrong (unless D holds one head per rank)."""
    plans, refused = _plan(case, "kvgeom")
    assert refused is None, refused
    pair, r = case.pair, case.request
    assert run_plans(pair.model, pair.p_engine, pair.d_engine, r, plans).ok
    bare = Oracle(
        pair.model,
        engine_geometries(pair.model, pair.p_engine),
        engine_geometries(pair.model, pair.d_engine),
        r,
    )
    for rp in plans:
        bare.run_plan(rp)
    for d in bare.d:  # the receive step without its regroups
        _, zero = receive_step(d, bare.p[0], r.d_ids, r.p_ids, r.num_tokens, pair.prefix_caching, r.p_tokens)
        bare.receive(d.global_rank, (), zero)
    # one head per D rank: token-major and head-major pages agree, nothing to permute
    assert bare.report().ok == (pair.model.num_kv_heads <= pair.d_engine.tp_size)


@pytest.mark.parametrize(("bsr", "covered"), [(1, 3), (2, 5), (4, 9), (4, 12)])
@pytest.mark.parametrize("heads", [1, 4])
def test_permute_receive_step_of_the_drop_in_equals_vllms(bsr: int, covered: int, heads: int) -> None:
    """kvgeom_vllm's ``post_process_device_kv_on_receive`` (kvgeom's token-major regroup, then its zero rows)
    against vLLM's own (its ``kv_postprocess_blksize_and_layout_on_receive`` kernel, then its zeroing) on a
    token-major (LBNHC) cache of random bytes: 8 blocks of 16 tokens x ``heads`` heads x 8 bfloat16, blocks
    ``[5, 1, 6]`` received, ``covered`` remote units of ``16 // bsr`` tokens written."""
    from kvgeom_vllm.answers.receive import post_process_device_kv_on_receive as ours
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    gen = torch.Generator().manual_seed(bsr * 100 + covered * 10 + heads)
    data = torch.randn((8, 16, heads, 8), generator=gen).to(torch.bfloat16)

    def worker(cache: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(
            device_kv_caches={"layer": cache},
            kv_cache_config=SimpleNamespace(transfer_groups=[SimpleNamespace(layer_names=["layer"])]),
            kv_cache_layout="LBNHC",
            enable_permute_local_kv=True,
            transfer_topo=object(),
        )

    theirs, mine = (data.clone().permute(0, 2, 1, 3) for _ in range(2))  # [B, H, N, C] views, NHD in memory
    NixlBaseConnectorWorker.post_process_device_kv_on_receive(worker(theirs), bsr, [(0, [5, 1, 6], covered)])
    ours(worker(mine), bsr, [(0, [5, 1, 6], covered)])
    assert not torch.equal(theirs, data.permute(0, 2, 1, 3)) or heads == 1  # the step did something
    assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16))


def _region_dcp_cases() -> list[kst.Case]:
    """Region-mapped pulls with decode context parallelism (a HiSparse-style D keeping layer 1 of 3 MLA layers in a
    group of its own): DCP on D, on P, on both (equal and different sizes), a replicated P under a sharded D (at
    equal TP and with more P ranks), and the reverse; 37 tokens (a last page partly filled), without and with a prefix hit, and the N-1 flow. Blocks
    of 4 tokens are their kernel blocks (vLLM refuses DCP region pulls otherwise); two setups with 2 kernel
    blocks per block, which vLLM refuses and kvgeom mode plans."""
    model = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 3)
    setups = [  # (P TP, P DCP, D TP, D DCP, block, kernel)
        (1, 1, 2, 2, 4, 4),
        (2, 2, 1, 1, 4, 4),
        (2, 2, 2, 2, 4, 4),
        (4, 4, 2, 2, 4, 4),
        (2, 2, 4, 4, 4, 4),
        (2, 1, 2, 2, 4, 4),
        (2, 2, 2, 1, 4, 4),
        (4, 1, 2, 2, 4, 4),
        (1, 1, 4, 4, 4, 4),
        (4, 4, 1, 1, 4, 4),
        (1, 1, 2, 2, 8, 4),
        (2, 2, 4, 4, 8, 4),
    ]
    out = []
    for p_tp, p_dcp, d_tp, d_dcp, block, kernel in setups:
        p = EngineConfig(
            tp_size=p_tp, block_size=block, num_blocks=24, kernel_block_size=kernel, dcp_size=p_dcp
        )
        d = EngineConfig(
            tp_size=d_tp,
            block_size=block,
            num_blocks=24,
            kernel_block_size=kernel,
            dcp_size=d_dcp,
            separate_group=("layers.1.attn",),
        )
        for prefix, computed in ((0, None), (1, None), (0, 36)):
            request = Request.simple(model, p, d, 37, prefix, prefill_tokens=computed)
            out.append(kst.Case(kst.PDPair(model, p, d, "pull", prefix_caching=prefix > 0), request))
    return out


REGION_DCP = _region_dcp_cases()


@settings(max_examples=len(REGION_DCP))
@given(st.sampled_from(REGION_DCP))
def test_region_mapped_dcp_vllm_mode_posts_vllms_transfers(case: kst.Case) -> None:
    _vllm_mode_posts_vllms_transfers(case)


@settings(max_examples=len(REGION_DCP))
@given(st.sampled_from(REGION_DCP))
def test_region_mapped_dcp_kvgeom_mode_plans_what_vllm_moves_right(case: kst.Case) -> None:
    assert _plan(case, "kvgeom")[1] is None  # every one of them planned (and judged by the oracle)
    _kvgeom_mode_plans_what_vllm_moves_right(case)


@settings(max_examples=E2E_EXAMPLES)
@given(_cases("pull"))
def test_vllm_mode_posts_vllms_transfers(case: kst.Case) -> None:
    _vllm_mode_posts_vllms_transfers(case)


@settings(max_examples=E2E_EXAMPLES)
@given(_cases("pull"))
def test_kvgeom_mode_plans_what_vllm_moves_right(case: kst.Case) -> None:
    _kvgeom_mode_plans_what_vllm_moves_right(case)


@settings(max_examples=E2E_EXAMPLES)
@given(_cases("push"))
def test_vllm_mode_posts_vllms_writes(case: kst.Case) -> None:
    _vllm_mode_posts_vllms_transfers(case)


@settings(max_examples=E2E_EXAMPLES)
@given(_cases("push"))
def test_kvgeom_mode_plans_what_vllm_writes_right(case: kst.Case) -> None:
    _kvgeom_mode_plans_what_vllm_moves_right(case)


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
