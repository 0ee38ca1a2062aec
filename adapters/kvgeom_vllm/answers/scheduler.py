"""The scheduler side: which blocks and tokens a request exchanges, answered by :mod:`kvgeom.plan.exchange`."""

from __future__ import annotations

from typing import Any

from kvgeom.plan.exchange import clip_ssm_state_blocks as _kv_clip_ssm_state_blocks
from kvgeom.plan.exchange import exchange_clipped_blocks as _kv_exchange_clipped_blocks
from kvgeom.plan.exchange import prefill_backoff as _kv_prefill_backoff
from kvgeom.plan.exchange import prefill_tokens as _kv_prefill_tokens
from kvgeom.plan.exchange import sliding_window_blocks

from ._common import KVI, lists


def clip_ssm_state_blocks(blocks: list[int], num_spec_blocks: int) -> list[int]:
    """``utils.clip_ssm_state_blocks``: an SSM group's running-state slot."""
    return _kv_clip_ssm_state_blocks(blocks, num_spec_blocks).tolist()


def blocks_per_window(self: Any) -> list[int]:
    """Blocks each transfer group exchanges: a sliding window's last ``ceil(window / block) + 1``, else all
    (0). vLLM computes this list in the scheduler's ``__init__``; kvgeom's replaces it there."""
    out = []
    for g in self.kv_cache_config.transfer_groups:
        spec = g.kv_cache_spec
        sliding = isinstance(spec, KVI.SlidingWindowSpec)
        out.append(
            sliding_window_blocks(
                int(spec.sliding_window) if sliding else 0,
                int(spec.block_size) if sliding else int(self.block_size),
            )
        )
    return out


def get_exchange_clipped_blocks(self: Any, block_ids: Any, clip_ssm: bool = True) -> Any:
    """``get_exchange_clipped_blocks``: the transfer groups' lists (vLLM's group selection), each clipped to
    what it exchanges (sliding-window tail, SSM running-state slot)."""
    if len(block_ids) == 0:
        return block_ids
    block_ids = self.kv_cache_config.select_transfer_block_ids(block_ids)
    if not self._is_hma_required:
        return block_ids
    return tuple(
        lists(_kv_exchange_clipped_blocks(block_ids, self.blocks_per_sw, self._ssm_spec_blocks, clip_ssm))
    )


def prefill_backoff(self: Any) -> int:
    """``_prefill_backoff``: the trailing prompt tokens D recomputes."""
    return _kv_prefill_backoff(
        bool(self._has_mamba), bool(self._bounded_replay), int(self.vllm_config.num_prefill_lookahead_tokens)
    )


def get_remote_prefill_token_count(self: Any, num_prompt_tokens: int) -> int:
    """``_get_remote_prefill_token_count``: the prompt tokens D loads from P."""
    return _kv_prefill_tokens(int(num_prompt_tokens), int(self._prefill_backoff()))
