"""kvgeom mode: pairing attention blocks by the tokens they hold, and zeroing what nothing wrote.

vLLM pairs a request's P and D block lists by counts (end-trim, front-trim, clip), which silently
pairs the wrong tokens when the two sides' blocks span different token ranges: P blocks larger than
D's, a prefix hit on D with different block sizes (vLLM issues and PR 51527). kvgeom places both
lists on the token axis first. A list of ``n`` blocks of ``B`` tokens ends at the request's padded end
``ceil(num_tokens / B) * B`` and so starts there minus ``n * B``; the transfer is the overlap, in units
of the finer kernel block. Without ``num_tokens`` the starts are known only when both sides use the
same block size (the lists end together) or when no prefix hit is possible (both start at token 0);
otherwise the request is refused with a :class:`~kvgeom.errors.PlanError` asking for ``num_tokens``.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import PlanError

__all__ = ["list_starts", "overlap", "consumer_zero_rows"]


def list_starts(n_c: int, b_c: int, n_p: int, b_p: int, num_tokens: int | None, prefix_caching: bool,
                sliding: bool, group: int) -> tuple[int, int]:
    """First token of the consumer's and the producer's block list of one attention group. A full
    attention producer sends the whole prompt: its list must start at token 0."""
    c0, p0 = _starts(n_c, b_c, n_p, b_p, num_tokens, prefix_caching, sliding, group)
    if p0 and not sliding:
        raise PlanError(f"block_ids[{group}]", f"the producer's {n_p} blocks of {b_p} tokens do not cover the "
                        f"consumer's {n_c} blocks of {b_c} tokens from token 0", local=n_c, remote=n_p)
    return c0, p0


def _starts(n_c: int, b_c: int, n_p: int, b_p: int, num_tokens: int | None, prefix_caching: bool,
            sliding: bool, group: int) -> tuple[int, int]:
    if num_tokens is not None:
        c0 = math.ceil(num_tokens / b_c) * b_c - n_c * b_c
        p0 = math.ceil(num_tokens / b_p) * b_p - n_p * b_p
        if c0 < 0 or p0 < 0:
            raise PlanError(f"block_ids[{group}]", f"{n_c} consumer / {n_p} producer blocks are more than "
                            f"{num_tokens} tokens need", local=n_c, remote=n_p)
        return c0, p0
    if b_c == b_p:  # both lists end at the same block boundary
        end = max(n_c, n_p) * b_c
        return end - n_c * b_c, end - n_p * b_p
    if not prefix_caching and not sliding:  # both lists start at token 0
        if abs(n_c * b_c - n_p * b_p) >= max(b_c, b_p):
            raise PlanError(f"block_ids[{group}]", f"{n_c} blocks of {b_c} tokens and {n_p} of {b_p} cannot hold the "
                            "same request from token 0 (a prefix hit?): pass num_tokens", local=n_c * b_c,
                            remote=n_p * b_p)
        return 0, 0
    raise PlanError("num_tokens", f"block sizes differ ({b_c} vs {b_p} tokens) and the lists need not start at "
                    "token 0 (prefix caching or a sliding window): pass the request's num_tokens to align them",
                    local=b_c, remote=b_p)


def overlap(c_start: int, n_c: int, p_start: int, n_p: int) -> tuple[int, int, int]:
    """``(consumer position, producer position, count)`` of the units both lists hold."""
    lo, hi = max(c_start, p_start), min(c_start + n_c, p_start + n_p)
    count = max(0, hi - lo)
    return lo - c_start, lo - p_start, count


def consumer_zero_rows(regions: list, kernel_ids: np.ndarray, units: int, first: int, count: int, tokens: int,
                       heads: int) -> np.ndarray:
    """``(region, offset, length)`` rows zeroing the consumer's kernel blocks ``kernel_ids`` outside fine
    positions ``[first, first + count)`` (``units`` fine positions per kernel block of ``tokens`` tokens).
    Head-major pages (``heads`` > 1) zero one run per head; others one run per token range."""
    n = kernel_ids.size * units
    lo, hi = first, first + count
    blocks = np.arange(kernel_ids.size)
    whole = (blocks * units >= hi) | ((blocks + 1) * units <= lo)
    inside = (blocks * units >= lo) & ((blocks + 1) * units <= hi)
    rows = []
    for r in regions:
        ids = kernel_ids[whole]
        rows.append(np.stack([np.full(ids.size, r.index), ids * r.block_stride, np.full(ids.size, r.block_len)],
                             axis=1))
    for k in np.flatnonzero(~whole & ~inside):  # at most the two blocks at the ends of the overlap
        start, end = int(k) * units, (int(k) + 1) * units
        gaps = [(start, max(start, lo)), (min(end, hi), end)]
        for a, b in gaps:
            if b <= a or b > n:
                continue
            t0, t1 = (a - start) * tokens // units, (b - start) * tokens // units
            for r in regions:
                per_head = r.block_len // heads
                tok = per_head // tokens
                base = int(kernel_ids[k]) * r.block_stride + t0 * tok
                rows.append(np.stack([np.full(heads, r.index), base + np.arange(heads) * per_head,
                                      np.full(heads, (t1 - t0) * tok)], axis=1))
    return np.concatenate(rows).astype(np.int64) if rows else np.zeros((0, 3), dtype=np.int64)
