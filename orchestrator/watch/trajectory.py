"""``runs/watch-<RUN>/trajectory.md`` + self-contained ``trajectory.html``: eval τ vs training
step with bootstrap CIs per point, per-position acceptance over steps (a heat map), the baseline
drafter as a band, the training run's own logged metrics on the same axis, a confidence head's
calibration per checkpoint (where the drafter has one), and the alarms. A superseded point (its
checkpoint saved again since it was evaluated) is shown apart, grey, never as its step's value."""
from __future__ import annotations

from pathlib import Path

from ..reports.svg import Chart
from ..reports.render import Document, fnum
from ..runs.folders import run_folder
from .state import WatchState


def tau_cis(run_dir: Path, budget: str | None = None) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """Bootstrap CIs (macro, pooled) from an eval run's per-prompt acceptance lengths, or those of its
    DDTree ``budget``; offline at T > 0 (no walk), of its per-prompt expected τ (Σ E[τ] / anchors, as
    ``compare`` pairs it). None when its results cannot be read."""
    from ..reports.stats import bootstrap_tau
    from ..runs.folders import RunError, load_run

    if not (run_dir / "results.jsonl").exists():
        return None
    try:
        rows = load_run(run_dir).results
    except RunError:
        return None
    toks, cycs = [], []
    for row in rows:
        lengths = (row.get("acceptance_lengths") if budget is None else
                   ((row.get("ddtree") or {}).get(budget) or {}).get("acceptance_lengths")) or []
        expected = (row.get("expected") or {}) if budget is None else {}
        if lengths:
            toks.append(sum(lengths))
            cycs.append(len(lengths))
        elif expected.get("anchors"):
            toks.append(expected["tau_sum"])
            cycs.append(expected["anchors"])
    return bootstrap_tau(toks, cycs) if toks else None


def calibration(summary: dict, run_dir: Path | None) -> dict | None:
    """A point's confidence-head numbers (reports/confidence.py ``headline``; None without a head).
    A point recorded before the state kept them has them read from its eval run's summary.json."""
    from ..reports.confidence import headline
    from ..runs.folders import RunError, load_run

    if "confidence" in summary:
        return summary["confidence"]
    if run_dir is None or not (run_dir / "summary.json").exists():
        return None
    try:
        return headline(load_run(run_dir).summary.get("confidence"))
    except RunError:
        return None


def ddtree_speedups(run_dir: Path | None) -> dict[str, float]:
    """An online point's speedup over plain decoding per DDTree budget, from its eval run's
    summary.json (``{}`` offline, or when the run cannot be read)."""
    from ..runs.folders import RunError, load_run

    if run_dir is None or not (run_dir / "summary.json").exists():
        return {}
    try:
        dd = (load_run(run_dir).summary or {}).get("ddtree") or {}
    except RunError:
        return {}
    return {str(b): v["speedup"] for b, v in dd.items() if isinstance(v, dict) and v.get("speedup") is not None}


def tau_word(points: list[dict]) -> str:
    """How the points' τ is named: every point of a watch has the same settings, so offline at
    T > 0 (no walk) all of them are the expected τ."""
    return "expected τ" if points and all(p["expected"] for p in points) else "τ"


