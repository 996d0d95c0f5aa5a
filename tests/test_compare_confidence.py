"""`compare` and `watch` on drafters with a DSpark confidence head: its calibration paired prompt by
prompt (values as remote/contract/confidence.py computes them, differences with paired CIs), a run
without a head said so, and the trajectory's calibration per checkpoint."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fakeruns import add_confidences, make_run, read_rows
from orchestrator.cli import app
from orchestrator.reports.stats import paired_bootstrap, paired_permutation_test, paired_sums
from remote.contract import confidence as cf
from reportchecks import check_self_contained_html

pytestmark = pytest.mark.timeout(240)
A, B = "20261202-2041-v5-step10k-ct129", "20261203-1100-v5-step20k-ct129"


def compare_json(runs: Path, *args: str) -> dict:
    res = CliRunner().invoke(app, ["compare", *args, "--runs-dir", str(runs), "--json", "--resamples", "1000",
                                   "--out", str(runs.parent / "cmp")])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    return json.loads(res.stdout[res.stdout.index("{"):])


def cycles(rows: list[dict]) -> list:
    return [c for r in rows for c in zip(r["confidences"], r["acceptance_lengths"])]


@pytest.fixture
def runs(tmp_path):
    d = tmp_path / "runs"
    make_run(d, A, "v5", "step10k", prompts=24, mean=4.0, ddtree=False)
    make_run(d, B, "v5", "step20k", prompts=24, mean=4.0, ddtree=False)
    return d


def test_two_heads_are_paired_with_the_values_confidence_py_computes(runs):
    rows_a, rows_b = add_confidences(runs / A, skill=0.3), add_confidences(runs / B, skill=3.0)
    r = compare_json(runs, A, B)
    want = {A: cf.summary(cycles(rows_a)), B: cf.summary(cycles(rows_b))}
    for rid in (A, B):
        got = r["metrics"][rid]["confidence"]
        assert got["calibration"]["pooled"]["ece"] == pytest.approx(want[rid]["calibration"]["pooled"]["ece"])
        assert got["tau"] == pytest.approx(want[rid]["tau"])
    (c,) = r["comparisons"]
    h = c["confidence"]
    assert h["n"] == 24 and h["missing"] == []
    for key in ("ece", "auroc", "brier", "mean_predicted", "mean_observed"):
        a, b = want[A]["calibration"]["pooled"][key], want[B]["calibration"]["pooled"][key]
        iv = h["measures"][key]
        assert (iv["a"], iv["b"], iv["diff"]) == (pytest.approx(a), pytest.approx(b), pytest.approx(b - a)), key
        assert iv["ci_low"] <= iv["diff"] <= iv["ci_high"] and 0 < iv["p_value"] <= 1
    tau = h["measures"]["predicted_tau"]
    assert (tau["a"], tau["b"]) == (pytest.approx(want[A]["tau"]["predicted_tau"]),
                                    pytest.approx(want[B]["tau"]["predicted_tau"]))
    err = h["measures"]["tau_error"]
    assert err["b"] == pytest.approx(abs(want[B]["tau"]["predicted_tau"] - want[B]["tau"]["measured_tau"]))
    # the sharper head ranks accepted positions above rejected ones far better: a clear positive difference
    assert h["measures"]["auroc"]["diff"] > 0 and h["measures"]["auroc"]["ci_low"] > 0
    assert h["measures"]["auroc"]["p_value"] < 0.01
    assert h["measures"]["brier"]["diff"] < 0 and h["measures"]["brier"]["ci_high"] < 0
    points = {p["threshold"]: p for p in h["verify_budget"]}
    assert list(points) == list(cf.DEFAULT_THRESHOLDS)
    for t, p in points.items():
        wa = next(q for q in want[A]["verify_budget"]["points"] if q["threshold"] == t)
        wb = next(q for q in want[B]["verify_budget"]["points"] if q["threshold"] == t)
        assert (p["tau"]["a"], p["tau"]["b"]) == (pytest.approx(wa["tau"]), pytest.approx(wb["tau"]))
        assert p["mean_verify_len"]["diff"] == pytest.approx(wb["mean_verify_len"] - wa["mean_verify_len"])
    assert points[0.0]["tau"]["a"] == pytest.approx(r["metrics"][A]["tau_pooled"])   # t = 0: the measured τ

    md = (runs.parent / "cmp" / "compare.md").read_text()
    for heading in ("Confidence head: side by side", "Confidence head: difference vs baseline",
                    "Confidence head: per drafted position", "Verify budget"):
        assert f"## {heading}" in md, heading
    auroc = h["measures"]["auroc"]
    assert (f"| v5:step20k − v5:step10k | AUROC | 24 | {auroc['diff']:+.3f} [{auroc['ci_low']:+.3f}, "
            f"{auroc['ci_high']:+.3f}] |") in md
    assert "per drafted position the values are shown without intervals" in md
    imgs = check_self_contained_html(runs.parent / "cmp" / "compare.html")
    assert [i["alt"] for i in imgs][-1] == "Confidence head: reliability"
    assert (runs.parent / "cmp" / "plots" / "reliability.svg").read_text().count("<polyline") == 3   # diagonal + 2


def test_a_run_without_a_head_is_said_so_not_failed(runs):
    add_confidences(runs / B, skill=2.0)
    r = compare_json(runs, A, B)
    assert "confidence" not in r["metrics"][A] and r["metrics"][B]["confidence"]
    h = r["comparisons"][0]["confidence"]
    assert h == {"n": 0, "missing": [A], "measures": {}, "verify_budget": []}
    md = (runs.parent / "cmp" / "compare.md").read_text()
    assert "| cycles judged | no confidence head | " in md
    assert "| v5:step20k − v5:step10k | — | 0 | not paired: v5:step10k has no confidence head | — |" in md
    assert "| k | v5:step20k predicted | v5:step20k observed | v5:step20k ECE |" in md
    svg = (runs.parent / "cmp" / "plots" / "reliability.svg").read_text()
    assert svg.count("<polyline") == 2 and "step10k" not in svg


def test_no_head_anywhere_adds_nothing(runs):
    r = compare_json(runs, A, B)
    assert r["comparisons"][0]["confidence"] is None
    assert "Confidence head" not in (runs.parent / "cmp" / "compare.md").read_text()
    assert not (runs.parent / "cmp" / "plots" / "reliability.svg").exists()


def test_a_head_compared_with_itself_is_exactly_zero(runs):
    add_confidences(runs / A, skill=1.0)
    make_run(runs, B, "v5", "step20k", prompts=24, mean=4.0, ddtree=False,
             acceptance=[row["acceptance_lengths"] for row in read_rows(runs / A)],
             row_overrides={row["id"]: {"confidences": row["confidences"]} for row in read_rows(runs / A)})
    h = compare_json(runs, A, B)["comparisons"][0]["confidence"]
    for iv in [*h["measures"].values(), *(p[k] for p in h["verify_budget"] for k in ("tau", "mean_verify_len"))]:
        assert (iv["diff"], iv["ci_low"], iv["ci_high"], iv["p_value"]) == (0.0, 0.0, 0.0, 1.0)


def test_paired_sums_of_a_ratio_is_the_pooled_tau_interval():
    """A ratio of sums through paired_sums gives τ pooled's interval and p-value (the same resamples)."""
    rng = np.random.default_rng(3)
    ca, cb = rng.integers(5, 40, 40), rng.integers(5, 40, 40)
    ta, tb = ca * rng.uniform(2, 5, 40), cb * rng.uniform(2.5, 5.5, 40)
    (iv,) = paired_sums(np.c_[ta, ca], np.c_[tb, cb], [lambda t: t[:, 0] / t[:, 1]], resamples=4000, seed=5,
                        cells=2000 * 40)
    _, pooled = paired_bootstrap(ta, ca, tb, cb, resamples=4000, seed=5)
    assert (iv.a, iv.b, iv.diff) == (pytest.approx(pooled.a), pytest.approx(pooled.b), pytest.approx(pooled.diff))
    assert (iv.ci_low, iv.ci_high) == (pytest.approx(pooled.ci_low), pytest.approx(pooled.ci_high))
    assert iv.p_value == pytest.approx(paired_permutation_test(ta, ca, tb, cb, resamples=4000, seed=5)[1], abs=0.02)


