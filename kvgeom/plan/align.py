"""Pairing attention blocks by the tokens they hold, and zeroing what nothing wrote.

vLLM pairs a request's P and D block lists by counts (end-trim, front-trim, clip), which silently
pairs the wrong tokens when the two sides' blocks span different token ranges: P blocks larger than
D's, a prefix hit on D with different block sizes (vLLM issues and PR 51527), or a prefix hit in the
N-1 flow. kvgeom places both lists on the token axis first, from two counts a connector knows:

* ``num_tokens`` -- the tokens D holds blocks for (the request's prompt length ``N`` on D). D's list
  of ``n`` blocks of ``B`` tokens is the uncached tail of its ``ceil(N / B)`` blocks, so it starts at
  ``ceil(N / B) * B - n * B`` (a prefix hit skips whole blocks);
* ``prefill_tokens`` -- the tokens P computed and sends (vLLM's ``remote_num_tokens``). P's full-attention
  list starts at token 0 and ends at ``ceil(prefill_tokens / B)`` blocks; a sliding-window list ends
  there too. P computes fewer tokens than D holds when D recomputes the last ones itself: a Mamba
  hybrid's prefill stops at ``N - 1`` (the **N-1 flow**, :mod:`kvgeom.plan.exchange`).

The transfer is the overlap of the two lists, in units of the finer kernel block; the tokens in
``[prefill_tokens, N)`` are D's to compute. A count that is not given is never guessed from block counts:
only what holds whatever the counts are is used (P's full-attention list starts at token 0; without prefix
caching D's full-attention list does too; P's sliding-window lists end where its full-attention lists
do). Anything else is refused with a :class:`~kvgeom.errors.PlanError` that names the argument to pass.
:func:`~kvgeom.plan.request.plan_request` and :func:`~kvgeom.plan.receive.receive_step` go further: a pair made without
prefix caching is no proof that D cached nothing, so they need ``num_tokens`` for any attention list
(:class:`~kvgeom.errors.TokenCountError`).
(Equal block sizes do not make the lists end together: when P backs off across a block boundary D holds a
block more.)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvgeom.errors import PlanError
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.tokenruns import TokenRun, as_runs, layer_token_runs
from kvgeom.layout.view import EngineView, unpseudo

__all__ = ["list_starts", "overlap", "Page", "PageSet", "page_heads", "group_pages", "consumer_zero_rows"]


def _producer_end(
    n_p: int, b_p: int, prefill_tokens: int | None, sliding: bool, p_end_hint: int | None, group: int
) -> int:
    if prefill_tokens is not None:
        return math.ceil(prefill_tokens / b_p) * b_p
    if not sliding:
        return n_p * b_p  # a full-attention list starts at token 0
    if p_end_hint is not None:
        return p_end_hint
    raise PlanError(
        "prefill_tokens",
        f"group {group}: a sliding window's blocks on P end where P's computed tokens "
        "end, which its block counts do not tell here: pass prefill_tokens (the tokens P computed, "
        "vLLM's remote_num_tokens)",
        value=None,
    )


def list_starts(
    n_c: int,
    b_c: int,
    n_p: int,
    b_p: int,
    num_tokens: int | None,
    prefix_caching: bool,
    sliding: bool,
    group: int,
    prefill_tokens: int | None = None,
    *,
    p_end_hint: int | None = None,
) -> tuple[int, int]:
    """First token of the consumer's (``n_c`` blocks of ``b_c``) and the producer's (``n_p`` of ``b_p``)
    list of one attention group; ``p_end_hint``: where the producer's full-attention lists of the same
    request end (for a sliding group without ``prefill_tokens``)."""
    _check_token_counts(num_tokens, prefill_tokens)
    p_end = _producer_end(n_p, b_p, prefill_tokens, sliding, p_end_hint, group)
    p0 = p_end - n_p * b_p
    if p0 < 0 or (p0 and not sliding):
        raise PlanError(
            f"block_ids[{group}]",
            f"P's {n_p} blocks of {b_p} tokens do not end where its {p_end} "
            "computed tokens (prefill_tokens, rounded up to a block) do",
            local=n_c,
            remote=n_p,
        )
    if num_tokens is not None:
        return _counted_start(n_c, b_c, n_p, b_p, num_tokens, sliding, group, prefill_tokens), p0
    if not prefix_caching and not sliding:
        if n_c * b_c <= (n_p - 1) * b_p:  # D's whole list is shorter than what P computed: not from token 0
            raise PlanError(
                "num_tokens",
                f"group {group}: D's {n_c} blocks of {b_c} tokens hold fewer tokens than P's "
                f"{n_p} blocks of {b_p} computed (a prefix hit?): pass num_tokens (the tokens D holds "
                "blocks for) to place D's list",
                local=n_c * b_c,
                remote=n_p * b_p,
            )
        return 0, p0  # no prefix: D's list starts at token 0
    why = (
        "a prefix hit may skip its first blocks"
        if not sliding
        else "a sliding window keeps only its last blocks"
    )
    raise PlanError(
        "num_tokens",
        f"group {group}: D's list need not start at token 0 ({why}): pass the request's "
        "num_tokens (the tokens D holds blocks for) to place it",
        local=n_c,
        remote=n_p,
    )


def _check_token_counts(num_tokens: int | None, prefill_tokens: int | None) -> None:
    if num_tokens is not None and num_tokens < 1:
        raise PlanError("num_tokens", f"must be >= 1, got {num_tokens}", value=num_tokens)
    if prefill_tokens is not None:
        if prefill_tokens < 0 or (num_tokens is not None and prefill_tokens > num_tokens):
            raise PlanError(
                "prefill_tokens",
                f"{prefill_tokens} tokens computed by P for a request D holds {num_tokens} tokens of",
                value=prefill_tokens,
                expected=num_tokens,
            )


def _counted_start(
    n_c: int,
    b_c: int,
    n_p: int,
    b_p: int,
    num_tokens: int,
    sliding: bool,
    group: int,
    prefill_tokens: int | None,
) -> int:
    """The consumer list's first token from the tokens D holds blocks for (its list ends there)."""
    c_end = math.ceil(num_tokens / b_c) * b_c
    c0 = c_end - n_c * b_c
    if c0 < 0:
        raise PlanError(
            f"block_ids[{group}]",
            f"D's {n_c} blocks of {b_c} tokens are more than num_tokens={num_tokens} need",
            local=n_c,
            remote=n_p,
        )
    if (n_p - 1) * b_p >= num_tokens and prefill_tokens is None and not sliding:
        raise PlanError(
            f"block_ids[{group}]",
            f"P's {n_p} blocks of {b_p} tokens are more than num_tokens={num_tokens} need",
            local=n_c,
            remote=n_p,
        )
    return c0