def plot_tau(points: list[dict], baseline: dict | None, train: list[tuple[int, float]] | None,
             train_tag: str | None, superseded: list[tuple[int, float]] = ()) -> bytes | None:
    if not points and not superseded:
        return None
    word = tau_word(points)
    chart = Chart(f"{word} vs training step", "training step", f"{word} (accepted tokens per block)")
    steps = [p["step"] for p in points]
    tau = [p["tau_macro"] for p in points]
    lo = [p["tau_macro"] - p["ci"][0][0] if p["ci"] else 0 for p in points]
    hi = [p["ci"][0][1] - p["tau_macro"] if p["ci"] else 0 for p in points]
    if baseline:
        if baseline.get("ci"):
            chart.band(*baseline["ci"], "C7", f"baseline {baseline['label']} (95% CI)")
        chart.hline(baseline["tau"], "C7", None if baseline.get("ci") else f"baseline {baseline['label']}")
    chart.errorbars(steps, tau, lo, hi, "C0")
    chart.line(steps, tau, f"eval {word} (macro, 95% CI)", "C0")
    chart.line(steps, [p["tau_pooled"] for p in points], f"eval {word} (pooled)", "C0", dash="5 3", opacity=0.5)
    for i, b in enumerate(sorted({b for p in points for b in p["ddtree"]}, key=int)):
        ys = [(p["step"], p["ddtree"].get(b)) for p in points if p["ddtree"].get(b) is not None]
        if ys:
            chart.line(*zip(*ys), f"DDTree-{b} τ", f"C{i + 2}")
    predicted = [(p["step"], p["calibration"]["predicted_tau"]) for p in points
                 if (p["calibration"] or {}).get("predicted_tau") is not None]
    if predicted:
        chart.line(*zip(*predicted), "τ predicted by the confidence head", "C1", dash="2 2")
    if train:
        chart.line([s for s, _ in train], [v for _, v in train], f"training: {train_tag}", "C3", marker=False)
    for i, (step, tau) in enumerate(superseded):    # one mark each: never joined into a line
        chart.line([step], [tau], "superseded (saved again since)" if i == 0 else None, "C7", opacity=0.6)
    return chart.svg()


CALIBRATION = (("ece", "ECE", "C0"), ("auroc", "AUROC", "C1"))


def plot_calibration(points: list[dict], baseline: dict | None) -> bytes | None:
    """ECE and AUROC of the confidence head per checkpoint; a checkpoint without a value is left
    out of that line (never drawn as 0)."""
    if not any(p["calibration"] for p in points):
        return None
    chart = Chart("confidence head over training", "training step", "ECE, AUROC (survival, pooled)", ylim=(0, 1.02))
    for key, label, c in CALIBRATION:
        xy = [(p["step"], p["calibration"][key]) for p in points if (p["calibration"] or {}).get(key) is not None]
        if xy:
            chart.line(*zip(*xy), label, c)
        value = ((baseline or {}).get("calibration") or {}).get(key)
        if value is not None:
            chart.hline(value, c, f"baseline {baseline['label']} {label}", dash="4 3")
    return chart.svg()


def plot_acceptance(points: list[dict]) -> bytes | None:
    rows = [p for p in points if p["acceptance"]]
    if not rows:
        return None
    k = max(len(p["acceptance"]) for p in rows)
    chart = Chart("per-position acceptance over training", "training step", "block position k", grid="y")
    chart.heatmap([p["acceptance"] for p in rows], k, "P(accepted at k)")
    chart.set_xticks(range(len(rows)), [str(p["step"]) for p in rows], rotate=True)
    chart.note(f"{len(rows)} checkpoints")
    return chart.svg()


def plot_training(series: dict[str, list[tuple[int, float]]], skip: str | None) -> bytes | None:
    others = {t: v for t, v in series.items() if t != skip and v}
    if not others:
        return None
    chart = Chart("the training run's own metrics", "training step", "value", height=320)
    for i, (tag, vals) in enumerate(sorted(others.items())):
        chart.line([s for s, _ in vals], [v for _, v in vals], tag, f"C{i}", marker=False)
    return chart.svg()


def trajectory_points(state: WatchState, runs_root: Path) -> list[dict]:
    out = []
    for p in state.done_points():
        s = p.summary
        run_dir = run_folder(runs_root, p.eval_run) if p.eval_run else None
        out.append({"ddtree_ci": {b: tau_cis(run_dir, b) for b in s.get("ddtree") or {}} if run_dir else {},
                    "ddtree_speedup": ddtree_speedups(run_dir),
                    "name": p.name, "step": p.step, "tau_macro": s.get("tau_macro"), "tau_pooled": s.get("tau_pooled"),
                    "ddtree": s.get("ddtree") or {}, "acceptance": s.get("per_position_acceptance") or [],
                    "ci": tau_cis(run_folder(runs_root, p.eval_run)) if p.eval_run else None, "eval_run": p.eval_run,
                    "prompts": s.get("prompts"), "engine": s.get("engine"), "expected": s.get("measure") == "expected",
                    "calibration": calibration(s, run_folder(runs_root, p.eval_run) if p.eval_run else None)})
    return out


