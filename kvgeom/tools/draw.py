"""Pictures of one request's transfer: which bytes of which P rank land where on which D rank.

:func:`transfer_map` (:mod:`kvgeom.tools.transfermap`) computes what a picture shows, with numpy only: for
every rank of both engines and every region, the request's blocks as byte segments; the byte moves merged
into runs per (source rank, source region, destination rank, destination region) where both sides are
contiguous; and the D ranges the post-receive step zeroes. Regions whose picture is the same (same
segments, runs and zero ranges) form one class, drawn once. :func:`ascii_art` renders the map as text (no
dependency); :func:`figure` renders it with matplotlib (the ``plot`` extra, imported only when called) and
:func:`save` writes a PNG or SVG.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvgeom.errors import ConfigError
from kvgeom.tools.transfermap import D_SIDE as _D
from kvgeom.tools.transfermap import P_SIDE as _P
from kvgeom.tools.transfermap import TransferMap, transfer_map

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["TransferMap", "transfer_map", "ascii_art", "figure", "save", "RANK_CHARS", "FORMATS"]

#: characters naming P ranks 0..61 in the text picture
RANK_CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase
#: file formats :func:`save` writes
FORMATS = ("png", "svg")


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


#: bar height and the y of P's bars (top) and D's (bottom) in a panel's unit square
_BAR_H, _TOP, _BOTTOM = 0.16, 0.78, 0.06
#: a lane: its segments, their left x and the x per byte
_Lane = tuple[np.ndarray, np.ndarray, float]


def figure(tmap: TransferMap, max_panels: int = 6) -> Figure:
    """A matplotlib figure of the map: one panel per region class (at most ``max_panels``), P ranks'
    bars on top, D ranks' below, bands from each P byte range to the D range it fills, zeroed D
    ranges hatched. Needs matplotlib (``pip install 'kvgeom[plot]'``)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    classes = tmap.classes[:max_panels]
    fig = Figure(figsize=(12, 0.6 + 2.5 * len(classes)), layout="constrained")
    axes = fig.subplots(len(classes), 1, squeeze=False)[:, 0]
    colors = _colors(tmap.p_tp)
    for ax, cls in zip(axes, classes):
        _panel(ax, tmap, cls, colors)
    _legend_and_title(fig, tmap, colors, len(tmap.classes) - len(classes))
    return fig


def _panel(ax: Any, tmap: TransferMap, cls: tuple[int, ...], colors: list[Any]) -> None:
    """One region class's panel: the bars of both engines' ranks, the bands, the zeroed ranges."""
    r = cls[0]
    lanes: dict[tuple[int, int], _Lane] = {}
    for side, tp, y in ((_P, tmap.p_tp, _TOP), (_D, tmap.d_tp, _BOTTOM)):
        lanes.update(_lanes(ax, tmap, r, side, tp, y))
    _bands(ax, tmap, r, lanes, colors)
    _zeroed(ax, tmap, r, lanes)
    label = f"region {r}" if len(cls) == 1 else f"regions {_ranges(cls)} (alike, region {r} drawn)"
    ax.set_title(f"{label}: {tmap.region_names[r]} — holds {tmap.region_members[r]}", fontsize=9, loc="left")
    ax.set_xlim(-0.01, 1.01)
    ax.set_ylim(-0.06, 1.06)
    ax.axis("off")
    ax.text(-0.005, _TOP + _BAR_H / 2, "P", ha="right", va="center", fontsize=9)
    ax.text(-0.005, _BOTTOM + _BAR_H / 2, "D", ha="right", va="center", fontsize=9)


