"""Where a kernel block's tokens lie in an attention page, as data: the page's **token runs**.

A token run ``(offset, rows, row_stride, token_bytes)`` says that row ``r`` of token ``t`` of the page is
the ``token_bytes`` bytes at ``offset + r * row_stride + t * token_bytes`` (offsets relative to the page's
first byte in a kernel block). A page is the list of its runs; a token range ``[a, b)`` of a kernel block
is then, per run and per row, the one contiguous byte range ``offset + r * row_stride + a * token_bytes``
of ``(b - a) * token_bytes`` bytes. By layout (``kb`` kernel tokens, ``c`` bytes per token and head):

* ``HEAD_MAJOR`` (``[heads, tokens, K|V]``): one run per head, ``(h * kb * c, 1, 0, c)``;
* ``TOKEN_MAJOR`` (``[tokens, heads, K|V]``): one run, ``(0, 1, 0, heads * c)``;
* ``HEAD_KV_MAJOR`` (vLLM's CPU page, per head K transposed ``[head_size, tokens]`` then V rows
  ``[tokens, head_size]``): per head its K half as ``head_size`` rows of one element per token,
  ``(h * kb * c, head_size, kb * e, e)``, then its V half, ``(h * kb * c + kb * k_bytes, 1, 0, v_bytes)``;
* a latent (MLA): one run, ``(0, 1, 0, latent bytes)``.

kvgeom mode cuts the CPU page by these runs when P and D blocks differ in size (:func:`unit_runs`: each
finer block's every run and row is one descriptor, placed at its token range of the coarser block), and
zeroes a token range of it run by run (:func:`kvgeom.plan.align.consumer_zero_rows`).
"""

from __future__ import annotations

import numpy as np

from kvgeom.dtypes import dtype_size
from kvgeom.errors import ConfigError
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.runs import Runs

__all__ = ["TokenRun", "as_runs", "page_token_runs", "layer_token_runs", "unit_runs", "units_per_block"]

TokenRun = tuple[int, int, int, int]  # (offset, rows, row_stride, token_bytes) within one kernel block's page


def page_token_runs(
    layout: KVLayout,
    heads: int,
    tokens: int,
    k_bytes: int,
    v_bytes: int,
    elem: int,
    part: str = "kv",
) -> tuple[TokenRun, ...]:
    """The token runs of one attention page of ``tokens`` kernel tokens holding ``heads`` heads (``part``:
    ``"kv"`` both halves, ``"k"`` / ``"v"`` one of a split region's; ``k_bytes`` / ``v_bytes`` per token
    and head, ``elem`` bytes per element)."""
    halves = {
        "kv": ((0, 0, k_bytes), (1, k_bytes, v_bytes)),
        "k": ((0, 0, k_bytes),),
        "v": ((1, 0, v_bytes),),
    }
    if part not in halves:
        raise ConfigError("part", f"an attention page has part 'kv', 'k' or 'v', not {part!r}", value=part)
    pieces = halves[part]
    c = sum(size for _, _, size in pieces)
    if layout is KVLayout.TOKEN_MAJOR:
        return ((0, 1, 0, heads * c),)
    out: list[TokenRun] = []
    for h in range(heads):
        if layout is KVLayout.HEAD_MAJOR:
            out.append((h * tokens * c, 1, 0, c))
            continue
        for kv, inner, size in pieces:  # HEAD_KV_MAJOR: K transposed, V rows
            base = h * tokens * c + inner * tokens
            out.append((base, size // elem, tokens * elem, elem) if kv == 0 else (base, 1, 0, size))
    return tuple(out)


def layer_token_runs(geom: object, layer: str) -> tuple[TokenRun, ...]:
    """The token runs of ``layer``'s page on ``geom`` (a :class:`~kvgeom.layout.geometry.RankGeometry`): its
    attention page by the engine's layout, or a latent page as one run."""
    spec = geom.layer_specs[layer]  # type: ignore[attr-defined]
    eng = geom.engine  # type: ignore[attr-defined]
    region = next(r for r in geom.regions for _, name in r.members if name == layer)  # type: ignore[attr-defined]
    if getattr(spec, "num_kv_heads", None) is None:  # a latent: [tokens, latent]
        return ((0, 1, 0, int(spec.latent_size) * dtype_size(spec.dtype)),)
    e = dtype_size(spec.dtype)
    return page_token_runs(
        eng.kv_layout,
        int(spec.heads_per_rank(geom.tp_size)),  # type: ignore[attr-defined]
        int(eng.kernel),
        int(spec.head_size) * e,
        int(spec.v_size) * e,
        e,
        region.part,
    )


def units_per_block(runs: tuple[TokenRun, ...], tokens: int, unit_tokens: int) -> int:
    """Descriptors :func:`unit_runs` cuts a kernel block of ``tokens`` tokens into."""
    return (tokens // unit_tokens) * sum(rows for _, rows, _, _ in runs)


def unit_runs(runs: tuple[TokenRun, ...], tokens: int, unit_tokens: int) -> Runs:
    """A kernel block of ``tokens`` tokens cut into descriptors of ``unit_tokens`` tokens each, in the order
    (token chunk, run, row): chunk ``j`` of run ``(o, rows, s, tb)``, row ``r`` is the ``unit_tokens * tb``
    bytes at ``o + r * s + j * unit_tokens * tb``. So descriptor ``k`` of a block of ``unit_tokens`` tokens
    and descriptor ``j * U + k`` of a coarser block (``U`` per chunk) hold the same run, row and token of
    chunk ``j``, whatever the layout. Returned as :class:`~kvgeom.layout.runs.Runs` within the block, one run
    per (chunk, run), its rows ``stride`` apart."""
    if unit_tokens < 1 or tokens % unit_tokens:
        raise ConfigError(
            "unit_tokens",
            f"{unit_tokens}-token units do not cut a {tokens}-token kernel block",
            value=unit_tokens,
            expected=tokens,
        )
    page = as_runs(runs)
    chunks = tokens // unit_tokens
    units = Runs.concat([page] * chunks).units(
        np.repeat(np.arange(chunks) * unit_tokens, len(page)), unit_tokens
    )
    # a run of one row: its stride is its length (one descriptor, as a block's sub-block rows are)
    return Runs.of(
        units.base, units.length, np.where(units.count > 1, units.stride, units.length), units.count
    )


def as_runs(runs: tuple[TokenRun, ...]) -> Runs:
    """A page's token runs as :class:`~kvgeom.layout.runs.Runs`: one element per row, one token's bytes
    long (:meth:`~kvgeom.layout.runs.Runs.units` then takes a token range of every row)."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 4)
    return Runs.of(r[:, 0], r[:, 3], r[:, 2], r[:, 1])
