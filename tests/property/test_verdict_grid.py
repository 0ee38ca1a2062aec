"""Refusals are verdicts, not discards (issue 12).

The property tests reject every example kvgeom refuses, so a bug that turns correct plans into refusals
passed them (one mutant more than doubled the rejected examples with no failure). Two guards:

* ``GRID``: one concrete pair per class, its verdict pinned: ``OK`` (planned, and the plan passes the
  oracle) or the field a refusal must name. The classes are every combination vLLM 0.33.0's NIXL connector
  supports (dense GQA at any TP pair, MLA at any TP pair, Mamba2/GDN hybrids at equal TP in either conv
  layout and across TP sizes in DS, block-size ratios, kernel blocks smaller than logical ones) and the
  kvgeom-mode extensions, plus the pairs that must be refused and why.
* ``test_plannable_classes_are_never_refused``: hypothesis draws pairs only from the plannable classes
  (dense, MLA, hybrids at equal TP or in DS with enough groups, head-major pages, no prefix caching) and
  *fails* on a refusal instead of rejecting it; each class is counted with ``event`` (shown by
  ``--hypothesis-show-statistics``).
"""

from __future__ import annotations

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from kvgeom import KvgeomError
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import align_hybrid_block_size
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import Request, run

OK = "ok"

GQA8 = ModelSpec.from_layers("gqa8", [AttentionSpec(8, 4, "float16")] * 2)
GQA8_FP8 = ModelSpec.from_layers("gqa8-fp8", [AttentionSpec(8, 4, "fp8")] * 2)
MLA = ModelSpec.from_layers("mla", [MLASpec(8, "float16")] * 2)
# 8 groups: no B/C replication up to TP8
M2 = ModelSpec.from_layers(
    "attn+mamba2", [AttentionSpec(8, 4, "float16"), MambaSpec.mamba2(8, 2, 8, 2, 4, "float16")]
)
# 1 group: B and C replicated at TP > 1
M2_G1 = ModelSpec.from_layers(
    "attn+mamba2-g1", [AttentionSpec(8, 4, "float16"), MambaSpec.mamba2(8, 2, 1, 2, 4, "float16")]
)
GDN = ModelSpec.from_layers("attn+gdn", [AttentionSpec(8, 4, "float16"), MambaSpec.gdn(4, 4, 8, 4)])
SLIDING = ModelSpec.from_layers(
    "swa", [AttentionSpec(8, 4, "float16"), AttentionSpec(8, 4, "float16", sliding_window=8)]
)


def _e(
    tp: int,
    block: int,
    kernel: int | None = None,
    conv: str = "DS",
    layout: str = "head_major",
    blocks: int = 12,
) -> EngineConfig:
    return EngineConfig(
        tp_size=tp,
        block_size=block,
        kernel_block_size=kernel,
        num_blocks=blocks,
        conv_layout=conv,
        kv_layout=layout,
    )


def _hb(model: ModelSpec, tp: int) -> int:
    return align_hybrid_block_size(model, tp, 4, 4)


def _hybrid(model: ModelSpec, p_tp: int, d_tp: int, p_conv: str = "DS", d_conv: str = "DS") -> tuple:
    return _e(p_tp, _hb(model, p_tp), conv=p_conv), _e(d_tp, _hb(model, d_tp), conv=d_conv)


# name -> (model, P, D, mode, compat, expected verdict: OK or the refused field)
GRID: dict[str, tuple] = {}
for _mode in ("pull", "push"):
    for _compat in ("kvgeom", "vllm"):
        for _p, _d in ((1, 1), (1, 4), (4, 1), (2, 8), (8, 2)):
            GRID[f"dense GQA TP{_p}->TP{_d} {_mode} {_compat}"] = (
                GQA8,
                _e(_p, 8),
                _e(_d, 8),
                _mode,
                _compat,
                OK,
            )
            GRID[f"MLA TP{_p}->TP{_d} {_mode} {_compat}"] = (MLA, _e(_p, 8), _e(_d, 8), _mode, _compat, OK)
        GRID[f"dense fp8 TP2->TP1 {_mode} {_compat}"] = (GQA8_FP8, _e(2, 8), _e(1, 8), _mode, _compat, OK)
        # vLLM's block-size ratio (pull): D's kernel blocks a multiple of P's, never the other way; push
        # (P local) needs equal kernel blocks on head-major pages (a finer D block would interleave heads)
        GRID[f"dense block ratio P8->D16 {_mode} {_compat}"] = (
            GQA8,
            _e(1, 8),
            _e(1, 16),
            _mode,
            _compat,
            OK if _mode == "pull" else "block_size",
        )
        GRID[f"dense block ratio P16->D8 {_mode} {_compat}"] = (
            GQA8,
            _e(1, 16),
            _e(1, 8),
            _mode,
            _compat,
            "block_size",
        )
        GRID[f"dense kernel 4 < logical 8 on both {_mode} {_compat}"] = (
            GQA8,
            _e(1, 8, 4),
            _e(1, 8, 4),
            _mode,
            _compat,
            OK,
        )
        GRID[f"sliding window both sides {_mode} {_compat}"] = (
            SLIDING,
            _e(1, 8),
            _e(2, 8),
            _mode,
            _compat,
            OK,
        )
        for _conv in ("DS", "SD"):
            GRID[f"Mamba2 hybrid equal TP2 {_conv} {_mode} {_compat}"] = (
                M2,
                *_hybrid(M2, 2, 2, _conv, _conv),
                _mode,
                _compat,
                OK,
            )
            GRID[f"GDN hybrid equal TP1 {_conv} {_mode} {_compat}"] = (
                GDN,
                *_hybrid(GDN, 1, 1, _conv, _conv),
                _mode,
                _compat,
                OK,
            )
        # the bug issue 12 found: mixed conv layouts at equal TP were accepted and moved the wrong bytes
        GRID[f"Mamba2 hybrid equal TP DS->SD {_mode} {_compat}"] = (
            M2,
            *_hybrid(M2, 2, 2, "DS", "SD"),
            _mode,
            _compat,
            "conv_layout",
        )
        GRID[f"Mamba2 hybrid TP2->TP1 SD {_mode} {_compat}"] = (
            M2,
            *_hybrid(M2, 2, 1, "SD", "SD"),
            _mode,
            _compat,
            "conv_layout",
        )
    GRID[f"Mamba2 hybrid TP4->TP1 DS {_mode} kvgeom"] = (M2, *_hybrid(M2, 4, 1), _mode, "kvgeom", OK)
    GRID[f"Mamba2 hybrid TP1->TP2 DS {_mode} kvgeom"] = (M2, *_hybrid(M2, 1, 2), _mode, "kvgeom", OK)
    # n_groups 1 < TP: B/C replicated; vLLM would scale them by the TP ratio (vLLM issue 55208)
    GRID[f"Mamba2 one group TP2->TP1 {_mode} vllm"] = (M2_G1, *_hybrid(M2_G1, 2, 1), _mode, "vllm", "tp_size")
    GRID[f"Mamba2 one group TP2->TP1 {_mode} kvgeom"] = (M2_G1, *_hybrid(M2_G1, 2, 1), _mode, "kvgeom", OK)
    # token-major pages cut per token: kvgeom mode only
    GRID[f"token-major TP2->TP1 {_mode} kvgeom"] = (
        GQA8,
        _e(2, 8, layout="token_major"),
        _e(1, 8, layout="token_major"),
        _mode,
        "kvgeom",
        OK,
    )
