"""What a DDTree budget costs (issue 42): per budget of an online run, summary.json's τ, tokens/s and
speedup over plain decoding in the same run, and the time per cycle split by stage as DDTree's
ddtree_generate splits it (a real worker run records it, the run-file reader checks it); the
report's tables and plots naming the fastest budget (and, on a CPU, that its timings say little of
a GPU); compare pairing DDTree τ and speedup prompt by prompt; a watch's trajectory showing DDTree-N
τ with its CI and speedup per checkpoint."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fakeruns import TREE_SHARES, add_online_ddtree, make_run, read_rows
from orchestrator.cli import app
from orchestrator.reports.plots import plot_ddtree_costs
from orchestrator.reports.report import write_report
from orchestrator.reports.stats import paired_bootstrap
from remote.contract.metrics import LINEAR_STAGES, TREE_STAGES, fastest_budget, summarize
from remote.contract.runfiles import RunFileError, check_row, check_summary
from reportchecks import check_self_contained_html

REPO = Path(__file__).resolve().parents[1]
A, B = "20261202-2041-v5-step10k-ct129", "20261203-1100-v5-step20k-ct129"
CPU = {"device": "cpu", "gpu": None}


def online_run(runs, run_id, checkpoint, mean=4.0, env=None, **costs):
    d = make_run(runs, run_id, "v5", checkpoint, mode="online", ddtree=False, prompts=10, mean=mean, env=env)
    add_online_ddtree(d, **costs)
    return d


def test_summary_costs_per_budget_from_the_rows():
    """tokens/s = Σ output tokens / Σ wall_s of the budget's decodings, plain decoding's over the same
    rows from target_wall_s, speedup their ratio; a multi-turn row's earlier turns count the row's
    outputs; lossless as the linear decoding's; offline budgets keep τ only."""
    rows = [{"id": "a", "acceptance_lengths": [2, 2], "output_ids": [1] * 5, "wall_s": 1.0, "target_wall_s": 2.0,
             "lossless": True,
             "ddtree": {"4": {"acceptance_lengths": [3, 1], "output_ids": [1] * 5, "wall_s": 0.5, "lossless": True},
                        "8": {"acceptance_lengths": [4], "output_ids": [1] * 5, "wall_s": 2.5, "lossless": True}}},
            {"id": "b", "acceptance_lengths": [1, 3, 2], "output_ids": [2] * 4, "wall_s": 1.0, "target_wall_s": 3.0,
             "lossless": True, "turns": [{"output_ids": [2] * 3, "acceptance_lengths": [1, 1]},
                                         {"output_ids": [2] * 4, "acceptance_lengths": [3, 2]}],
             "ddtree": {"4": {"acceptance_lengths": [2, 2, 2], "output_ids": [2] * 4, "wall_s": 1.5, "lossless": False},
                        "8": {"acceptance_lengths": [3, 3], "output_ids": [2] * 4, "wall_s": 1.5, "lossless": True}}}]
    s = summarize(rows, 16, "online")
    tokens = 5 + 3 + 4                       # row b: its first turn's output, then the tree's last turn
    plain = tokens / 5.0
    assert s["online"]["target_tokens_per_s"] == pytest.approx(plain)
    d4, d8 = s["ddtree"]["4"], s["ddtree"]["8"]
    assert d4["tau_pooled"] == pytest.approx(10 / 5) and d8["tau_pooled"] == pytest.approx(10 / 3)
    assert d4["tokens_per_s"] == pytest.approx(tokens / 2.0) and d8["tokens_per_s"] == pytest.approx(tokens / 4.0)
    assert d4["target_tokens_per_s"] == pytest.approx(plain)
    assert d4["speedup"] == pytest.approx(5.0 / 2.0) and d8["speedup"] == pytest.approx(5.0 / 4.0)
    assert (d4["lossless"], d8["lossless"]) == (False, True)
    assert fastest_budget(s["ddtree"]) == "4"
    for r in rows:                            # T > 0: nothing checked per prompt
        for t in r["ddtree"].values():
            del t["lossless"]
    assert "lossless" not in summarize(rows, 16, "online")["ddtree"]["4"]
    offline = [{k: v for k, v in r.items() if k not in ("wall_s", "target_wall_s", "lossless")} for r in rows]
    for r in offline:
        r["ddtree"] = {b: {"acceptance_lengths": t["acceptance_lengths"]} for b, t in r["ddtree"].items()}
    so = summarize(offline, 16, "offline")
    assert set(so["ddtree"]["4"]) == {"tau_macro", "tau_pooled", "prompts"} and fastest_budget(so["ddtree"]) is None


