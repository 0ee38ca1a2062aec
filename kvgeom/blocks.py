"""Block-id algebra of vLLM's NIXL connector (vLLM-compatible; docs/vllm-behaviour.md B.1, B.3.5,
B.3.6, B.6.1 item 8).

Block ids are per KV-cache group: a sequence with one id list (or 1-D int array) per group, in group
order. Group kinds are passed as ``group_is_ssm`` (True for Mamba/SSM groups). Every function returns
fresh ``int64`` arrays (one per group) and never mutates its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvgeom.errors import BlockIdError, GroupMismatchError, KvgeomError, PlanError, RatioError

__all__ = [
    "BlockIds",
    "as_ids",
    "as_group_ids",
    "check_distinct",
    "check_positive_int",
    "logical_to_kernel",
    "get_mapped_blocks",
    "map_block_ids_for_block_size_ratio",
    "apply_prefix_caching",
]

IdsLike = Sequence[int] | np.ndarray
BlockIds = Sequence[IdsLike]


def check_positive_int(
    value: Any, field: str, minimum: int = 1, error: type[KvgeomError] = RatioError
) -> int:
    """``value`` as an ``int`` if it is an integer ``>= minimum``, else ``error`` (default
    :class:`RatioError`) naming ``field``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(field, f"must be an integer >= {minimum}, got {value!r}", value=value)
    if value < minimum:
        raise error(field, f"must be >= {minimum}, got {value}", value=int(value))
    return int(value)


def as_ids(ids: IdsLike, field: str) -> np.ndarray:
    """One id list as a 1-D ``int64`` array; :class:`BlockIdError` if it is not 1-D integers >= 0."""
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise BlockIdError(
            field, f"must be a flat list of integer block ids, got {arr.dtype} of shape {arr.shape}"
        )
    arr = arr.astype(np.int64, copy=True)
    if arr.min() < 0:
        i = int(np.flatnonzero(arr < 0)[0])
        raise BlockIdError(
            field, f"block ids must be >= 0, got {int(arr[i])} at position {i}", value=int(arr[i])
        )
    return arr


def as_group_ids(block_ids: BlockIds, group_is_ssm: Sequence[bool], field: str) -> list[np.ndarray]:
    """Per-group ids as ``int64`` arrays; :class:`BlockIdError` unless ``block_ids`` holds one id list
    per KV-cache group, :class:`GroupMismatchError` if the group count differs."""
    shape = f"one id list per KV-cache group ({len(group_is_ssm)} groups, in geometry.groups order)"
    if isinstance(block_ids, np.ndarray) and block_ids.ndim == 1 and block_ids.dtype != object:
        raise BlockIdError(field, f"must be {shape}, got a flat array")
    if not isinstance(block_ids, (Sequence, np.ndarray)) or isinstance(block_ids, (str, bytes)):
        raise BlockIdError(field, f"must be {shape}, got {type(block_ids).__name__}", value=block_ids)
    if any(isinstance(g, (int, np.integer)) for g in block_ids):
        raise BlockIdError(field, f"must be {shape}, got a flat list of ids", value=list(block_ids)[:8])
    if len(block_ids) != len(group_is_ssm):
        raise GroupMismatchError(
            field,
            f"{len(block_ids)} groups of block ids but {len(group_is_ssm)} group kinds",
            value=len(block_ids),
            expected=len(group_is_ssm),
        )
    return [as_ids(g, f"{field}[{i}]") for i, g in enumerate(block_ids)]


def check_distinct(groups: Sequence[np.ndarray], field: str) -> None:
    """Refuse a request whose block ids repeat: twice in one group (two transfers into one page), or one
    id in two groups (hybrid groups share one block pool and one page per id, so two groups would alias).
    :class:`BlockIdError` names the group(s) and the id. Vectorised: one sort over all ids."""
    sizes = [int(np.asarray(g).size) for g in groups]
    if sum(sizes) < 2:
        return
    ids = np.concatenate([np.asarray(g, dtype=np.int64).ravel() for g in groups])
    s = np.sort(ids)
    if not (s[1:] == s[:-1]).any():  # the common case: one sort, no repeat
        return
    owner = np.repeat(np.arange(len(sizes)), sizes)
    order = np.argsort(ids, kind="stable")
    dup = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if dup.size:
        i = int(dup[0])
        a, b, bid = int(owner[order[i]]), int(owner[order[i + 1]]), int(ids[order[i]])
        if a == b:
            raise BlockIdError(
                f"{field}[{a}]", f"block id {bid} appears twice in group {a}", value=bid, group=a
            )
        raise BlockIdError(
            f"{field}[{b}]",
            f"block id {bid} is in group {a} and in group {b}; groups share one "
            "block pool, so one id cannot belong to two groups",
            value=bid,
            groups=(a, b),
        )


