"""Exact behaviour of kvgeom.plan.exchange (hand-derived clipping, backoff, token counts, every refusal)."""

from __future__ import annotations

import numpy as np
import pytest

from kvgeom.errors import BlockIdError, GroupMismatchError, PlanError
from kvgeom.plan.exchange import (
    clip_ssm_state_blocks,
    exchange_clipped_blocks,
    prefill_backoff,
    prefill_tokens,
    sliding_window_blocks,
)


def _err(exc: pytest.ExceptionInfo, cls: type, field: str, **values: object) -> None:
    assert type(exc.value) is cls
    assert exc.value.field == field
    assert exc.value.values == values


def test_clip_ssm_state_blocks() -> None:
    # drop 2 scratch slots of [0, 0, 7, 8, 9] -> [0, 0, 7]; keep the last -> [7]
    assert clip_ssm_state_blocks([0, 0, 7, 8, 9], 2).tolist() == [7]
    # no scratch: the last slot
    assert clip_ssm_state_blocks([4, 5, 6], 0).tolist() == [6]
    # one scratch slot: [4, 5]
    assert clip_ssm_state_blocks([4, 5, 6], 1).tolist() == [5]
    # scratch count >= size: keep at least one slot (min(spec, size - 1) = 2 dropped) -> [4]
    assert clip_ssm_state_blocks([4, 5, 6], 2).tolist() == [4]
    assert clip_ssm_state_blocks([4, 5, 6], 3).tolist() == [4]
    assert clip_ssm_state_blocks([4, 5, 6], 9).tolist() == [4]
    # a single slot stays
    assert clip_ssm_state_blocks([3], 5).tolist() == [3]
    out = clip_ssm_state_blocks([], 2)
    assert out.size == 0 and out.dtype == np.int64
    assert clip_ssm_state_blocks(np.array([1, 2], dtype=np.int32), 0).dtype == np.int64


def test_clip_ssm_state_blocks_refuses() -> None:
    with pytest.raises(PlanError) as info:
        clip_ssm_state_blocks([1, 2], -1)
    _err(info, PlanError, "num_spec_blocks", value=-1)
    with pytest.raises(PlanError) as info:
        clip_ssm_state_blocks([1, 2], 1.0)
    _err(info, PlanError, "num_spec_blocks", value=1.0)
    with pytest.raises(BlockIdError) as info:
        clip_ssm_state_blocks([1, -2], 0)
    assert info.value.field == "blocks"


def test_sliding_window_blocks() -> None:
    # ceil(window / block) + 1
    assert sliding_window_blocks(32, 16) == 3  # 2 + 1
    assert sliding_window_blocks(33, 16) == 4  # 3 + 1
    assert sliding_window_blocks(1, 16) == 2  # 1 + 1
    assert sliding_window_blocks(16, 1) == 17
    assert sliding_window_blocks(0, 16) == 0  # full attention: everything
    assert sliding_window_blocks(5, 2) == 4  # ceil(2.5) = 3, + 1


def test_sliding_window_blocks_refuses() -> None:
    with pytest.raises(PlanError) as info:
        sliding_window_blocks(-1, 16)
    _err(info, PlanError, "window", value=-1)
    with pytest.raises(PlanError) as info:
        sliding_window_blocks(8, 0)
    _err(info, PlanError, "block_size", value=0)
    assert sliding_window_blocks(8, 1) == 9  # block 1 is the smallest accepted


def test_exchange_clipped_blocks() -> None:
    ids = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10], [11, 12]]
    # group 0: window of 2 blocks -> last 2; group 1: SSM with 1 scratch slot -> [6];
    # group 2: full attention, unchanged; group 3: SSM slot count 0 -> last slot [12]
    out = exchange_clipped_blocks(ids, [2, 0, 0, 0], [None, 1, None, 0])
    assert [a.tolist() for a in out] == [[3, 4], [6], [8, 9, 10], [12]]
    assert all(a.dtype == np.int64 for a in out)
    # clip_ssm=False: SSM groups pass unchanged (the window still applies)
    out = exchange_clipped_blocks(ids, [2, 0, 0, 0], [None, 1, None, 0], clip_ssm=False)
    assert [a.tolist() for a in out] == [[3, 4], [5, 6, 7], [8, 9, 10], [11, 12]]
    # a window wins over the SSM slot count of the same group
    assert [a.tolist() for a in exchange_clipped_blocks([[1, 2, 3]], [1], [0])] == [[3]]
    # a window larger than the list keeps all of it
    assert [a.tolist() for a in exchange_clipped_blocks([[1, 2]], [5], [None])] == [[1, 2]]
    # an empty SSM group stays empty
    assert [a.tolist() for a in exchange_clipped_blocks([[], [1, 2]], [0, 0], [1, None])] == [[], [1, 2]]
    # numpy window sizes work
    assert exchange_clipped_blocks([[1, 2, 3]], [np.int64(2)], [None])[0].tolist() == [2, 3]
    assert exchange_clipped_blocks([], [1, 2], [None]) == []


