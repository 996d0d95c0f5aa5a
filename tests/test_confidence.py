"""Confidence-head calibration (remote/contract/confidence.py): hand-computed cases, invariants, and
cross-checks against recomputations written differently here."""
from __future__ import annotations

import json
import math
import random

import pytest

from remote.contract import confidence as cf
from remote.contract import metrics

EPS = cf.SGLANG_EPS_PROB

# survival [0.9, 0.45] [0.9, 0.45] [0.6, 0.3] [1.0, 0.0]; accepted [T T] [T F] [F F] [T F]
HAND = [([0.9, 0.5], 3), ([0.9, 0.5], 2), ([0.6, 0.5], 1), ([1.0, 0.0], 2)]


def approx(x: float) -> object:
    return pytest.approx(x, abs=1e-7)


def _random_cycles(rng: random.Random, n: int, gamma: int = 6, decimals: int | None = None) -> list:
    cycles = []
    for _ in range(n):
        conf = [rng.random() ** 0.4 for _ in range(rng.randint(0, gamma))]
        if decimals is not None:
            conf = [round(c, decimals) for c in conf]
        cycles.append((conf, rng.randint(1, len(conf) + 1)))
    return cycles


def _calibrated_cycles(rng: random.Random, n: int, gamma: int) -> list:
    """Position k is accepted with probability c_k once its predecessors are: survival is exact."""
    cycles = []
    for _ in range(n):
        conf = [rng.random() ** 0.3 for _ in range(gamma)]
        length = 1
        for c in conf:
            if rng.random() >= c:
                break
            length += 1
        cycles.append((conf, length))
    return cycles


def _pairs(cycles: list) -> list[tuple[int, float, bool]]:
    out = []
    for conf, length in cycles:
        s = 1.0
        for k, c in enumerate(conf, start=1):
            s *= c
            out.append((k, s, length - 1 >= k))
    return out


# --- hand-computed ------------------------------------------------------------------------------

def test_position_one_by_hand():
    p1 = cf.per_position(HAND)["positions"][0]
    assert p1["position"] == 1 and p1["n"] == 4
    # bins: 0.9 -> 13 (twice, both accepted), 0.6 -> 9 (rejected), 1.0 -> clamped, 14 (accepted)
    assert p1["ece"] == approx((2 * 0.1 + 0.6 + EPS) / 4)
    assert p1["auroc"] == 1.0
    assert p1["brier"] == approx((0.01 + 0.01 + 0.36) / 4)
    assert p1["mean_predicted"] == approx(3.4 / 4)
    assert p1["mean_observed"] == 0.75
    assert [(r["bin"], r["count"]) for r in p1["reliability"]] == [(9, 1), (13, 2), (14, 1)]
    top = p1["reliability"][-1]
    assert top["range"] == [14 / 15, 1.0] and top["mean_predicted"] == 1.0 - EPS and top["observed_rate"] == 1.0


def test_position_two_by_hand_with_a_tie_and_a_zero():
    p2 = cf.per_position(HAND)["positions"][1]
    # survival 0.45 (accepted), 0.45 (rejected), 0.3, 0.0 (rejected): one tie counts 1/2 -> 2.5 / 3
    assert p2["auroc"] == approx(2.5 / 3)
    assert p2["ece"] == approx((2 * 0.05 + 0.3 + EPS) / 4)
    assert p2["brier"] == approx((0.55 ** 2 + 0.45 ** 2 + 0.3 ** 2) / 4)
    assert p2["reliability"] == [
        {"bin": 0, "range": [0.0, 1 / 15], "count": 1, "mean_predicted": EPS, "observed_rate": 0.0},
        {"bin": 4, "range": [4 / 15, 5 / 15], "count": 1, "mean_predicted": approx(0.3), "observed_rate": 0.0},
        {"bin": 6, "range": [6 / 15, 7 / 15], "count": 2, "mean_predicted": approx(0.45), "observed_rate": 0.5},
    ]


def test_pooled_by_hand():
    pooled = cf.per_position(HAND)["pooled"]
    assert pooled["n"] == 8
    assert pooled["ece"] == approx((0.3 + 0.1 + 0.6 + 0.2) / 8)
    # accepted 0.9 0.9 1.0 0.45 vs rejected 0.6 0.45 0.3 0.0: 4 + 4 + 4 + 2.5 of 16 pairs
    assert pooled["auroc"] == approx(14.5 / 16)
    assert pooled["mean_observed"] == 0.5


def test_bin_edges():
    assert cf.bin_index(0.0, 15) == 0
    assert cf.bin_index(1.0, 15) == 14
    assert cf.bin_index(0.2, 15) == 3  # a lower edge belongs to the bin above it
    assert cf.bin_index(1 / 15, 15) == 1
    assert cf.bin_index(0.2 - 1e-12, 15) == 2
    rows = cf.reliability([cf._clamp(p) for p in (0.0, 0.2, 1.0)], [False, True, True])
    assert [(r["bin"], r["range"]) for r in rows] == [(0, [0.0, 1 / 15]), (3, [0.2, 4 / 15]), (14, [14 / 15, 1.0])]


