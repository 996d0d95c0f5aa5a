"""`dflash-ops compare` through the real CLI: pairing checks and refusals (named), --force, the
side-by-side numbers, paired statistics, environment warnings, published rows, outputs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from reportchecks import check_self_contained_html, recompute
from fakeruns import make_run, read_rows
from clirun import invoke

pytestmark = pytest.mark.timeout(240)
A, B = "20261202-2041-zlab-ct129", "20261203-1100-v5-step20k-ct129"


def compare_json(runs: Path, *args: str) -> tuple[int, dict]:
    res = CliRunner().invoke(app, ["compare", *args, "--runs-dir", str(runs), "--json", "--resamples", "1000"])
    assert "Traceback" not in res.output, res.output
    start = res.stdout.index("{")
    return res.exit_code, json.loads(res.stdout[start:])


@pytest.fixture
def runs(tmp_path):
    d = tmp_path / "runs"
    make_run(d, A, "zlab", prompts=30)
    make_run(d, B, "v5", "step20k", prompts=30, mean=3.2)
    return d


def test_compare_side_by_side_and_statistics(runs):
    code, r = compare_json(runs, "zlab", "v5:step20k", "--seed", "11")
    assert code == 0, r
    assert r["baseline"] == A and [x["id"] for x in r["runs"]] == [A, B]
    assert not r["mismatches"] and not r["refused"] and r["paired_prompts"] == 30
    for rid in (A, B):
        want = recompute(read_rows(runs / rid))
        m = r["metrics"][rid]
        assert m["tau_macro"] == pytest.approx(want["tau_macro"])
        assert m["tau_pooled"] == pytest.approx(want["tau_pooled"])
        assert m["ddtree"]["32"]["tau_macro"] == pytest.approx(want["DDTree-32 tau_macro"])
        assert len(m["per_position_acceptance"]) == 15
    c = r["comparisons"][0]
    assert (c["run"], c["vs"], c["n"], c["resamples"], c["seed"]) == (B, A, 30, 1000, 11)
    ma, mb = r["metrics"][A], r["metrics"][B]
    assert c["macro"]["diff"] == pytest.approx(mb["tau_macro"] - ma["tau_macro"])
    assert c["pooled"]["diff"] == pytest.approx(mb["tau_pooled"] - ma["tau_pooled"])
    assert c["macro"]["ci_low"] < c["macro"]["diff"] < c["macro"]["ci_high"]
    assert 0 < c["macro"]["p_value"] <= 1
    ta = [sum(x["acceptance_lengths"]) / len(x["acceptance_lengths"]) for x in read_rows(runs / A)]
    tb = [sum(x["acceptance_lengths"]) / len(x["acceptance_lengths"]) for x in read_rows(runs / B)]
    assert (c["wins"], c["losses"]) == (sum(b > a for a, b in zip(ta, tb)), sum(b < a for a, b in zip(ta, tb)))
    assert c["wins"] + c["ties"] + c["losses"] == 30
    assert set(c["ddtree"]) == {"8", "16", "32", "64"}
    assert set(c["categories"]) == {"math", "code", "writing"} and c["categories"]["math"]["n"] == 10
    # automatic published row: the suite is gsm8k
    assert r["published"]["benchmark"] == "gsm8k" and r["published"]["tau"] == 6.57
    assert r["published"]["label"] == "published, not measured here"
    out = Path(r["outputs"]["html"])
    assert out.parent == runs / f"compare-{A}_vs_{B}"
    imgs = check_self_contained_html(out)
    assert len(imgs) == 4
    md = Path(r["outputs"]["md"]).read_text()
    assert "1000 resamples, seed 11" in md and "published, not measured here" in md


def test_compare_terminal_table(runs, tmp_path):
    res = invoke("compare", "zlab", "v5:step20k", "--runs-dir", str(runs), "--resamples", "500",
                 "--out", str(tmp_path / "cmp"))
    assert res.exit_code == 0, res.output
    for s in ("side by side", "difference vs baseline", "per-position acceptance", "tau_macro", "tau_pooled",
              "DDTree-16", "win / tie / loss", "500 resamples, seed 0", "published, not measured here",
              "per category"):
        assert s in res.output, s
    assert (tmp_path / "cmp" / "compare.html").exists() and (tmp_path / "cmp" / "compare.md").exists()


def test_compare_says_the_verdict_first(runs, tmp_path):
    """compare's first line, on the terminal and in compare.md/.html: the paired τ difference
    with its CI and the prompts each way, as a person reads it aloud."""
    code, r = compare_json(runs, "zlab", "v5:step20k")
    c = r["comparisons"][0]
    ta = [sum(x["acceptance_lengths"]) / len(x["acceptance_lengths"]) for x in read_rows(runs / A)]
    tb = [sum(x["acceptance_lengths"]) / len(x["acceptance_lengths"]) for x in read_rows(runs / B)]
    worse = sum(b < a for a, b in zip(ta, tb))
    assert c["macro"]["ci_high"] < 0 and worse > 15          # mean 3.2 against 4.0: clearly worse

    def minus(x):
        return f"{x:+.2f}".replace("-", "−")
    first = (f"v5:step20k vs zlab: τ {minus(c['macro']['diff'])} [{minus(c['macro']['ci_low'])}, "
             f"{minus(c['macro']['ci_high'])}], v5:step20k worse on {worse} of 30 prompts")
    assert r["verdict"][0].startswith(first) and "no clear difference" not in r["verdict"][0]
    assert r["verdict"][1].startswith("beside the published τ 6.57 (GSM8K, target Qwen3-8B, T=0; not measured "
                                      "here): zlab ")
    res = invoke("compare", "zlab", "v5:step20k", "--runs-dir", str(runs), "--resamples", "1000",
                 "--out", str(tmp_path / "cmp"))
    assert " ".join(res.stdout.split()).startswith(r["verdict"][0])
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert md.split("\n")[2].startswith("**" + first)
    page = (tmp_path / "cmp" / "compare.html").read_text()
    assert page.index('<div class="verdict">') < page.index("<table") and first in page


def test_run_compared_with_itself_is_exactly_zero(runs):
    shutil.copytree(runs / A, runs / "20261205-0000-zlab-copy")
    meta = json.loads((runs / "20261205-0000-zlab-copy" / "run.json").read_text())
    meta["id"] = "20261205-0000-zlab-copy"
    (runs / "20261205-0000-zlab-copy" / "run.json").write_text(json.dumps(meta))
    code, r = compare_json(runs, A, "20261205-0000-zlab-copy")
    assert code == 0, r
    c = r["comparisons"][0]
    for k in ("macro", "pooled"):
        assert (c[k]["diff"], c[k]["ci_low"], c[k]["ci_high"]) == (0.0, 0.0, 0.0)
        assert c[k]["p_value"] == 1.0
    assert (c["wins"], c["ties"], c["losses"]) == (0, 30, 0)
    assert r["verdict"][0] == f"20261205-0000-zlab-copy vs {A}: τ +0.00 [+0.00, +0.00], the same τ on all 30 prompts"
    for b in c["ddtree"].values():
        assert (b["macro"]["diff"], b["macro"]["ci_low"], b["macro"]["ci_high"]) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("kwargs, field, values", [
    ({"target": "Qwen/Qwen3-4B"}, "target differs", ("Qwen/Qwen3-8B", "Qwen/Qwen3-4B")),
    ({"suite": "humaneval"}, "suite differs", ("gsm8k", "humaneval")),
    ({"block_size": 8}, "block size differs", ("16", "8")),
    ({"mode": "online"}, "mode differs", ("offline", "online")),
    ({"ref_seed": 1}, "reference completions (output_ids) differ", ("30 of 30 common prompts",)),
    ({"env": {"settings": {"max_new_tokens": 512}}}, "decoding setting max_new_tokens differs", ("256", "512")),
    ({"env": {"settings": {"enable_thinking": True}}}, "decoding setting enable_thinking differs", ("false", "true")),
    ({"env": {"settings": {"semantics": "specforge"}}}, "counting rules (semantics) differs", ("zlab", "specforge")),
    ({"prompts": 25}, "prompt ids differ", ("30 prompts", "25 prompts", "only in " + A)),
])
def test_mismatched_runs_are_refused_with_the_mismatch_named(tmp_path, kwargs, field, values):
    runs = tmp_path / "runs"
    make_run(runs, A, "zlab", prompts=30)
    opts = {"prompts": 30, "mean": 3.2, **kwargs}
    if kwargs.get("suite"):
        opts["prompt_ids"] = [f"gsm8k-{i}" for i in range(30)]   # same prompts, another suite name
    make_run(runs, B, "v5", "step20k", **opts)
    res = invoke("compare", "zlab", "v5:step20k", "--runs-dir", str(runs), "--resamples", "200")
    assert res.exit_code == 3, res.output
    text = " ".join(res.output.replace("│", " ").split())      # the panels' borders out of wrapped lines
    assert "refusing to compare" in text and "--force" in text
    assert field in text, text
    for v in values:
        assert v in text, (v, text)
    assert not list(runs.glob("compare-*"))
    code, r = compare_json(runs, "zlab", "v5:step20k")
    assert code == 3 and r["refused"] and "comparisons" not in r
    assert any(field in m["message"] for m in r["mismatches"])

    # --force compares anyway (on the common prompts), the mismatch still shown
    res = invoke("compare", "zlab", "v5:step20k", "--runs-dir", str(runs), "--resamples", "200", "--force")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "FORCED" in text and field in text and "difference vs baseline" in text
    html = next(runs.glob("compare-*")) / "compare.html"
    assert "Forced comparison" in html.read_text() and field in html.read_text().replace("&#x27;", "'")
    code, r = compare_json(runs, "zlab", "v5:step20k", "--force")
    assert code == 0 and r["forced"] and r["paired_prompts"] == (25 if "prompts" in kwargs else 30)


def test_environment_differences_are_listed_prominently(runs):
    make_run(runs, "20261204-0000-v5-step30k-ct129", "v5", "step30k", prompts=30,
             env={"kernel_path": "torch", "dtype": "float32", "gpu": "NVIDIA A100",
                  "versions": {"transformers": "5.4.0", "torch": "2.12.0"}, "host": "ct130"})
    res = invoke("compare", "zlab", "v5:step30k", "--runs-dir", str(runs), "--resamples", "200")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "environment differences that can change the numbers" in text
    for s in ("kernel path differs", "fla", "torch", "dtype differs", "float32", "GPU differs", "NVIDIA A100",
              "transformers differs", "5.4.0", "torch differs", "2.12.0"):
        assert s in text, s
    assert text.index("environment differences") < text.index("side by side")
    code, r = compare_json(runs, "zlab", "v5:step30k")
    fields = {d["field"] for d in r["env_differences"]}
    assert {"kernel path", "dtype", "GPU", "transformers", "torch"} <= fields
    assert "host" in {d["field"] for d in r["other_differences"]} and "host" not in fields


def test_three_runs_and_errors(runs):
    make_run(runs, "20261204-0000-v5-step30k-ct129", "v5", "step30k", prompts=30, mean=4.5)
    code, r = compare_json(runs, "zlab", "v5:step20k", "v5:step30k")
    assert code == 0 and [c["run"] for c in r["comparisons"]] == [B, "20261204-0000-v5-step30k-ct129"]
    assert all(c["vs"] == A for c in r["comparisons"])
    res = invoke("compare", "zlab", "--runs-dir", str(runs))
    assert res.exit_code == 2 and "at least two runs" in res.output
    res = invoke("compare", "zlab", A, "--runs-dir", str(runs))
    assert res.exit_code == 2 and "the same run is given twice" in res.output
    res = invoke("compare", "zlab", "v6", "--runs-dir", str(runs))
    assert res.exit_code == 2 and "no run matches 'v6'" in res.output and "did you mean 'v5'" in res.output


def test_published_rows(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs, "r-a", "zlab", prompts=8, suite="custom-set")
    make_run(runs, "r-b", "v5", prompts=8, suite="custom-set", mean=3.0)
    code, r = compare_json(runs, "r-a", "r-b")
    assert code == 0 and r["published"] is None                   # no benchmark for this suite
    code, r = compare_json(runs, "r-a", "r-b", "--published", "MATH-500")
    assert r["published"]["benchmark"] == "math500" and r["published"]["tau"] == 7.79
    assert r["published"]["ddtree_tau"] == 10.73 and r["published"]["speedup"] == 5.56
    res = invoke("compare", "r-a", "r-b", "--runs-dir", str(runs), "--published", "mt-bench", "--resamples", "200")
    text = " ".join(res.output.split())
    assert "MT-Bench: published, not measured here" in text and "4.28" in text and "6.58" in text
    res = invoke("compare", "r-a", "r-b", "--runs-dir", str(runs), "--published", "nosuch")
    assert res.exit_code == 2 and "no published numbers for 'nosuch'" in res.output
    make_run(runs, "r-c", "zlab", prompts=8, suite="humaneval", target="Qwen/Qwen3.6-27B")
    make_run(runs, "r-d", "v5", prompts=8, suite="humaneval", target="Qwen/Qwen3.6-27B")
    code, r = compare_json(runs, "r-c", "r-d")
    assert r["published"]["benchmark"] == "humaneval" and r["published"]["automatic"]
    assert "published for target Qwen3-8B" in r["published"]["caveat"]
    code, r = compare_json(runs, "r-c", "r-d", "--no-published")
    assert r["published"] is None


def test_engine_tau_and_speedup_pair_like_every_metric(tmp_path):
    """Runs with the engine's own counts (`eval --engine`): its τ and speedup are paired prompt by
    prompt with CIs, beside our τ, and shown side by side."""
    d = tmp_path / "runs"

    def engine_rows(run_id, counts, plain_share=1.0):
        ids = [f"gsm8k-{i}" for i in range(len(counts))]
        make_run(d, run_id, run_id.split("-")[-1], prompts=len(ids), mode="online", ddtree=False, all_anchors=False,
                 row_overrides={i: {"engine": {"kind": "vllm", "tokens": t, "cycles": c, "wall_s": w,
                                               "output_ids": [5] * t,
                                               "plain": {"wall_s": p, "tokens": int(t * plain_share)}}}
                                for i, (t, c, w, p) in zip(ids, counts)})

    engine_rows("20261204-1000-a", [(30, 10, 1.0, 0.8)] * 6)
    engine_rows("20261204-1100-b", [(40, 10, 1.0, 1.2)] * 6)
    # sampled: without the drafter the engine wrote half as many tokens in its 1.2 s, so its rate is
    # half and the speedup twice b's (time over time would say they are equal)
    engine_rows("20261204-1200-c", [(40, 10, 1.0, 1.2)] * 6, plain_share=0.5)
    code, result = compare_json(d, "20261204-1100-b", "20261204-1200-c")
    assert result["comparisons"][0]["engine"]["speedup"]["macro"]["diff"] == pytest.approx(1.2)
    assert result["metrics"]["20261204-1200-c"]["engine"]["speedup"] == pytest.approx(2.4)
    code, result = compare_json(d, "20261204-1000-a", "20261204-1100-b")
    assert code == 0, result
    (c,) = result["comparisons"]
    assert c["engine"]["tau"]["n"] == 6 and c["engine"]["tau"]["macro"]["diff"] == pytest.approx(1.0)
    assert c["engine"]["tau"]["pooled"]["diff"] == pytest.approx(1.0)
    assert c["engine"]["speedup"]["macro"]["diff"] == pytest.approx(0.4) and c["engine"]["speedup"]["wins"] == 6
    m = result["metrics"]["20261204-1100-b"]["engine"]
    assert (m["tau_macro"], m["speedup"]) == (pytest.approx(4.0), pytest.approx(1.2))
    res = invoke("compare", "20261204-1000-a", "20261204-1100-b", "--runs-dir", str(d), "--resamples", "1000",
                 "--out", str(tmp_path / "cmp"))
    md = next((tmp_path / "cmp").glob("*.md")).read_text()
    assert res.exit_code == 0 and "engine τ macro (the engine's own count)" in md and "↳ engine τ" in md, md
    assert "↳ engine speedup" in md
