"""Run reports (report.md / self-contained report.html), `dflash-ops show`, `dflash-ops runs` and
run-label resolution, and the HTML rendered in headless Chromium."""
from __future__ import annotations

import json
import os
import re

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.reports.report import write_report
from orchestrator.runs.folders import RunError, load_runs, resolve
from reportchecks import check_self_contained_html, md_table_values, recompute
from fakeruns import make_run, read_rows
from browser import assert_images_decode, chromium, run_chromium
from clirun import invoke

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def runs(tmp_path):
    d = tmp_path / "runs"
    make_run(d, "20261201-1000-zlab-ct129", "zlab", prompts=9)
    make_run(d, "20261202-1000-zlab-ct129", "zlab", prompts=15, mean=4.4)
    make_run(d, "20261203-1000-zlab-ct129", "zlab", prompts=4, status="failed", summary=False)
    make_run(d, "20261202-2041-v5-step20k-ct129", "v5", "step20k", prompts=15, mean=3.2)
    make_run(d, "20261202-2100-v5-step10k-ct200", "v5", "step10k", prompts=15, mean=2.8, host="ct200",
             suite="humaneval")
    make_run(d, "20261203-0900-v6-step20k-ct129", "v6", "step20k", prompts=15, mean=3.5)
    return d


def test_report_files_numbers_and_self_contained_html(runs):
    run_dir = runs / "20261202-1000-zlab-ct129"
    md_path, html_path = write_report(run_dir)
    assert md_path == run_dir / "report.md" and html_path == run_dir / "report.html"
    assert md_path.stat().st_size > 0 and html_path.stat().st_size > 0
    imgs = check_self_contained_html(html_path)
    assert {i["alt"] for i in imgs} == {"Per-position acceptance", "Acceptance-length histogram",
                                        "τ per prompt category", "DDTree τ vs budget"}
    md = md_path.read_text()
    values = md_table_values(md)
    for b, macro, pooled in re.findall(r"^\| (\d+) \| \d+ \| ([0-9.]+) \| ([0-9.]+) \|$", md, re.M):
        values[f"DDTree-{b} tau_macro"], values[f"DDTree-{b} tau_pooled"] = macro, pooled   # the DDTree table
    expected = recompute(read_rows(run_dir))
    assert len(expected) == 5 + 8
    for key, want in expected.items():
        got = values[key]
        if isinstance(want, int):
            assert int(got) == want, key
        else:
            assert float(got) == pytest.approx(want, abs=5e-5), key
            assert f"{want:.4f}" in html_path.read_text(), key
    for key in ("device", "GPU", "dtype", "kernel path", "versions", "drafter sha256", "mode", "block size"):
        assert key in values
    assert values["kernel path"] == "fla" and values["block size"] == "16"
    env = json.loads((run_dir / "env.json").read_text())
    assert values["drafter sha256"] == env["drafter"]["sha256"]["model.safetensors"][:12]
    assert "Warnings" not in md  # summary.json (the worker's) agrees with the recomputation
    # per-position table: τ_pooled = 1 + Σ acceptance
    section = md.split("### Per-position acceptance", 1)[1].split("###", 1)[0]
    acc = [float(m.group(1)) for m in re.finditer(r"^\| \d+ \| ([0-9.]+) \| [0-9.]+ \| [0-9.]+ \|$", section, re.M)]
    assert len(acc) == 15 and 1 + sum(acc) == pytest.approx(expected["tau_pooled"], abs=1e-3)
    for plot in ("per-position", "histogram", "categories", "ddtree"):
        assert (run_dir / "plots" / f"{plot}.svg").stat().st_size > 1000
        assert f"plots/{plot}.svg" in md


def test_report_numbers_come_from_results_not_summary(tmp_path):
    d = make_run(tmp_path, "r1", prompts=6, summary={"tau_macro": 9.99, "ddtree": {"16": {"tau_pooled": 1.0}}})
    md_path, html_path = write_report(d)
    md, page = md_path.read_text(), html_path.read_text()
    assert "9.99" not in md_table_values(md)["tau_macro"]
    assert float(md_table_values(md)["tau_macro"]) == pytest.approx(recompute(read_rows(d))["tau_macro"], abs=5e-5)
    assert "summary.json tau_macro = 9.99 but results.jsonl gives" in md
    assert "summary.json ddtree[16].tau_pooled = 1.0" in md
    assert 'class="warn"' in page and "summary.json tau_macro = 9.99" in page


def test_report_of_online_and_running_runs(tmp_path):
    d = make_run(tmp_path, "online1", mode="online", prompts=5, categories=False, status="running", summary=False)
    md_path, html_path = write_report(d)
    values = md_table_values(md_path.read_text())
    rows = read_rows(d)
    tokens = sum(sum(r["acceptance_lengths"]) for r in rows)
    assert float(values["online tokens/s"]) == pytest.approx(tokens / sum(r["wall_s"] for r in rows), abs=0.01)
    assert float(values["speedup"]) == pytest.approx(sum(r["target_wall_s"] for r in rows) / sum(r["wall_s"] for r in rows), abs=1e-3)
    md = md_path.read_text()
    assert "summary.json is missing" in md and "status is 'running'" in md
    check_self_contained_html(html_path)   # histogram + per-position only