@pytest.mark.worker
def test_a_real_online_run_times_every_cycle_by_stage(embedded_pair, tmp_path):
    """The worker's online run on the hybrid demo pair: each row's linear decoding and DDTree budget
    record their cycles' time (``cycles_s``, under ``wall_s``) split by stage (draft, verify,
    commit; a tree also tree_build and tree_compile), every stage timed, summing to within 3% of
    the cycles' time; summary.json has the time per cycle and per stage; the run-file reader
    accepts both."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "remote.worker", "--target", embedded_pair["target"],
                           "--drafter", embedded_pair["drafter"], "--prompts", "1", "--mode", "online",
                           "--ddtree", "4", "--max-new-tokens", "32", "--device", "cpu", "--out", str(out)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = read_rows(out)
    summary = json.loads((out / "summary.json").read_text())
    check_row(row, 16)
    check_summary(summary)
    for decoding, stages in ((row, LINEAR_STAGES), (row["ddtree"]["4"], TREE_STAGES)):
        split, cycles = decoding["stage_s"], decoding["cycles_s"]
        assert tuple(split) == stages and all(v > 0 for v in split.values()), split
        assert 0 < cycles < decoding["wall_s"]
        assert sum(split.values()) == pytest.approx(cycles, rel=0.03), (split, cycles)
    for costs, decoding in ((summary["online"], row), (summary["ddtree"]["4"], row["ddtree"]["4"])):
        n = len(decoding["acceptance_lengths"])
        assert costs["s_per_cycle"] == pytest.approx(decoding["cycles_s"] / n)
        assert costs["stage_s_per_cycle"] == pytest.approx({k: v / n for k, v in decoding["stage_s"].items()})


@pytest.mark.worker
def test_a_sampled_online_runs_speedup_is_recomputed_from_its_rows(embedded_pair, tmp_path):
    """At T > 0 plain decoding is its own sample and stops at its own length: a real online run on
    the demo pair (a multi-turn prompt among them) records plain decoding's own output tokens per
    row and per turn, and summary.json's plain tokens/s, speedup and DDTree-4 speedup are what its
    rows give: each decoding's own tokens per second of its own time, the speedup their ratio."""
    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps(r) + "\n" for r in (
        {"id": "mt", "category": "writing", "turns": ["Say hello.", "Now again."]},
        {"id": "one", "category": "coding", "turns": ["Write some code."]},
        {"id": "two", "category": "math", "turns": ["Solve this problem."]})))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "remote.worker", "--target", embedded_pair["target"],
                           "--drafter", embedded_pair["drafter"], "--suite", str(suite), "--mode", "online",
                           "--temperature", "1", "--ddtree", "4", "--max-new-tokens", "64", "--device", "cpu",
                           "--out", str(out)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_rows(out)
    summary = json.loads((out / "summary.json").read_text())
    check_summary(summary)
    for r in rows:
        check_row(r, 8)
        if r.get("turns"):
            assert len(r["turns"]) == 2 and r["target_tokens"] == sum(t["target_tokens"] for t in r["turns"])
    spec_tokens = [sum(len(t["output_ids"]) for t in (r.get("turns") or [r])) for r in rows]
    assert [r["target_tokens"] for r in rows] != spec_tokens, "every sample as long as plain decoding's"
    plain = sum(r["target_tokens"] for r in rows) / sum(r["target_wall_s"] for r in rows)
    spec = sum(spec_tokens) / sum(r["wall_s"] for r in rows)
    tree_tokens = [len(r["ddtree"]["4"]["output_ids"]) + sum(len(t["output_ids"]) for t in (r.get("turns") or [])[:-1])
                   for r in rows]
    tree = sum(tree_tokens) / sum(r["ddtree"]["4"]["wall_s"] for r in rows)
    on, d4 = summary["online"], summary["ddtree"]["4"]
    assert on["target_tokens"] == sum(r["target_tokens"] for r in rows)
    assert on["target_tokens_per_s"] == pytest.approx(plain) and d4["target_tokens_per_s"] == pytest.approx(plain)
    assert on["tokens_per_s"] == pytest.approx(spec) and on["speedup"] == pytest.approx(spec / plain)
    assert d4["tokens_per_s"] == pytest.approx(tree) and d4["speedup"] == pytest.approx(tree / plain)