_STEPS: dict[
    int, np.ndarray
] = {}  # ratio -> the row 0..ratio-1 (read-only): a constant, not a cache of input


def _steps(ratio: int) -> np.ndarray:
    row = _STEPS.get(ratio)
    if row is None:
        row = np.arange(ratio, dtype=np.int64)
        row.flags.writeable = False
        if len(_STEPS) < 4096:
            _STEPS[ratio] = row
    return row


def _expand(ids: np.ndarray, ratio: int) -> np.ndarray:
    """``b -> b*ratio + j`` for ``j < ratio``, id-major (the shared kernel of the two expansions)."""
    out: np.ndarray = np.add.outer(ids * ratio, _steps(ratio)).reshape(-1)
    return out


def logical_to_kernel(block_ids: BlockIds, ppl: int, group_is_ssm: Sequence[bool]) -> list[np.ndarray]:
    """Logical block ids to kernel (physical) block ids (vLLM ``logical_to_kernel_block_ids``).

    Non-SSM group: id ``b`` becomes ``b*ppl + j`` for ``j = 0..ppl-1`` (id-major, repeats kept);
    SSM groups pass through unchanged (their caches are not kernel-split). ``ppl = 1`` is the identity.
    Example: ``[[1], [2, 3]]``, ppl 2 -> ``[[2, 3], [4, 5, 6, 7]]``.
    """
    ppl = check_positive_int(ppl, "ppl")
    return kernel_of(as_group_ids(block_ids, group_is_ssm, "block_ids"), ppl, group_is_ssm)


def kernel_of(groups: list[np.ndarray], ppl: int, group_is_ssm: Sequence[bool]) -> list[np.ndarray]:
    """:func:`logical_to_kernel` on ids a planner has already checked (one ``int64`` array per group)."""
    if len(groups) != len(group_is_ssm):
        raise GroupMismatchError(
            "block_ids",
            f"{len(groups)} groups of ids for {len(group_is_ssm)} group kinds",
            value=len(groups),
            expected=len(group_is_ssm),
        )
    if ppl == 1:
        return list(groups)
    return [g if ssm else _expand(g, ppl) for g, ssm in zip(groups, group_is_ssm)]


def get_mapped_blocks(ids: IdsLike, ratio: int) -> np.ndarray:
    """Expand flat ids to a finer block granularity (vLLM ``get_mapped_blocks``).

    Each id ``b`` becomes ``b*ratio + j`` for ``j = 0..ratio-1`` (sparse and unsorted input allowed).
    """
    ratio = check_positive_int(ratio, "ratio")
    return _expand(as_ids(ids, "ids"), ratio)


def map_block_ids_for_block_size_ratio(
    local_ids: BlockIds, remote_ids: BlockIds, ratio: int, group_is_ssm: Sequence[bool]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Map local ids to the remote (smaller) block granularity (vLLM ``_map_block_ids_for_block_size_ratio``).

    ``ratio`` = local block size / remote block size. Per group: SSM groups pass through 1:1 on both
    sides; attention groups get ``local' = get_mapped_blocks(local, ratio)[:len(remote)]`` (clipped to the
    remote list; the untransferred tail is zeroed later), remote unchanged. The clip applies at
    ``ratio == 1`` too. ``local_ids == []`` as a whole (notify-only request) gives ``local = []``, and so does
    a result whose every group is empty (full prefix hit).
    """
    ratio = check_positive_int(ratio, "ratio")
    remote = as_group_ids(remote_ids, group_is_ssm, "remote_ids")
    if len(local_ids) == 0:
        return [], remote
    return map_checked(as_group_ids(local_ids, group_is_ssm, "local_ids"), remote, ratio, group_is_ssm)


def map_checked(
    local: list[np.ndarray], remote: list[np.ndarray], ratio: int, group_is_ssm: Sequence[bool]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """:func:`map_block_ids_for_block_size_ratio` on checked ids (one ``int64`` array per group)."""
    mapped = [
        loc if ssm else _expand(loc, ratio)[: len(rem)]
        for loc, rem, ssm in zip(local, remote, group_is_ssm, strict=True)
    ]
    if all(m.size == 0 for m in mapped):
        return [], remote
    return mapped, remote


def _tail(ids: np.ndarray, n: int) -> np.ndarray:
    """vLLM's ``ids[-n:]``, kept with its quirk: ``n == 0`` keeps the whole list."""
    return ids[-n:] if n else ids


