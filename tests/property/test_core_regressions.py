"""Reproducers of the core bugs the oracle found, each the smallest case hypothesis shrank to, written
out by hand.

* ``kvgeom`` mode: planned right (token alignment, routing by units) or refused; regression tests.
* ``vllm`` mode: vLLM's count-based pairing would move the wrong bytes in some of them; vllm mode checks
  its pairing against the token alignment and its routes against the consumers' needs, and refuses
  (a typed error) instead. Whatever it plans passes the oracle.
"""

from __future__ import annotations

import pytest

from kvgeom import KvgeomError, UnsupportedError
from kvgeom.layout.engine import EngineConfig
from kvgeom.layout.geometry import align_hybrid_block_size
from kvgeom.model.layers import AttentionSpec, MambaSpec, MLASpec
from kvgeom.model.spec import ModelSpec
from kvgeom.testing import Request, run


def _engine(tp: int, block: int, kernel: int | None = None, blocks: int = 4) -> EngineConfig:
    return EngineConfig(tp_size=tp, block_size=block, kernel_block_size=kernel, num_blocks=blocks)


DENSE2 = ModelSpec.from_layers("dense", [AttentionSpec(2, 2, "float16")])
DENSE4 = ModelSpec.from_layers("dense", [AttentionSpec(4, 2, "float16")])
MLA = ModelSpec.from_layers("mla", [MLASpec(4, "float16")])
MLA_MAMBA2 = ModelSpec.from_layers(
    "mla+ssm", [MLASpec(4, "float16"), MambaSpec.mamba2(2, 1, 2, 1, 2, "float16")]
)
ATTN1_MAMBA1 = ModelSpec.from_layers(
    "attn+ssm", [AttentionSpec(1, 4, "float16"), MambaSpec.mamba1(4, 1, 2, "float16")]
)
MAMBA1 = ModelSpec.from_layers("ssm", [MambaSpec.mamba1(4, 1, 2, "float16")])
HYBRID_BLOCK = align_hybrid_block_size(ATTN1_MAMBA1, 1, 4, 4)

OK, REFUSED = "ok", "refused"