def trajectory_verdict(run: str, points: list[dict], baseline: dict, runs_root: Path) -> list[str]:
    """The trajectory's answer, first: the newest checkpoint's τ with its CI (and the best one so
    far when that is another), then that checkpoint against the baseline, paired prompt by prompt."""
    from ..reports.compare import CompareError, compare_runs
    from ..reports.verdict import ci_text, pair_verdict
    from ..runs.folders import RunError, load_run

    scored = [p for p in points if p["tau_macro"] is not None]
    if not scored:
        return [f"{run}: no checkpoint evaluated yet"]
    latest, word = max(scored, key=lambda p: p["step"]), tau_word(scored)
    ci = f" {ci_text(*latest['ci'][0])}" if latest["ci"] else ""
    line = (f"{run} at step {latest['step']} (the newest of {len(scored)} checkpoint{'s' * (len(scored) != 1)} "
            f"evaluated): {word} {latest['tau_macro']:.2f}{ci}")
    best = max(scored, key=lambda p: p["tau_macro"])
    if best is not latest and best["tau_macro"] > latest["tau_macro"]:
        line += f"; the best so far is step {best['step']}, {word} {best['tau_macro']:.2f}"
    lines = [line]
    if baseline.get("status") == "done" and baseline.get("eval_run") and latest["eval_run"]:
        name = f"{run} step {latest['step']}"
        try:
            result = compare_runs([load_run(run_folder(runs_root, baseline["eval_run"])),
                                   load_run(run_folder(runs_root, latest["eval_run"]))], resamples=2000,
                                  use_published=False)
        except (CompareError, RunError) as e:
            lines.append(f"{name} vs {baseline['label']}: not compared ({e})")
        else:
            if result["refused"]:
                lines.append(f"{name} vs {baseline['label']}: the runs do not pair ({result['mismatches'][0]['message']})")
            else:
                measure = "expected τ" if result.get("measure") == "expected" else "τ"
                lines.append(pair_verdict(name, baseline["label"], result["comparisons"][0], measure))
    return lines


CALIBRATION_NOTE = ("Confidence head: ECE, AUROC and the τ it predicts (1 + Σ survival) beside the τ "
                    "measured on the same cycles, on the survival pooled over drafted positions, SGLang's definitions "
                    "(remote/contract/confidence.py); a checkpoint without a head shows —.")


def calibration_cells(c: dict | None) -> list[str]:
    if not c:
        return ["—", "—", "—"]
    return [fnum(c["ece"], 3), fnum(c["auroc"], 3), f"{fnum(c['predicted_tau'], 3)} / {fnum(c['measured_tau'], 3)}"]


def ddtree_cell(point: dict, budget: str) -> str:
    """A point's DDTree-N τ (macro) with its CI and, online, its speedup over plain decoding."""
    ci = (point["ddtree_ci"].get(budget) or [None])[0]
    speedup = point["ddtree_speedup"].get(budget)
    return (fnum(point["ddtree"].get(budget), 3) + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
            + (f", {speedup:.2f}×" if speedup is not None else ""))


def settings_note(settings: dict, budgets: list[str]) -> str:
    """What every point shares, as the points themselves show it (the DDTree budgets that ran)."""
    st = settings
    ddtree = f"DDTree budgets {', '.join(budgets)}" if budgets else "no DDTree"
    return (f"Every point is one checkpoint evaluated with the same settings: suite `{st.get('suite')}`, "
            f"{st.get('prompts') or 'all'} prompts, mode `{st.get('mode')}`, max new tokens "
            f"{st.get('max_new_tokens')}, thinking `{st.get('thinking')}`, {ddtree}. "
            f"CIs: 95% percentile bootstrap over prompts.")