GRID["token-major push P16->D8 kvgeom"] = (
    GQA8,
    _e(1, 16, layout="token_major"),
    _e(1, 8, layout="token_major"),
    "push",
    "kvgeom",
    OK,
)
GRID["GDN hybrid TP2->TP1 DS pull kvgeom"] = (GDN, *_hybrid(GDN, 2, 1), "pull", "kvgeom", OK)
GRID["Mamba2 hybrid TP4->TP1 DS pull vllm"] = (M2, *_hybrid(M2, 4, 1), "pull", "vllm", OK)


def _verdict(model: ModelSpec, p: EngineConfig, d: EngineConfig, mode: str, compat: str) -> str:
    request = Request.simple(model, p, d, 2 * max(p.block_size, d.block_size) - 3)
    try:
        report = run(model, p, d, request, mode, compat)
    except KvgeomError as exc:
        return exc.field
    assert report.ok, str(report)
    assert report.bytes_moved > 0
    return OK


@pytest.mark.parametrize("name", sorted(GRID))
def test_grid_verdict(name: str) -> None:
    model, p, d, mode, compat, expected = GRID[name]
    assert _verdict(model, p, d, mode, compat) == expected


# -- plannable classes, drawn: a refusal fails -------------------------------------------------------
@st.composite
def _plannable(draw: st.DrawFn) -> tuple[str, ModelSpec, EngineConfig, EngineConfig, str, str]:
    cls = draw(st.sampled_from(("dense", "mla", "hybrid-equal-tp", "hybrid-ds")))
    mode, compat = draw(st.sampled_from(("pull", "push"))), draw(st.sampled_from(("kvgeom", "vllm")))
    tps = (1, 2, 4, 8)
    if cls in ("dense", "mla"):
        heads = draw(st.sampled_from((8, 16)))
        dtype = draw(st.sampled_from(("float16", "bfloat16", "float32", "fp8")))
        spec = (
            AttentionSpec(heads, draw(st.sampled_from((2, 4))), dtype)
            if cls == "dense"
            else MLASpec(draw(st.sampled_from((4, 8))), dtype)
        )
        model = ModelSpec.from_layers(cls, [spec] * draw(st.integers(1, 3)))
        block = draw(st.sampled_from((4, 8, 16)))
        p_tp, d_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
        if mode == "push" and compat == "vllm":
            d_tp = p_tp
        p, d = _e(p_tp, block), _e(d_tp, block)
    else:
        family = draw(st.sampled_from(("mamba2", "gdn")))
        ssm = MambaSpec.mamba2(8, 2, 8, 2, 4, "float16") if family == "mamba2" else MambaSpec.gdn(8, 2, 8, 2)
        model = ModelSpec.from_layers(f"attn+{family}", [AttentionSpec(8, 4, "float16"), ssm])
        if cls == "hybrid-equal-tp":
            tp = draw(st.sampled_from(tps))
            conv = draw(st.sampled_from(("DS", "SD")))
            p, d = _e(tp, _hb(model, tp), conv=conv), _e(tp, _hb(model, tp), conv=conv)
        else:
            p_tp, d_tp = draw(st.sampled_from(tps)), draw(st.sampled_from(tps))
            compat = "kvgeom"
            p, d = _e(p_tp, _hb(model, p_tp)), _e(d_tp, _hb(model, d_tp))
    return cls, model, p, d, mode, compat


@given(_plannable(), st.integers(1, 40))
def test_plannable_classes_are_never_refused(drawn: tuple, tokens: int) -> None:
    cls, model, p, d, mode, compat = drawn
    event(f"class: {cls} {mode} {compat}")
    request = Request.simple(model, p, d, tokens)
    try:
        report = run(model, p, d, request, mode, compat)
    except KvgeomError as exc:  # a verdict, not a discard
        raise AssertionError(
            f"plannable class {cls} refused: {model.name} P {p} D {d} {mode} {compat}: {exc}"
        ) from exc
    assert report.ok, str(report)
