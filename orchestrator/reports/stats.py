"""Paired statistics for comparing two eval runs prompt by prompt (the metrics themselves are
:mod:`remote.contract.metrics`).

The *prompt* is the unit (REFERENCE §2): a bootstrap resamples prompts (the same prompts for both
runs) and the significance test swaps the two runs' values within prompts. Inputs are per-prompt
token and cycle counts aligned by prompt; τ per prompt = tokens / cycles. Cross-checked against
``scipy.stats.bootstrap(paired=True)`` and ``scipy.stats.permutation_test`` in tests/test_stats.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

import numpy as np

TIE_TOL = 1e-9  # two per-prompt τ closer than this are a tie


# --------------------------------------------------------------------------- paired statistics

@dataclass
class Interval:
    a: float                # value of the baseline run on the paired prompts
    b: float                # value of the other run
    diff: float             # b - a
    ci_low: float
    ci_high: float
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