def test_auroc_ties_inside_a_fine_bin_as_sglang_and_exact_ranks_on_request():
    cycles = [([0.5002], 2), ([0.5001], 1)]  # both in fine bin 512 of 1024
    assert cf.per_position(cycles)["positions"][0]["auroc"] == 0.5
    assert cf.per_position(cycles, auroc_bins=None)["positions"][0]["auroc"] == 1.0
    assert cf.auroc([0.3, 0.3, 0.3], [True, False, True], fine_bins=None) == 0.5


def test_a_one_class_position_has_no_auroc_and_a_cut_block_counts_only_its_positions():
    cycles = [([0.9, 0.8, 0.7], 2), ([0.9, 0.8], 3), ([0.5], 1)]
    out = cf.per_position(cycles)
    assert [p["n"] for p in out["positions"]] == [3, 2, 1]
    assert out["positions"][2]["auroc"] is None  # position 3: one example, rejected
    assert out["positions"][2]["mean_observed"] == 0.0
    assert cf.per_position([([0.9], 2), ([0.8], 2)])["positions"][0]["auroc"] is None  # all accepted
    assert out["pooled"]["n"] == 6


def test_predicted_tau_by_hand():
    out = cf.predicted_tau(HAND)
    assert out["cycles"] == 4
    assert out["predicted_tau"] == approx((2.35 + 2.35 + 1.9 + 2.0) / 4)
    assert out["measured_tau"] == 2.0
    assert out["ratio"] == approx(2.15 / 2.0)


def test_verify_budget_curve_by_hand():
    out = cf.verify_budget_curve(HAND, thresholds=[0.0, cf.SGLANG_SURVIVAL_EPS, 0.5, 0.95, 1.1])
    assert out["measured_tau"] == 2.0 and out["cycles"] == 4
    got = {p["threshold"]: (p["tau"], p["mean_verify_len"]) for p in out["points"]}
    assert got[0.0] == (2.0, 3.0)
    assert got[cf.SGLANG_SURVIVAL_EPS] == (2.0, 2.75)  # the 0.0 survival of the last cycle drops out
    assert got[0.5] == (1.75, 2.0)
    assert got[0.95] == (1.25, 1.25)  # only the survival 1.0 is verified
    assert got[1.1] == (1.0, 1.0)


def test_default_thresholds_include_sglang_eps():
    points = cf.verify_budget_curve(HAND)["points"]
    ts = [p["threshold"] for p in points]
    assert ts[:3] == [0.0, 1e-6, 0.05] and ts[-1] == 0.95 and len(ts) == 21


def test_empty_input():
    out = cf.per_position([])
    assert out["positions"] == [] and out["pooled"]["n"] == 0 and out["pooled"]["ece"] is None
    assert cf.predicted_tau([])["predicted_tau"] is None
    assert cf.verify_budget_curve([], [0.0])["points"][0]["tau"] is None


@pytest.mark.parametrize("cycle", [([1.5], 1), ([float("nan")], 1), ([0.5], 3), ([0.5], 0), ([], 2)])
def test_bad_cycles_are_refused(cycle):
    with pytest.raises(ValueError):
        cf.per_position([cycle])


# --- invariants ---------------------------------------------------------------------------------

def test_survival_is_non_increasing():
    rng = random.Random(7)
    for conf, _ in _random_cycles(rng, 500):
        s = cf.survival(conf)
        assert all(b <= a for a, b in zip(s, s[1:]))
        assert all(0.0 <= x <= 1.0 for x in s)


def test_threshold_zero_gives_the_measured_tau():
    cycles = _random_cycles(random.Random(11), 400)
    out = cf.verify_budget_curve(cycles, [0.0])
    tau = metrics.tau_summary([[n for _, n in cycles]])["tau_pooled"]
    assert out["measured_tau"] == approx(tau)
    assert out["points"][0]["tau"] == approx(tau)
    assert out["points"][0]["mean_verify_len"] == approx(sum(len(c) + 1 for c, _ in cycles) / len(cycles))


def test_a_higher_threshold_never_verifies_more_nor_accepts_more():
    cycles = _random_cycles(random.Random(13), 400)
    points = cf.verify_budget_curve(cycles, [i / 100 for i in range(101)])["points"]
    for a, b in zip(points, points[1:]):
        assert b["mean_verify_len"] <= a["mean_verify_len"]
        assert b["tau"] <= a["tau"]
    for conf, _ in cycles:
        s = cf.survival(conf)
        lengths = [cf.verify_length(s, t / 20) for t in range(21)]
        assert lengths == sorted(lengths, reverse=True)


