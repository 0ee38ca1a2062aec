"""Pictures of one request's transfer: which bytes of which P rank land where on which D rank.

:func:`transfer_map` computes what a picture shows, with numpy only: for every rank of both engines and
every region, the request's blocks as byte segments; the byte moves merged into runs per (source rank,
source region, destination rank, destination region) where both sides are contiguous; and the D ranges
the post-receive step zeroes. Regions whose picture is the same (same segments, runs and zero ranges)
form one class, drawn once. :func:`ascii_art` renders the map as text (no dependency); :func:`figure`
renders it with matplotlib (the ``plot`` extra, imported only when called) and :func:`save` writes a
PNG or SVG.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvgeom.errors import ConfigError
from kvgeom.layout.allocate import rank_geometry
from kvgeom.layout.engine import KVLayout
from kvgeom.layout.geometry import RankGeometry
from kvgeom.modes import policy_of
from kvgeom.plan.receive import receive_step
from kvgeom.plan.requestplan import Regroup

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from kvgeom.tools.scenario import RequestIds, Scenario

__all__ = ["TransferMap", "transfer_map", "ascii_art", "figure", "save", "RANK_CHARS", "FORMATS"]

#: characters naming P ranks 0..61 in the text picture
RANK_CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase
#: file formats :func:`save` writes
FORMATS = ("png", "svg")
_P, _D = 0, 1


@dataclass(frozen=True, eq=False)
class TransferMap:
    """What a picture of one request shows.

    ``segments`` rows: ``(side, rank, region, offset, length, is_ssm, block)`` (side 0 = P, 1 = D; one
    row per kernel block of an attention group, or per SSM state slot, that the request holds in the
    region). ``runs`` rows: ``(src_rank, src_region, src_offset, dst_rank, dst_region, dst_offset,
    length)``, P to D, merged where both sides continue. ``zero`` rows: ``(d_rank, region, offset,
    length)``. ``classes``: regions with the same picture, each drawn once.
    """

    description: str
    mode: str
    num_tokens: int
    p_tp: int
    d_tp: int
    region_names: tuple[str, ...]
    region_members: tuple[str, ...]
    segments: np.ndarray
    runs: np.ndarray
    zero: np.ndarray
    classes: tuple[tuple[int, ...], ...]
    regrouped: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "mode": self.mode,
            "num_tokens": self.num_tokens,
            "p_tp": self.p_tp,
            "d_tp": self.d_tp,
            "regions": [
                {"index": i, "name": n, "members": m}
                for i, (n, m) in enumerate(zip(self.region_names, self.region_members))
            ],
            "region_classes": [list(c) for c in self.classes],
            "segment_columns": ["side", "rank", "region", "offset", "length", "is_ssm", "block"],
            "segments": self.segments.tolist(),
            "run_columns": [
                "src_rank",
                "src_region",
                "src_offset",
                "dst_rank",
                "dst_region",
                "dst_offset",
                "length",
            ],
            "runs": self.runs.tolist(),
            "zero_columns": ["d_rank", "region", "offset", "length"],
            "zero": self.zero.tolist(),
            "regrouped_after_receive": self.regrouped,
        }


def _segments(geom: RankGeometry, ids: tuple[tuple[int, ...], ...], side: int) -> np.ndarray:
    """The request's logical blocks of one rank as byte segments of its regions: an attention block
    spans its ``ppl`` kernel blocks, an SSM slot its state (a loop over groups and regions; the blocks
    themselves are arrays)."""
    ssm_len = geom.ssm.conv_bytes + geom.ssm.ssm_bytes if geom.ssm else 0
    out = [np.zeros((0, 7), dtype=np.int64)]
    for g, logical in zip(geom.groups, ids):
        blocks = np.asarray(logical, dtype=np.int64)
        for region in geom.regions:
            if region.member_of(g.index) is None or not blocks.size:
                continue
            rows = np.empty((blocks.size, 7), dtype=np.int64)
            rows[:, 0], rows[:, 1], rows[:, 2] = side, geom.tp_rank, region.index
            rows[:, 3] = blocks * region.block_stride * geom.ppl
            rows[:, 4] = ssm_len if g.is_ssm else (geom.ppl - 1) * region.block_stride + region.block_len
            rows[:, 5], rows[:, 6] = int(g.is_ssm), blocks
            out.append(rows)
    seg = np.concatenate(out)
    return seg[np.lexsort((seg[:, 3], seg[:, 2]))]


def _merge_runs(moves: np.ndarray) -> np.ndarray:
    """Moves merged where consecutive rows continue on both sides (same ranks and regions)."""
    if not len(moves):
        return np.zeros((0, 7), dtype=np.int64)
    m = moves[np.lexsort((moves[:, 2], moves[:, 4], moves[:, 3], moves[:, 1], moves[:, 0]))]
    same = (m[1:, [0, 1, 3, 4]] == m[:-1, [0, 1, 3, 4]]).all(axis=1)
    cont = same & (m[1:, 2] == m[:-1, 2] + m[:-1, 6]) & (m[1:, 5] == m[:-1, 5] + m[:-1, 6])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    runs: np.ndarray = m[starts].copy()
    runs[:, 6] = np.add.reduceat(m[:, 6], starts)
    return runs


def _regroup(runs: np.ndarray, step: Regroup, d_rank: int, stride: np.ndarray) -> np.ndarray:
    """``runs`` with the destination bytes of ``step``'s blocks moved to where the consumer's regroup
    puts them: a block received as ``[bsr, heads, n, b]`` is stored as ``[heads, bsr * n, b]`` (token-major
    ``step.layout``: ``[bsr * n, heads, b]``). Runs are cut at the chunks the regroup moves (``n * b``
    bytes; token-major: ``b``) (arrays, no loop over runs)."""
    n = step.tokens // step.bsr
    token_major = step.layout is KVLayout.TOKEN_MAJOR
    chunk = step.head_bytes if token_major else n * step.head_bytes
    hit = (runs[:, 3] == d_rank) & np.isin(runs[:, 4], step.regions)
    block = runs[:, 5] // stride[runs[:, 4]]
    hit &= np.isin(block, step.blocks)
    if not hit.any():
        return runs
    r = runs[hit]
    start = block[hit] * stride[r[:, 4]]
    rel = r[:, 5] - start
    first, last = rel // chunk, (rel + r[:, 6] - 1) // chunk
    counts = last - first + 1
    idx = np.repeat(np.arange(len(r)), counts)
    c = first[idx] + (np.arange(idx.size) - np.repeat(np.cumsum(counts) - counts, counts))
    lo = np.maximum(rel[idx], c * chunk)
    hi = np.minimum(rel[idx] + r[idx, 6], (c + 1) * chunk)
    pieces = r[idx].copy()
    pieces[:, 2] = r[idx, 2] + (lo - rel[idx])
    if token_major:  # chunk c = (s, h, t) of [bsr, heads, n] goes to token s * n + t, head h
        s, h, t = c // (step.heads * n), c // n % step.heads, c % n
        dest = (s * n + t) * step.heads + h
    else:
        dest = (c % step.heads) * step.bsr + c // step.heads
    pieces[:, 5] = start[idx] + dest * chunk + (lo - c * chunk)
    pieces[:, 6] = hi - lo
    return np.concatenate([runs[~hit], pieces])


def transfer_map(sc: Scenario, req: RequestIds) -> TransferMap:
    """The picture of request ``req`` of scenario ``sc`` (raises what planning raises). D bytes are
    shown where they are after the post-receive step (regrouped head-major blocks included)."""
    plans = sc.plans(req)
    moves = [p.moves(sc.pairings[r]) for r, p in plans.items()]
    runs = _merge_runs(np.concatenate(moves) if moves else np.zeros((0, 7), dtype=np.int64))
    p_geoms = [rank_geometry(sc.model, sc.prefill.with_rank(r)) for r in range(sc.prefill.tp_size)]
    d_geoms = [rank_geometry(sc.model, sc.decode.with_rank(r)) for r in range(sc.decode.tp_size)]
    # D's receive steps, (rank, regroups, zero ranges): its plans' in pull; in push kvgeom's receive_step on
    # every D rank (vLLM never zeroes in push, docs/vllm-behaviour.md B.6.1 item 9, nor permutes, B.6.15)
    if sc.mode == "pull":
        received = [(plan.consumer_rank, plan.regroup, plan.zero) for plan in plans.values()]
    elif policy_of(sc.compat).by_tokens:
        received = [
            (d.tp_rank, *receive_step(d, p_geoms[0], req.decode, req.prefill, req.num_tokens))
            for d in d_geoms
        ]
    else:
        received = []
    if any(steps for _, steps, _ in received):
        stride = np.asarray([reg.block_stride for reg in d_geoms[0].regions], dtype=np.int64)
        for rank, steps, _ in received:
            for step in steps:
                runs = _regroup(runs, step, rank, stride)
        runs = _merge_runs(runs)
    segments = np.concatenate(
        [_segments(g, req.prefill, _P) for g in p_geoms] + [_segments(g, req.decode, _D) for g in d_geoms]
    )
    zero_parts = [np.zeros((0, 4), dtype=np.int64)]
    for rank, _, z in received:
        z = np.asarray(z, dtype=np.int64).reshape(-1, 3)
        zero_parts.append(np.column_stack([np.full(len(z), rank, dtype=np.int64), z]))
    zero = np.concatenate(zero_parts)
    zero = zero[np.lexsort((zero[:, 2], zero[:, 1], zero[:, 0]))]
    geom = d_geoms[0]
    names = tuple(r.name for r in geom.regions)
    members = tuple(_members(geom, r.index) for r in geom.regions)
    classes = _classes(len(names), segments, runs, zero, members)
    regrouped = any(steps for _, steps, _ in received)
    return TransferMap(
        sc.describe(),
        sc.mode,
        req.num_tokens,
        sc.prefill.tp_size,
        sc.decode.tp_size,
        names,
        members,
        segments,
        runs,
        zero,
        classes,
        regrouped,
    )


def _members(geom: RankGeometry, region: int) -> str:
    kinds: dict[str, int] = {}
    for g, _ in geom.regions[region].members:
        k = geom.groups[g].kind.value
        kinds[k] = kinds.get(k, 0) + 1
    return " + ".join(k if n == 1 else f"{n} {k}" for k, n in kinds.items())


def _classes(
    n: int, segments: np.ndarray, runs: np.ndarray, zero: np.ndarray, members: tuple[str, ...]
) -> tuple[tuple[int, ...], ...]:
    """Group regions whose segments, runs and zero ranges are equal (one loop over regions)."""
    seen: dict[bytes, list[int]] = {}
    for r in range(n):
        key = b"|".join(
            [
                members[r].encode(),
                segments[segments[:, 2] == r][:, [0, 1, 3, 4, 5]].tobytes(),
                runs[runs[:, 1] == r][:, [0, 2, 3, 5, 6]].tobytes(),
                zero[zero[:, 1] == r][:, [0, 2, 3]].tobytes(),
            ]
        )
        seen.setdefault(key, []).append(r)
    return tuple(tuple(v) for v in seen.values())


def _ranges(regions: tuple[int, ...]) -> str:
    parts, start = [], regions[0]
    for a, b in zip(regions, regions[1:] + (-2,)):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


# -- text ------------------------------------------------------------------------------------------------
def _paint(seg: np.ndarray, width: int, spans: np.ndarray, values: np.ndarray, grid: np.ndarray) -> None:
    """Write ``values[i]`` into the cells of ``grid`` (one row per segment) whose byte midpoint lies in
    ``spans[i] = (offset, length)``; vectorised over cells and spans."""
    if not len(spans) or not len(seg):
        return
    order = np.argsort(spans[:, 0], kind="stable")
    starts, ends, vals = spans[order, 0], spans[order, 0] + spans[order, 1], values[order]
    mid = seg[:, 3:4] + (2 * np.arange(width)[None, :] + 1) * seg[:, 4:5] // (2 * width)
    i = np.searchsorted(starts, mid, side="right") - 1
    ok = (i >= 0) & (mid < ends[np.maximum(i, 0)])
    grid[ok] = vals[i[ok]]


def ascii_art(tmap: TransferMap, width: int = 64) -> str:
    """The map as text: for every D rank and region class, one line per block of the request, each
    character a ``1/width`` slice of the block's bytes: the P rank that wrote it (``RANK_CHARS``),
    ``.`` zeroed after receive, `` `` (blank) not written."""
    lines = [
        tmap.description,
        f"request of {tmap.num_tokens} tokens, {tmap.mode}: each line is one of the request's blocks on a D "
        f"rank, each character 1/{width} of its bytes: the P rank that wrote them, '.' zeroed, ' ' not written",
    ]
    if tmap.p_tp > 10:
        lines.append(
            "P ranks: 0-9 = 0-9, a-z = 10-35, A-Z = 36-61"
            + (", '#' = 62 and above (see --json)" if tmap.p_tp > len(RANK_CHARS) else "")
        )
    if tmap.regrouped:
        lines.append("(D bytes shown after the post-receive regroup of head-major blocks)")
    chars = np.array(list(RANK_CHARS) + ["#"])
    for d in range(tmap.d_tp):
        lines.append(f"D rank {d}:")
        for cls in tmap.classes:
            r = cls[0]
            label = f"region {r}" if len(cls) == 1 else f"regions {_ranges(cls)} (alike; region {r} shown)"
            lines.append(f"  {label}: {tmap.region_names[r]} ({tmap.region_members[r]})")
            seg = tmap.segments[
                (tmap.segments[:, 0] == _D) & (tmap.segments[:, 1] == d) & (tmap.segments[:, 2] == r)
            ]
            grid = np.full((len(seg), width), " ", dtype="<U1")
            mv = tmap.runs[(tmap.runs[:, 3] == d) & (tmap.runs[:, 4] == r)]
            _paint(seg, width, mv[:, [5, 6]], chars[np.minimum(mv[:, 0], len(RANK_CHARS))], grid)
            z = tmap.zero[(tmap.zero[:, 0] == d) & (tmap.zero[:, 1] == r)]
            _paint(seg, width, z[:, [2, 3]], np.full(len(z), "."), grid)
            for row, cells in zip(seg, grid):
                kind = "state" if row[5] else "block"
                lines.append(f"    {kind} {int(row[6]):6d} |{''.join(cells)}|")
    return "\n".join(lines)


# -- matplotlib ------------------------------------------------------------------------------------------
def _xmap(seg: np.ndarray, x0: float, scale: float, gap: float) -> tuple[np.ndarray, np.ndarray]:
    """Left x of every segment of one lane (segments side by side, ``gap`` apart) and its scale."""
    widths = seg[:, 4] * scale
    lefts = x0 + np.concatenate(([0.0], np.cumsum(widths[:-1] + gap)))
    return lefts, widths


def _to_x(seg: np.ndarray, lefts: np.ndarray, scale: float, offsets: np.ndarray) -> np.ndarray:
    i = np.clip(np.searchsorted(seg[:, 3], offsets, side="right") - 1, 0, max(len(seg) - 1, 0))
    return np.asarray(lefts[i] + (offsets - seg[i, 3]) * scale, dtype=float)


def _colors(n: int) -> list[Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "turbo"]
    return [cmap(i if n <= 20 else i / max(n - 1, 1)) for i in range(n)]


def figure(tmap: TransferMap, max_panels: int = 6) -> Figure:
    """A matplotlib figure of the map: one panel per region class (at most ``max_panels``), P ranks'
    bars on top, D ranks' below, bands from each P byte range to the D range it fills, zeroed D
    ranges hatched. Needs matplotlib (``pip install 'kvgeom[plot]'``)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    classes = tmap.classes[:max_panels]
    fig = Figure(figsize=(12, 0.6 + 2.5 * len(classes)), layout="constrained")
    axes = fig.subplots(len(classes), 1, squeeze=False)[:, 0]
    colors = _colors(tmap.p_tp)
    bar_h, top, bottom = 0.16, 0.78, 0.06
    for ax, cls in zip(axes, classes):
        r = cls[0]
        lanes: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, float]] = {}
        for side, tp, y in ((_P, tmap.p_tp, top), (_D, tmap.d_tp, bottom)):
            segs = [
                tmap.segments[
                    (tmap.segments[:, 0] == side) & (tmap.segments[:, 1] == k) & (tmap.segments[:, 2] == r)
                ]
                for k in range(tp)
            ]
            total = sum(int(s[:, 4].sum()) for s in segs)
            count = sum(len(s) for s in segs)
            lane_gap, seg_gap = 0.02, min(0.004, 0.2 / max(count, 1))
            usable = 1.0 - lane_gap * (tp - 1) - seg_gap * max(count - tp, 0)
            scale = usable / max(total, 1)
            x = 0.0
            for k, seg in enumerate(segs):
                lefts, widths = _xmap(seg, x, scale, seg_gap)
                lanes[(side, k)] = (seg, lefts, scale)
                face = np.where(seg[:, 5][:, None] == 1, [[0.85, 0.88, 0.95]], [[0.92, 0.92, 0.92]])
                ax.add_collection(
                    PolyCollection(
                        list(_rects(lefts, widths, y, bar_h)),
                        facecolors=face,
                        edgecolors="0.35",
                        linewidths=0.4,
                    )
                )
                _labels(ax, seg, lefts, widths, y, bar_h)
                end = lefts[-1] + widths[-1] if len(seg) else x
                name = f"{'PD'[side]}{k}"
                ax.text(
                    (x + end) / 2,
                    y + bar_h + 0.02 if side == _P else y - 0.02,
                    name,
                    ha="center",
                    va="bottom" if side == _P else "top",
                    fontsize=8,
                    fontweight="bold",
                )
                x = end + lane_gap
        runs = tmap.runs[tmap.runs[:, 1] == r]
        verts, faces = [], []
        for k in range(tmap.p_tp):
            for d in range(tmap.d_tp):
                sel = runs[(runs[:, 0] == k) & (runs[:, 3] == d)]
                if not len(sel):
                    continue
                ps, pl, psc = lanes[(_P, k)]
                ds, dl, dsc = lanes[(_D, d)]
                sx0 = _to_x(ps, pl, psc, sel[:, 2])
                sx1 = sx0 + sel[:, 6] * psc
                dx0 = _to_x(ds, dl, dsc, sel[:, 5])
                dx1 = dx0 + sel[:, 6] * dsc
                band = _merge_bands(np.column_stack([sx0, sx1, dx0, dx1]), 1e-3)
                y0, y1 = top, bottom + bar_h
                verts.append(
                    np.stack(
                        [
                            np.column_stack([band[:, 0], np.full(len(band), y0)]),
                            np.column_stack([band[:, 1], np.full(len(band), y0)]),
                            np.column_stack([band[:, 3], np.full(len(band), y1)]),
                            np.column_stack([band[:, 2], np.full(len(band), y1)]),
                        ],
                        axis=1,
                    )
                )
                faces.extend([colors[k]] * len(band))
                # the bytes P rank k sends, coloured on its own bar and where they land on D's
                verts.append(_rects(band[:, 0], band[:, 1] - band[:, 0], top, bar_h))
                verts.append(_rects(band[:, 2], band[:, 3] - band[:, 2], bottom, bar_h))
                faces.extend([colors[k]] * (2 * len(band)))
        if verts:
            ax.add_collection(
                PolyCollection(list(np.concatenate(verts)), facecolors=faces, edgecolors="none", alpha=0.55)
            )
        z = tmap.zero[tmap.zero[:, 1] == r]
        zverts = []
        for d in range(tmap.d_tp):
            zz = z[z[:, 0] == d]
            if len(zz):
                ds, dl, dsc = lanes[(_D, d)]
                x0 = _to_x(ds, dl, dsc, zz[:, 2])
                zverts.append(_rects(x0, zz[:, 3] * dsc, bottom, bar_h))
        if zverts:
            ax.add_collection(
                PolyCollection(
                    list(np.concatenate(zverts)),
                    facecolors="white",
                    edgecolors="red",
                    hatch="////",
                    linewidths=0.6,
                )
            )
        label = f"region {r}" if len(cls) == 1 else f"regions {_ranges(cls)} (alike, region {r} drawn)"
        ax.set_title(
            f"{label}: {tmap.region_names[r]} — holds {tmap.region_members[r]}", fontsize=9, loc="left"
        )
        ax.set_xlim(-0.01, 1.01)
        ax.set_ylim(-0.06, 1.06)
        ax.axis("off")
        ax.text(-0.005, top + bar_h / 2, "P", ha="right", va="center", fontsize=9)
        ax.text(-0.005, bottom + bar_h / 2, "D", ha="right", va="center", fontsize=9)
    more = len(tmap.classes) - len(classes)
    handles = [Patch(facecolor=colors[k], alpha=0.55, label=f"from P{k}") for k in range(min(tmap.p_tp, 16))]
    handles += [
        Patch(facecolor=(0.92, 0.92, 0.92), edgecolor="0.35", label="KV block of the request"),
        Patch(facecolor=(0.85, 0.88, 0.95), edgecolor="0.35", label="SSM state of the request"),
        Patch(facecolor="white", edgecolor="red", hatch="////", label="zeroed after receive"),
    ]
    fig.legend(
        handles=handles, loc="outside lower center", ncol=min(len(handles), 8), fontsize=8, frameon=False
    )
    note = f" ({more} more region classes not drawn)" if more else ""
    fig.suptitle(
        f"{tmap.description}\nrequest of {tmap.num_tokens} tokens: which P bytes fill which D bytes, per "
        f"region (widths proportional to bytes; white = not written){note}",
        fontsize=10,
    )
    return fig