def test_exchange_clipped_blocks_refuses() -> None:
    with pytest.raises(GroupMismatchError) as info:
        exchange_clipped_blocks([[1], [2]], [0], [None, None])
    _err(info, GroupMismatchError, "block_ids", value=2, expected=1)
    with pytest.raises(GroupMismatchError) as info:
        exchange_clipped_blocks([[1], [2]], [0, 0], [None])
    _err(info, GroupMismatchError, "block_ids", value=2, expected=2)
    with pytest.raises(GroupMismatchError) as info:
        exchange_clipped_blocks([[1]], [0, 0], [None, None])
    _err(info, GroupMismatchError, "block_ids", value=1, expected=2)
    with pytest.raises(BlockIdError) as info:
        exchange_clipped_blocks([[1], [-1]], [0, 0], [None, None])
    assert info.value.field == "block_ids[1]"


def test_prefill_backoff() -> None:
    assert prefill_backoff(False) == 0
    assert prefill_backoff(True) == 1
    assert prefill_backoff(False, True) == 1
    assert prefill_backoff(False, bounded_replay=False) == 0
    assert prefill_backoff(True, True) == 1
    # lookahead window: n - 1 when larger
    assert prefill_backoff(False, False, 1) == 0
    assert prefill_backoff(False, False, 2) == 1
    assert prefill_backoff(False, False, 3) == 2
    assert prefill_backoff(True, False, 2) == 1
    assert prefill_backoff(True, False, 4) == 3
    assert prefill_backoff(False, True, 0) == 1
    assert prefill_backoff(False, num_prefill_lookahead_tokens=5) == 4
    with pytest.raises(PlanError) as info:
        prefill_backoff(False, False, -1)
    _err(info, PlanError, "num_prefill_lookahead_tokens", value=-1)


def test_prefill_tokens() -> None:
    assert prefill_tokens(10, 1) == 9
    assert prefill_tokens(10, 0) == 10
    assert prefill_tokens(2, 1) == 1  # N > backoff by one
    assert prefill_tokens(1, 1) == 1  # N == backoff: everything
    assert prefill_tokens(1, 2) == 1
    assert prefill_tokens(5, 3) == 2
    assert prefill_tokens(0, 0) == 0
    assert prefill_tokens(0, 1) == 0
    with pytest.raises(PlanError) as info:
        prefill_tokens(-1, 0)
    _err(info, PlanError, "num_prompt_tokens", value=-1)
    with pytest.raises(PlanError) as info:
        prefill_tokens(4, -1)
    _err(info, PlanError, "backoff", value=-1)


def lists(groups: list) -> list:
    return [g.tolist() for g in groups]


def test_ssm_lists_keep_the_running_state_only() -> None:
    assert clip_ssm_state_blocks([0, 0, 7, 8, 9], 2).tolist() == [7]  # placeholders, state, 2 scratch slots
    assert clip_ssm_state_blocks([0, 6, 7, 8, 9], 2).tolist() == [7]  # the previous state is dropped too
    assert clip_ssm_state_blocks([5], 2).tolist() == [5]  # scratch slots not allocated yet
    assert clip_ssm_state_blocks([], 2).tolist() == []
    assert lists(exchange_clipped_blocks([[1, 2, 3], [0, 0, 7, 8, 9]], [0, 0], [None, 2])) == [[1, 2, 3], [7]]
    assert lists(exchange_clipped_blocks([[1], [7, 8]], [0, 0], [None, 2], clip_ssm=False)) == [[1], [7, 8]]
    assert lists(exchange_clipped_blocks([[1, 2, 3], [7, 8, 9]], [2, 0], [None, 2])) == [[2, 3], [7]]
    assert exchange_clipped_blocks([], [0], [None]) == []
    with pytest.raises(GroupMismatchError):
        exchange_clipped_blocks([[1]], [0, 0], [None, 1])


def test_window_and_backoff() -> None:
    assert sliding_window_blocks(2048, 16) == 129 and sliding_window_blocks(0, 16) == 0
    assert sliding_window_blocks(20, 16) == 3
    assert prefill_backoff(has_mamba=True) == 1 and prefill_backoff(False) == 0
    assert prefill_backoff(False, bounded_replay=True) == 1
    assert prefill_backoff(True, num_prefill_lookahead_tokens=4) == 3
    assert prefill_tokens(17, 1) == 16 and prefill_tokens(1, 1) == 1 and prefill_tokens(10, 0) == 10