# name -> (model, P engine, D engine, request, mode, kvgeom-mode outcome, vllm-mode outcome if vLLM would corrupt)
CASES = {
    # K1: pairing blocks by count. P's 8-token block is 2 kernel blocks, D's 4-token block 1: the non-Mamba
    # prefix trim keeps P's *last* kernel block, so D's token 0 received P's token 4.
    "K1 P blocks cover more tokens (pull)": (
        DENSE2,
        _engine(1, 8, 4),
        _engine(1, 4),
        Request(1, [[0]], [[0]]),
        "pull",
        OK,
        "refused",
    ),
    "K1 P blocks cover more tokens (push)": (
        DENSE2,
        _engine(1, 8, 4),
        _engine(1, 4),
        Request(1, [[0]], [[0]]),
        "push",
        OK,
        "refused",
    ),
    # K1 with a prefix hit: D caches tokens 0-7 (one 8-token block); P's 4-token blocks 1, 2 (tokens 4-11)
    # were paired with D's block of tokens 8-15.
    "K1 prefix hit, block sizes differ (pull)": (
        DENSE2,
        _engine(1, 4),
        _engine(1, 8, 4),
        Request(9, [[0, 1, 2]], [[1]], 1),
        "pull",
        OK,
        "refused",
    ),
    "K1 prefix hit, block sizes differ (push)": (
        DENSE2,
        _engine(1, 4),
        _engine(1, 8, 4),
        Request(9, [[0, 1, 2]], [[1]], 1),
        "push",
        OK,
        "refused",
    ),
    # K1c: D's 4-token block is 2 kernel blocks, P sent one 2-token block: refused ('D has 2 uncomputed
    # blocks but P sent only 1') instead of moving P's block and zeroing the rest (vllm mode: refused).
    "K1c D blocks cover more tokens (pull)": (
        DENSE2,
        _engine(1, 2),
        _engine(1, 4, 2),
        Request(1, [[0]], [[0]]),
        "pull",
        OK,
        None,
    ),
    "K1c D blocks cover more tokens (push)": (
        DENSE2,
        _engine(1, 2),
        _engine(1, 4, 2),
        Request(1, [[0]], [[0]]),
        "push",
        OK,
        None,
    ),
    # K2: push P TP1 -> D TP4 with 2 KV heads: D ranks 1 and 3 hold replicas of heads 0 and 1; P wrote each
    # head to the first D rank holding it only (vllm mode refuses this pair).
    "K2 push into replicated KV heads": (
        DENSE2,
        _engine(1, 4),
        _engine(4, 4),
        Request(1, [[0]], [[0]]),
        "push",
        OK,
        None,
    ),
    # K2 in a hybrid (1 KV head, P TP1 -> D TP2): vLLM's refusal exempts Mamba hybrids, so vllm mode still
    # leaves D rank 1's attention unwritten.
    "K2 hybrid push into a replicated KV head": (
        ATTN1_MAMBA1,
        _engine(1, HYBRID_BLOCK, blocks=3),
        _engine(2, HYBRID_BLOCK, blocks=3),
        Request(1, [[0], [1]], [[0], [1]]),
        "push",
        OK,
        "refused",
    ),
    # K3: push P TP1 -> D TP4 of a Mamba2 state with 2 groups (and 2 heads): D replicates every piece; P cut
    # each 4-byte piece in four 1-byte chunks (half an element each). vllm mode refuses replicated pieces.
    "K3 push into a replicated SSM state": (
        MLA_MAMBA2,
        _engine(1, 4, blocks=3),
        _engine(4, 4, blocks=3),
        Request(1, [[0], [1]], [[0], [1]]),
        "push",
        OK,
        None,
    ),
    # K5: push with a prefix hit, P kernel 4 > D kernel 2: D's uncached block (tokens 4-7) got P's first
    # kernel block (tokens 0-3): P's expanded ids are clipped from the front.
    "K5 push prefix hit with P kernel > D kernel": (
        MLA,
        _engine(1, 4, blocks=3),
        _engine(1, 4, 2, blocks=3),
        Request(5, [[0, 1]], [[1]], 1),
        "push",
        OK,
        "refused",
    ),
    # K6: push P TP1 (4 heads, kernel 4) -> D TP4 (1 head, kernel 2): the first half of P's head-major page
    # is heads 0-1 of all tokens, not tokens 0-1 of all heads. Now refused in both modes.
    "K6 push ratio on a head-major page": (
        DENSE4,
        _engine(1, 4),
        _engine(4, 4, 2),
        Request(1, [[0]], [[0]]),
        "push",
        REFUSED,
        None,
    ),
    # R1: an attention-free model could not change TP (the attention block_len rule was applied to the
    # state region, or the plan failed with 'FA descriptors to split but no attention group').
    "R1 pure Mamba P TP2 -> D TP1": (
        MAMBA1,
        _engine(2, 1, blocks=2),
        _engine(1, 1, blocks=2),
        Request(1, [[0]], [[0]]),
        "pull",
        OK,
        None,
    ),
    "R1 pure Mamba P TP1 -> D TP2": (
        MAMBA1,
        _engine(1, 1, blocks=2),
        _engine(2, 1, blocks=2),
        Request(1, [[0]], [[0]]),
        "pull",
        OK,
        None,
    ),
    # R2: vllm mode's DCP pairing check compared id pairs of lists of unequal length (2 local kernel pages,
    # 4 remote) with numpy broadcasting: a raw ValueError instead of a plan or a typed refusal.
    "R2 DCP pairs of unequal length (pull)": (
        ModelSpec.from_layers("mla+ssm", [MLASpec(4, "float16"), MambaSpec.mamba1(2, 1, 2, "float16")]),
        EngineConfig(tp_size=2, block_size=4, kernel_block_size=1, num_blocks=3, dcp_size=2),
        EngineConfig(tp_size=2, block_size=2, kernel_block_size=2, num_blocks=3, dcp_size=2),
        Request(1, [[0], [1]], [[0], [1]]),
        "pull",
        OK,
        None,
    ),
}


def _outcome(name: str, compat: str) -> str:
    model, p, d, request, mode, *_ = CASES[name]
    try:
        report = run(model, p, d, request, mode, compat)
    except KvgeomError:
        return REFUSED
    assert report.ok, str(report)
    return OK


@pytest.mark.parametrize("name", sorted(CASES))
def test_kvgeom_mode_plans_or_refuses(name: str) -> None:
    assert _outcome(name, "kvgeom") == CASES[name][5]


@pytest.mark.parametrize("name", sorted(CASES))
def test_vllm_mode_never_moves_wrong_bytes(name: str) -> None:
    """vllm mode may refuse what vLLM refuses (or more), but whatever it plans must pass the oracle; where
    vLLM itself would move the wrong bytes, it refuses."""
    outcome = _outcome(name, "vllm")
    if CASES[name][6] is not None:
        assert outcome == CASES[name][6]