def write_trajectory(folder: Path, state: WatchState, runs_root: Path, train: dict, tau_tag: str | None,
                     alarms: list[str]) -> tuple[Path, Path]:
    from .trainlog import value_at

    points = trajectory_points(state, runs_root)
    budgets = sorted({k for p in points for k in p["ddtree"]}, key=int)
    doc = Document(f"Trajectory of training run {state.run}")
    doc.verdict(trajectory_verdict(state.run, points, state.baseline, runs_root))
    doc.warnings("Alarm: eval τ departs from the training metric", alarms)
    doc.para(settings_note(state.settings, budgets), "note")
    base = None
    b = state.baseline
    if b.get("status") == "done":
        base_dir = run_folder(runs_root, b["eval_run"]) if b.get("eval_run") else None
        ci = tau_cis(base_dir) if base_dir else None
        base = {"label": b["label"], "tau": b["summary"]["tau_macro"], "ci": ci[0] if ci else None,
                "calibration": calibration(b["summary"], base_dir)}
    tags = sorted(train)
    engine = any(p["engine"] for p in points)       # watch --engine: the serving engine's own τ per point
    head = any(p["calibration"] for p in points)    # a confidence head (DSpark): its calibration per point
    speed = any(p["ddtree_speedup"] for p in points)
    word = tau_word(points)
    header = ["step", "checkpoint", f"{word} macro [95% CI]", f"{word} pooled [95% CI]",
              *[f"DDTree-{k} τ [95% CI]" + (", speedup" if speed else "") for k in budgets],
              *(["engine τ macro", "engine speedup"] if engine else []),
              *(["head ECE", "head AUROC", "head τ predicted / measured"] if head else []),
              *[f"training {t}" for t in tags], "eval run"]
    rows = []
    for p in points:
        ci = p["ci"]
        rows.append([str(p["step"]), p["name"],
                     f"{fnum(p['tau_macro'], 3)}" + (f" [{ci[0][0]:.3f}, {ci[0][1]:.3f}]" if ci else ""),
                     f"{fnum(p['tau_pooled'], 3)}" + (f" [{ci[1][0]:.3f}, {ci[1][1]:.3f}]" if ci else ""),
                     *[ddtree_cell(p, k) for k in budgets],
                     *([fnum((p["engine"] or {}).get("tau_macro"), 3), fnum((p["engine"] or {}).get("speedup"), 2)]
                       if engine else []),
                     *(calibration_cells(p["calibration"]) if head else []),
                     *[fnum(value_at(train[t], p["step"]), 4) for t in tags], p["eval_run"] or "—"])
    doc.table(header, rows, heading="Points")
    if base:
        doc.para(f"Baseline **{base['label']}** (same settings): {word} macro {base['tau']:.3f}"
                 + (f" [{base['ci'][0]:.3f}, {base['ci'][1]:.3f}]" if base["ci"] else "") + ".")
    old = sorted(state.superseded, key=lambda p: p.step)
    doc.plot("tau", f"{word} vs training step", plot_tau(points, base, train.get(tau_tag) if tau_tag else None, tau_tag,
                                                   [(p.step, p.summary["tau_macro"]) for p in old
                                                    if p.summary.get("tau_macro") is not None]),
             "no checkpoint evaluated yet")
    doc.plot("acceptance", "Per-position acceptance over training", plot_acceptance(points),
             "no per-position acceptance yet")
    doc.plot("calibration", "Confidence head over training", plot_calibration(points, base))
    if head:
        doc.para(CALIBRATION_NOTE, "note")
    doc.plot("training", "Training metrics", plot_training(train, tau_tag))
    if old:
        doc.table(["step", "checkpoint", f"{word} macro", "eval run", "why"],
                  [[str(p.step), p.name, fnum(p.summary.get("tau_macro"), 3), p.eval_run or "—", p.reason or ""]
                   for p in old], heading="Superseded (not in the trajectory: the checkpoint changed since)")
    pending = [p for p in sorted(state.points.values(), key=lambda p: p.step) if p.status != "done"]
    if pending:
        doc.table(["step", "checkpoint", "status", "attempts", "reason"],
                  [[str(p.step), p.name, p.status, str(p.attempts), p.reason or ""] for p in pending],
                  heading="Not (yet) in the trajectory")
    return doc.write(folder, "trajectory")
