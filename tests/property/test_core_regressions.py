"""Reproducers of the core bugs the oracle found (strict xfail: they pass once the core is fixed, and then
the ``xfail`` mark and the matching predicate in ``_known_core_bugs.py`` go).

Each reproducer is the smallest case hypothesis shrank to, written out by hand.
"""

from __future__ import annotations

import pytest
from _known_core_bugs import known_core_bug  # tests/property/ (rootdir-relative import)

from kvgeom import IncompatiblePairError, PlanError
from kvgeom.engine import EngineConfig
from kvgeom.spec import AttentionSpec, MambaSpec, MLASpec, ModelSpec
from kvgeom.testing import Request, run
from kvgeom.testing.strategies import Case, PDPair


def _engine(tp: int, block: int, kernel: int | None = None, blocks: int = 4) -> EngineConfig:
    return EngineConfig(tp_size=tp, block_size=block, kernel_block_size=kernel, num_blocks=blocks)


DENSE2 = ModelSpec.from_layers("dense", [AttentionSpec(2, 2, "float16")])
DENSE4 = ModelSpec.from_layers("dense", [AttentionSpec(4, 2, "float16")])
MLA = ModelSpec.from_layers("mla", [MLASpec(4, "float16")])
MLA_MAMBA2 = ModelSpec.from_layers("mla+ssm", [MLASpec(4, "float16"), MambaSpec.mamba2(2, 1, 2, 1, 2, "float16")])
MAMBA1 = ModelSpec.from_layers("ssm", [MambaSpec.mamba1(4, 1, 2, "float16")])

# name -> (model, P engine, D engine, request, mode, known-bug id)
CASES = {
    # K1: plan_request pairs blocks by count. P's 8-token block is 2 kernel blocks, D's 4-token block 1: the
    # non-Mamba prefix trim keeps P's *last* kernel block, so D's token 0 receives P's token 4.
    "K1 P blocks cover more tokens (pull)": (DENSE2, _engine(1, 8, 4), _engine(1, 4), Request(1, [[0]], [[0]]),
                                             "pull", "K1 token span"),
    "K1 P blocks cover more tokens (push)": (DENSE2, _engine(1, 8, 4), _engine(1, 4), Request(1, [[0]], [[0]]),
                                             "push", "K1 token span"),
    # K1 with a prefix hit: D caches tokens 0-7 (one 8-token block); P's 4-token blocks 1, 2 (tokens 4-11)
    # are paired with D's block of tokens 8-15.
    "K1 prefix hit, block sizes differ (pull)": (DENSE2, _engine(1, 4), _engine(1, 8, 4),
                                                 Request(9, [[0, 1, 2]], [[1]], 1), "pull", "K1 token span"),
    "K1 prefix hit, block sizes differ (push)": (DENSE2, _engine(1, 4), _engine(1, 8, 4),
                                                 Request(9, [[0, 1, 2]], [[1]], 1), "push", "K1 token span"),
    # K2: push P TP1 -> D TP4 with 2 KV heads: D ranks 1 and 3 hold replicas of heads 0 and 1; P writes
    # each head to the first D rank holding it only.
    "K2 push into replicated KV heads": (DENSE2, _engine(1, 4), _engine(4, 4), Request(1, [[0]], [[0]]), "push",
                                         "K2 push replicated KV"),
    # K3: push P TP1 -> D TP4 of a Mamba2 state with 2 groups (and 2 heads): D replicates every piece;
    # P cuts each 4-byte piece in four 1-byte chunks (half an element each).
    "K3 push into a replicated SSM state": (MLA_MAMBA2, _engine(1, 4, blocks=3), _engine(4, 4, blocks=3),
                                            Request(1, [[0], [1]], [[0], [1]]), "push", "K3 push replicated state"),
    # K5: push with a prefix hit, P kernel 4 > D kernel 2: D's uncached block (tokens 4-7) gets P's first
    # kernel block (tokens 0-3): P's expanded ids are clipped from the front.
    "K5 push prefix hit with P kernel > D kernel": (MLA, _engine(1, 4, blocks=3), _engine(1, 4, 2, blocks=3),
                                                    Request(5, [[0, 1]], [[1]], 1), "push", "K5 push prefix ratio"),
    # K6: push P TP1 (4 heads, kernel 4) -> D TP4 (1 head, kernel 2): the first half of P's head-major page
    # is heads 0-1 of all tokens, not tokens 0-1 of all heads.
    "K6 push ratio on a head-major page": (DENSE4, _engine(1, 4), _engine(4, 4, 2), Request(1, [[0]], [[0]]),
                                           "push", "K6 push ratio head-major"),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="core bug: see the case's comment in CASES")
def test_known_core_bug_reproducer(name: str) -> None:
    model, p, d, request, mode, _ = CASES[name]
    report = run(model, p, d, request, mode)
    assert report.ok, str(report)


@pytest.mark.parametrize("name", sorted(CASES))
def test_known_bug_predicates_match_their_reproducers(name: str) -> None:
    """``_known_core_bugs`` skips exactly these cases in the property tests (keep the two in sync)."""
    model, p, d, request, mode, bug = CASES[name]
    assert known_core_bug(Case(PDPair(model, p, d, mode, "kvgeom", request.prefix_blocks > 0), request)) == bug


# -- refusals of valid input (typed errors, no corruption) -------------------------------------------
@pytest.mark.xfail(strict=True, raises=PlanError, reason="core bug K1c: D's logical block spans more kernel "
                   "blocks than P sent (D block 4 tokens / kernel 2, P block 2): 'D has 2 uncomputed blocks but P "
                   "sent only 1' instead of transferring P's block and zeroing D's second kernel block")
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_d_blocks_covering_more_tokens_than_p_blocks_are_planned(mode: str) -> None:
    report = run(DENSE2, _engine(1, 2), _engine(1, 4, 2), Request(1, [[0]], [[0]]), mode)
    assert report.ok, str(report)


@pytest.mark.xfail(strict=True, raises=IncompatiblePairError, reason="core bug R1: an attention-free (pure "
                   "Mamba) model cannot change TP: the handshake applies the attention block_len rule to the "
                   "state region ('remote block length should be 16 B'), and where block sizes make the lengths "
                   "agree the plan fails with GroupMismatchError ('FA descriptors to split but no attention group')")
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_pure_mamba_model_changes_tp(p_tp: int, d_tp: int) -> None:
    report = run(MAMBA1, _engine(p_tp, 1, blocks=2), _engine(d_tp, 1, blocks=2), Request(1, [[0]], [[0]]), "pull")
    assert report.ok, str(report)