def _labels(ax: Any, seg: np.ndarray, lefts: np.ndarray, widths: np.ndarray, y: float, h: float) -> None:
    """Name each segment wide enough for it inside its box (block id, or "state" for an SSM slot)."""
    texts = np.where(seg[:, 5] == 1, "state", np.char.add("blk ", seg[:, 6].astype(str)))
    wide = widths * 860 >= np.char.str_len(texts) * 4.2
    for x, w, t in zip(lefts[wide], widths[wide], texts[wide]):
        ax.text(x + w / 2, y + h / 2, t, ha="center", va="center", fontsize=6, color="0.15")


def _rects(x: np.ndarray, w: np.ndarray, y: float, h: float) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    w = np.asarray(w, dtype=float)
    out = np.empty((len(x), 4, 2))
    out[:, 0, 0], out[:, 1, 0], out[:, 2, 0], out[:, 3, 0] = x, x + w, x + w, x
    out[:, 0, 1], out[:, 1, 1], out[:, 2, 1], out[:, 3, 1] = y, y, y + h, y + h
    return out


def _merge_bands(b: np.ndarray, eps: float) -> np.ndarray:
    """Bands ``(src_x0, src_x1, dst_x0, dst_x1)`` merged where both sides touch within ``eps`` (the
    picture's resolution), so a long run of small moves is one band."""
    if len(b) < 2:
        return b
    b = b[np.argsort(b[:, 0], kind="stable")]
    cont = (np.abs(b[1:, 0] - b[:-1, 1]) <= eps) & (np.abs(b[1:, 2] - b[:-1, 3]) <= eps)
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    ends = np.concatenate((starts[1:], [len(b)])) - 1
    return np.column_stack([b[starts, 0], b[ends, 1], b[starts, 2], b[ends, 3]])


def save(tmap: TransferMap, path: str | Path, fmt: str | None = None, max_panels: int = 6) -> Path:
    """Write the picture to ``path`` as PNG or SVG (from the suffix unless ``fmt`` is given)."""
    p = Path(path)
    kind = (fmt or p.suffix.lstrip(".")).lower()
    if kind not in FORMATS:
        raise ConfigError(
            "output", f"unknown picture format {kind!r} (accepted: {', '.join(FORMATS)})", value=kind
        )
    figure(tmap, max_panels).savefig(p, format=kind, dpi=150)
    return p
