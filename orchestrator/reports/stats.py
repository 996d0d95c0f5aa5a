"""Paired statistics for comparing two eval runs prompt by prompt (the metrics themselves are
:mod:`remote.contract.metrics`).

The *prompt* is the unit (REFERENCE §2): a bootstrap resamples prompts (the same prompts for both
runs) and the significance test swaps the two runs' values within prompts. Inputs are per-prompt
token and cycle counts aligned by prompt; τ per prompt = tokens / cycles. Cross-checked against
``scipy.stats.bootstrap(paired=True)`` and ``scipy.stats.permutation_test`` in tests/test_stats.py.
:func:`paired_sums` does the same for any statistic of per-prompt sums (a confidence head's
calibration, orchestrator/reports/confidence.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

TIE_TOL = 1e-9  # two per-prompt τ closer than this are a tie


# --------------------------------------------------------------------------- paired statistics

@dataclass
class Interval:
    a: float                # value of the baseline run on the paired prompts
    b: float                # value of the other run
    diff: float             # b - a
    ci_low: Optional[float]     # None: no resample had a value
    ci_high: Optional[float]
    p_value: Optional[float] = None


@dataclass
class PairedResult:
    n: int
    resamples: int
    seed: int
    confidence: float
    macro: Interval
    pooled: Interval
    wins: int               # prompts where b's τ > a's τ
    ties: int
    losses: int
    test: str = "paired permutation test (random swap of the two runs within each prompt), two-sided"
    exact_test: bool = False
    ddtree: dict = field(default_factory=dict)   # budget -> Interval (macro τ)

    def to_dict(self) -> dict:
        return asdict(self)


def _weights(n: int, resamples: int, rng: np.random.Generator, chunk: int) -> Iterable[np.ndarray]:
    """Bootstrap resamples as count matrices (rows sum to n), in chunks to bound memory."""
    p = np.full(n, 1.0 / n)
    done = 0
    while done < resamples:
        k = min(chunk, resamples - done)
        yield rng.multinomial(n, p, size=k).astype(np.float64)
        done += k


def _percentile(x: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(x, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def paired_bootstrap(tok_a, cyc_a, tok_b, cyc_b, *, resamples: int = 10000, seed: int = 0,
                     confidence: float = 0.95, chunk: int = 2000) -> tuple[Interval, Interval]:
    """Percentile bootstrap CIs on the differences (b − a) of tau_macro and tau_pooled,
    resampling prompts (the same resample for both runs). Inputs are per-prompt token and cycle
    counts, aligned by prompt."""
    ta, ca, tb, cb = (np.asarray(x, dtype=np.float64) for x in (tok_a, cyc_a, tok_b, cyc_b))
    n = len(ta)
    if n == 0:
        raise ValueError("no paired prompts")
    tau_a, tau_b = ta / ca, tb / cb
    d = tau_b - tau_a
    macro_obs = float(d.mean())
    pooled_a, pooled_b = float(ta.sum() / ca.sum()), float(tb.sum() / cb.sum())
    rng = np.random.default_rng(seed)
    macro, pooled = [], []
    for w in _weights(n, resamples, rng, chunk):
        macro.append(w @ d / n)
        pooled.append((w @ tb) / (w @ cb) - (w @ ta) / (w @ ca))
    macro_s, pooled_s = np.concatenate(macro), np.concatenate(pooled)
    if np.all(d == 0):
        macro_s[:] = 0.0
    if np.array_equal(ta, tb) and np.array_equal(ca, cb):
        pooled_s[:] = 0.0
    return (Interval(float(tau_a.mean()), float(tau_b.mean()), macro_obs, *_percentile(macro_s, confidence)),
            Interval(pooled_a, pooled_b, pooled_b - pooled_a, *_percentile(pooled_s, confidence)))


def bootstrap_tau(tokens, cycles, *, resamples: int = 2000, seed: int = 0, confidence: float = 0.95,
                  chunk: int = 2000) -> tuple[tuple[float, float], tuple[float, float]]:
    """Percentile bootstrap CIs of ONE run's (tau_macro, tau_pooled), resampling prompts; inputs
    are per-prompt token and cycle counts (the trajectory's error bars)."""
    t, c = np.asarray(tokens, dtype=np.float64), np.asarray(cycles, dtype=np.float64)
    if len(t) == 0:
        raise ValueError("no prompts")
    tau = t / c
    macro, pooled = [], []
    for w in _weights(len(t), resamples, np.random.default_rng(seed), chunk):
        macro.append(w @ tau / len(t))
        pooled.append((w @ t) / (w @ c))
    return _percentile(np.concatenate(macro), confidence), _percentile(np.concatenate(pooled), confidence)


def paired_permutation_test(tok_a, cyc_a, tok_b, cyc_b, *, resamples: int = 10000, seed: int = 0,
                            chunk: int = 4000) -> tuple[float, float, bool]:
    """Two-sided p-values (macro, pooled) for H0 "the two runs are exchangeable within each
    prompt": each resample swaps the runs' values on a random subset of prompts (for the macro
    τ this is the sign-flip test on per-prompt differences). Exact enumeration when 2^n ≤
    resamples. Returns (p_macro, p_pooled, exact)."""
    ta, ca, tb, cb = (np.asarray(x, dtype=np.float64) for x in (tok_a, cyc_a, tok_b, cyc_b))
    n = len(ta)
    d = tb / cb - ta / ca
    dt, dc = tb - ta, cb - ca
    sum_ta, sum_ca = ta.sum(), ca.sum()
    sum_tb, sum_cb = tb.sum(), cb.sum()
    obs_macro = abs(d.mean())
    obs_pooled = abs(sum_tb / sum_cb - sum_ta / sum_ca)
    if n == 0 or (np.all(d == 0) and np.all(dt == 0) and np.all(dc == 0)):
        return 1.0, 1.0, True
    eps = 1e-12 * max(1.0, obs_macro, obs_pooled)

    def stats(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # s: (k, n) of 0/1, 1 = swapped
        macro = np.abs((d * (1.0 - 2.0 * s)).sum(axis=1) / n)
        a_t, a_c = sum_ta + s @ dt, sum_ca + s @ dc
        b_t, b_c = sum_tb - s @ dt, sum_cb - s @ dc
        return macro, np.abs(b_t / b_c - a_t / a_c)

    exact = n <= 30 and 2 ** n <= resamples
    hits_m = hits_p = 0
    if exact:
        total = 2 ** n
        for start in range(0, total, chunk):
            codes = np.arange(start, min(total, start + chunk), dtype=np.int64)
            s = ((codes[:, None] >> np.arange(n)) & 1).astype(np.float64)
            m, p = stats(s)
            hits_m += int((m >= obs_macro - eps).sum())
            hits_p += int((p >= obs_pooled - eps).sum())
        return hits_m / total, hits_p / total, True
    rng = np.random.default_rng(seed + 1)
    done = 0
    while done < resamples:
        k = min(chunk, resamples - done)
        s = rng.integers(0, 2, size=(k, n)).astype(np.float64)
        m, p = stats(s)
        hits_m += int((m >= obs_macro - eps).sum())
        hits_p += int((p >= obs_pooled - eps).sum())
        done += k
    return (hits_m + 1) / (resamples + 1), (hits_p + 1) / (resamples + 1), False


def win_tie_loss(tau_a, tau_b, tol: float = TIE_TOL) -> tuple[int, int, int]:
    d = np.asarray(tau_b, dtype=np.float64) - np.asarray(tau_a, dtype=np.float64)
    return int((d > tol).sum()), int((np.abs(d) <= tol).sum()), int((d < -tol).sum())


def paired_compare(tok_a, cyc_a, tok_b, cyc_b, *, resamples: int = 10000, seed: int = 0,
                   confidence: float = 0.95) -> PairedResult:
    """Bootstrap CIs, permutation p-values and win/tie/loss for run b against baseline a."""
    macro, pooled = paired_bootstrap(tok_a, cyc_a, tok_b, cyc_b, resamples=resamples, seed=seed,
                                     confidence=confidence)
    p_m, p_p, exact = paired_permutation_test(tok_a, cyc_a, tok_b, cyc_b, resamples=resamples, seed=seed)
    macro.p_value, pooled.p_value = p_m, p_p
    ta, ca, tb, cb = (np.asarray(x, dtype=np.float64) for x in (tok_a, cyc_a, tok_b, cyc_b))
    w, t, l = win_tie_loss(ta / ca, tb / cb)
    return PairedResult(n=len(ta), resamples=resamples, seed=seed, confidence=confidence, macro=macro,
                        pooled=pooled, wins=w, ties=t, losses=l, exact_test=exact)


# --------------------------------------------------------------------------- statistics of sums over prompts

def paired_sums(xa, xb, statistics: Sequence[Callable[[np.ndarray], np.ndarray]], *, resamples: int = 10000,
                seed: int = 0, confidence: float = 0.95, cells: int = 2_000_000) -> list[Optional[Interval]]:
    """Paired bootstrap CIs and permutation p-values of statistic(b) − statistic(a), for statistics
    of sums over prompts (a ratio of sums, a binned calibration error, an AUROC from score counts).

    ``xa``, ``xb``: (prompts × k) per-prompt values, aligned by prompt, that add up over prompts;
    each statistic maps an (m × k) array of totals to m values, NaN where undefined. The bootstrap
    resamples prompts (the same resamples for both runs and every statistic) and drops, per
    statistic, the resamples where either value is undefined (no CI when none is left); the test
    swaps the two runs' rows within a random subset of prompts (exact when 2^n ≤ resamples). An
    interval is None where either run's own value is undefined. ``cells`` bounds the size of one
    chunk of resamples (resamples × max(k, prompts))."""
    xa, xb = np.asarray(xa, dtype=np.float64), np.asarray(xb, dtype=np.float64)
    n, k = xa.shape
    if n == 0:
        raise ValueError("no paired prompts")
    chunk = max(1, cells // max(k, n))
    with np.errstate(divide="ignore", invalid="ignore"):
        own = [[float(v) for v in f(np.stack([xa.sum(axis=0), xb.sum(axis=0)]))] for f in statistics]
        boot: list[list[np.ndarray]] = [[] for _ in statistics]
        for w in _weights(n, resamples, np.random.default_rng(seed), chunk):
            ta, tb = w @ xa, w @ xb
            for out, f in zip(boot, statistics):
                out.append(f(tb) - f(ta))
        p_values = _swap_test(xa, xb, statistics, [abs(b - a) for a, b in own], resamples, seed, chunk)
    result: list[Optional[Interval]] = []
    for (a, b), diffs, p in zip(own, boot, p_values):
        if np.isnan(a) or np.isnan(b):
            result.append(None)
            continue
        d = np.concatenate(diffs)
        d = d[~np.isnan(d)]
        lo, hi = _percentile(d, confidence) if len(d) else (None, None)
        result.append(Interval(a, b, b - a, lo, hi, p))
    return result


def _swap_test(xa: np.ndarray, xb: np.ndarray, statistics, observed: list[float], resamples: int, seed: int,
               chunk: int) -> list[Optional[float]]:
    """Two-sided p-values of |statistic(b) − statistic(a)| with the runs swapped within prompts
    (None where no swap gives a value)."""
    d = xb - xa
    if not d.any():
        return [1.0] * len(statistics)
    n = len(d)
    ta, tb = xa.sum(axis=0), xb.sum(axis=0)
    found, total = [0] * len(statistics), [0] * len(statistics)

    def count(s: np.ndarray) -> None:
        moved = s @ d
        a, b = ta + moved, tb - moved
        for j, (f, obs) in enumerate(zip(statistics, observed)):
            diff = np.abs(f(b) - f(a))
            ok = ~np.isnan(diff)
            found[j] += int((diff[ok] >= obs - 1e-12 * max(1.0, obs)).sum())
            total[j] += int(ok.sum())

    if n <= 30 and 2 ** n <= resamples:
        for start in range(0, 2 ** n, chunk):
            codes = np.arange(start, min(2 ** n, start + chunk), dtype=np.int64)
            count(((codes[:, None] >> np.arange(n)) & 1).astype(np.float64))
        return [f / t if t else None for f, t in zip(found, total)]
    rng = np.random.default_rng(seed + 1)
    done = 0
    while done < resamples:
        m = min(chunk, resamples - done)
        count(rng.integers(0, 2, size=(m, n)).astype(np.float64))
        done += m
    return [(f + 1) / (t + 1) if t else None for f, t in zip(found, total)]