MLA_MAMBA1 = ModelSpec.from_layers("mla+ssm", [MLASpec(4, "float16"), MambaSpec.mamba1(2, 1, 2, "float16")])


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_p_side_replicated_state_into_fewer_d_ranks_is_refused_at_handshake(mode: str, compat: str) -> None:
    """Limitation R2: P TP8 replicates the 2 Mamba1 channels (ranks 0-3 hold channel 0, 4-7 channel 1);
    gathering 4 B from 8 sources in equal chunks is impossible, so the pair is refused at handshake (not at
    the first request) with a typed error. Reading each channel from one replica would plan it."""
    from kvgeom.testing import pull_plans, push_plans

    make = pull_plans if mode == "pull" else push_plans
    with pytest.raises(UnsupportedError, match="conv piece"):
        make(
            MLA_MAMBA1,
            _engine(8, 4, blocks=3),
            _engine(1, 4, blocks=3),
            Request(1, [[0], [1]], [[0], [1]]),
            compat,
        )


ATTN_MAMBA2 = ModelSpec.from_layers(
    "attn+ssm", [AttentionSpec(2, 4, "float16"), MambaSpec.mamba2(4, 2, 2, 2, 4, "float16")]
)
ATTN_MAMBA2_BLOCK = align_hybrid_block_size(ATTN_MAMBA2, 1, 4, 4)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_mixed_conv_layouts_are_refused_at_any_tp(tp: int, mode: str, compat: str) -> None:
    """Found by mutation testing (issue 12): P with the DS conv layout and D with SD at the *same* TP size
    was accepted (the layout rule ran only when the TP sizes differ) and the plan copied DS pages into SD
    pages, so 88-92 conv bytes per rank held another (channel, position) (oracle: I2). Now refused at
    handshake naming ``conv_layout``; the same layout on both sides still plans and passes the oracle."""
    from kvgeom import IncompatiblePairError

    request = Request(1, [[0], [1]], [[0], [1]])
    for p_layout, d_layout in (("DS", "SD"), ("SD", "DS")):
        p = EngineConfig(tp_size=tp, block_size=ATTN_MAMBA2_BLOCK, num_blocks=3, conv_layout=p_layout)
        d = EngineConfig(tp_size=tp, block_size=ATTN_MAMBA2_BLOCK, num_blocks=3, conv_layout=d_layout)
        with pytest.raises(IncompatiblePairError, match="conv_layout") as err:
            run(ATTN_MAMBA2, p, d, request, mode, compat)
        assert err.value.field == "conv_layout" and set(err.value.values.values()) == {"DS", "SD"}
    for layout in ("DS", "SD"):
        same = EngineConfig(tp_size=tp, block_size=ATTN_MAMBA2_BLOCK, num_blocks=3, conv_layout=layout)
        assert run(ATTN_MAMBA2, same, same, request, mode, compat).ok


@pytest.mark.parametrize("compat", ["kvgeom", "vllm"])
def test_dcp_pull_with_unequal_vllm_page_lists_is_refused_not_a_numpy_error(compat: str) -> None:
    """Found by the CI hypothesis profile while widening the strategies (issue 12): MLA + Mamba1, DCP 2 on
    both sides, P block 4/kernel 1, D block 2/kernel 2, pull. In vllm mode vLLM's closed-form DCP pairing
    and its block-size-ratio map gave 2 local and 4 remote pages, and the planner crashed with a raw numpy
    broadcast ValueError. Now a typed refusal naming the group's block ids; kvgeom mode plans it."""
    model = ModelSpec.from_layers("mla+ssm", [MLASpec(4, "float16"), MambaSpec.mamba1(2, 1, 2, "float16")])
    p = EngineConfig(tp_size=2, block_size=4, kernel_block_size=1, num_blocks=3, dcp_size=2)
    d = EngineConfig(tp_size=2, block_size=2, kernel_block_size=2, num_blocks=3, dcp_size=2)
    request = Request(1, [[0], [1]], [[0], [1]])
    if compat == "kvgeom":
        assert run(model, p, d, request, "pull", compat).ok
        return
    with pytest.raises(UnsupportedError) as err:
        run(model, p, d, request, "pull", compat)
    assert err.value.field == "block_ids[0]" and err.value.values == {"local": 2, "remote": 4}