def test_rows_without_plain_decodings_tokens_read_greedy_and_give_no_speedup_sampled(tmp_path):
    """Rows written without ``target_tokens``: a greedy row's plain decoding made its own output (the
    rate and speedup as its times give them), a sampled row's length is unknown: no plain tokens/s,
    no speedup (in summary.json, for DDTree and in the report's per-prompt column), rather than a
    number divided by the wrong count."""
    rows = [{"id": "a", "acceptance_lengths": [2, 2], "output_ids": [1] * 4, "wall_s": 1.0, "target_wall_s": 2.0,
             "lossless": True, "ddtree": {"4": {"acceptance_lengths": [4], "output_ids": [1] * 4, "wall_s": 0.5}}}]
    greedy = summarize(rows, 16, "online")
    assert greedy["online"]["target_tokens_per_s"] == pytest.approx(2.0) and greedy["online"]["speedup"] == pytest.approx(2.0)
    assert greedy["ddtree"]["4"]["speedup"] == pytest.approx(4.0)
    rows[0]["lossless"] = None
    sampled = summarize(rows, 16, "online")
    assert sampled["online"]["target_tokens_per_s"] is None and sampled["online"]["speedup"] is None
    assert sampled["ddtree"]["4"]["target_tokens_per_s"] is None and sampled["ddtree"]["4"]["speedup"] is None
    check_summary(sampled)
    d = make_run(tmp_path, A, "v5", "step10k", mode="online", ddtree=False, prompts=2,
                 row_overrides={pid: {"lossless": None} for pid in ("gsm8k-0", "gsm8k-1")})
    md = write_report(d)[0].read_text()
    assert "| speedup |" not in md and "plain decoding tokens/s" not in md, md


def test_the_time_per_cycle_by_stage_in_summary_json_and_the_reader():
    """summary.json's time per cycle pools the rows (Σ seconds / Σ cycles), the whole cycle and each
    stage, for the linear decoding and every DDTree budget; rows without a split give none; the
    reader refuses a negative time and a stage of no name it knows, naming the field."""
    rows = [{"id": "a", "acceptance_lengths": [2, 2], "output_ids": [1] * 5, "wall_s": 1.0, "target_wall_s": 2.0,
             "cycles_s": 0.8, "stage_s": {"draft": 0.2, "verify": 0.5, "commit": 0.1},
             "ddtree": {"4": {"acceptance_lengths": [3, 1], "output_ids": [1] * 5, "wall_s": 0.5, "cycles_s": 0.4,
                              "stage_s": {"draft": 0.1, "tree_build": 0.05, "tree_compile": 0.05, "verify": 0.15,
                                          "commit": 0.05}}}},
            {"id": "b", "acceptance_lengths": [1, 3, 2], "output_ids": [2] * 4, "wall_s": 1.0, "target_wall_s": 3.0,
             "cycles_s": 0.7, "stage_s": {"draft": 0.3, "verify": 0.3, "commit": 0.1},
             "ddtree": {"4": {"acceptance_lengths": [4], "output_ids": [2] * 4, "wall_s": 0.6, "cycles_s": 0.5,
                              "stage_s": {"draft": 0.1, "tree_build": 0.1, "tree_compile": 0.0, "verify": 0.2,
                                          "commit": 0.1}}}}]
    s = summarize(rows, 16, "online")
    on, d4 = s["online"], s["ddtree"]["4"]
    assert on["s_per_cycle"] == pytest.approx(1.5 / 5)
    assert on["stage_s_per_cycle"] == pytest.approx({"draft": 0.5 / 5, "verify": 0.8 / 5, "commit": 0.2 / 5})
    assert d4["s_per_cycle"] == pytest.approx(0.9 / 3)
    assert d4["stage_s_per_cycle"] == pytest.approx({"draft": 0.2 / 3, "tree_build": 0.15 / 3, "tree_compile": 0.05 / 3,
                                                     "verify": 0.35 / 3, "commit": 0.15 / 3})
    check_summary(s)
    for r in rows:
        check_row(r, 16)
    del rows[1]["ddtree"]["4"]["stage_s"]
    assert "stage_s_per_cycle" not in summarize(rows, 16, "online")["ddtree"]["4"]

    rows[0]["ddtree"]["4"]["stage_s"]["verify"] = -0.1
    with pytest.raises(RunFileError, match=r"^ddtree\.4\.stage_s\.verify: -0\.1 is not a finite number ≥ 0$"):
        check_row(rows[0], 16)
    rows[0]["ddtree"]["4"]["stage_s"]["verify"] = 0.1
    rows[0]["stage_s"] = {"prefill": 0.1}
    with pytest.raises(RunFileError, match=r"^stage_s: key \"prefill\" is not a cycle stage \(draft, tree_build, "):
        check_row(rows[0], 16)
    with pytest.raises(RunFileError, match=r"^online\.s_per_cycle: "):
        check_summary({**s, "online": {**on, "s_per_cycle": "fast"}})