def overlap(c_start: int, n_c: int, p_start: int, n_p: int) -> tuple[int, int, int]:
    """``(consumer position, producer position, count)`` of the units both lists hold."""
    lo, hi = max(c_start, p_start), min(c_start + n_c, p_start + n_p)
    count = max(0, hi - lo)
    return lo - c_start, lo - p_start, count


@dataclass(frozen=True)
class Page:
    """One layer's page of every kernel block of a region (all layers of a shared region view the same
    page): it starts ``offset`` bytes into each block, spans ``length`` bytes, blocks ``stride`` apart."""

    region: int
    offset: int
    length: int
    stride: int
    heads: int = 1  # runs per kernel block when zeroing a token range: the local heads of a head-major page
    #: the page's token runs where a token range is not one byte range per head (vLLM's CPU page, its K
    #: transposed: :mod:`kvgeom.layout.tokenruns`); a token range is then zeroed run by run, row by row
    runs: tuple[TokenRun, ...] = ()


def page_heads(geom: object, layer: str) -> int:
    """Runs of token rows in ``layer``'s head-major attention page on ``geom``: its local KV heads, twice
    that where each head holds its K rows then its V rows (``head_kv_major``, vLLM's CPU page); 1 for
    latents, states and token-major pages. A regroup or a zero range treats each run as one head."""
    spec = geom.layer_specs[layer]  # type: ignore[attr-defined]
    layout = geom.engine.kv_layout  # type: ignore[attr-defined]
    if getattr(spec, "num_kv_heads", None) is None or not layout.is_head_major:
        return 1
    return int(spec.heads_per_rank(geom.tp_size)) * int(layout.runs_per_head)  # type: ignore[attr-defined]


def group_pages(geom: object, group: int) -> list[Page]:
    """The pages of ``geom``'s (a :class:`~kvgeom.layout.geometry.RankGeometry`) layers of group ``group``: one per
    region it views, or per layer's slot in a packed row."""
    out: dict[tuple[int, int], Page] = {}
    for region in geom.regions:  # type: ignore[attr-defined]
        for g, name in region.members:
            if g == group:
                off, length = region.slot(name)
                out.setdefault(
                    (region.index, off),
                    Page(
                        region.index,
                        off,
                        length,
                        region.block_stride,
                        page_heads(geom, name),
                        _runs(geom, name),
                    ),
                )
    return list(out.values())


