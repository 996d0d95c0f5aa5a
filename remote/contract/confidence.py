"""Calibration of a DSpark confidence head against measured acceptance. Stdlib only.

Input: a list of cycles, each ``(confidences, acceptance_length)``: ``confidences`` are the head's
per-position acceptance probabilities (sigmoid already applied), one per drafted position in draft
order; ``acceptance_length`` counts the bonus token (1 + accepted drafts), as
:mod:`remote.contract.metrics` does. A cycle may have fewer drafted positions than others (a cut
last block): its missing positions count nowhere.

Definitions follow SGLang (sgl-project/sglang, read at commit
8320f957899e6414508844c4642603aaea3ea98e; the same code is at 0b79ccf242ea60667ef3533d2fe4e35ad8dd13aa
and, as ``dspark_confidence_metrics.py``, at 692c5f7d532f129424b57961c262bbd253b411dc). Paths are under
``python/sglang/srt/speculative/dspark_components/``.

- **Survival** of drafted position k (1-based) = c_1 · c_2 · … · c_k, the cumulative product of the
  confidences along the block (``dspark_observability.py``, ``ConfidenceMetricsProbe.maybe_observe``:
  ``torch.cumprod(torch.sigmoid(confidence_raw), dim=1)``). It is non-increasing in k.
- **Accepted** (the label): position k is accepted iff k <= acceptance_length - 1, a prefix mask
  (``maybe_observe``: ``positions < num_correct_drafts`` with 0-based positions).
- **Clamping**: every prediction is clamped to [1e-8, 1 - 1e-8] before binning, means, ECE, Brier
  and AUROC (``PerPositionConfidenceMetrics.update``, ``EPS_PROB``).
- **Bins**: ``bins`` (15) equal-width bins; bin index = floor(p · bins) clamped to 0..bins-1
  (``update``: ``(probs * num_coarse_bins).long().clamp_(0, num_coarse_bins - 1)``). Bin i covers
  [i/bins, (i+1)/bins): a lower edge belongs to the bin above it (0.2 is in bin 3 of 15), 0.0 is in
  bin 0 and 1.0 in the last bin.
- **ECE** = Σ_b (n_b / N) · |mean predicted_b − observed rate_b|; an empty bin has weight 0 and
  adds nothing (``PerPositionConfidenceMetrics.compute``).
- **AUROC** = P(score of an accepted position > score of a rejected one), ties counting ½
  (Mann–Whitney), computed here with the rank formula (R_pos − P(P+1)/2) / (P·N) on mid-ranks.
  SGLang scores each position by its fine-bin index, floor(p · 1024) clamped to 0..1023, so two
  predictions in the same 1/1024-wide bin tie (``PerPositionConfidenceMetrics._auroc_from_hist``);
  ``auroc_bins=1024`` does the same, ``auroc_bins=None`` ranks the raw (unclamped) values. Undefined
  (``None`` here, NaN in SGLang) when the position has no accepted or no rejected example.
- **Brier** = mean of (clamped survival − accepted)², on the survival, not the raw confidence
  (``update``: ``(probs - targets).pow(2)``).
- **Mean predicted / mean observed** = mean clamped survival / share accepted (``compute``:
  ``pred_mean``, ``target_mean``).
- **Reliability table**: one row per non-empty bin (SGLang lists no empty bin): bin index, range
  [i/bins, (i+1)/bins], count, mean predicted, observed rate (``compute``: ``reliability``).
- **Positions with no example**: every statistic ``None`` and an empty table (SGLang: NaN).
- SGLang reports these per drafted position only, and only on the survival; it has no pooled row
  and no metric on the raw per-position (conditional) confidence. ``pooled`` here applies the same
  definitions to every (cycle, position) pair together.

- **Predicted τ** = mean over cycles of 1 + Σ_k survival_k, beside the measured τ = mean
  acceptance length (Σ tokens / Σ cycles). SGLang's planner takes the same sum as a batch's
  expected committed tokens (``dspark_scheduler.py``, ``compute_verify_token_budget``:
  ``tau_star = num_requests + cumsum(sorted survival)``).
- **Verify budget at threshold t**: a cycle verifies its leading drafted positions whose survival is
  >= t, L_c of them, and commits min(accepted drafts, L_c) + 1 tokens. The verified tokens of a
  cycle are L_c + 1, the anchor (the position whose target logits give the bonus token) included,
  as SGLang's ``verify_lens`` count it (``kernels/schedule_verify_lens_topk.py``,
  ``schedule_verify_lens_topk_from_survival``: ``min_verify_len`` 1 plus the drafts chosen, at most
  γ + 1). t = 0 verifies every drafted position and gives back the measured τ.
- SGLang has no survival threshold of its own: its planner picks a batch-wide token budget that
  maximises expected tokens × steps per second from a profiled cost table and gives it to the
  highest survivals of the batch. The one fixed cut it applies is
  ``DSparkScheduleConfig.survival_eps`` = 1e-6 (``dspark_scheduler.py``): a drafted position whose
  survival is below it is never verified, which is all the planner does with an unprofiled (flat)
  cost table. :data:`SGLANG_SURVIVAL_EPS` is in the default sweep.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

SGLANG_BINS = 15
SGLANG_AUROC_BINS = 1024
SGLANG_EPS_PROB = 1e-8
SGLANG_SURVIVAL_EPS = 1e-6
DEFAULT_THRESHOLDS: tuple[float, ...] = (0.0, SGLANG_SURVIVAL_EPS) + tuple(i / 20 for i in range(1, 20))
VERIFY_LEN_COUNTS = "anchor + verified drafted positions (SGLang verify_lens)"

Cycle = tuple[Sequence[float], int]


def survival(confidences: Sequence[float]) -> list[float]:
    """Cumulative product of the per-position confidences along the block."""
    out: list[float] = []
    running = 1.0
    for c in confidences:
        running *= float(c)
        out.append(running)
    return out


def accepted(n_positions: int, acceptance_length: int) -> list[bool]:
    """Prefix mask: drafted position k (1-based) is accepted iff k <= acceptance_length - 1."""
    return [k <= acceptance_length - 1 for k in range(1, n_positions + 1)]


def _checked(cycles: Iterable[Cycle]) -> list[tuple[list[float], int]]:
    out = []
    for i, (confidences, acceptance_length) in enumerate(cycles):
        conf = [float(c) for c in confidences]
        if any(not 0.0 <= c <= 1.0 for c in conf):
            raise ValueError(f"cycle {i}: a confidence outside [0, 1] (or NaN): {conf}")
        if int(acceptance_length) != acceptance_length or not 1 <= acceptance_length <= len(conf) + 1:
            raise ValueError(f"cycle {i}: acceptance length {acceptance_length} is not in 1..{len(conf) + 1}")
        out.append((conf, int(acceptance_length)))
    return out


def _clamp(p: float) -> float:
    return min(max(p, SGLANG_EPS_PROB), 1.0 - SGLANG_EPS_PROB)


def bin_index(p: float, bins: int) -> int:
    """floor(p · bins) clamped to 0..bins-1 (p already clamped)."""
    return min(max(int(p * bins), 0), bins - 1)


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _bins(preds: Sequence[float], labels: Sequence[bool], bins: int) -> dict[int, tuple[list[float], list[bool]]]:
    grouped: dict[int, tuple[list[float], list[bool]]] = {}
    for p, y in zip(preds, labels):
        ps, ys = grouped.setdefault(bin_index(p, bins), ([], []))
        ps.append(p)
        ys.append(y)
    return dict(sorted(grouped.items()))


def reliability(preds: Sequence[float], labels: Sequence[bool], bins: int = SGLANG_BINS) -> list[dict]:
    """One row per non-empty bin of the (clamped) predictions."""
    return [{"bin": b, "range": [b / bins, (b + 1) / bins], "count": len(ps),
             "mean_predicted": _mean(ps), "observed_rate": _mean([float(y) for y in ys])}
            for b, (ps, ys) in _bins(preds, labels, bins).items()]


def ece(preds: Sequence[float], labels: Sequence[bool], bins: int = SGLANG_BINS) -> float | None:
    """Σ_b (n_b / N) · |mean predicted_b − observed rate_b| over the non-empty bins."""
    if not preds:
        return None
    gaps = [len(ps) * abs(_mean(ps) - _mean([float(y) for y in ys]))
            for ps, ys in _bins(preds, labels, bins).values()]
    return math.fsum(gaps) / len(preds)


def brier(preds: Sequence[float], labels: Sequence[bool]) -> float | None:
    return _mean([(p - float(y)) ** 2 for p, y in zip(preds, labels)])


def _mid_ranks(keys: Sequence[float]) -> list[float]:
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    ranks = [0.0] * len(keys)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and keys[order[end + 1]] == keys[order[start]]:
            end += 1
        for j in range(start, end + 1):
            ranks[order[j]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def auroc(preds: Sequence[float], labels: Sequence[bool], fine_bins: int | None = SGLANG_AUROC_BINS) -> float | None:
    """Mann–Whitney AUROC by the mid-rank formula; scores are fine-bin indices when ``fine_bins``
    is set (SGLang), else the values themselves. ``None`` when one class is absent."""
    n_pos = sum(1 for y in labels if y)
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    keys = [float(bin_index(p, fine_bins)) for p in preds] if fine_bins else [float(p) for p in preds]
    ranks = _mid_ranks(keys)
    rank_sum = math.fsum(r for r, y in zip(ranks, labels) if y)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def calibration(preds: Sequence[float], labels: Sequence[bool], bins: int = SGLANG_BINS,
                auroc_bins: int | None = SGLANG_AUROC_BINS) -> dict:
    """n, means, ECE, AUROC, Brier and reliability table of raw predictions against 0/1 labels;
    predictions are clamped first (SGLang) except for the ``auroc_bins=None`` ranking."""
    clamped = [_clamp(p) for p in preds]
    return {"n": len(preds), "mean_predicted": _mean(clamped),
            "mean_observed": _mean([float(y) for y in labels]), "ece": ece(clamped, labels, bins),
            "auroc": auroc(clamped if auroc_bins else preds, labels, auroc_bins),
            "brier": brier(clamped, labels), "reliability": reliability(clamped, labels, bins)}


def _pairs(cycles: list[tuple[list[float], int]]) -> list[tuple[int, float, bool]]:
    """(position k, survival, accepted) for every drafted position of every cycle."""
    return [(k, s, a) for conf, length in cycles
            for k, (s, a) in enumerate(zip(survival(conf), accepted(len(conf), length)), start=1)]


def per_position(cycles: Iterable[Cycle], bins: int = SGLANG_BINS,
                 auroc_bins: int | None = SGLANG_AUROC_BINS) -> dict:
    """Calibration of the survival against the prefix-mask label, per drafted position (1-based)
    and pooled over all positions."""
    pairs = _pairs(_checked(cycles))
    depth = max((k for k, _, _ in pairs), default=0)
    positions = []
    for k in range(1, depth + 1):
        preds = [s for j, s, _ in pairs if j == k]
        labels = [a for j, _, a in pairs if j == k]
        positions.append({"position": k, **calibration(preds, labels, bins, auroc_bins)})
    pooled = calibration([s for _, s, _ in pairs], [a for _, _, a in pairs], bins, auroc_bins)
    return {"predicted": "survival", "bins": bins, "auroc_bins": auroc_bins,
            "positions": positions, "pooled": pooled}


def predicted_tau(cycles: Iterable[Cycle]) -> dict:
    """τ the head predicts (mean of 1 + Σ survival) beside the measured τ (mean acceptance length)."""
    checked = _checked(cycles)
    predicted = _mean([1.0 + math.fsum(survival(conf)) for conf, _ in checked])
    measured = _mean([float(length) for _, length in checked])
    return {"cycles": len(checked), "predicted_tau": predicted, "measured_tau": measured,
            "ratio": predicted / measured if measured else None}


def verify_length(surv: Sequence[float], threshold: float) -> int:
    """Number of leading drafted positions whose survival is >= threshold."""
    n = 0
    for s in surv:
        if s < threshold:
            break
        n += 1
    return n


def _budget_point(cycles: list[tuple[list[float], int]], threshold: float) -> dict:
    lengths = [verify_length(survival(conf), threshold) for conf, _ in cycles]
    committed = [1.0 + min(length - 1, n) for (_, length), n in zip(cycles, lengths)]
    tau = _mean(committed)
    verify_len = _mean([n + 1.0 for n in lengths])
    return {"threshold": threshold, "tau": tau, "mean_verify_len": verify_len,
            "mean_verified_drafts": _mean([float(n) for n in lengths]),
            "tau_per_verify_token": tau / verify_len if verify_len else None}


def verify_budget_curve(cycles: Iterable[Cycle], thresholds: Sequence[float] | None = None) -> dict:
    """τ and verified tokens per cycle if each cycle verified only its leading positions whose
    survival is >= t, for each threshold t (default :data:`DEFAULT_THRESHOLDS`)."""
    checked = _checked(cycles)
    chosen = DEFAULT_THRESHOLDS if thresholds is None else tuple(float(t) for t in thresholds)
    if any(math.isnan(t) for t in chosen):
        raise ValueError(f"a threshold is NaN: {chosen}")
    return {"cycles": len(checked), "measured_tau": _mean([float(n) for _, n in checked]),
            "verify_len_counts": VERIFY_LEN_COUNTS, "sglang_survival_eps": SGLANG_SURVIVAL_EPS,
            "points": [_budget_point(checked, t) for t in chosen]}


def summary(cycles: Iterable[Cycle]) -> dict:
    """``summary.json``'s ``confidence``: the calibration per position and pooled, the predicted τ
    and the verify-budget curve, from the same cycles."""
    checked = _checked(cycles)
    return {"calibration": per_position(checked), "tau": predicted_tau(checked),
            "verify_budget": verify_budget_curve(checked)}