def fastest_from_rows(rows):
    """The budget with the most output tokens per second, straight from the rows."""
    rate = {}
    for b in rows[0]["ddtree"]:
        rate[b] = sum(len(r["ddtree"][b]["output_ids"]) for r in rows) / sum(r["ddtree"][b]["wall_s"] for r in rows)
    return max(rate, key=rate.get), rate


def test_report_names_the_fastest_budget_and_says_cpu_timings_are_not_a_gpus(tmp_path):
    d = online_run(tmp_path, A, "step10k", env=CPU)
    rows = read_rows(d)
    best, rate = fastest_from_rows(rows)
    plain = sum(len(r["output_ids"]) for r in rows) / sum(r["target_wall_s"] for r in rows)
    assert best not in ("4", "32"), rate              # the fake cost model peaks at a middle budget
    md_path, html_path = write_report(d)
    md = md_path.read_text()
    assert "| DDTree budget N | prompts | tau_macro | tau_pooled | tokens/s | speedup over plain decoding | lossless |" in md
    assert re.search(rf"^\| {best} \| 10 \| [0-9.]+ \| [0-9.]+ \| {rate[best]:.2f} \| {rate[best] / plain:.3f} \| yes \|$",
                     md, re.M), md
    assert f"Fastest DDTree budget: N = {best}, {rate[best]:.2f} tokens/s, {rate[best] / plain:.2f}× plain decoding" in md
    assert "Measured on a CPU (device cpu): CPU timings are not indicative of a GPU." in md
    alts = [i["alt"] for i in check_self_contained_html(html_path)]
    assert "DDTree: τ and speed vs budget" in alts
    svg = (d / "plots" / "ddtree-costs.svg").read_text()
    assert f"fastest: N = {best}" in svg and "DDTree speedup" in svg

    head = "| decoding | ms / cycle | draft ms | tree build ms | tree compile ms | verify ms | commit ms |"
    assert "### DDTree: time per cycle by stage" in md and head in md, md
    linear = 1e3 * sum(r["cycles_s"] for r in rows) / sum(len(r["acceptance_lengths"]) for r in rows)
    assert re.search(rf"^\| DFlash \(no tree\) \| {linear:.2f} \| {0.3 * linear:.2f} \| — \| — \| {0.6 * linear:.2f} \| "
                     rf"{0.1 * linear:.2f} \|$", md, re.M), md
    cycle = 1e3 * sum(r["ddtree"][best]["cycles_s"] for r in rows) / sum(len(r["ddtree"][best]["acceptance_lengths"])
                                                                          for r in rows)
    cells = " \\| ".join(f"{share * cycle:.2f}" for share in TREE_SHARES.values())
    assert re.search(rf"^\| DDTree-{best} \| {cycle:.2f} \| {cells} \|$", md, re.M), md
    assert "DDTree: time per cycle by stage vs budget" in alts
    stages_svg = (d / "plots" / "ddtree-stages.svg").read_text()
    assert all(name in stages_svg for name in ("tree build", "tree compile", "verify", "DFlash (no tree) cycle"))

    gpu = online_run(tmp_path, B, "step20k")                       # fakeruns' default: cuda:0
    assert "not indicative of a GPU" not in write_report(gpu)[0].read_text()
    offline = make_run(tmp_path, "20261204-1000-v5-step30k-ct129", "v5", "step30k", prompts=6)
    text = write_report(offline)[0].read_text()
    assert "Fastest DDTree budget" not in text and "| DDTree budget N | prompts | tau_macro | tau_pooled |\n" in text
    assert "time per cycle by stage" not in text


def test_the_costs_plot_escapes_its_label():
    m = summarize([{"id": "a", "acceptance_lengths": [2], "output_ids": [1, 2], "wall_s": 1.0, "target_wall_s": 2.0,
                    "ddtree": {"4": {"acceptance_lengths": [2], "output_ids": [1, 2], "wall_s": 0.5}}}], 16, "online")
    svg = plot_ddtree_costs('v5 <script>"&', m).decode()
    ET.fromstring(svg)
    assert "<script>" not in svg and "&lt;script&gt;" in svg