def apply_prefix_caching(
    decode_ids: BlockIds,
    prefill_ids: BlockIds,
    decode_ppl: int,
    prefill_ppl: int,
    group_is_ssm: Sequence[bool],
    has_mamba: bool | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Trim kernel ids for a prefix-cache hit on the decode side (vLLM ``_apply_prefix_caching``).

    ``decode`` = D's uncomputed blocks, ``prefill`` = P's full list, ``*_ppl`` = kernel blocks per logical
    block on each side; ``has_mamba`` defaults to ``any(group_is_ssm)``. With ``n_d, n_p`` the counts:

    - no Mamba, every group: require ``n_d <= n_p``; ``prefill := prefill[-n_d:]``.
    - Mamba, SSM group: ``n_d == n_p`` keep; ``n_d > n_p`` requires ``n_d - n_p <= 1`` and takes
      ``decode[:n_p]``; ``n_p > n_d`` takes ``prefill[-n_d:]``.
    - Mamba, other group: equal ppl and ``n_d < n_p`` -> ``prefill[-n_d:]``; otherwise require
      ``|n_d - n_p| <= decode_ppl + prefill_ppl`` and front-trim both to ``min(n_d, n_p)``.

    vLLM's ``prefill[-0:]`` quirk is kept: a tail trim with ``n_d == 0`` keeps the whole prefill list.
    Every vLLM assert is a :class:`PlanError` here.
    """
    decode_ppl = check_positive_int(decode_ppl, "decode_ppl")
    prefill_ppl = check_positive_int(prefill_ppl, "prefill_ppl")
    dec = as_group_ids(decode_ids, group_is_ssm, "decode_ids")
    pre = as_group_ids(prefill_ids, group_is_ssm, "prefill_ids")
    return prefix_checked(dec, pre, decode_ppl, prefill_ppl, group_is_ssm, has_mamba)


def prefix_checked(
    dec: list[np.ndarray],
    pre: list[np.ndarray],
    decode_ppl: int,
    prefill_ppl: int,
    group_is_ssm: Sequence[bool],
    has_mamba: bool | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """:func:`apply_prefix_caching` on checked ids (one ``int64`` array per group, ppl values >= 1)."""
    mamba = any(group_is_ssm) if has_mamba is None else bool(has_mamba)
    out_d: list[np.ndarray] = []
    out_p: list[np.ndarray] = []
    for g, (d, p, ssm) in enumerate(zip(dec, pre, group_is_ssm, strict=True)):
        n_d, n_p = d.size, p.size
        if not mamba:
            if n_d > n_p:
                raise PlanError(
                    f"decode_ids[{g}]",
                    f"D has {n_d} uncomputed blocks but P sent only {n_p}",
                    value=n_d,
                    expected=n_p,
                )
            out_d.append(d)
            out_p.append(_tail(p, n_d))
        elif ssm:
            if n_d - n_p > 1:
                raise PlanError(
                    f"decode_ids[{g}]",
                    f"unpairable SSM state slots, decode={n_d} prefill={n_p}",
                    value=n_d,
                    expected=n_p,
                )
            out_d.append(d[:n_p] if n_d > n_p else d)
            out_p.append(_tail(p, n_d) if n_p > n_d else p)
        elif decode_ppl == prefill_ppl and n_d < n_p:
            out_d.append(d)
            out_p.append(_tail(p, n_d))
        else:
            max_padding = decode_ppl + prefill_ppl
            if abs(n_d - n_p) > max_padding:
                raise PlanError(
                    f"decode_ids[{g}]",
                    f"|{n_d} - {n_p}| > {max_padding}: decode and prefill kernel block counts differ by "
                    f"more than decode_ppl + prefill_ppl",
                    value=n_d,
                    expected=n_p,
                )
            m = min(n_d, n_p)
            out_d.append(d[:m])
            out_p.append(p[:m])
    return out_d, out_p