def streamed_pages(geom: object, view: EngineView, group: int, every: list[Page]) -> list[Page]:
    """The pages of group ``group`` (all of them: ``every``) that ``view``'s streams carry: all, unless the
    streams pair layer by layer (layer-name routing, a pipeline stage's regions), then the pages of the
    layers a stream transfers."""
    if not view.transfer_groups and (view.num_regions == geom.num_regions or view.group_streams):  # type: ignore[attr-defined]
        return every
    pages = []  # streams pair layer by layer
    regions = geom.regions  # type: ignore[attr-defined]
    for b, length, stride, g in zip(view.bases, view.block_lens, view.block_strides, view.transfer_groups):
        region, offset = unpseudo(b)
        layer = next(
            (
                name
                for gg, name in regions[region].members
                if gg == g and regions[region].slot(name)[0] == offset
            ),
            None,
        )
        if g == group and layer is not None:
            pages.append(Page(region, offset, length, stride, page_heads(geom, layer)))
    return pages


def _runs(geom: object, layer: str) -> tuple[TokenRun, ...]:
    """``layer``'s token runs where its page needs them (:attr:`Page.runs`): a CPU attention page."""
    spec = geom.layer_specs[layer]  # type: ignore[attr-defined]
    if getattr(spec, "num_kv_heads", None) is None or geom.engine.kv_layout is not KVLayout.HEAD_KV_MAJOR:  # type: ignore[attr-defined]
        return ()
    return layer_token_runs(geom, layer)


def _as_page(page: object, heads: int | None) -> Page:
    """A :class:`Page`, or a region-like value (``index``, ``block_len``, ``block_stride``: a whole block)."""
    if isinstance(page, Page):
        return page if heads is None else replace(page, heads=heads)
    return Page(page.index, 0, page.block_len, page.block_stride, heads or 1)  # type: ignore[attr-defined]


@dataclass(frozen=True, eq=False)
class PageSet:
    """Pages as the arrays :func:`consumer_zero_rows` reads (built once per pairing and group, not per
    request): ``cols`` ``(region, offset, length, stride)`` per page; per run of a head-major page (one per
    head) its page, its byte offset in the page and its bytes per token (``run_page``, ``run_offset``,
    ``run_token_bytes``)."""

    pages: tuple[Page, ...]
    cols: np.ndarray
    run_page: np.ndarray
    run_offset: np.ndarray
    run_token_bytes: np.ndarray
    tokens: int
    most_heads: int = 1  # the most runs of any page (1: no page is head-major with several heads)
    cut: bool = False  # some page is cut by token runs (:attr:`Page.runs`)
    #: per page, its whole-block row ``(region, offset, length)`` (``row_base``) and what one block id adds
    #: to it (``row_step``: ``(0, stride, 0)``), shaped ``(pages, 1, 3)``
    row_base: np.ndarray = field(default_factory=lambda: np.zeros((0, 1, 3), dtype=np.int64))
    row_step: np.ndarray = field(default_factory=lambda: np.zeros((0, 1, 3), dtype=np.int64))

    @classmethod
    def of(cls, pages: Sequence[object], tokens: int, heads: int | None = None) -> PageSet:
        """``pages`` (:class:`Page` values, or region-like values viewed whole) of kernel blocks of ``tokens``
        tokens; ``heads``: the runs of every page (default: each page's own)."""
        ps = tuple(_as_page(p, heads) for p in pages)
        cols = np.asarray([(p.region, p.offset, p.length, p.stride) for p in ps], dtype=np.int64).reshape(
            -1, 4
        )
        nheads = np.asarray([p.heads for p in ps], dtype=np.int64)
        page = np.repeat(np.arange(len(ps)), nheads)
        head = np.arange(page.size) - np.repeat(np.cumsum(nheads) - nheads, nheads)
        per_head = cols[page, 2] // nheads[page] if ps else np.zeros(0, np.int64)
        base = np.zeros((len(ps), 1, 3), dtype=np.int64)
        base[:, 0, 0], base[:, 0, 1], base[:, 0, 2] = cols[:, 0], cols[:, 1], cols[:, 2]
        step = np.zeros((len(ps), 1, 3), dtype=np.int64)
        step[:, 0, 1] = cols[:, 3]
        return cls(
            ps,
            cols,
            page,
            head * per_head,
            per_head // tokens,
            tokens,
            max(nheads.tolist(), default=1),
            any(p.runs for p in ps),
            base,
            step,
        )

    def __iter__(self) -> Iterator[Page]:
        return iter(self.pages)

    def __len__(self) -> int:
        return len(self.pages)