def test_a_calibrated_head_has_ece_near_zero_and_predicts_tau():
    cycles = _calibrated_cycles(random.Random(2024), 20000, gamma=5)
    out = cf.per_position(cycles)
    assert out["pooled"]["ece"] < 0.02
    for p in out["positions"]:
        assert p["ece"] < 0.03
        assert abs(p["mean_predicted"] - p["mean_observed"]) < 0.02
    tau = cf.predicted_tau(cycles)
    assert abs(tau["predicted_tau"] - tau["measured_tau"]) < 0.03
    # the same acceptances against an over-confident head are visibly miscalibrated
    bold = [([c ** 0.3 for c in conf], n) for conf, n in cycles]
    assert cf.per_position(bold)["pooled"]["ece"] > 0.1


def test_deterministic_order_free_and_json():
    cycles = _random_cycles(random.Random(5), 300, decimals=2)
    shuffled = list(cycles)
    random.Random(6).shuffle(shuffled)
    for fn in (cf.per_position, cf.predicted_tau, cf.verify_budget_curve):
        text = json.dumps(fn(cycles), allow_nan=False, sort_keys=True)
        assert text == json.dumps(fn(shuffled), allow_nan=False, sort_keys=True)


# --- cross-checks written differently -----------------------------------------------------------

def _auroc_by_pairs(scores: list, labels: list) -> float | None:
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return None
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def _sglang_fine_bin(p: float) -> int:
    return min(1023, math.floor(min(max(p, 1e-8), 1 - 1e-8) * 1024))


def _ece_by_edges(preds: list, labels: list, bins: int = 15) -> float:
    preds = [min(max(p, 1e-8), 1 - 1e-8) for p in preds]
    total = 0.0
    for i in range(bins):
        lo, hi = i / bins, (i + 1) / bins
        members = [(p, y) for p, y in zip(preds, labels) if lo <= p < hi]
        if members:
            conf = sum(p for p, _ in members) / len(members)
            acc = sum(y for _, y in members) / len(members)
            total += len(members) / len(preds) * abs(conf - acc)
    return total


@pytest.mark.parametrize("decimals", [1, 2, None])
def test_auroc_matches_pair_counting(decimals):
    cycles = _random_cycles(random.Random(17), 250, decimals=decimals)
    pairs = _pairs(cycles)
    out = cf.per_position(cycles)
    exact = cf.per_position(cycles, auroc_bins=None)
    for k, row in enumerate(out["positions"], start=1):
        scores = [s for j, s, _ in pairs if j == k]
        labels = [y for j, _, y in pairs if j == k]
        want = _auroc_by_pairs([_sglang_fine_bin(s) for s in scores], labels)
        assert row["auroc"] == (None if want is None else approx(want))
        want_exact = _auroc_by_pairs(scores, labels)
        assert exact["positions"][k - 1]["auroc"] == (None if want_exact is None else approx(want_exact))
    assert out["pooled"]["auroc"] == approx(_auroc_by_pairs([_sglang_fine_bin(s) for _, s, _ in pairs],
                                                            [y for _, _, y in pairs]))


def test_ece_brier_and_reliability_match_recomputation():
    cycles = _random_cycles(random.Random(19), 400)
    pairs = _pairs(cycles)
    out = cf.per_position(cycles)
    for k, row in enumerate(out["positions"], start=1):
        preds = [s for j, s, _ in pairs if j == k]
        labels = [y for j, _, y in pairs if j == k]
        assert row["ece"] == approx(_ece_by_edges(preds, labels))
        clamped = [min(max(p, 1e-8), 1 - 1e-8) for p in preds]
        assert row["brier"] == approx(sum((p - y) ** 2 for p, y in zip(clamped, labels)) / len(preds))
        table = row["reliability"]
        assert sum(r["count"] for r in table) == row["n"] == len(preds)
        assert sum(r["count"] * r["mean_predicted"] for r in table) / row["n"] == approx(row["mean_predicted"])
        assert sum(r["count"] * r["observed_rate"] for r in table) / row["n"] == approx(row["mean_observed"])
        from_table = sum(r["count"] * abs(r["mean_predicted"] - r["observed_rate"]) for r in table) / row["n"]
        assert from_table == approx(row["ece"])
        assert all(r["range"][0] <= r["mean_predicted"] <= r["range"][1] for r in table)


def test_predicted_tau_is_one_plus_the_summed_mean_survival_per_position():
    cycles = _random_cycles(random.Random(23), 300)
    out = cf.per_position(cycles)
    n = len(cycles)
    summed = sum(row["n"] * row["mean_predicted"] for row in out["positions"]) / n
    assert cf.predicted_tau(cycles)["predicted_tau"] == pytest.approx(1 + summed, abs=1e-6)
    observed = sum(row["n"] * row["mean_observed"] for row in out["positions"]) / n
    assert cf.predicted_tau(cycles)["measured_tau"] == approx(1 + observed)
