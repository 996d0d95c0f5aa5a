"""A small SVG chart: one plot area with linear axes (x optionally log2), lines, grouped bars,
error bars, a band, a heat map, a legend beside the plot; written as text, no plotting library.
Colours ``C0``, ``C1``, ... are matplotlib's default cycle.
"""
from __future__ import annotations

import math
from html import escape
from typing import Sequence

CYCLE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
         "#17becf")
VIRIDIS = ((0.0, (68, 1, 84)), (0.25, (59, 82, 139)), (0.5, (33, 145, 140)), (0.75, (94, 201, 98)),
           (1.0, (253, 231, 37)))
LEFT, TOP, BOTTOM, LEGEND = 64, 34, 52, 230       # px: y-axis labels, title, x-axis labels, legend column


def colour(c: str) -> str:
    """``C3`` → matplotlib's fourth default colour; anything else as given."""
    return CYCLE[int(c[1:]) % len(CYCLE)] if c[:1] == "C" and c[1:].isdigit() else c


def viridis(v: float) -> str:
    v = min(1.0, max(0.0, v))
    for (a, ca), (b, cb) in zip(VIRIDIS, VIRIDIS[1:]):
        if v <= b:
            t = (v - a) / (b - a)
            return "#%02x%02x%02x" % tuple(round(x + (y - x) * t) for x, y in zip(ca, cb))
    return "#%02x%02x%02x" % VIRIDIS[-1][1]


def nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """Round tick values covering [lo, hi], about ``n`` of them (steps of 1, 2 or 5 × 10^k)."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if m * step >= raw)
    first = math.floor(lo / step + 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def fmt(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e5 else f"{v:.3g}"


def finite(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


class Chart:
    """Draw calls in data units; :meth:`svg` lays the axes out around what was drawn."""

    def __init__(self, title: str, xlabel: str | None, ylabel: str, width: int = 760, height: int = 360,
                 xlog2: bool = False, ylim: tuple[float, float] | None = None, grid: str = "both"):
        self.title, self.xlabel, self.ylabel = title, xlabel, ylabel
        self.width, self.height, self.xlog2, self.ylim, self.grid = width, height, xlog2, ylim, grid
        self.marks: list[tuple] = []          # (kind, data): drawn in order
        self.legend: list[tuple[str, str, str]] = []    # (label, colour, kind: line|dash|box|none)
        self.xs: list[float] = []
        self.ys: list[float] = []
        self.xticks: tuple[list[float], list[str], bool] | None = None
        self.heat: tuple | None = None

    # ----------------------------------------------------------------- drawing (data units)

    def line(self, xs: Sequence[float], ys: Sequence[float], label: str | None, color: str, dash: str = "",
             marker: bool = True, opacity: float = 1.0) -> None:
        pts = [(float(x), float(y)) for x, y in zip(xs, ys) if finite(y)]
        self.xs += [x for x, _ in pts]
        self.ys += [y for _, y in pts]
        self.marks.append(("line", pts, colour(color), dash, marker, opacity))
        if label:
            self.legend.append((label, colour(color), "dash" if dash else "line"))

    def bars(self, xs: Sequence[float], heights: Sequence[float], width: float, label: str, color: str) -> None:
        self.xs += [x - width / 2 for x in xs] + [x + width / 2 for x in xs]
        self.ys += [0.0, *heights]
        self.marks.append(("bars", list(zip(xs, heights)), width, colour(color)))
        self.legend.append((label, colour(color), "box"))

    def errorbars(self, xs: Sequence[float], ys: Sequence[float], lo: Sequence[float], hi: Sequence[float],
                  color: str) -> None:
        self.ys += [y - a for y, a in zip(ys, lo)] + [y + b for y, b in zip(ys, hi)]
        self.marks.append(("err", list(zip(xs, ys, lo, hi)), colour(color)))

    def hline(self, y: float, color: str, label: str | None = None, dash: str = "") -> None:
        self.ys.append(y)
        self.marks.append(("hline", y, colour(color), dash))
        if label:
            self.legend.append((label, colour(color), "dash" if dash else "line"))

    def band(self, y0: float, y1: float, color: str, label: str | None) -> None:
        self.ys += [y0, y1]
        self.marks.append(("band", y0, y1, colour(color)))
        if label:
            self.legend.append((label, colour(color), "box"))

    def heatmap(self, columns: Sequence[Sequence[float]], rows: int, scale_label: str) -> None:
        """``columns[j][i]``: the value (0..1) of row i+1 in column j; x runs 0..len-1, y 1..rows."""
        self.heat = (columns, rows, scale_label)
        self.xs += [-0.5, len(columns) - 0.5]
        self.ys += [0.5, rows + 0.5]

    def set_xticks(self, positions: Sequence[float], labels: Sequence[str], rotate: bool = False) -> None:
        self.xticks = (list(positions), list(labels), rotate)

    def note(self, label: str) -> None:
        """A legend line with no mark (e.g. how many checkpoints a heat map has)."""
        self.legend.append((label, "none", "none"))

    # ----------------------------------------------------------------- layout

    def _x_range(self) -> tuple[float, float]:
        lo, hi = min(self.xs, default=0.0), max(self.xs, default=1.0)
        if self.heat:
            return lo, hi
        if self.xlog2:
            return math.log2(lo) - 0.3, math.log2(hi) + 0.3
        pad = (hi - lo) * 0.05 or 0.5
        return lo - pad, hi + pad

    def _y_range(self) -> tuple[float, float]:
        if self.ylim:
            return self.ylim
        lo, hi = min(self.ys, default=0.0), max(self.ys, default=1.0)
        if self.heat:
            return lo, hi
        pad = (hi - lo) * 0.06 or 0.5
        return lo - pad, hi + pad

    def svg(self) -> bytes:
        legend_w = LEGEND if self.legend else 16
        right = self.width - legend_w
        bottom = self.height - BOTTOM - (24 if self.xticks and self.xticks[2] else 0)
        if self.heat:
            right -= 70                              # the colour scale
        x0, x1 = self._x_range()
        y0, y1 = self._y_range()

        def sx(x: float) -> float:
            x = math.log2(x) if self.xlog2 else x
            return LEFT + (x - x0) / ((x1 - x0) or 1) * (right - LEFT)

        def sy(y: float) -> float:
            return bottom - (y - y0) / ((y1 - y0) or 1) * (bottom - TOP)

        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
               f'viewBox="0 0 {self.width} {self.height}" font-family="DejaVu Sans, Arial, sans-serif" font-size="11">',
               f'<rect width="{self.width}" height="{self.height}" fill="white"/>',
               f'<text x="{(LEFT + right) / 2:.1f}" y="20" text-anchor="middle" font-size="13">{escape(self.title)}</text>']
        # ticks and grid
        yt = [t for t in nice_ticks(y0, y1) if y0 <= t <= y1]
        if self.heat:
            yt = [t for t in nice_ticks(1, self.heat[1]) if t == int(t) and 1 <= t <= self.heat[1]]
        for t in yt:
            y = sy(t)
            if self.grid in ("both", "y"):
                out.append(f'<line x1="{LEFT}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#000" stroke-opacity="0.12"/>')
            out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
        if self.xticks:
            xt, xl, rotate = self.xticks
        elif self.xlog2:
            xt = [2 ** k for k in range(math.ceil(x0), math.floor(x1) + 1)]
            xl, rotate = [fmt(t) for t in xt], False
        else:
            xt = [t for t in nice_ticks(x0, x1) if x0 <= t <= x1]
            xl, rotate = [fmt(t) for t in xt], False
        for t, label in zip(xt, xl):
            x = sx(t)
            if self.grid == "both":
                out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{bottom}" stroke="#000" stroke-opacity="0.12"/>')
            if rotate:
                out.append(f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="end" font-size="9" '
                           f'transform="rotate(-45 {x:.1f} {bottom + 14})">{escape(label)}</text>')
            else:
                out.append(f'<text x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{escape(label)}</text>')
        if self.heat:
            columns, rows, scale_label = self.heat
            cw, ch = (right - LEFT) / len(columns), (bottom - TOP) / rows
            for j, col in enumerate(columns):
                for i, v in enumerate(col):
                    if finite(v):
                        out.append(f'<rect x="{LEFT + j * cw:.1f}" y="{bottom - (i + 1) * ch:.1f}" width="{cw + 0.3:.1f}" '
                                   f'height="{ch + 0.3:.1f}" fill="{viridis(v)}"/>')
            sx0 = right + 20
            for k in range(20):
                out.append(f'<rect x="{sx0}" y="{bottom - (k + 1) * (bottom - TOP) / 20:.1f}" width="14" '
                           f'height="{(bottom - TOP) / 20 + 0.3:.1f}" fill="{viridis((k + 0.5) / 20)}"/>')
            for v in (0, 0.5, 1):
                out.append(f'<text x="{sx0 + 18}" y="{bottom - v * (bottom - TOP) + 4:.1f}">{fmt(v)}</text>')
            out.append(f'<text transform="translate({sx0 + 52} {(TOP + bottom) / 2:.1f}) rotate(-90)" '
                       f'text-anchor="middle">{escape(scale_label)}</text>')
        for mark in self.marks:
            kind = mark[0]
            if kind == "band":
                _, a, b, c = mark
                out.append(f'<rect x="{LEFT}" y="{sy(b):.1f}" width="{right - LEFT}" height="{sy(a) - sy(b):.1f}" '
                           f'fill="{c}" fill-opacity="0.2"/>')
            elif kind == "hline":
                _, y, c, dash = mark
                out.append(f'<line x1="{LEFT}" x2="{right}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="{c}" '
                           f'stroke-width="1.2"{_dash(dash)}/>')
            elif kind == "bars":
                _, pts, w, c = mark
                for x, h in pts:
                    top, base = sy(max(h, 0)), sy(min(h, 0))
                    out.append(f'<rect x="{sx(x - w / 2):.1f}" y="{top:.1f}" width="{sx(x + w / 2) - sx(x - w / 2):.1f}" '
                               f'height="{base - top:.1f}" fill="{c}"/>')
            elif kind == "err":
                _, pts, c = mark
                for x, y, a, b in pts:
                    px = sx(x)
                    out.append(f'<path d="M{px:.1f},{sy(y - a):.1f}V{sy(y + b):.1f}M{px - 3:.1f},{sy(y - a):.1f}h6'
                               f'M{px - 3:.1f},{sy(y + b):.1f}h6" stroke="{c}" fill="none"/>')
            elif kind == "line":
                _, pts, c, dash, marker, opacity = mark
                if len(pts) > 1:
                    d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
                    out.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="1.5" '
                               f'stroke-opacity="{opacity}"{_dash(dash)}/>')
                if marker:
                    out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{c}"/>' for x, y in pts]
        out.append(f'<rect x="{LEFT}" y="{TOP}" width="{right - LEFT}" height="{bottom - TOP}" fill="none" stroke="#333"/>')
        if self.xlabel:
            out.append(f'<text x="{(LEFT + right) / 2:.1f}" y="{self.height - 10}" text-anchor="middle">'
                       f'{escape(self.xlabel)}</text>')
        out.append(f'<text transform="translate(16 {(TOP + bottom) / 2:.1f}) rotate(-90)" text-anchor="middle">'
                   f'{escape(self.ylabel)}</text>')
        lx = self.width - legend_w + 10
        for k, (label, c, kind) in enumerate(self.legend):
            y = TOP + 8 + 16 * k
            if kind == "box":
                out.append(f'<rect x="{lx}" y="{y - 5}" width="14" height="9" fill="{c}"/>')
            elif kind != "none":
                out.append(f'<line x1="{lx}" x2="{lx + 14}" y1="{y}" y2="{y}" stroke="{c}" stroke-width="2"'
                           f'{_dash("4 2" if kind == "dash" else "")}/>')
            out.append(f'<text x="{lx + 20}" y="{y + 4}" font-size="10">{escape(_fit(label, legend_w - 34))}</text>')
        out.append("</svg>")
        return "\n".join(out).encode()


def _dash(dash: str) -> str:
    return f' stroke-dasharray="{dash}"' if dash else ""


def _fit(label: str, width_px: int) -> str:
    """A legend label cut to the legend column (about 5.6 px per character at 10 px)."""
    most = max(8, int(width_px / 5.6))
    return label if len(label) <= most else label[:most - 1] + "…"

