"""The plots of reports and comparisons, as SVG bytes (``series`` = [(label, metrics)], one
colour per series), drawn by :mod:`orchestrator.reports.svg`. A plot with nothing to set side by
side (one category, one acceptance length) is not drawn: None, as for no data.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .svg import Chart


def _grouped_bars(chart: Chart, series, positions: Sequence[float], value) -> None:
    """One bar per series at each position, side by side; ``value(metrics, j)`` is bar j's height."""
    width = 0.8 / len(series)
    for i, (label, m) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in positions]
        chart.bars(xs, [value(m, j) for j in range(len(positions))], width, label, f"C{i}")


def per_position(m: dict) -> tuple[Optional[list], str]:
    """A run's per-position acceptance and what it is: its walk's, or offline at T > 0 (no walk) the
    expected one (remote/contract/metrics.py ``expected_summary``), labelled an estimate."""
    if m.get("expected"):
        return m["expected"].get("per_position_acceptance"), " (expected, an estimate)"
    return m.get("per_position_acceptance"), ""


def category_tau(m: dict, category: str) -> Optional[float]:
    """A run's τ macro in a category (offline at T > 0: the expected τ macro)."""
    c = (m.get("categories") or {}).get(category) or {}
    return ((c.get("expected") or {}) if m.get("expected") else c).get("tau_macro")


def plot_per_position(series: Sequence[tuple[str, dict]], with_anchors: bool = True) -> Optional[bytes]:
    series = [(l, m) for l, m in series if per_position(m)[0]]
    if not series:
        return None
    chart = Chart("per-position acceptance", "block position k", "acceptance", ylim=(0, 1.02))
    for i, (label, m) in enumerate(series):
        ppa, what = per_position(m)
        anchors = with_anchors and m.get("all_anchors_accuracy")
        chart.line(range(1, len(ppa) + 1), ppa, f"{label}{what or (' (greedy walk)' if anchors else '')}", f"C{i}")
        if anchors:
            acc = m["all_anchors_accuracy"]
            chart.line(range(1, len(acc) + 1), acc, f"{label} (teacher-forced, all anchors)", f"C{i}", dash="5 3",
                       marker=False, opacity=0.7)
    return chart.svg()


def plot_histogram(series: Sequence[tuple[str, dict]]) -> Optional[bytes]:
    series = [(l, m) for l, m in series if m.get("cycles")]
    if not series:
        return None
    if len({k for _, m in series for k, n in m["acceptance_histogram"].items() if n}) < 2:
        return None
    chart = Chart("acceptance-length histogram", "acceptance length (tokens per cycle, bonus included)",
                  "share of cycles", grid="y")
    lengths = sorted({int(k) for _, m in series for k in m["acceptance_histogram"]})

    def share(m, j):
        h = m["acceptance_histogram"]
        return h.get(str(lengths[j]), 0) / (sum(h.values()) or 1)
    _grouped_bars(chart, series, lengths, share)
    chart.set_xticks(lengths, [str(n) for n in lengths])
    return chart.svg()


def plot_categories(series: Sequence[tuple[str, dict]]) -> Optional[bytes]:
    series = [(l, m) for l, m in series if m.get("categories")]
    if not series:
        return None
    cats = sorted({c for _, m in series for c in m["categories"]})
    if len(cats) < 2:
        return None
    expected = all(m.get("expected") for _, m in series)
    chart = Chart("expected τ per prompt category (an estimate)" if expected else "τ per prompt category", None,
                  "expected τ (macro)" if expected else "τ (macro)", grid="y")
    _grouped_bars(chart, series, range(len(cats)), lambda m, j: category_tau(m, cats[j]) or 0.0)
    chart.set_xticks(range(len(cats)), cats, rotate=len(cats) > 6)
    return chart.svg()


