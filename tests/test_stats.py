"""orchestrator/stats.py: metrics recomputed from rows, paired bootstrap and permutation test."""
from __future__ import annotations

import numpy as np
import pytest

from orchestrator.stats import (compute_metrics, paired_bootstrap, paired_compare, paired_permutation_test,
                                summary_disagreements, win_tie_loss)

pytestmark = pytest.mark.timeout(300)


def test_metrics_by_hand():
    rows = [{"id": "a", "category": "math", "acceptance_lengths": [3, 1, 4]},          # 8 / 3
            {"id": "b", "category": "code", "acceptance_lengths": [2, 2]},             # 4 / 2
            {"id": "c", "category": "math", "acceptance_lengths": [16, 1, 1, 1, 1]}]   # 20 / 5
    m = compute_metrics(rows, 16, "offline")
    assert (m["prompts"], m["cycles"], m["tokens"]) == (3, 10, 32)
    assert m["tau_macro"] == pytest.approx((8 / 3 + 2 + 4) / 3)
    assert m["tau_pooled"] == pytest.approx(3.2)
    assert m["tau_pooled"] == pytest.approx(1 + sum(m["per_position_acceptance"]))
    assert m["per_position_acceptance"][0] == pytest.approx(5 / 10)   # lengths >= 2
    assert m["per_position_acceptance"][14] == pytest.approx(1 / 10)  # length 16
    assert m["acceptance_histogram"]["1"] == 5 and m["acceptance_histogram"]["16"] == 1
    assert m["categories"]["math"]["tau_pooled"] == pytest.approx(28 / 8)
    assert m["categories"]["code"]["prompts"] == 1


def test_summary_disagreement_is_named():
    rows = [{"id": "a", "acceptance_lengths": [3, 1, 4], "tau": 2.0}]
    m = compute_metrics(rows, 16, "offline")
    w = summary_disagreements(m, {"tau_macro": 9.0, "tau_pooled": m["tau_pooled"], "prompts": 1})
    assert any("tau_macro = 9.0" in x for x in w)
    assert any("store tau" in x for x in w)          # the row's stored tau disagrees with its lengths
    assert not any("tau_pooled" in x for x in w)


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
