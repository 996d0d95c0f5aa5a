"""The plots of reports and comparisons, as PNG bytes (``series`` = [(label, metrics)], one
colour per series). matplotlib is imported inside, on the Agg backend (no pyplot), never at
module load. A plot with nothing to set side by side (one category, one acceptance length) is
not drawn: None, as for no data.
"""
from __future__ import annotations

import io
from typing import Optional, Sequence


def _figure(w: float = 7.0, h: float = 3.6):
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100)
    return fig, fig.add_subplot(111)


def _png(fig, ax, title: str, xlabel: str | None, ylabel: str, grid_axis: str = "both") -> bytes:
    ax.set_title(title)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis=grid_axis)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _grouped_bars(ax, series, positions: Sequence[float], value) -> None:
    """One bar per series at each position, side by side; ``value(metrics, j)`` is bar j's height."""
    width = 0.8 / len(series)
    for i, (label, m) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in positions]
        ax.bar(xs, [value(m, j) for j in range(len(positions))], width=width, color=f"C{i}", label=label)


def plot_per_position(series: Sequence[tuple[str, dict]], with_anchors: bool = True) -> Optional[bytes]:
    series = [(l, m) for l, m in series if m.get("per_position_acceptance")]
    if not series:
        return None
    fig, ax = _figure()
    for i, (label, m) in enumerate(series):
        ppa = m["per_position_acceptance"]
        ax.plot(range(1, len(ppa) + 1), ppa, marker="o", ms=3, color=f"C{i}",
                label=f"{label} (greedy walk)" if with_anchors and m.get("all_anchors_accuracy") else label)
        if with_anchors and m.get("all_anchors_accuracy"):
            acc = m["all_anchors_accuracy"]
            ax.plot(range(1, len(acc) + 1), acc, ls="--", color=f"C{i}", alpha=0.7,
                    label=f"{label} (teacher-forced, all anchors)")
    ax.set_ylim(0, 1.02)
    return _png(fig, ax, "per-position acceptance", "block position k", "acceptance")


def plot_histogram(series: Sequence[tuple[str, dict]]) -> Optional[bytes]:
    series = [(l, m) for l, m in series if m.get("cycles")]
    if not series:
        return None
    if len({k for _, m in series for k, n in m["acceptance_histogram"].items() if n}) < 2:
        return None
    fig, ax = _figure()
    lengths = sorted({int(k) for _, m in series for k in m["acceptance_histogram"]})

    def share(m, j):
        h = m["acceptance_histogram"]
        return h.get(str(lengths[j]), 0) / (sum(h.values()) or 1)
    _grouped_bars(ax, series, lengths, share)
    return _png(fig, ax, "acceptance-length histogram", "acceptance length (tokens per cycle, bonus included)",
                "share of cycles", grid_axis="y")


def plot_categories(series: Sequence[tuple[str, dict]]) -> Optional[bytes]:
    series = [(l, m) for l, m in series if m.get("categories")]
    if not series:
        return None
    cats = sorted({c for _, m in series for c in m["categories"]})
    if len(cats) < 2:
        return None
    fig, ax = _figure()
    _grouped_bars(ax, series, range(len(cats)),
                  lambda m, j: (m["categories"].get(cats[j]) or {}).get("tau_macro") or 0.0)
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=20 if len(cats) > 6 else 0)
    return _png(fig, ax, "τ per prompt category", None, "τ (macro)", grid_axis="y")


def plot_ddtree(series: Sequence[tuple[str, dict]]) -> Optional[bytes]:
    series = [(l, m) for l, m in series if m.get("ddtree")]
    if not series:
        return None
    fig, ax = _figure()
    for i, (label, m) in enumerate(series):
        bs = sorted(m["ddtree"], key=int)
        ax.plot([int(b) for b in bs], [m["ddtree"][b]["tau_macro"] or float("nan") for b in bs], marker="o", color=f"C{i}",
                label=f"{label} DDTree")
        if m.get("tau_macro") is not None:
            ax.axhline(m["tau_macro"], color=f"C{i}", ls=":", alpha=0.8, label=f"{label} DFlash (no tree)")
    ax.set_xscale("log", base=2)
    return _png(fig, ax, "DDTree τ vs node budget", "DDTree node budget N", "τ (macro)")