def test_report_answers_first_then_every_prompt(runs):
    """The first thing report.md/.html say is the verdict a person can read aloud: τ with its CI
    over prompts, against the published number the suite names; then τ, plots, each prompt."""
    from orchestrator.reports.report import ENGINE_COLUMNS, PromptColumn, prompt_table
    from orchestrator.reports.stats import bootstrap_tau

    run_dir = runs / "20261202-2041-v5-step20k-ct129"          # suite gsm8k: published τ 6.57 at T=0
    md_path, html_path = write_report(run_dir)
    rows = read_rows(run_dir)
    taus = [sum(r["acceptance_lengths"]) / len(r["acceptance_lengths"]) for r in rows]
    (lo, hi), _ = bootstrap_tau([sum(r["acceptance_lengths"]) for r in rows],
                                [len(r["acceptance_lengths"]) for r in rows], resamples=2000, seed=0)
    want = (f"v5:step20k: τ {sum(taus) / len(taus):.2f} [{lo:.2f}, {hi:.2f}] over 15 prompts of gsm8k, below the "
            f"published 6.57 (GSM8K, target Qwen3-8B, T=0; not measured here)")
    md = md_path.read_text()
    assert md.split("\n")[2] == f"**{want}**"                     # right under the title
    page = html_path.read_text()
    assert page.index('<div class="verdict">') < page.index("<table") and want in page
    # the per-prompt table: one row per prompt, in suite order, its numbers from the rows
    section = md.split("## Per prompt", 1)[1].split("\n## ", 1)[0]
    table = re.findall(r"^\| (gsm8k-\d+) \| (\w+) \| ([0-9.]+) \| (\d+) \| (\d+) \|$", section, re.M)
    assert "| prompt | category | τ | cycles | tokens |" in section
    assert [t[0] for t in table] == [r["id"] for r in rows]
    for (pid, cat, tau, cycles, tokens), r in zip(table, rows):
        assert (cat, int(cycles), int(tokens)) == (r["category"], len(r["acceptance_lengths"]),
                                                   sum(r["acceptance_lengths"]))
        assert float(tau) == pytest.approx(int(tokens) / int(cycles), abs=5e-4)
    assert md.index("**" + want) < md.index("## τ") < md.index("## Per-position acceptance") < md.index("## Per prompt")
    # a column the rows carry is added from the rows (as the engine's own τ will be); one none has is left out
    engine = PromptColumn("engine τ", lambda r: (r.get("engine") or {}).get("tau"))
    head, cells = prompt_table(rows, [*ENGINE_COLUMNS, engine])
    assert head == [] and cells == [[] for _ in rows]
    rows[0]["engine"] = {"tau": "3.5"}
    head, cells = prompt_table(rows, [engine])
    assert head == ["engine τ"] and cells[0] == ["3.5"] and cells[1] == ["—"]


def test_plots_of_one_bar_are_left_out(tmp_path):
    d = make_run(tmp_path, "one-category", prompts=6, categories=["math"] * 6)
    md_path, html_path = write_report(d)
    alts = {i["alt"] for i in check_self_contained_html(html_path)}
    assert alts == {"Per-position acceptance", "Acceptance-length histogram", "DDTree τ vs budget"}
    assert "τ per prompt category" not in md_path.read_text() and not (d / "plots" / "categories.svg").exists()
    d = make_run(tmp_path, "all-length-one", acceptance=[[1, 1, 1], [1, 1]], ddtree=False, all_anchors=False,
                 categories=False)
    alts = {i["alt"] for i in check_self_contained_html(write_report(d)[1])}
    assert alts == {"Per-position acceptance"}               # every cycle one token long: no histogram of one bar


def test_the_verdict_of_a_run_still_running_and_of_an_invalid_run(tmp_path):
    d = make_run(tmp_path, "partial", prompts=3, status="running", summary=False, suite="mine")
    record = json.loads((d / "run.json").read_text())
    record["request"]["settings"]["prompts"] = 12                    # asked for 12, 3 written so far
    (d / "run.json").write_text(json.dumps(record))
    line = write_report(d)[0].read_text().split("\n")[2]
    assert line.startswith("**zlab (running, 3 of 12 prompts so far): τ ") and "over 3 prompts of mine**" in line
    d = make_run(tmp_path, "bad", prompts=2, mode="online", suite="mine",
                 row_overrides={"mine-1": {"divergence": {"near_tie": False, "describe": "token 7"}}})
    assert write_report(d)[0].read_text().split("\n")[2] == (
        "**zlab: invalid, its τ is not a result: prompt mine-1 diverged from the target's greedy output at token 7**")


