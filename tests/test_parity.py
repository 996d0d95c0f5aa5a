"""remote/parity.py's SpecForge numbers on cases small enough to compute by hand: the accept
probability of known distributions, the per-block τ it sums to, the pooling (Σ correct / Σ positions
before any ratio), the run's own τ, and the gap sentences. No model: the quick loop runs them."""
from __future__ import annotations

import math

import pytest


def test_accept_probability_of_known_distributions():
    """1 − ½‖q − p‖₁ at temperature 1: identical distributions 1, disjoint ones 0, and
    q = (½, ½) against p = (1, 0) (logits −inf for p's second token) ½, which is Σ min(q, p)."""
    import torch

    from remote.parity import accept_probability

    draft = torch.tensor([[0.0, 0.0], [3.0, -1.0], [0.0, 0.0]])
    target = torch.tensor([[0.0, -math.inf], [3.0, -1.0], [math.log(3.0), 0.0]])
    got = accept_probability(draft, target).tolist()
    # third row: q = (½, ½), p = (¾, ¼): ½(¼ + ¼) = ¼ off, 0.75 = min(½, ¾) + min(½, ¼)
    assert got == pytest.approx([0.5, 1.0, 0.75], abs=1e-6)
    disjoint = accept_probability(torch.tensor([[50.0, -50.0]]), torch.tensor([[-50.0, 50.0]]))
    assert disjoint.tolist() == pytest.approx([0.0], abs=1e-6)


def test_block_tau_is_one_plus_the_cumulative_products_up_to_the_end():
    """Per block 1 + a₀ + a₀a₁ + …; a position past the sequence's end ends the sum. With 0/1 hits
    it is 1 + the leading run of hits (Domino's accept_len)."""
    import torch

    from remote.parity import block_tau

    accept = torch.tensor([[0.5, 0.5, 1.0], [0.5, 0.5, 1.0], [0.9, 0.0, 0.9]])
    valid = torch.tensor([[True, True, True], [True, True, False], [True, True, True]])
    assert block_tau(accept, valid).tolist() == pytest.approx([1 + 0.5 + 0.25 + 0.25, 1 + 0.5 + 0.25, 1.9])
    hits = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    assert block_tau(hits, valid).tolist() == [3.0, 1.0, 4.0]


def test_specforge_pools_counts_before_dividing():
    """Accuracy is Σ correct / Σ positions (SpecForge's evaluator), not the mean of per-position
    ratios; the accuracy-derived τ multiplies the per-position accuracies."""
    from types import SimpleNamespace

    from remote.parity import SpecForgeTally

    drafter = SimpleNamespace(block_size=3, config=SimpleNamespace(family="dflash", shift_label=False))
    tally = SpecForgeTally(drafter)                     # B = 3: two positions, slots 1 and 2
    tally.blocks, tally.correct, tally.count = 4, [3, 1], [4, 2]
    report = tally.report()
    assert report["accuracy"] == pytest.approx(4 / 6)                  # not (0.75 + 0.5) / 2
    assert report["per_position"] == [0.75, 0.5]
    assert report["accuracy_tau"] == pytest.approx(1 + 0.75 + 0.75 * 0.5)
    assert (report["correct"], report["denominator"], report["first_slot"]) == (4, 6, 1)


def test_run_tau_names_how_the_run_counted():
    from remote.parity import run_tau

    offline = [{"acceptance_lengths": [3, 1]}, {"acceptance_lengths": [2]}]
    assert run_tau(offline, 8) == {"tau_pooled": 2.0, "how": "offline walk"}
    online = [dict(r, wall_s=1.0) for r in offline]
    assert run_tau(online, 8) == {"tau_pooled": 2.0, "how": "online decoding"}
    assert run_tau([{"acceptance_lengths": []}], 8) is None


def test_gaps_name_each_specforge_tau_against_ours():
    """One sentence per SpecForge τ, with its value, our offline estimate and the run's τ, and why
    they differ; for DSpark the slot each token is scored from, and the confidence head against the
    expected τ it is trained to predict."""
    from remote.parity import gaps

    report = {"tau_estimate": {"training": 2.7},
              "specforge": {"family": "dspark", "accuracy_tau": 2.4, "denominator": 124, "expected_tau": 3.1,
                            "confidence_tau": 2.9}}
    lines = gaps(report, {"tau_pooled": 2.65, "how": "online decoding"})
    assert len(lines) == 3
    assert lines[0].startswith("SpecForge's accuracy-derived τ 2.40 ") and "124 positions" in lines[0]
    assert "our offline τ estimate 2.70" in lines[0] and "the run's τ 2.65 (online decoding, pooled)" in lines[0]
    assert "slot i scores token p+1+i" in lines[0]
    assert lines[1].startswith("SpecForge's expected τ 3.10 (accept probability") and "all or nothing on the argmax" in lines[1]
    assert lines[2] == ("the confidence head's τ 2.90 (1 + Σ cumulative product of σ(head), teacher-forced) vs "
                        "SpecForge's expected τ 3.10, which it is trained to predict: under-predicts by 0.20")
    domino = gaps({"tau_estimate": {"training": 1.5},
                   "specforge": {"family": "domino", "accuracy_tau": 1.6, "denominator": 7, "accept_len": 1.4}}, None)
    assert len(domino) == 2 and "the run's τ" not in domino[0] and "teacher-forced" in domino[0]
    assert domino[1].startswith("SpecForge's accept_len 1.40 ")
    assert gaps({"tau_estimate": {"training": 1.5}}, None) == []
