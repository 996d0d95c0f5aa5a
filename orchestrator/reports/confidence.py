"""A confidence head (summary's ``confidence``, remote/contract/confidence.py) between runs and
along a trajectory: its calibration paired prompt by prompt, and the few numbers a trajectory keeps.

Every statistic compared is a function of sums over prompts: ECE of the per-bin sums of predicted
survival and of acceptance, AUROC of the per-fine-bin counts of accepted and rejected positions,
Brier, the means and τ as ratios of sums. So the paired bootstrap and permutation test resample and
swap whole prompts, as for τ (:func:`orchestrator.reports.stats.paired_sums`), and each run's own
value is what confidence.py computes on the paired prompts. numpy loads only when runs are paired.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

from remote.contract import confidence as cf

NO_HEAD = "no confidence head"


def cycles_of(row: dict) -> list[cf.Cycle]:
    """A results.jsonl row's cycles as summary.json's ``confidence`` reads them: (confidences,
    acceptance length) of each cycle that has confidences."""
    return list(zip(row.get("confidences") or [], row.get("acceptance_lengths") or []))


def headline(conf: Optional[dict]) -> Optional[dict]:
    """A summary's ``confidence`` in a few numbers, as compare and a trajectory show it: the pooled
    calibration, τ predicted vs measured and the gap between them (None without a head)."""
    if not conf:
        return None
    pooled, tau = conf["calibration"]["pooled"], conf["tau"]
    predicted, measured = tau["predicted_tau"], tau["measured_tau"]
    return {"positions": pooled["n"], "cycles": tau["cycles"],
            **{k: pooled[k] for k in ("ece", "auroc", "brier", "mean_predicted", "mean_observed")},
            "predicted_tau": predicted, "measured_tau": measured,
            "tau_error": abs(predicted - measured) if predicted is not None and measured is not None else None}


# --------------------------------------------------------------------------- per-prompt sums

SCALARS = ("n", "sq", "cycles", "predicted", "measured")     # the parts of prompt_sums that are one number


def prompt_sums(cycles: Sequence[cf.Cycle], thresholds: Sequence[float]) -> dict:
    """One prompt's additive parts of every compared statistic: drafted positions ``n``, Σ predicted
    and Σ accepted per ECE bin, Σ squared error ``sq``, accepted and rejected positions per AUROC
    fine bin (``pos``, ``neg``: {bin: count}), ``cycles``, Σ τ ``predicted`` and ``measured``, and
    per threshold Σ tokens ``committed`` and ``verified``. Each part is a list (one number for
    :data:`SCALARS`) but the fine-bin counts."""
    preds, labels = [], []
    for conf, length in cycles:
        preds += cf.survival(conf)
        labels += cf.accepted(len(conf), length)
    cal = cf.calibration(preds, labels)
    p_bins, y_bins = [0.0] * cf.SGLANG_BINS, [0.0] * cf.SGLANG_BINS
    for r in cal["reliability"]:
        p_bins[r["bin"]], y_bins[r["bin"]] = r["count"] * r["mean_predicted"], r["count"] * r["observed_rate"]
    pos: dict[int, int] = {}
    neg: dict[int, int] = {}
    for s, y in zip(preds, labels):
        # clamping (1e-8 off 0 and 1) moves no survival across a 1/1024-wide bin: the raw bin is the clamped one's
        b = cf.bin_index(s, cf.SGLANG_AUROC_BINS)
        counts = pos if y else neg
        counts[b] = counts.get(b, 0) + 1
    tau = cf.predicted_tau(cycles)
    budget = cf.verify_budget_curve(cycles, thresholds)["points"]
    n_cycles = tau["cycles"]
    return {"n": [float(cal["n"])], "p_bins": p_bins, "y_bins": y_bins,
            "sq": [cal["n"] * cal["brier"] if cal["n"] else 0.0], "pos": pos, "neg": neg,
            "cycles": [float(n_cycles)], "predicted": [n_cycles * (tau["predicted_tau"] or 0.0)],
            "measured": [n_cycles * (tau["measured_tau"] or 0.0)],
            "committed": [n_cycles * (p["tau"] or 0.0) for p in budget],
            "verified": [n_cycles * (p["mean_verify_len"] or 0.0) for p in budget]}


# --------------------------------------------------------------------------- the statistics

def _auroc(pos, neg):
    """Mann–Whitney AUROC from counts per fine bin (in bin order): ties within a bin count ½."""
    import numpy as np

    below = np.cumsum(neg, axis=1) - neg
    return (pos * (below + neg / 2)).sum(axis=1) / (pos.sum(axis=1) * neg.sum(axis=1))


@dataclass(frozen=True)
class Measure:
    """A compared statistic: its key (as :func:`headline` names it), its label,
    the parts of :func:`prompt_sums` it is computed from, and the computation from their totals,
    one row per resample (a part of :data:`SCALARS` as a vector, the others as a matrix)."""
    key: str
    label: str
    parts: tuple[str, ...]
    value: Callable


MEASURES: list[Measure] = [
    Measure("ece", f"ECE ({cf.SGLANG_BINS} bins)", ("n", "p_bins", "y_bins"),
            lambda n, p, y: abs(p - y).sum(axis=1) / n),
    Measure("auroc", "AUROC", ("pos", "neg"), _auroc),
    Measure("brier", "Brier", ("n", "sq"), lambda n, sq: sq / n),
    Measure("mean_predicted", "mean predicted survival", ("n", "p_bins"), lambda n, p: p.sum(axis=1) / n),
    Measure("mean_observed", "observed acceptance", ("n", "y_bins"), lambda n, y: y.sum(axis=1) / n),
    Measure("predicted_tau", "τ predicted (1 + Σ survival)", ("cycles", "predicted"), lambda c, p: p / c),
    Measure("tau_error", "|τ predicted − measured|", ("cycles", "predicted", "measured"),
            lambda c, p, m: abs(p - m) / c),
]


def _columns(sums_a: list[dict], sums_b: list[dict]):
    """Both runs' per-prompt parts as (prompts × k) arrays, and where each part is in a row; the
    fine-bin counts keep only the bins either run uses, in bin order."""
    import numpy as np

    used = sorted({b for s in sums_a + sums_b for part in ("pos", "neg") for b in s[part]})
    parts = [part for part in sums_a[0]]
    widths = [len(used) if part in ("pos", "neg") else len(sums_a[0][part]) for part in parts]
    ends = np.cumsum(widths)
    where = {part: slice(int(end - w), int(end)) for part, w, end in zip(parts, widths, ends)}

    def row(s: dict) -> list[float]:
        return [x for part in parts for x in ([s[part].get(b, 0) for b in used] if part in ("pos", "neg")
                                               else s[part])]
    return np.array([row(s) for s in sums_a], dtype=float), np.array([row(s) for s in sums_b], dtype=float), where


def _statistic(value: Callable, parts: Sequence[str], where: dict) -> Callable:
    """``value`` of the parts, from an (m × k) array of totals (a part of :data:`SCALARS` as a vector)."""
    def of(totals):
        return value(*[totals[:, where[p]][:, 0] if p in SCALARS else totals[:, where[p]] for p in parts])
    return of


def thresholds_of(conf_a: dict, conf_b: dict) -> list[float]:
    """The verify-budget thresholds both runs' curves have, in the baseline's order."""
    theirs = {p["threshold"] for p in conf_b["verify_budget"]["points"]}
    return [p["threshold"] for p in conf_a["verify_budget"]["points"] if p["threshold"] in theirs]


def pair(rows_a: dict, rows_b: dict, ids: Sequence[str], thresholds: Sequence[float], *, resamples: int,
         seed: int, confidence: float) -> dict:
    """The confidence heads of two runs paired on the prompts ``ids`` where both have cycles with
    confidences: ``n`` such prompts, each of :data:`MEASURES` as an interval (a: the baseline's value,
    b: the other's, diff = b − a, CI, p; None where a run's value is undefined) and, per threshold, the
    verify budget's τ and verified tokens per cycle the same way."""
    from .stats import paired_sums

    ok = [i for i in ids if cycles_of(rows_a[i]) and cycles_of(rows_b[i])]
    out: dict = {"n": len(ok), "measures": {}, "verify_budget": []}
    if not ok:
        return out
    xa, xb, where = _columns([prompt_sums(cycles_of(rows_a[i]), thresholds) for i in ok],
                             [prompt_sums(cycles_of(rows_b[i]), thresholds) for i in ok])
    budget = [(t, key, lambda c, s, j=j: s[:, j] / c, ("cycles", part)) for j, t in enumerate(thresholds)
              for key, part in (("tau", "committed"), ("mean_verify_len", "verified"))]
    found = paired_sums(xa, xb, [_statistic(m.value, m.parts, where) for m in MEASURES]
                        + [_statistic(value, parts, where) for _, _, value, parts in budget],
                        resamples=resamples, seed=seed, confidence=confidence)
    found = [asdict(iv) if iv else None for iv in found]
    out["measures"] = {m.key: iv for m, iv in zip(MEASURES, found)}
    points: dict[float, dict] = {}
    for (t, key, _, _), iv in zip(budget, found[len(MEASURES):]):
        points.setdefault(t, {"threshold": t})[key] = iv
    out["verify_budget"] = list(points.values())
    return out


def pair_runs(heads: dict[str, Optional[dict]], rows: dict[str, dict], ids: Sequence[str], *, resamples: int,
              seed: int, confidence: float) -> Optional[dict]:
    """:func:`pair` for the baseline and another run (``heads``: run id → its metrics' ``confidence``,
    the baseline first; ``rows``: run id → its rows by prompt id), with ``missing``, the run ids
    that have no confidence head (then nothing is paired); None when neither has one."""
    (base, head_a), (other, head_b) = heads.items()
    if not head_a and not head_b:
        return None
    missing = [rid for rid, head in heads.items() if not head]
    if missing:
        return {"n": 0, "missing": missing, "measures": {}, "verify_budget": []}
    return {"missing": [], **pair(rows[base], rows[other], ids, thresholds_of(head_a, head_b), resamples=resamples,
                                  seed=seed, confidence=confidence)}