def _lanes(ax: Any, tmap: TransferMap, r: int, side: int, tp: int, y: float) -> dict[tuple[int, int], _Lane]:
    """Draw one engine's bars of region ``r`` (one lane per rank, side by side, widths by bytes) and
    return the lanes by ``(side, rank)``."""
    from matplotlib.collections import PolyCollection

    segs = [
        tmap.segments[(tmap.segments[:, 0] == side) & (tmap.segments[:, 1] == k) & (tmap.segments[:, 2] == r)]
        for k in range(tp)
    ]
    total = sum(int(s[:, 4].sum()) for s in segs)
    count = sum(len(s) for s in segs)
    lane_gap, seg_gap = 0.02, min(0.004, 0.2 / max(count, 1))
    usable = 1.0 - lane_gap * (tp - 1) - seg_gap * max(count - tp, 0)
    scale = usable / max(total, 1)
    lanes: dict[tuple[int, int], _Lane] = {}
    x = 0.0
    for k, seg in enumerate(segs):
        lefts, widths = _xmap(seg, x, scale, seg_gap)
        lanes[(side, k)] = (seg, lefts, scale)
        face = np.where(seg[:, 5][:, None] == 1, [[0.85, 0.88, 0.95]], [[0.92, 0.92, 0.92]])
        ax.add_collection(
            PolyCollection(
                list(_rects(lefts, widths, y, _BAR_H)), facecolors=face, edgecolors="0.35", linewidths=0.4
            )
        )
        _labels(ax, seg, lefts, widths, y, _BAR_H)
        end = lefts[-1] + widths[-1] if len(seg) else x
        ax.text(
            (x + end) / 2,
            y + _BAR_H + 0.02 if side == _P else y - 0.02,
            f"{'PD'[side]}{k}",
            ha="center",
            va="bottom" if side == _P else "top",
            fontsize=8,
            fontweight="bold",
        )
        x = end + lane_gap
    return lanes


def _bands(
    ax: Any, tmap: TransferMap, r: int, lanes: dict[tuple[int, int], _Lane], colors: list[Any]
) -> None:
    """Draw the bands from each P byte range of region ``r`` to the D range it fills, coloured by the
    P rank, and the same bytes coloured on both bars."""
    from matplotlib.collections import PolyCollection

    runs = tmap.runs[tmap.runs[:, 1] == r]
    verts, faces = [], []
    for k in range(tmap.p_tp):
        for d in range(tmap.d_tp):
            sel = runs[(runs[:, 0] == k) & (runs[:, 3] == d)]
            if not len(sel):
                continue
            band = _band_xs(sel, lanes[(_P, k)], lanes[(_D, d)])
            verts.append(_trapezoids(band, _TOP, _BOTTOM + _BAR_H))
            faces.extend([colors[k]] * len(band))
            # the bytes P rank k sends, coloured on its own bar and where they land on D's
            verts.append(_rects(band[:, 0], band[:, 1] - band[:, 0], _TOP, _BAR_H))
            verts.append(_rects(band[:, 2], band[:, 3] - band[:, 2], _BOTTOM, _BAR_H))
            faces.extend([colors[k]] * (2 * len(band)))
    if verts:
        ax.add_collection(
            PolyCollection(list(np.concatenate(verts)), facecolors=faces, edgecolors="none", alpha=0.55)
        )


def _band_xs(sel: np.ndarray, p_lane: _Lane, d_lane: _Lane) -> np.ndarray:
    """The runs ``sel`` from one P lane to one D lane as merged bands ``(src_x0, src_x1, dst_x0,
    dst_x1)``."""
    ps, pl, psc = p_lane
    ds, dl, dsc = d_lane
    sx0 = _to_x(ps, pl, psc, sel[:, 2])
    sx1 = sx0 + sel[:, 6] * psc
    dx0 = _to_x(ds, dl, dsc, sel[:, 5])
    dx1 = dx0 + sel[:, 6] * dsc
    return _merge_bands(np.column_stack([sx0, sx1, dx0, dx1]), 1e-3)


def _trapezoids(band: np.ndarray, y0: float, y1: float) -> np.ndarray:
    """Each band's four corners: its source range at height ``y0``, its destination range at ``y1``."""
    return np.stack(
        [
            np.column_stack([band[:, 0], np.full(len(band), y0)]),
            np.column_stack([band[:, 1], np.full(len(band), y0)]),
            np.column_stack([band[:, 3], np.full(len(band), y1)]),
            np.column_stack([band[:, 2], np.full(len(band), y1)]),
        ],
        axis=1,
    )


def _zeroed(ax: Any, tmap: TransferMap, r: int, lanes: dict[tuple[int, int], _Lane]) -> None:
    """Hatch the D ranges of region ``r`` that the post-receive step zeroes."""
    from matplotlib.collections import PolyCollection

    z = tmap.zero[tmap.zero[:, 1] == r]
    zverts = []
    for d in range(tmap.d_tp):
        zz = z[z[:, 0] == d]
        if len(zz):
            ds, dl, dsc = lanes[(_D, d)]
            x0 = _to_x(ds, dl, dsc, zz[:, 2])
            zverts.append(_rects(x0, zz[:, 3] * dsc, _BOTTOM, _BAR_H))
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


def _legend_and_title(fig: Any, tmap: TransferMap, colors: list[Any], more: int) -> None:
    """The figure's legend (P ranks' colours, up to 16, and the box kinds) and its title."""
    from matplotlib.patches import Patch

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
