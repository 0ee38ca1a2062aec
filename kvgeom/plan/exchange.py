"""Which blocks and tokens a request exchanges: the scheduler side of a P/D transfer.

Before any geometry, a connector decides what of a request travels:

* **blocks**: a sliding-window group keeps only the blocks its window can still read (the last
  ``ceil(window / block) + 1``); an SSM group keeps only its running-state slot -- not the speculative
  scratch slots a Mamba manager co-allocates after it, nor the null placeholders and superseded state
  before it (vLLM ``clip_ssm_state_blocks``, ``get_exchange_clipped_blocks``);
* **tokens**: P computes ``N - backoff`` of a request's ``N`` prompt tokens and D recomputes the rest.
  A Mamba hybrid needs the state after token ``N - 2`` so that D derives the last one itself (backoff 1),
  so does a sliding window that is not replayed after a load; multi-token prediction keeps its lookahead
  window off the prefiller (vLLM ``_prefill_backoff``). P's block list then ends at
  ``ceil((N - backoff) / B)`` blocks while D holds ``ceil(N / B)``: the **N-1 flow**, which
  :func:`kvgeom.plan.request.plan_request` plans from its ``num_tokens`` and ``prefill_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvgeom.blocks import BlockIds, IdsLike, as_ids, check_positive_int
from kvgeom.errors import GroupMismatchError, PlanError

__all__ = [
    "clip_ssm_state_blocks",
    "sliding_window_blocks",
    "exchange_clipped_blocks",
    "prefill_backoff",
    "prefill_tokens",
]


def clip_ssm_state_blocks(blocks: IdsLike, num_spec_blocks: int) -> np.ndarray:
    """An SSM group's exchanged slot: drop the ``num_spec_blocks`` trailing scratch slots (keeping at least
    one slot), then keep the last one, the running state. ``[0, 0, 7, 8, 9]`` with 2 -> ``[7]``."""
    ids = as_ids(blocks, "blocks")
    spec = check_positive_int(num_spec_blocks, "num_spec_blocks", 0, PlanError)
    if not ids.size:
        return ids
    scratch = min(spec, ids.size - 1)
    if scratch:
        ids = ids[:-scratch]
    return ids[-1:]


def sliding_window_blocks(window: int, block_size: int) -> int:
    """Blocks a sliding-window group exchanges: ``ceil(window / block_size) + 1`` (one more for a window
    not aligned with the blocks); 0 (everything) for a full-attention group (``window == 0``)."""
    window = check_positive_int(window, "window", 0, PlanError)
    block_size = check_positive_int(block_size, "block_size", error=PlanError)
    return math.ceil(window / block_size) + 1 if window else 0


def exchange_clipped_blocks(
    block_ids: BlockIds,
    blocks_per_window: Sequence[int],
    ssm_spec_blocks: Sequence[int | None],
    clip_ssm: bool = True,
) -> list[np.ndarray]:
    """A request's per-group block lists clipped to what it exchanges (vLLM
    ``get_exchange_clipped_blocks``, with HMA): group ``g`` with ``blocks_per_window[g] > 0`` keeps its
    last that many blocks; otherwise an SSM group (``ssm_spec_blocks[g]`` not ``None``: its scratch slot
    count) keeps :func:`clip_ssm_state_blocks` when ``clip_ssm``; other groups pass unchanged. An empty
    request (a full prefix hit) stays empty."""
    if len(block_ids) == 0:
        return []
    if len(block_ids) != len(blocks_per_window) or len(block_ids) != len(ssm_spec_blocks):
        raise GroupMismatchError(
            "block_ids",
            f"{len(block_ids)} groups of ids for {len(blocks_per_window)} "
            f"window sizes and {len(ssm_spec_blocks)} SSM slot counts",
            value=len(block_ids),
            expected=len(blocks_per_window),
        )
    out = []
    for g, (ids, window, spec) in enumerate(zip(block_ids, blocks_per_window, ssm_spec_blocks)):
        arr = as_ids(ids, f"block_ids[{g}]")
        if window:
            arr = arr[-int(window) :]
        elif clip_ssm and arr.size and spec is not None:
            arr = clip_ssm_state_blocks(arr, spec)
        out.append(arr)
    return out


def prefill_backoff(
    has_mamba: bool, bounded_replay: bool = False, num_prefill_lookahead_tokens: int = 0
) -> int:
    """Trailing prompt tokens P leaves for D to recompute (vLLM ``_prefill_backoff``): 1 for a Mamba
    hybrid or a sliding window under bounded replay, and the lookahead window of multi-token prediction
    (``num_prefill_lookahead_tokens - 1``), whichever is larger."""
    lookahead = check_positive_int(num_prefill_lookahead_tokens, "num_prefill_lookahead_tokens", 0, PlanError)
    return max(1 if (has_mamba or bounded_replay) else 0, lookahead - 1)


def prefill_tokens(num_prompt_tokens: int, backoff: int) -> int:
    """Tokens P computes, and D loads, of an ``N``-token prompt: ``N - backoff`` when ``N > backoff``, else
    ``N`` (vLLM ``_get_remote_prefill_token_count``, and P's ``_truncate_request_for_prefill``)."""
    n = check_positive_int(num_prompt_tokens, "num_prompt_tokens", 0, PlanError)
    backoff = check_positive_int(backoff, "backoff", 0, PlanError)
    return n - backoff if backoff and n > backoff else n
