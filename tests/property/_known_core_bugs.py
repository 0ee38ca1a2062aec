"""Open core bugs the oracle found, as predicates over generated cases.

The property tests skip (``reject``) a case that matches one of these, so that CI stays green while the
bug is open; each has a strict-xfail reproducer in ``test_core_regressions.py``. When one is fixed,
delete its entry here and the ``xfail`` there: the property tests then cover those cases again.

All three are ``compat="vllm"`` behaviour: that mode reproduces vLLM 0.33.0's pairing, which silently
moves the wrong bytes in these cases (kvgeom mode plans them correctly since commit f9a4d68).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvgeom.testing.strategies import Case


def vllm_token_span_mismatch(case: Case) -> bool:
    """K1 (vllm mode): blocks are paired by count, not token. Wrong when P's blocks cover more tokens
    than D's (non-Mamba: D gets P's *last* kernel blocks), and with a prefix hit when the logical block
    sizes differ."""
    pair, req = case.pair, case.request
    bp, bd = pair.p_engine.block_size, pair.d_engine.block_size
    n = req.num_tokens
    p_span, d_span = math.ceil(n / bp) * bp, math.ceil(n / bd) * bd
    mismatch = (p_span > d_span and not pair.model.has_ssm) or (req.prefix_blocks > 0 and bp != bd)
    return pair.compat == "vllm" and mismatch


def vllm_push_prefix_with_ratio(case: Case) -> bool:
    """K5 (vllm mode): push with a prefix hit and P kernel blocks larger than D's: P's expanded ids are
    clipped to D's count from the *front*, so D's first uncached block gets P's first block."""
    pair = case.pair
    return (pair.compat == "vllm" and pair.mode == "push" and case.request.prefix_blocks > 0
            and pair.p_engine.kernel > pair.d_engine.kernel)


def vllm_hybrid_push_misses_replicated_kv(case: Case) -> bool:
    """K2 (vllm mode, hybrids): push with D_TP > P_TP and D replicating KV heads (D_TP > KV heads): P
    writes each head to the first D rank holding it only (vLLM refuses this for non-hybrid models only)."""
    pair, model = case.pair, case.pair.model
    attn = None if model.is_mla else model.attention_spec
    p, d = pair.p_engine.tp_size, pair.d_engine.tp_size
    return (pair.compat == "vllm" and pair.mode == "push" and model.has_ssm and attn is not None and d > p
            and d > attn.num_kv_heads)


KNOWN: dict[str, Callable[[Case], bool]] = {
    "K1 vllm token span": vllm_token_span_mismatch,
    "K2 vllm hybrid push replicated KV": vllm_hybrid_push_misses_replicated_kv,
    "K5 vllm push prefix ratio": vllm_push_prefix_with_ratio,
}


def known_core_bug(case: Case) -> str | None:
    """The name of the first open core bug ``case`` runs into, else ``None``."""
    return next((name for name, hits in KNOWN.items() if hits(case)), None)