def compare_json(runs, *args):
    res = CliRunner().invoke(app, ["compare", *args, "--runs-dir", str(runs), "--json", "--resamples", "1000",
                                   "--out", str(runs.parent / "cmp")])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    return json.loads(res.stdout[res.stdout.index("{"):])


def test_compare_pairs_ddtree_tau_and_speedup_per_budget(tmp_path):
    runs = tmp_path / "runs"
    da, db = online_run(runs, A, "step10k"), online_run(runs, B, "step20k", mean=4.6, node_s=0.0003)
    out = compare_json(runs, A, B)
    c = out["comparisons"][0]
    ra, rb = {r["id"]: r for r in read_rows(da)}, {r["id"]: r for r in read_rows(db)}
    ids = list(ra)
    for b in ("4", "8", "16", "32"):
        lengths = [[m[i]["ddtree"][b]["acceptance_lengths"] for i in ids] for m in (ra, rb)]
        macro, pooled = paired_bootstrap([sum(x) for x in lengths[0]], [len(x) for x in lengths[0]],
                                         [sum(x) for x in lengths[1]], [len(x) for x in lengths[1]], resamples=1000)
        got = c["ddtree"][b]
        assert got["n"] == len(ids)
        assert (got["macro"]["diff"], got["macro"]["ci_low"], got["macro"]["ci_high"]) == \
            pytest.approx((macro.diff, macro.ci_low, macro.ci_high))
        assert got["pooled"]["diff"] == pytest.approx(pooled.diff)
        speed = got["speedup"]["pooled"]
        for side, m in (("a", ra), ("b", rb)):
            assert speed[side] == pytest.approx(sum(m[i]["target_wall_s"] for i in ids)
                                                / sum(m[i]["ddtree"][b]["wall_s"] for i in ids))
        assert speed["ci_low"] <= speed["diff"] <= speed["ci_high"]
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "## DDTree per budget" in md and "Δ speedup v5:step20k [95% CI]" in md
    assert sum(line.count("★") for line in md.splitlines() if line.startswith("|")) == 2   # each run's fastest
    assert check_self_contained_html(tmp_path / "cmp" / "compare.html")

    make_run(runs, "20261204-1000-v5-step30k-ct129", "v5", "step30k", prompts=10, mode="online", ddtree=False)
    plain = compare_json(runs, A, "20261204-1000-v5-step30k-ct129")
    assert plain["comparisons"][0]["ddtree"] == {}
    assert "DDTree per budget" not in (tmp_path / "cmp" / "compare.md").read_text()


def test_trajectory_shows_ddtree_tau_with_its_ci_and_speedup_per_checkpoint(tmp_path):
    from orchestrator.reports.stats import bootstrap_tau
    from orchestrator.watch import WatchState
    from orchestrator.watch.loop import headline
    from orchestrator.watch.state import Point
    from orchestrator.watch.trajectory import write_trajectory

    runs = tmp_path / "runs"
    st = WatchState(run="v5", settings={"suite": "gsm8k", "prompts": 10, "mode": "online", "max_new_tokens": 256,
                                        "thinking": "off", "ddtree": "8"}, path=tmp_path / "state.json")
    for i, step in enumerate((1000, 2000)):
        rid = f"20261203-10{i}0-v5-step{step}-ct129"
        d = online_run(runs, rid, f"step_{step}", mean=3.0 + i, budgets=(8,))
        summary = json.loads((d / "summary.json").read_text())
        st.points[f"step_{step}"] = Point(name=f"step_{step}", step=step, status="done", eval_run=rid,
                                          summary=headline(summary))
        rows = read_rows(d)
        lengths = [r["ddtree"]["8"]["acceptance_lengths"] for r in rows]
        (lo, hi), _ = bootstrap_tau([sum(x) for x in lengths], [len(x) for x in lengths])
        dd = summary["ddtree"]["8"]
        cell = f"{dd['tau_macro']:.3f} [{lo:.3f}, {hi:.3f}], {dd['speedup']:.2f}×"
        st.points[f"step_{step}"].summary["want"] = cell
    md = write_trajectory(tmp_path / "watch-v5", st, runs, {}, None, [])[0].read_text()
    assert "| DDTree-8 τ [95% CI], speedup |" in md
    for step in (1000, 2000):
        cell = st.points[f"step_{step}"].summary["want"]
        assert re.search(rf"^\| {step} \| step_{step} \|.*\| {re.escape(cell)} \|", md, re.M), (cell, md)
    assert "DDTree-8 τ" in (tmp_path / "watch-v5" / "plots" / "tau.svg").read_text()