def test_resolve_labels(runs):
    assert resolve("20261201-1000-zlab-ct129", runs).id == "20261201-1000-zlab-ct129"
    assert resolve("zlab", runs).id == "20261202-1000-zlab-ct129"   # newest *finished* zlab run
    assert resolve("v5:step20k", runs).id == "20261202-2041-v5-step20k-ct129"
    assert resolve("step10k", runs).id == "20261202-2100-v5-step10k-ct200"
    assert resolve("20261202-21", runs).id == "20261202-2100-v5-step10k-ct200"  # unique id prefix
    with pytest.raises(RunError, match=r"ambiguous.*v5:step20k or v6:step20k"):
        resolve("step20k", runs)
    with pytest.raises(RunError, match=r"ambiguous: it starts 3 run ids"):
        resolve("20261202", runs)
    with pytest.raises(RunError, match=r"no run matches 'zlb'.*did you mean 'zlab'"):
        resolve("zlb", runs)
    with pytest.raises(RunError, match=r"did you mean 'v5:step20k'"):
        resolve("v5:step2k", runs)
    assert [r.id for r in load_runs(runs)][0] == "20261201-1000-zlab-ct129"


def test_runs_command_lists_and_filters(runs):
    res = invoke("runs", "--runs-dir", str(runs))
    assert res.exit_code == 0, res.output
    for rid in ("20261201-1000-zlab-ct129", "20261202-2041-v5-step20k-ct129", "20261203-0900-v6-step20k-ct129"):
        assert rid in res.output
    for col in ("drafter", "target", "mode", "suite", "prompts", "settings", "τ", "host", "date", "status"):
        assert col in res.output
    res = invoke("runs", "--runs-dir", str(runs), "--drafter", "v5", "--json")
    rows = json.loads(res.output)
    assert {r["id"] for r in rows} == {"20261202-2041-v5-step20k-ct129", "20261202-2100-v5-step10k-ct200"}
    want = recompute(read_rows(runs / "20261202-2041-v5-step20k-ct129"))["tau_macro"]
    assert next(r for r in rows if r["checkpoint"] == "step20k")["tau_macro"] == pytest.approx(want)
    res = invoke("runs", "--runs-dir", str(runs), "--host", "ct200", "--suite", "humaneval", "--json")
    assert [r["id"] for r in json.loads(res.output)] == ["20261202-2100-v5-step10k-ct200"]
    res = invoke("runs", "--runs-dir", str(runs), "--status", "failed", "--json")
    assert [r["id"] for r in json.loads(res.output)] == ["20261203-1000-zlab-ct129"]
    env = dict(os.environ, DFLASH_OPS_RUNS=str(runs))
    res = CliRunner().invoke(app, ["runs", "--json"], env=env)
    assert len(json.loads(res.output)) == 6


def test_show_command(runs):
    run_dir = runs / "20261202-2041-v5-step20k-ct129"
    assert not (run_dir / "report.html").exists()
    res = invoke("show", "v5:step20k", "--runs-dir", str(runs))
    assert res.exit_code == 0, res.output
    want = recompute(read_rows(run_dir))
    assert f"{want['tau_macro']:.4f}" in res.output and f"{want['tau_pooled']:.4f}" in res.output
    assert "report.html" in res.output and (run_dir / "report.html").exists()
    assert "math" in res.output  # category table
    mtime = (run_dir / "report.html").stat().st_mtime_ns
    invoke("show", "v5:step20k", "--runs-dir", str(runs))
    assert (run_dir / "report.html").stat().st_mtime_ns == mtime   # current: not rewritten
    res = invoke("show", "nope", "--runs-dir", str(runs))
    assert res.exit_code == 2 and "no run matches 'nope'" in res.output


# --------------------------------------------------------------------------- headless Chromium

def test_html_report_renders_in_headless_chromium(runs, tmp_path):
    exe = chromium()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (CI is set): add `chromium` to .ci/run's apt packages")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    from PIL import Image

    _, html_path = write_report(runs / "20261202-1000-zlab-ct129")
    shot = tmp_path / "shot.png"
    res = run_chromium(exe, tmp_path, [f"--screenshot={shot}", "--window-size=1200,2000",
                                        html_path.resolve().as_uri()])
    assert shot.exists() and shot.stat().st_size > 20_000, res.stderr[-2000:]
    im = Image.open(shot).convert("RGB")
    assert im.size == (1200, 2000)
    colors = im.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50, "screenshot is (nearly) one colour"
    # the first series' blue (C0 #1f77b4) drawn in the plots must be on screen
    import numpy as np

    a = np.asarray(im, dtype=np.int32)
    r, g, b = a[..., 0], a[..., 1], a[..., 2]
    blueish = int(((b > 150) & (r < 90) & (g > 90) & (g < 150)).sum())
    assert blueish > 800, f"no plot colours in the screenshot ({blueish} blue pixels)"

    assert_images_decode(exe, tmp_path, html_path, 4)