def test_trajectory_shows_the_calibration_of_each_checkpoint_that_has_a_head(tmp_path):
    """watch on a DSpark drafter: ECE, AUROC and τ predicted vs measured per point; a point without
    a head shows — and is left out of the calibration lines (not drawn at 0); a state recorded
    before points kept these numbers reads them from the eval run."""
    from orchestrator.watch import WatchState
    from orchestrator.watch.loop import headline
    from orchestrator.watch.state import Point
    from orchestrator.watch.trajectory import write_trajectory

    runs = tmp_path / "runs"
    st = WatchState(run="v5", settings={"suite": "gsm8k", "prompts": 8, "mode": "offline", "max_new_tokens": 256,
                                        "thinking": "off", "ddtree_budgets": None}, path=tmp_path / "state.json")
    want = {}
    for i, (step, skill) in enumerate([(1000, None), (2000, 0.5), (3000, 3.0)]):
        rid = f"20261203-10{i}0-v5-step{step}-ct129"
        d = make_run(runs, rid, "v5", f"step_{step}", prompts=8, ddtree=False)
        if skill is not None:
            want[step] = cf.summary(cycles(add_confidences(d, skill=skill)))
        st.points[f"step_{step}"] = Point(name=f"step_{step}", step=step, status="done", eval_run=rid,
                                          summary=headline(json.loads((d / "summary.json").read_text())))
    assert st.points["step_1000"].summary["confidence"] is None
    st.save()
    folder = tmp_path / "watch-v5"
    md = write_trajectory(folder, st, runs, {}, None, [])[0].read_text()
    assert "| head ECE | head AUROC | head τ predicted / measured |" in md
    for step, w in want.items():
        pooled, tau = w["calibration"]["pooled"], w["tau"]
        cells = (f"| {pooled['ece']:.3f} | {pooled['auroc']:.3f} | "
                 f"{tau['predicted_tau']:.3f} / {tau['measured_tau']:.3f} |")
        assert re.search(rf"^\| {step} \| step_{step} \|.*{re.escape(cells)}", md, re.M), (step, cells)
    assert re.search(r"^\| 1000 \| step_1000 \|.*\| — \| — \| — \|", md, re.M)
    svg = (folder / "plots" / "calibration.svg").read_text()
    assert svg.count("<circle") == 4            # ECE and AUROC at steps 2000 and 3000 only
    assert "τ predicted by the confidence head" in (folder / "plots" / "tau.svg").read_text()
    html = check_self_contained_html(folder / "trajectory.html")
    assert "Confidence head over training" in [i["alt"] for i in html]

    old = json.loads(st.path.read_text())                 # points recorded before the state kept calibration
    for p in old["points"].values():
        del p["summary"]["confidence"]
    st.path.write_text(json.dumps(old))
    again = WatchState.open(tmp_path, "v5", st.settings)
    assert write_trajectory(folder, again, runs, {}, None, [])[0].read_text() == md
    for p in st.points.values():
        p.summary["confidence"] = None
    assert "head ECE" not in write_trajectory(folder, st, runs, {}, None, [])[0].read_text()
