"""orchestrator/runs/metrics.py: an eval run's metrics recomputed from its rows (through
remote.contract.metrics, the worker's own implementation) and the summary.json consistency check."""
from __future__ import annotations

import pytest

from orchestrator.runs.metrics import compute_metrics, summary_disagreements


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


def test_the_report_extends_the_worker_summary_exactly(tmp_path):
    """One implementation: summary.json's fields in a report are the worker's summarize() output."""
    from remote.contract.metrics import summarize
    from fakeruns import make_run, read_rows

    for mode in ("offline", "online"):
        rows = read_rows(make_run(tmp_path, f"r-{mode}", mode=mode, prompts=9))
        s = summarize(rows, 16, mode)
        m = compute_metrics(rows, 16, mode)
        assert {k: m[k] for k in s} == s
        assert not summary_disagreements(m, s)


def test_damaged_rows_are_counted_not_fatal():
    rows = [{"id": "a", "acceptance_lengths": [3, 17, 0]},
            {"id": "b", "acceptance_lengths": [2], "all_anchors": {"correct": [1] * 20, "count": [2] * 20}},
            {"id": "c", "acceptance_lengths": [1], "ddtree": {"8": {}}}]
    m = compute_metrics(rows, 16)
    assert m["out_of_range_lengths"] == 2 and sum(m["acceptance_histogram"].values()) == 3
    assert m["all_anchors_accuracy"] == [0.5] * 15
    assert m["ddtree"]["8"] == {"tau_macro": None, "tau_pooled": None, "prompts": 0}
    assert any("2 acceptance length(s) outside 1..16" in w for w in summary_disagreements(m, None))


def test_online_speed_counts_output_tokens_and_lossless_only_when_recorded():
    row = {"id": "a", "acceptance_lengths": [3, 2], "output_ids": list(range(6)), "wall_s": 2.0, "target_wall_s": 3.0}
    m = compute_metrics([row], 16, "online")
    assert m["online"]["tokens_per_s"] == 3.0 and m["online"]["speedup"] == 1.5
    assert "lossless" not in m["online"]               # never claimed when the rows do not say
    m = compute_metrics([row, {**row, "id": "b", "lossless": True}], 16, "online")
    assert m["online"]["lossless"] is False            # one row without the record is not lossless
