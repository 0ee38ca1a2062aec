"""Core bugs the oracle found, as predicates over generated cases.

The property tests skip (``reject``) a case that matches one of these, so that CI stays green while the
bug is open; each bug has a strict-xfail reproducer in ``test_core_regressions.py``. When the core is
fixed, delete the entry here and the ``xfail`` mark there: the property tests then cover the case again.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvgeom.spec import AttentionSpec
from kvgeom.testing.strategies import Case


def _attention(case: Case) -> AttentionSpec | None:
    return None if case.pair.model.is_mla else case.pair.model.attention_spec


def token_span_mismatch(case: Case) -> bool:
    """K1: blocks are paired by counts, not tokens. Wrong when P's blocks cover more tokens than D's
    (non-Mamba path: D's blocks get P's *last* kernel blocks), and with a prefix hit when the logical
    block sizes differ."""
    pair, req = case.pair, case.request
    bp, bd = pair.p_engine.block_size, pair.d_engine.block_size
    n = req.num_tokens
    p_span, d_span = math.ceil(n / bp) * bp, math.ceil(n / bd) * bd
    return (p_span > d_span and not pair.model.has_ssm) or (req.prefix_blocks > 0 and bp != bd)


def push_misses_replicated_kv(case: Case) -> bool:
    """K2: push with D_TP > P_TP and D replicating KV heads (D_TP > KV heads): P writes each head to the
    first D rank holding it only; the other replicas are never written."""
    pair, attn = case.pair, _attention(case)
    p, d = pair.p_engine.tp_size, pair.d_engine.tp_size
    return pair.mode == "push" and attn is not None and d > p and d > attn.num_kv_heads


def push_misses_replicated_state(case: Case) -> bool:
    """K3: push with D_TP > P_TP where D replicates an SSM shard (e.g. Mamba2 n_groups < D_TP): P cuts
    its state in D_TP / P_TP byte chunks, which is wrong for replicated pieces."""
    pair, ssm = case.pair, case.pair.model.ssm_spec
    p, d = pair.p_engine.tp_size, pair.d_engine.tp_size
    return (pair.mode == "push" and ssm is not None and d > p
            and (any(ssm.replicated_pieces(d)) or ssm.temporal.replicated(d)))


def push_prefix_with_ratio(case: Case) -> bool:
    """K5: push with a prefix hit and P kernel blocks larger than D's: P's expanded ids are clipped to
    D's count from the *front*, so D's first uncached block gets P's first block."""
    pair = case.pair
    return pair.mode == "push" and case.request.prefix_blocks > 0 and pair.p_engine.kernel > pair.d_engine.kernel


def push_ratio_cuts_head_major(case: Case) -> bool:
    """K6: push with P kernel blocks larger than D's on a head-major layout with several KV heads per P
    rank: a 1/bsr byte slice of P's [H, kb, C] page is a head slice, not a token slice."""
    pair, attn = case.pair, _attention(case)
    return (pair.mode == "push" and attn is not None and pair.p_engine.kernel > pair.d_engine.kernel
            and pair.p_engine.kv_layout.value == "head_major" and attn.heads_per_rank(pair.p_engine.tp_size) > 1)


KNOWN: dict[str, Callable[[Case], bool]] = {
    "K1 token span": token_span_mismatch,
    "K2 push replicated KV": push_misses_replicated_kv,
    "K3 push replicated state": push_misses_replicated_state,
    "K5 push prefix ratio": push_prefix_with_ratio,
    "K6 push ratio head-major": push_ratio_cuts_head_major,
}


def known_core_bug(case: Case) -> str | None:
    """The name of the first known core bug ``case`` runs into, else ``None``."""
    return next((name for name, hits in KNOWN.items() if hits(case)), None)
