"""orchestrator/reports/stats.py: paired bootstrap and permutation test, cross-checked against scipy."""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.reports.stats import paired_bootstrap, paired_compare, paired_permutation_test, win_tie_loss

pytestmark = pytest.mark.timeout(300)


def _fake_run(rng, n):
    L = rng.integers(40, 120, size=n).astype(float)
    tau = rng.uniform(2.5, 6.0, size=n)
    return L, np.maximum(1.0, np.round(L / tau))


def test_self_comparison_is_exactly_zero():
    rng = np.random.default_rng(1)
    t, c = _fake_run(rng, 50)
    r = paired_compare(t, c, t, c, resamples=2000, seed=3)
    assert r.macro.diff == 0.0 and r.pooled.diff == 0.0
    assert (r.macro.ci_low, r.macro.ci_high) == (0.0, 0.0)
    assert (r.pooled.ci_low, r.pooled.ci_high) == (0.0, 0.0)
    assert (r.wins, r.ties, r.losses) == (0, 50, 0)
    assert r.macro.p_value == 1.0 and r.pooled.p_value == 1.0


def test_bootstrap_is_seeded():
    rng = np.random.default_rng(2)
    ta, ca = _fake_run(rng, 30)
    tb, cb = ta, np.maximum(1.0, ca + rng.integers(-3, 4, size=30))
    a = paired_bootstrap(ta, ca, tb, cb, resamples=1000, seed=7)
    b = paired_bootstrap(ta, ca, tb, cb, resamples=1000, seed=7)
    c = paired_bootstrap(ta, ca, tb, cb, resamples=1000, seed=8)
    assert a == b and a != c


def test_bootstrap_ci_covers_the_true_difference_at_about_the_nominal_rate():
    """200 synthetic paired datasets of 60 prompts: each prompt has a difficulty shared by both
    runs, run B's per-prompt τ is shifted by +0.3 with noise; the completions (tokens) are shared.
    The true macro difference is 0.3; the true pooled difference comes from a huge sample."""
    delta, n, sims = 0.3, 60, 200

    def draw(rng, size):
        L = rng.integers(40, 160, size=size).astype(float)
        base = rng.uniform(2.5, 6.0, size=size)
        tau_a = base + rng.normal(0, 0.4, size=size)
        tau_b = base + delta + rng.normal(0, 0.4, size=size)
        return L, L / tau_a, L, L / tau_b, tau_b - tau_a

    big = draw(np.random.default_rng(12345), 2_000_000)
    true_pooled = big[2].mean() / big[3].mean() - big[0].mean() / big[1].mean()
    true_macro = delta
    rng = np.random.default_rng(99)
    cover_m = cover_p = 0
    for s in range(sims):
        ta, ca, tb, cb, _ = draw(rng, n)
        macro, pooled = paired_bootstrap(ta, ca, tb, cb, resamples=1000, seed=s)
        cover_m += macro.ci_low <= true_macro <= macro.ci_high
        cover_p += pooled.ci_low <= true_pooled <= pooled.ci_high
    assert 0.90 <= cover_m / sims <= 0.99, cover_m / sims
    assert 0.90 <= cover_p / sims <= 0.99, cover_p / sims


def test_permutation_test_calibrated_and_powerful():
    rng = np.random.default_rng(5)
    rejections = 0
    for s in range(200):
        t = rng.integers(40, 120, size=40).astype(float)
        base = rng.uniform(2.5, 6.0, size=40)
        ca = t / (base + rng.normal(0, 0.4, size=40))
        cb = t / (base + rng.normal(0, 0.4, size=40))
        p_m, _, _ = paired_permutation_test(t, ca, t, cb, resamples=500, seed=s)
        rejections += p_m < 0.05
    assert 0.01 <= rejections / 200 <= 0.10, rejections
    t = rng.integers(40, 120, size=40).astype(float)
    base = rng.uniform(2.5, 6.0, size=40)
    p_m, p_p, exact = paired_permutation_test(t, t / base, t, t / (base + 1.0), resamples=2000, seed=0)
    assert p_m < 0.001 and p_p < 0.001 and not exact


def test_permutation_test_exact_for_few_prompts():
    # 5 prompts, all better in B: the exact two-sided sign-flip p-value is 2/32
    ta = np.array([10.0, 20, 30, 40, 50])
    ca = ta / 2.0
    cb = ta / np.array([3.0, 2.5, 4.0, 2.2, 3.3])
    p_m, p_p, exact = paired_permutation_test(ta, ca, ta, cb, resamples=10000)
    assert exact and p_m == pytest.approx(2 / 32)
    assert 0 < p_p <= 1


def test_win_tie_loss():
    assert win_tie_loss([1.0, 2.0, 3.0, 4.0], [1.5, 2.0, 2.0, 4.0]) == (1, 2, 1)


# --------------------------------------------------------------------------- against scipy