def plot_ddtree(series: Sequence[tuple[str, dict]]) -> Optional[bytes]:
    series = [(l, m) for l, m in series if m.get("ddtree")]
    if not series:
        return None
    chart = Chart("DDTree τ vs node budget", "DDTree node budget N", "τ (macro)", xlog2=True)
    for i, (label, m) in enumerate(series):
        bs = sorted(m["ddtree"], key=int)
        chart.line([int(b) for b in bs], [m["ddtree"][b]["tau_macro"] for b in bs], f"{label} DDTree", f"C{i}")
        if m.get("tau_macro") is not None:
            chart.hline(m["tau_macro"], f"C{i}", f"{label} DFlash (no tree)", dash="2 2")
    return chart.svg()


def plot_ddtree_costs(label: str, m: dict) -> Optional[bytes]:
    """One online run's DDTree budgets: τ (pooled) and the speedup over plain decoding against the
    budget, plain decoding and the linear DFlash decoding as lines, the fastest budget named."""
    from remote.contract.metrics import fastest_budget

    dd = m.get("ddtree") or {}
    best = fastest_budget(dd)
    if best is None:
        return None
    bs = sorted(dd, key=int)
    chart = Chart(f"{label}: DDTree τ and speed vs node budget", "DDTree node budget N",
                  "τ (tokens / cycle), speedup (× plain decoding)", xlog2=True)
    chart.line([int(b) for b in bs], [dd[b]["tau_pooled"] for b in bs], "DDTree τ (pooled)", "C0")
    chart.line([int(b) for b in bs], [dd[b].get("speedup") for b in bs], "DDTree speedup", "C1")
    chart.hline(1.0, "C7", "plain decoding (speedup 1)", dash="2 2")
    if (m.get("online") or {}).get("speedup") is not None:
        chart.hline(m["online"]["speedup"], "C1", "DFlash (no tree) speedup", dash="5 3")
    chart.note(f"fastest: N = {best} ({dd[best]['tokens_per_s']:.3g} tokens/s)")
    return chart.svg()


def plot_ddtree_stages(label: str, m: dict) -> Optional[bytes]:
    """One online run's time per cycle against the DDTree budget: the whole cycle and each stage
    (ddtree_generate's split), the linear DFlash decoding's cycle as a line."""
    from remote.contract.metrics import TREE_STAGES

    dd = {b: v for b, v in (m.get("ddtree") or {}).items() if v.get("stage_s_per_cycle")}
    if not dd:
        return None
    bs = sorted(dd, key=int)
    chart = Chart(f"{label}: DDTree time per cycle by stage", "DDTree node budget N", "ms per cycle", xlog2=True)
    chart.line([int(b) for b in bs], [1e3 * dd[b]["s_per_cycle"] for b in bs], "cycle", "C7")
    for i, stage in enumerate(TREE_STAGES):
        chart.line([int(b) for b in bs], [1e3 * dd[b]["stage_s_per_cycle"].get(stage, float("nan")) for b in bs],
                   stage.replace("_", " "), f"C{i}")
    if (m.get("online") or {}).get("s_per_cycle") is not None:
        chart.hline(1e3 * m["online"]["s_per_cycle"], "C7", "DFlash (no tree) cycle", dash="5 3")
    return chart.svg()


def plot_reliability(series: Sequence[tuple[str, dict]]) -> Optional[bytes]:
    """A confidence head's reliability (pooled over drafted positions): observed acceptance per bin of
    predicted survival, against the diagonal a calibrated head follows."""
    series = [(l, m) for l, m in series if (m.get("confidence") or {}).get("calibration")]
    if not series:
        return None
    chart = Chart("confidence head: reliability", "predicted survival (bin mean)", "observed acceptance",
                  ylim=(0, 1.02))
    chart.line([0, 1], [0, 1], "calibrated", "C7", dash="4 3", marker=False, opacity=0.6)
    for i, (label, m) in enumerate(series):
        rows = m["confidence"]["calibration"]["pooled"]["reliability"]
        chart.line([r["mean_predicted"] for r in rows], [r["observed_rate"] for r in rows], label, f"C{i}")
    return chart.svg()