def consumer_zero_rows(
    pages: Sequence[object] | PageSet,
    kernel_ids: np.ndarray,
    units: int,
    first: int,
    count: int,
    tokens: int,
    heads: int | None = None,
) -> np.ndarray:
    """``(region, offset, length)`` rows zeroing the consumer's kernel blocks ``kernel_ids`` outside fine
    positions ``[first, first + count)`` (``units`` fine positions per kernel block of ``tokens`` tokens), in
    every page of ``pages`` (:class:`Page` values, or region-like values viewed whole, or a :class:`PageSet`
    of them built for ``tokens``). Head-major pages (``heads`` > 1: each page's own, or ``heads`` for all)
    zero one run per head; others one run per token range."""
    ps = pages if isinstance(pages, PageSet) and heads is None and pages.tokens == tokens else None
    if ps is None:
        ps = PageSet.of(list(pages), tokens, heads)
    cols = ps.cols
    size = int(kernel_ids.size)
    n = size * units
    lo, hi = first, first + count
    # blocks [0, a) and [b, size) lie wholly outside [lo, hi); at most the blocks a and b - 1 lie partly in it
    a = min(max(lo // units, 0), size)
    b = min(max(-(-hi // units), a), size)
    ids = kernel_ids[:a] if b >= size else np.concatenate([kernel_ids[:a], kernel_ids[b:]])
    # every page of the whole blocks at once: (region, offset + id * stride, length), page-major
    whole: np.ndarray = (ids[None, :, None] * ps.row_step + ps.row_base).reshape(-1, 3)
    gaps = []  # (kernel block, first token, end token) of the partly covered blocks: at most two
    for k in sorted({a, b - 1}) if b > a else ():
        start, end = k * units, (k + 1) * units
        if start >= lo and end <= hi:
            continue
        for x, y in ((start, max(start, lo)), (min(end, hi), end)):
            if x < y <= n:
                gaps.append(
                    (int(kernel_ids[k]), (x - start) * tokens // units, (y - start) * tokens // units)
                )
    if not gaps:
        return whole
    if ps.cut:
        return _cut_gap_rows(whole, list(ps.pages), cols, gaps, tokens)
    # one run per (gap, page, head), all at once
    page, tok = ps.run_page, ps.run_token_bytes
    g = np.asarray(gaps, dtype=np.int64)
    out = np.empty((len(gaps), page.size, 3), dtype=np.int64)
    out[..., 0] = cols[page, 0]
    out[..., 1] = g[:, 0, None] * cols[page, 3] + cols[page, 1] + g[:, 1, None] * tok + ps.run_offset
    out[..., 2] = (g[:, 2, None] - g[:, 1, None]) * tok
    return np.concatenate([whole, out.reshape(-1, 3)])


def _cut_gap_rows(
    whole: np.ndarray, pages: list[Page], cols: np.ndarray, gaps: list[tuple[int, int, int]], tokens: int
) -> np.ndarray:
    """:func:`consumer_zero_rows`' rows of the partly covered blocks where some page is cut by token runs:
    the whole blocks' rows, then one row per (gap, page, run, row) of the cut pages, then one run per (gap,
    page, head) of the others."""
    rows = [whole]
    cut = [k for k, p in enumerate(pages) if p.runs]
    for k in cut:  # pages cut by token runs: one row per (gap, page, run, row)
        p = pages[k]
        start, tb = as_runs(p.runs).shift(p.offset).expand()  # each row's token 0 and its bytes per token
        g = np.asarray(gaps, dtype=np.int64)
        out = np.empty((len(gaps), start.size, 3), dtype=np.int64)
        out[..., 0] = p.region
        out[..., 1] = g[:, 0, None] * p.stride + start[None, :] + g[:, 1, None] * tb[None, :]
        out[..., 2] = (g[:, 2, None] - g[:, 1, None]) * tb[None, :]
        rows.append(out.reshape(-1, 3))
    keep = [k for k, p in enumerate(pages) if not p.runs]
    pages, cols = [pages[k] for k in keep], cols[keep]
    if pages:  # one run per (gap, page, head), all at once
        nheads = np.asarray([p.heads for p in pages], dtype=np.int64)
        page = np.repeat(np.arange(len(pages)), nheads)
        head = np.arange(page.size) - np.repeat(np.cumsum(nheads) - nheads, nheads)
        per_head = cols[page, 2] // nheads[page]
        tok = per_head // tokens
        g = np.asarray(gaps, dtype=np.int64)
        out = np.empty((len(gaps), page.size, 3), dtype=np.int64)
        out[..., 0] = cols[page, 0]
        out[..., 1] = g[:, 0, None] * cols[page, 3] + cols[page, 1] + g[:, 1, None] * tok + head * per_head
        out[..., 2] = (g[:, 2, None] - g[:, 1, None]) * tok
        rows.append(out.reshape(-1, 3))
    return np.concatenate(rows).astype(np.int64)