def _paired_sample(seed: int, n: int):
    rng = np.random.default_rng(seed)
    ta, ca = _fake_run(rng, n)
    tb = ta
    cb = np.maximum(1.0, np.round(ca * rng.uniform(0.75, 1.1, size=n)))
    return ta, ca, tb, cb


def test_bootstrap_matches_scipy_paired_bootstrap():
    """Same statistic, same percentile method, independent resampling: the CI ends agree within
    Monte Carlo error (a few % of the CI width at 20000 resamples)."""
    from scipy import stats as sps

    ta, ca, tb, cb = _paired_sample(21, 40)
    macro, pooled = paired_bootstrap(ta, ca, tb, cb, resamples=20000, seed=4)

    def macro_stat(a_t, a_c, b_t, b_c, axis=-1):
        return np.mean(b_t / b_c - a_t / a_c, axis=axis)

    def pooled_stat(a_t, a_c, b_t, b_c, axis=-1):
        return b_t.sum(axis=axis) / b_c.sum(axis=axis) - a_t.sum(axis=axis) / a_c.sum(axis=axis)

    for ours, stat in ((macro, macro_stat), (pooled, pooled_stat)):
        ref = sps.bootstrap((ta, ca, tb, cb), stat, paired=True, vectorized=True, n_resamples=20000,
                            confidence_level=0.95, method="percentile", random_state=np.random.default_rng(9))
        width = ref.confidence_interval.high - ref.confidence_interval.low
        assert ours.diff == pytest.approx(float(stat(ta, ca, tb, cb)))
        assert abs(ours.ci_low - ref.confidence_interval.low) < 0.05 * width
        assert abs(ours.ci_high - ref.confidence_interval.high) < 0.05 * width


def test_permutation_test_matches_scipy():
    """Exact enumeration (2^10 swaps) gives scipy's exact p-values to the last digit; a sampled
    test (40 prompts) agrees within Monte Carlo error."""
    from scipy import stats as sps

    def macro_stat(a_t, a_c, b_t, b_c, axis=-1):
        return np.mean(b_t / b_c - a_t / a_c, axis=axis)

    def pooled_stat(a_t, a_c, b_t, b_c, axis=-1):
        return b_t.sum(axis=axis) / b_c.sum(axis=axis) - a_t.sum(axis=axis) / a_c.sum(axis=axis)

    def scipy_p(ta, ca, tb, cb, stat, n_resamples, seed=0):
        # a "samples" permutation swaps the runs within a prompt: (ta, ca) <-> (tb, cb) together
        a, b = np.stack([ta, ca]), np.stack([tb, cb])
        res = sps.permutation_test((a, b), lambda x, y, axis: stat(x[..., 0, :], x[..., 1, :], y[..., 0, :], y[..., 1, :]),
                                   permutation_type="samples", vectorized=True, n_resamples=n_resamples,
                                   alternative="two-sided", random_state=np.random.default_rng(seed), axis=-1)
        return res.pvalue

    ta, ca, tb, cb = _paired_sample(31, 10)
    p_m, p_p, exact = paired_permutation_test(ta, ca, tb, cb, resamples=5000)
    assert exact
    assert p_m == pytest.approx(scipy_p(ta, ca, tb, cb, macro_stat, 5000), abs=1e-12)
    assert p_p == pytest.approx(scipy_p(ta, ca, tb, cb, pooled_stat, 5000), abs=1e-12)

    ta, ca, tb, cb = _paired_sample(32, 40)
    cb = np.maximum(1.0, ca + np.random.default_rng(3).integers(-2, 3, size=40))   # a small effect
    p_m, p_p, exact = paired_permutation_test(ta, ca, tb, cb, resamples=20000, seed=1)
    assert not exact
    for ours, stat in ((p_m, macro_stat), (p_p, pooled_stat)):
        ref = scipy_p(ta, ca, tb, cb, stat, 20000, seed=2)
        assert abs(ours - ref) < 4 * np.sqrt(max(ref * (1 - ref), 1e-4) / 20000) + 1e-3, (ours, ref)


def test_one_run_bootstrap_matches_scipy_and_is_seeded():
    """bootstrap_tau (the trajectory's error bars) vs scipy.stats.bootstrap's percentile CI."""
    from scipy import stats

    from orchestrator.reports.stats import bootstrap_tau

    rng = np.random.default_rng(3)
    cyc = rng.integers(20, 60, size=40)
    tok = (cyc * rng.uniform(2.0, 5.0, size=40)).round()
    (lo, hi), (plo, phi) = bootstrap_tau(tok, cyc, resamples=20000, seed=1)
    ref = stats.bootstrap((tok / cyc,), np.mean, n_resamples=20000, method="percentile", random_state=1)
    assert lo == pytest.approx(ref.confidence_interval.low, abs=0.02)
    assert hi == pytest.approx(ref.confidence_interval.high, abs=0.02)
    pooled = tok.sum() / cyc.sum()
    assert plo < pooled < phi
    assert bootstrap_tau(tok, cyc, seed=5) == bootstrap_tau(tok, cyc, seed=5)
